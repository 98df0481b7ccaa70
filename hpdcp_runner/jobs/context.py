"""What every job gets: the validated config, rank info, the run dir, metrics and engine calls
with the configured knobs."""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import dcp
from ..config import Config, parse_size
from ..dcp.collectives import Comm
from ..dcp.filesystem_storage import FileSystemReader, FileSystemWriter
from ..dcp.retention import apply_retention
from ..dcp.standard_planner import local_pieces
from ..layouts import Placer
from ..metrics import Metrics
from ..runtime import RankInfo


class JobContext:
    def __init__(self, cfg: Config, plain: dict, info: RankInfo, run_dir: str) -> None:
        self.cfg, self.plain, self.info, self.run_dir = cfg, plain, info, run_dir
        self.metrics = Metrics()
        self.comm = Comm.create(None, cfg.dcp.timeout_s)

    # -- paths ------------------------------------------------------------------------------
    def abspath(self, p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(self.run_dir, p)

    def checkpoint_path(self, name: str | None = None) -> str:
        if self.cfg.checkpoint.path and name is None:
            return self.abspath(self.cfg.checkpoint.path)
        return os.path.join(self.abspath(self.cfg.checkpoint.dir), name or self.cfg.checkpoint.name)

    def progress(self, iterable: Any, desc: str, total: int | None = None) -> Any:
        """A progress bar on rank 0 when attached to a terminal (``runtime.progress``)."""
        import sys

        if self.info.rank != 0 or not self.cfg.runtime.progress or not sys.stderr.isatty():
            return iterable
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, leave=False)

    def placer(self, layout: Any = None) -> Placer:
        return Placer(layout or self.cfg.layout, self.info.rank, self.info.world_size, self.info.device)

    # -- engine calls with the configured knobs ----------------------------------------------
    def save(self, state: Any, path: str, phase: str = "save", overwrite: bool | None = None) -> dcp.Metadata:
        d = self.cfg.dcp
        writer = FileSystemWriter(path, fsync=d.storage.fsync)
        with self.metrics.phase(phase):
            md = dcp.save(state, storage_writer=writer, planner=dcp.SAVE_PLANNERS[d.planner.name](),
                          overwrite=self.cfg.checkpoint.overwrite if overwrite is None else overwrite,
                          allow_pickle=d.allow_pickle, verify_replicas=d.verify_replicas, timeout=d.timeout_s)
        self.metrics.add(writer.counters.as_dict(), f"{phase}.")
        return md

    def async_save(self, state: Any, path: str, phase: str = "async_save", callback: Any = None,
                   overwrite: bool | None = None) -> dcp.AsyncSaveResponse:
        """``dcp.async_save`` with the configured knobs; ``phase`` times only the blocking part.
        ``callback(metadata)`` runs in the background after the commit (never after a failure)."""
        d = self.cfg.dcp
        writer = FileSystemWriter(path, fsync=d.storage.fsync)

        def done(md: dcp.Metadata) -> None:
            self.metrics.add(writer.counters.as_dict(), f"{phase}.")
            if callback is not None:
                callback(md)

        with self.metrics.phase(phase):
            return dcp.async_save(state, storage_writer=writer, checkpoint_id=path,
                                  planner=dcp.SAVE_PLANNERS[d.planner.name](),
                                  overwrite=self.cfg.checkpoint.overwrite if overwrite is None else overwrite,
                                  allow_pickle=d.allow_pickle, verify_replicas=d.verify_replicas, timeout=d.timeout_s,
                                  callback=done)

    def load(self, state: Any, path: str, phase: str = "load", strict: bool = True) -> dcp.LoadResult:
        d = self.cfg.dcp
        cap = d.storage.max_read_bytes_per_s
        reader = FileSystemReader(path, files_kept=d.storage.files_kept, verify_checksums=d.storage.verify_checksums,
                                  max_metadata_bytes=parse_size(d.storage.max_metadata_bytes),
                                  shared_storage=d.storage.shared,
                                  segment_bytes=max(1, parse_size(d.storage.segment_bytes, "dcp.storage.segment_bytes")),
                                  max_read_bytes_per_s=parse_size(cap) if cap is not None else None)
        with self.metrics.phase(phase):
            res = dcp.load(state, storage_reader=reader, planner=dcp.LOAD_PLANNERS[d.planner.name](), strict=strict,
                           allow_pickle=d.allow_pickle, allow_cast=d.allow_cast, timeout=d.timeout_s,
                           broadcast=self.broadcast_options())
        self.metrics.add(dict(res.counters), f"{phase}.")
        return res

    def broadcast_options(self) -> dcp.BroadcastOptions:
        b = self.cfg.dcp.broadcast
        return dcp.BroadcastOptions(b.mode, parse_size(b.batch_bytes, "dcp.broadcast.batch_bytes"), b.max_in_flight)

    def engine_knobs(self) -> dict:
        """The knob values as the engine received them (parsed), for metrics.json."""
        o, s = self.broadcast_options(), self.cfg.dcp.storage
        return {"dcp.planner.name": self.cfg.dcp.planner.name, "dcp.broadcast.mode": o.mode,
                "dcp.broadcast.batch_bytes": o.batch_bytes, "dcp.broadcast.max_in_flight": o.max_in_flight,
                "dcp.storage.files_kept": s.files_kept, "dcp.storage.shared": s.shared,
                "dcp.storage.segment_bytes": parse_size(s.segment_bytes, "dcp.storage.segment_bytes"),
                "dcp.storage.max_read_bytes_per_s": parse_size(s.max_read_bytes_per_s)
                if s.max_read_bytes_per_s is not None else None}

    def apply_retention(self, directory: str) -> list[str]:
        """Keep the newest ``checkpoint.keep_last`` committed checkpoints of ``directory`` (rank 0)."""
        if self.cfg.checkpoint.keep_last <= 0 or self.info.rank != 0:
            return []
        return apply_retention(directory, self.cfg.checkpoint.keep_last)


def compare_state(got: Any, expect: Any, prefix: str = "") -> list[str]:
    """Problems comparing a loaded state with its placed reference, shard by shard, bitwise."""
    from ..dcp.utils import TENSOR_LEAVES

    if isinstance(expect, dict):
        if not isinstance(got, dict) or set(got) != set(expect):
            return [f"{prefix or '<root>'}: structure differs"]
        return [p for k in expect for p in compare_state(got[k], expect[k], f"{prefix}{k}.")]
    if isinstance(expect, list):
        if not isinstance(got, list) or len(got) != len(expect):
            return [f"{prefix[:-1]}: list differs"]
        return [p for i, (g, e) in enumerate(zip(got, expect)) for p in compare_state(g, e, f"{prefix}{i}.")]
    key = prefix[:-1]
    if isinstance(expect, TENSOR_LEAVES):
        gp, ep = local_pieces(got), local_pieces(expect)
        if [b for b, _ in gp] != [b for b, _ in ep]:
            return [f"{key}: local boxes differ"]
        if any(g.dtype != e.dtype or not torch.equal(g.cpu(), e.cpu()) for (_, g), (_, e) in zip(gp, ep)):
            return [f"{key}: values differ from the reference"]
        return []
    return [] if got == expect and type(got) is type(expect) else [f"{key}: {got!r} != {expect!r}"]
