"""save / load: the checkpoint protocol, top to bottom.

Every rank of the process group calls the same function (SPMD). Each step that can fail
locally runs under ``Comm.agree``, so a failure on any rank becomes the same error on every
rank, and the checkpoint is committed by one atomic rename only after every rank has written.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .core import faults
from .comm.broadcast import BroadcastOptions, group_sets, node_id, run_load_transfers, sendable_devices
from .comm.collectives import Comm
from .core.errors import ConfigError, KeyMismatchError
from .storage.filesystem import DEFAULT_FILES_KEPT, FileSystemReader, FileSystemWriter
from .storage.foreign import open_reader
from .core.geometry import Box, relative
from .format.metadata import METADATA_FILE, DeferredMetadata, Metadata
from .core.columns import pack_ints, unpack_ints
from .planning.save_dedup import CompactPlan, GlobalSavePlan
from .planning.interfaces import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from .format.renames import rename_keys
from .planning.load_replicas import Batch, CompactShards, batch_ops
from .planning.standard import StandardLoadPlanner, StandardSavePlanner, build_metadata, chunk_key
from .state_dict import restore_stateful, stateful_to_state_dict
from .storage.interfaces import ReadRequest, StorageReader, StorageWriter, WriteResult
from .core.utils import PhaseTimer, get_logger, pauses_gc

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
        raise ConfigError("give checkpoint_id (a directory) or a storage writer/reader")
    if checkpoint_id is not None:
        return os.fspath(checkpoint_id)
    # a storage given alone: its own path names the checkpoint in logs and errors
    path = getattr(storage, "path", None) or getattr(storage, "checkpoint_id", None)
    return os.fspath(path) if path is not None else None


@pauses_gc
def save(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: Any = None, overwrite: bool = False, allow_pickle: bool = False,
         verify_replicas: bool = False, timeout: Timeout = None, extra: Mapping[str, Any] | None = None,
         timer: PhaseTimer | None = None) -> Metadata:
    """Save ``state_dict`` as one checkpoint; every rank of ``process_group`` must call it.

    Replicated chunks are written once. Top-level ``Stateful`` values (an ``nn.Module``, an
    optimizer wrapper, anything with ``state_dict()``/``load_state_dict()``) are saved through
    their ``state_dict()``, never pickled. The checkpoint appears under its name only when
    complete; an existing one is refused unless ``overwrite`` and stays loadable until then.
    ``verify_replicas`` compares checksums of replicated chunks across their holders.
    ``timeout`` (seconds) bounds every collective. Returns the committed metadata.
    """
    path = _checkpoint_path(checkpoint_id, storage_writer)
    state_dict = stateful_to_state_dict(state_dict)[0]
    comm = Comm.create(process_group, timeout)
    writer = storage_writer or FileSystemWriter(path)
    planner = planner or StandardSavePlanner()
    timer = timer or PhaseTimer()
    token: str | None = None

    own: SavePlan | None = None
    gplan: GlobalSavePlan | None = None

    def local_plan() -> dict:
        nonlocal token, own
        faults.point("save.plan", rank=comm.rank, path=path)
        if comm.rank == 0:
            token = writer.begin(overwrite=overwrite)
        planner.configure(state_dict, rank=comm.rank, world_size=comm.world_size,
                          allow_pickle=allow_pickle, verify_replicas=verify_replicas)
        own = planner.create_local_plan()
        return {"plan": CompactPlan.from_plan(own).to_wire(), "token": token}

    def global_plan(gathered: list) -> list:
        # coordinator only: every rank's plan, in compact form; each rank gets its write list
        nonlocal gplan
        tables: dict = {}
        gplan = planner.create_global_plan([CompactPlan.from_wire(g["plan"], tables) for g in gathered])
        return [{"writes": pack_ints(w), "token": gathered[0]["token"]} for w in gplan.write_idx]

    try:
        with timer.phase("plan"):
            mine = comm.coordinate("save: plan", local_plan, global_plan)
            token = mine["token"]

        def write() -> dict:
            writer.attach(token, rank=comm.rank, world_size=comm.world_size)
            faults.point("save.write", rank=comm.rank, path=path)
            tensors, objs = [], {}
            for i in unpack_ints(mine["writes"]).tolist():
                it = own.items[i]
                if it.kind == "object":
                    objs[it.fqn] = planner.resolve_data(it)
                elif it.box.numel:
                    tensors.append((chunk_key(it.fqn, it.box.offsets), planner.resolve_data(it)))
            result = writer.write(tensors, objs)
            faults.point("save.written", rank=comm.rank, path=path)
            return result.to_wire()

        committed: Metadata | None = None

        def metadata_of(results: list) -> list:
            nonlocal committed
            committed = build_metadata(gplan, [WriteResult.from_wire(w) for w in results], comm.world_size, extra)
            return [None] * comm.world_size

        with timer.phase("write"):
            comm.coordinate("save: write", write, metadata_of)
        with timer.phase("commit"):
            def commit() -> str:
                faults.point("save.commit", rank=comm.rank, path=path)
                writer.commit(committed)
                return committed.to_json() if comm.world_size > 1 else ""

            # every rank returns the committed metadata, as torch DCP does; parsed on first use
            text = comm.agree_root("save: commit", commit)
            metadata = committed if comm.rank == 0 else DeferredMetadata(text, source=METADATA_FILE)
    except BaseException:
        if comm.rank == 0 and token is not None:
            writer.abort()
        raise
    log.debug("saved %s: %d tensors, %d bytes written here", path, len(metadata.tensors),
              writer.counters.bytes_written)
    return metadata


def read_metadata(checkpoint_id: str | os.PathLike, *, format: str = "auto", allow_pickle: bool = False,
                  rename: Sequence[Any] = (), **reader_kwargs: Any) -> Metadata:
    """Read and validate a checkpoint's metadata (single process, no collectives). ``format``:
    auto | hpdcp | hf | torch_dcp; ``rename``: the key renames a load with them would see."""
    reader = open_reader(checkpoint_id, format, allow_pickle=allow_pickle, **reader_kwargs)
    try:
        md = Metadata.from_json(reader.read_metadata_text(), source=_metadata_source(reader, checkpoint_id))
    finally:
        reader.close()
    return rename_keys(md, rename, source=os.fspath(checkpoint_id))


def _metadata_source(reader: StorageReader, path: Any) -> str:
    """What a metadata error names: our metadata.json, or the foreign checkpoint directory."""
    if isinstance(reader, FileSystemReader) and type(reader) is not FileSystemReader:
        return f"{reader.path} (as {reader.format_name})"  # type: ignore[attr-defined]
    return os.path.join(os.fspath(path), METADATA_FILE) if path else METADATA_FILE


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
         timer: PhaseTimer | None = None, format: str = "auto", rename: Sequence[Any] = ()) -> LoadResult:
    """Load a checkpoint into ``state_dict`` in place (tensors are filled, other leaves replaced).

    Works for any saved layout and world size: each destination shard is assembled from the
    saved chunks it intersects. ``strict`` makes missing keys (on any rank) and checkpoint keys
    that no rank asked for one ``KeyMismatchError``; ``strict=False`` loads the keys both have and
    returns the rest in ``LoadResult.missing_keys`` / ``unexpected_keys``: that is how to load a
    subset, e.g. ``load({"model": model.state_dict()}, ..., strict=False)`` from a model+optimizer
    checkpoint. Top-level ``Stateful`` values (``state_dict()``/``load_state_dict()``, e.g. an
    ``nn.Module``) are loaded through their state dict and restored in place. A shard held by
    several ranks is read once and broadcast to the others per ``broadcast`` (mode auto: only
    across nodes or from storage declared shared/slow).

    ``format`` (auto | hpdcp | hf | torch_dcp) reads a Hugging Face or torch DCP checkpoint in
    place, with the same partial reads and broadcasts (torch DCP needs ``allow_pickle``: its
    metadata is a pickle). ``rename``: ordered ``(pattern, replace)`` regex rules applied to the
    checkpoint's keys before matching them to the state dict (two keys renamed onto one is an
    error listing them).
    """
    options = broadcast or BroadcastOptions()
    path = _checkpoint_path(checkpoint_id, storage_reader)
    caller, (state_dict, stateful) = state_dict, stateful_to_state_dict(state_dict)
    comm = Comm.create(process_group, timeout)
    reader = storage_reader or open_reader(path, format, allow_pickle=allow_pickle, files_kept=files_kept)
    planner = planner or StandardLoadPlanner()
    timer = timer or PhaseTimer()
    own: LoadPlan | None = None
    try:
        with timer.phase("metadata"):
            # Rank 0 reads, every rank parses and validates in parallel; a rank whose validation
            # fails reports it in the plan agreement below, so every rank raises it.
            source = _metadata_source(reader, path)
            got = comm.agree_root("load: metadata", lambda: {"text": reader.read_metadata_text(), "pin": reader.pin()})
            md_or_error: Metadata | Exception
            try:
                md_or_error = Metadata.from_json(got["text"], source=source)
                reader.attach_metadata(md_or_error, pin=got["pin"])
                md_or_error = rename_keys(md_or_error, rename, source=path or "checkpoint")
            except Exception as e:
                md_or_error = e

        def local_plan() -> dict:
            nonlocal own
            if isinstance(md_or_error, Exception):
                raise md_or_error
            planner.configure(state_dict, md_or_error, rank=comm.rank, world_size=comm.world_size,
                              allow_cast=allow_cast, sendable=sendable_devices())
            own = planner.create_local_plan()
            # every file this rank may read exists, is regular and has its recorded size, checked
            # here (an agreed step) before any data moves into the caller's tensors
            md = md_or_error
            reader.check_files(sorted({md.tensors[it.fqn].chunks[it.chunk].file for it in own.items}
                                      | {md.objects[f].file for f in own.objects}))
            return {"missing": list(own.missing), "requested": _bitmap(md_or_error.keys(), own.requested),
                    # no broadcasts without replicas to share: the coordinator need not see shards
                    "shards": CompactShards.from_summaries(() if options.mode == "never" else own.shards).to_wire(),
                    "node": node_id(),
                    "slow": bool(reader.slow_storage)}

        def global_plan(gathered: list) -> list:
            # coordinator only: key checks and who reads/broadcasts each replicated shard; every
            # rank receives the key verdict and just the broadcast batches it takes part in
            keys = md_or_error.keys()
            missing_by_rank = {r: g["missing"] for r, g in enumerate(gathered) if g["missing"]}
            unexpected = _unrequested(keys, [g["requested"] for g in gathered])
            tables: dict = {}
            shards = [CompactShards.from_wire(g["shards"], tables) for g in gathered]
            ops = planner.create_global_plan(shards, mode=options.mode, nodes=[g["node"] for g in gathered],
                                             slow_storage=gathered[0]["slow"])
            batches = batch_ops(ops, options.batch_bytes)
            per_rank: list[list] = [[] for _ in gathered]
            for b in batches:
                for r in b.ranks:
                    per_rank[r].append(b.to_wire())
            verdict = {"missing": sorted(missing_by_rank.items()), "unexpected": unexpected}
            needed = group_sets(batches)
            return [{"keys": verdict, "batches": mine, "groups": needed} for mine in per_rank]

        with timer.phase("plan"):
            reply = comm.coordinate("load: plan", local_plan, global_plan)
            md = md_or_error
            missing_by_rank = {int(r): ks for r, ks in reply["keys"]["missing"]}
            unexpected = reply["keys"]["unexpected"]
            if strict and (missing_by_rank or unexpected):
                raise _key_error(missing_by_rank, unexpected)
            batches = [Batch.from_wire(w) for w in reply["batches"]]
            needed = reply["groups"]
            own = dataclasses.replace(own, sources={(op.key[0], op.key[1]): op.src for b in batches for op in b.ops})

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
                               counters=reader.counters, reads=reads, read=reader.read_tensors, needed=needed)
            values = reader.read_objects({f: md.objects[f] for f in own.objects}, allow_pickle=allow_pickle)
            for fqn, value in values.items():
                planner.apply_object(fqn, value)

        with timer.phase("read"):  # storage reads overlap the replica broadcasts
            comm.agree("load: read", transfer)
    finally:
        reader.close()
    restore_stateful(stateful, state_dict, caller)
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
