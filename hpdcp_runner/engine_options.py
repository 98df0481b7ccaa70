"""The engine's knobs of a runner config (``dcp.*``), parsed and validated once into the engine's
own option objects: what every job hands the engine, so that no job parses a size or re-checks a
knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import parse_size
from .dcp import ConfigError

if TYPE_CHECKING:
    from .config import Config


@dataclass(frozen=True)
class EngineOptions:
    """Every engine knob of the config, parsed and validated once (in :func:`validate_all`) into
    the engine's own option objects and handed down: jobs never parse a size or re-check a knob."""

    planner: str
    broadcast: Any  # dcp.BroadcastOptions
    reader: Any  # dcp.storage.filesystem.ReaderOptions
    store: Any  # dcp.tools.ObjectStoreOptions (s3:// paths)
    fsync: bool
    timeout_s: float
    allow_pickle: bool
    allow_cast: bool
    verify_replicas: bool
    cache_plan: bool
    format_version: int = 2
    async_mode: str = "thread"
    persist_start_wait_s: float = 0.0
    persist_nice: int = 10
    async_staging: str = "background"

    def knobs(self) -> dict:
        """The knob values as the engine received them, for metrics.json."""
        b, r = self.broadcast, self.reader
        return {"dcp.planner.name": self.planner, "dcp.broadcast.mode": b.mode,
                "dcp.broadcast.batch_bytes": b.batch_bytes, "dcp.broadcast.max_in_flight": b.max_in_flight,
                "dcp.broadcast.share_reads": b.share_reads,
                "dcp.storage.files_kept": r.files_kept, "dcp.storage.shared": r.shared_storage,
                "dcp.storage.read_gap_bytes": "auto" if r.read_gap_bytes is None else r.read_gap_bytes,
                "dcp.storage.max_request_bytes": r.max_request_bytes,
                "dcp.storage.max_read_bytes_per_s": r.max_read_bytes_per_s, "dcp.format_version": self.format_version,
                "dcp.async_mode": self.async_mode, "dcp.persist_start_wait_s": self.persist_start_wait_s,
                "dcp.persist_nice": self.persist_nice, "dcp.async_staging": self.async_staging,
                **{f"dcp.storage.{k}": v for k, v in self.store.kwargs().items()}}


def engine_options(c: Config) -> EngineOptions:
    """The engine options of ``c``; one ConfigError naming every bad key."""
    from .dcp import SAVE_PLANNERS, BroadcastOptions
    from .dcp.tools import ObjectStoreOptions, ReaderOptions

    d, problems = c.dcp, []

    def size(key: str, value: Any, positive: bool = False) -> int:
        try:
            n = parse_size(value, key)
        except ConfigError as e:
            problems.append(str(e))
            return 1
        if positive and n == 0:
            problems.append(f"{key}: must be positive")
        return n

    def build(prefix: str, make: Any) -> Any:
        try:
            return make()
        except ConfigError as e:  # the engine's own check, named by the config key
            head, sep, rest = str(e).partition(": ")
            problems.append(f"{prefix}.{head}: {rest}" if sep and head.isidentifier() else f"{prefix}: {e}")

    if d.planner.name not in SAVE_PLANNERS:
        problems.append(f"dcp.planner.name: unknown planner {d.planner.name!r} (choose {', '.join(SAVE_PLANNERS)})")
    if d.storage.name not in ("default", "filesystem"):
        problems.append(f"dcp.storage.name: unknown storage {d.storage.name!r} (choose default; the location "
                        f"itself picks the store: a path, s3://, gs:// or az://)")
    s = d.storage
    cap = s.max_read_bytes_per_s
    sizes = (size("dcp.storage.max_metadata_bytes", s.max_metadata_bytes, True),
             None if cap is None else size("dcp.storage.max_read_bytes_per_s", cap, True),
             None if s.read_gap_bytes == "auto" else size("dcp.storage.read_gap_bytes", s.read_gap_bytes),
             size("dcp.broadcast.batch_bytes", d.broadcast.batch_bytes),
             size("dcp.storage.max_request_bytes", s.max_request_bytes, True))
    if s.files_kept < 1:
        problems.append(f"dcp.storage.files_kept: must be >= 1, got {s.files_kept}")
    if d.broadcast.max_in_flight < 1:
        problems.append(f"dcp.broadcast.max_in_flight: must be >= 1, got {d.broadcast.max_in_flight}")
    if d.format_version not in (1, 2):
        problems.append(f"dcp.format_version: {d.format_version!r} is not 1 or 2 (the format versions this build writes)")
    if d.async_mode not in ("thread", "process"):
        problems.append(f"dcp.async_mode: {d.async_mode!r} is not thread or process")
    if not 0 <= d.persist_start_wait_s <= 3600:  # nan fails both
        problems.append(f"dcp.persist_start_wait_s: {d.persist_start_wait_s!r} is not seconds from 0 to 3600")
    if d.async_staging not in ("now", "background"):
        problems.append(f"dcp.async_staging: {d.async_staging!r} is not now or background")
    if not 0 <= d.persist_nice <= 19:
        problems.append(f"dcp.persist_nice: {d.persist_nice!r} is not a niceness from 0 to 19")
    if d.broadcast.mode not in ("always", "never", "auto"):
        problems.append(f"dcp.broadcast.mode: {d.broadcast.mode!r} is not always, never or auto")
    if problems:
        raise ConfigError("\n".join(problems))
    reader = build("dcp.storage", lambda: ReaderOptions(s.files_kept, sizes[0], s.verify_checksums, s.shared,
                                                        sizes[1], sizes[2], sizes[4]))
    broadcast = build("dcp.broadcast", lambda: BroadcastOptions(d.broadcast.mode, sizes[3], d.broadcast.max_in_flight,
                                                                         share_reads=bool(d.broadcast.share_reads)))
    store = build("dcp.storage", lambda: ObjectStoreOptions(
        s.endpoint, s.region, s.allow_http, size("dcp.storage.part_size", s.part_size, True), s.concurrency,
        s.max_retries,
        coalesce_bytes=None if s.coalesce_bytes == "auto" else size("dcp.storage.coalesce_bytes", s.coalesce_bytes),
        read_buffer_bytes=size("dcp.storage.read_buffer_bytes", s.read_buffer_bytes, True),
        orphan_grace_s=s.orphan_grace_s, request_timeout_s=s.request_timeout_s, retry_timeout_s=s.retry_timeout_s,
        unconditional_ok=s.unconditional_ok, store_digests=s.store_digests))
    if problems:
        raise ConfigError("\n".join(problems))
    return EngineOptions(d.planner.name, broadcast, reader, store, s.fsync, d.timeout_s, d.allow_pickle, d.allow_cast,
                         d.verify_replicas, d.cache_plan, d.format_version, d.async_mode, d.persist_start_wait_s,
                         d.persist_nice, d.async_staging)
