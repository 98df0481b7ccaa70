"""save / load: the checkpoint protocol, top to bottom.

Every rank of the process group calls the same function (SPMD). Each step that can fail
locally runs under ``Comm.agree``, so a failure on any rank becomes the same error on every
rank, and the checkpoint is committed by one atomic rename only after every rank has written.
"""

from __future__ import annotations

import base64
import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import faults
from .broadcast import BroadcastOptions, node_id, run_load_transfers
from .collectives import Comm
from .errors import KeyMismatchError
from .filesystem_storage import DEFAULT_FILES_KEPT, FileSystemReader, FileSystemWriter
from .geometry import Box, relative
from .metadata import METADATA_FILE, Metadata
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from .replica_plan import ShardSummary, batch_ops
from .standard_planner import StandardLoadPlanner, StandardSavePlanner, build_metadata, chunk_key
from .storage import ReadRequest, StorageReader, StorageWriter, WriteResult
from .utils import PhaseTimer, get_logger, pauses_gc

log = get_logger(__name__)
Timeout = float | _dt.timedelta | None


@dataclass(frozen=True)
class LoadResult:
    """Keys this rank asked for that the checkpoint lacks, and checkpoint keys no rank asked for."""

    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)


def _checkpoint_path(checkpoint_id: str | os.PathLike | None, storage: Any) -> str | None:
    if checkpoint_id is None and storage is None:
        raise ValueError("give checkpoint_id (a directory) or a storage writer/reader")
    return os.fspath(checkpoint_id) if checkpoint_id is not None else None


@pauses_gc
def save(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: Any = None, overwrite: bool = False, allow_pickle: bool = False,
         verify_replicas: bool = False, timeout: Timeout = None, extra: Mapping[str, Any] | None = None,
         timer: PhaseTimer | None = None) -> Metadata:
    """Save ``state_dict`` as one checkpoint; every rank of ``process_group`` must call it.

    Replicated chunks are written once. The checkpoint appears under its name only when
    complete; an existing one is refused unless ``overwrite`` and stays loadable until then.
    ``verify_replicas`` compares checksums of replicated chunks across their holders.
    ``timeout`` (seconds) bounds every collective. Returns the committed metadata.
    """
    path = _checkpoint_path(checkpoint_id, storage_writer)
    comm = Comm.create(process_group, timeout)
    writer = storage_writer or FileSystemWriter(path)
    planner = planner or StandardSavePlanner()
    timer = timer or PhaseTimer()
    token: str | None = None

    def local_plan() -> dict:
        nonlocal token
        faults.point("save.plan", rank=comm.rank, path=path)
        if comm.rank == 0:
            token = writer.begin(overwrite=overwrite)
        planner.configure(state_dict, rank=comm.rank, world_size=comm.world_size,
                          allow_pickle=allow_pickle, verify_replicas=verify_replicas)
        return {"plan": planner.create_local_plan().to_wire(), "token": token}

    try:
        with timer.phase("plan"):
            gathered = comm.agree("save: plan", local_plan)
            token = gathered[0]["token"]
            gplan = planner.create_global_plan([SavePlan.from_wire(g["plan"]) for g in gathered])

        def write() -> dict:
            writer.attach(token, rank=comm.rank, world_size=comm.world_size)
            faults.point("save.write", rank=comm.rank, path=path)
            own = gplan.plans[comm.rank]
            tensors, objs = [], {}
            for i in gplan.writes[comm.rank]:
                it = own.items[i]
                if it.kind == "object":
                    objs[it.fqn] = planner.resolve_data(it)
                elif it.box.numel:
                    tensors.append((chunk_key(it.fqn, it.box.offsets), planner.resolve_data(it)))
            result = writer.write(tensors, objs)
            faults.point("save.written", rank=comm.rank, path=path)
            return result.to_wire()

        with timer.phase("write"):
            results = [WriteResult.from_wire(w) for w in comm.agree("save: write", write)]
        metadata = build_metadata(gplan, results, comm.world_size, extra)
        with timer.phase("commit"):
            def commit() -> None:
                faults.point("save.commit", rank=comm.rank, path=path)
                writer.commit(metadata)

            comm.agree_root("save: commit", commit)
    except BaseException:
        if comm.rank == 0 and token is not None:
            writer.abort()
        raise
    log.debug("saved %s: %d tensors, %d bytes written here", path, len(metadata.tensors),
              writer.counters.bytes_written)
    return metadata


def read_metadata(checkpoint_id: str | os.PathLike, **reader_kwargs: Any) -> Metadata:
    """Read and validate a checkpoint's metadata (single process, no collectives)."""
    reader = FileSystemReader(checkpoint_id, **reader_kwargs)
    return Metadata.from_json(reader.read_metadata_text(), source=os.path.join(reader.path, METADATA_FILE))


def _bitmap(keys: list[str], requested: frozenset[str]) -> str:
    bits = bytearray((len(keys) + 7) // 8)
    for i, k in enumerate(keys):
        if k in requested:
            bits[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(bits)).decode()


def _unrequested(keys: list[str], bitmaps: list[str]) -> list[str]:
    union = bytearray((len(keys) + 7) // 8)
    for b in bitmaps:
        for i, byte in enumerate(base64.b64decode(b)):
            union[i] |= byte
    return [k for i, k in enumerate(keys) if not union[i // 8] >> (i % 8) & 1]


@pauses_gc
def load(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: Any = None, strict: bool = True, allow_pickle: bool = False, allow_cast: bool = False,
         files_kept: int = DEFAULT_FILES_KEPT, broadcast: BroadcastOptions | None = None, timeout: Timeout = None,
         timer: PhaseTimer | None = None) -> LoadResult:
    """Load a checkpoint into ``state_dict`` in place (tensors are filled, other leaves replaced).

    Works for any saved layout and world size: each destination shard is assembled from the
    saved chunks it intersects. ``strict`` makes missing keys (on any rank) and checkpoint keys
    that no rank asked for one ``KeyMismatchError``; otherwise they are returned. A shard held by
    several ranks is read once and broadcast to the others per ``broadcast`` (mode auto: only
    across nodes or from storage declared shared/slow).
    """
    options = broadcast or BroadcastOptions()
    path = _checkpoint_path(checkpoint_id, storage_reader)
    comm = Comm.create(process_group, timeout)
    reader = storage_reader or FileSystemReader(path, files_kept=files_kept)
    planner = planner or StandardLoadPlanner()
    timer = timer or PhaseTimer()
    own: LoadPlan | None = None
    try:
        with timer.phase("metadata"):
            # Rank 0 reads, every rank parses and validates in parallel; a rank whose validation
            # fails reports it in the plan agreement below, so every rank raises it.
            source = os.path.join(path, METADATA_FILE) if path else METADATA_FILE
            text = comm.agree_root("load: metadata", reader.read_metadata_text)
            md_or_error: Metadata | Exception
            try:
                md_or_error = Metadata.from_json(text, source=source)
                reader.attach_metadata(md_or_error)
            except Exception as e:
                md_or_error = e

        def local_plan() -> dict:
            nonlocal own
            if isinstance(md_or_error, Exception):
                raise md_or_error
            planner.configure(state_dict, md_or_error, rank=comm.rank, world_size=comm.world_size,
                              allow_cast=allow_cast)
            own = planner.create_local_plan()
            return {"missing": list(own.missing), "requested": _bitmap(md_or_error.keys(), own.requested),
                    "shards": [s.to_wire() for s in own.shards], "node": node_id(),
                    "slow": bool(reader.slow_storage)}

        with timer.phase("plan"):
            gathered = comm.agree("load: plan", local_plan)
            md = md_or_error
            keys = md.keys()
            missing_by_rank = {r: g["missing"] for r, g in enumerate(gathered) if g["missing"]}
            unexpected = _unrequested(keys, [g["requested"] for g in gathered])
            if strict and (missing_by_rank or unexpected):
                raise _key_error(missing_by_rank, unexpected)
            shards = [[ShardSummary.from_wire(w) for w in g["shards"]] for g in gathered]
            own, ops = planner.create_global_plan(shards, own, mode=options.mode, nodes=[g["node"] for g in gathered],
                                                  slow_storage=gathered[0]["slow"])
            batches = batch_ops(ops, options.batch_bytes)

        def transfer() -> None:
            batch_of = {op.key: i for i, b in enumerate(batches) for op in b.ops if b.src == comm.rank}
            reads: list[tuple[int | None, ReadRequest]] = []  # (batch this rank sources, request)
            for it in own.items:
                src = own.sources.get((it.fqn, it.dest_box.offsets))
                if src is not None and src != comm.rank:
                    continue  # another holder reads it and broadcasts it here
                tm = md.tensors[it.fqn]
                chunk = tm.chunks[it.chunk]
                req = ReadRequest(chunk, tm.dtype, Box(relative(it.overlap, chunk.box), it.overlap.sizes),
                                  planner.acquire_tensor(it))
                reads.append((batch_of.get((it.fqn, it.dest_box.offsets, it.dest_box.sizes)), req))
            run_load_transfers(batches, rank=comm.rank, group=comm.group, control=comm.control,
                               timeout=comm.timeout, options=options, destination=planner.destination,
                               counters=reader.counters, reads=reads, read=reader.read_tensors)
            values = reader.read_objects({f: md.objects[f] for f in own.objects}, allow_pickle=allow_pickle)
            for fqn, value in values.items():
                planner.apply_object(fqn, value)

        with timer.phase("read"):  # storage reads overlap the replica broadcasts
            comm.agree("load: read", transfer)
    finally:
        reader.close()
    return LoadResult(tuple(own.missing), tuple(unexpected), reader.counters.as_dict(), dict(timer.seconds))


def _key_error(missing_by_rank: dict[int, list[str]], unexpected: list[str]) -> KeyMismatchError:
    parts = []
    all_missing = sorted({k for ks in missing_by_rank.values() for k in ks})
    if all_missing:
        where = ", ".join(f"rank {r}" for r in sorted(missing_by_rank))
        parts.append(f"{len(all_missing)} key(s) missing from the checkpoint ({where}): {_short(all_missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint key(s) not in any rank's state dict: {_short(unexpected)}")
    return KeyMismatchError("strict load: " + "; ".join(parts) + " (pass strict=False to load the common keys)",
                            all_missing, unexpected)


def _short(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
