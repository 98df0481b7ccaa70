"""save / load: the checkpoint protocol, top to bottom.

Every rank of the process group calls the same function (SPMD). Each step that can fail
locally runs under ``Comm.agree``, so a failure on any rank becomes the same error on every
rank, and the checkpoint is committed by one atomic rename only after every rank has written.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .comm.broadcast import BroadcastOptions
from .comm.collectives import Comm
from .core.errors import ConfigError
from .core.utils import PhaseTimer, get_logger, pauses_gc
from .format.metadata import FORMAT_VERSION, METADATA_FILE, READ_VERSIONS, DeferredMetadata, Metadata
from .format.renames import rename_keys
from .planning.interfaces import LoadPlanner, SavePlanner
from .planning.standard import StandardLoadPlanner, StandardSavePlanner
from .protocol import LoadSteps, SaveSteps, metadata_source
from .state_dict import restore_stateful, stateful_to_state_dict
from .storage.posix.filesystem import DEFAULT_FILES_KEPT
from .storage.checkpoint_io import open_reader, open_writer
from .storage.location import locate, spelled
from .storage.uri import join
from .storage.interfaces import StorageReader, StorageWriter

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
        return spelled(checkpoint_id)
    # a storage given alone: its own path names the checkpoint in logs and errors
    path = getattr(storage, "checkpoint_id", None) or getattr(storage, "path", None)
    return os.fspath(path) if path is not None else None


def _check_extra(extra: Mapping[str, Any] | None) -> None:
    """``extra`` goes into ``metadata.json`` as strict JSON: refused here, before any byte is
    written, if it is not (NaN, infinities, non-string keys, objects JSON cannot hold)."""
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise ConfigError(f"extra must be a mapping of JSON values, got {type(extra).__name__}")
    for k, v in extra.items():
        try:
            if not isinstance(k, str):
                raise TypeError(f"key {k!r} is not a string")
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"extra[{k!r}] cannot be stored in metadata.json as JSON ({e})") from None


@pauses_gc
def save(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: Any = None, overwrite: bool = False, allow_pickle: bool = False,
         verify_replicas: bool = False, timeout: Timeout = None, extra: Mapping[str, Any] | None = None,
         timer: PhaseTimer | None = None, cache_plan: bool = False,
         format_version: int = FORMAT_VERSION) -> Metadata:
    """Save ``state_dict`` as one checkpoint; every rank of ``process_group`` must call it.

    Replicated chunks are written once. Top-level ``Stateful`` values (an ``nn.Module``, an
    optimizer wrapper, anything with ``state_dict()``/``load_state_dict()``) are saved through
    their ``state_dict()``, never pickled. The checkpoint appears under its name only when
    complete; an existing one is refused unless ``overwrite`` and stays loadable until then.
    ``verify_replicas`` compares checksums of replicated chunks across their holders.
    ``timeout`` (seconds) bounds every collective. ``cache_plan``: a save whose structure (keys,
    shapes, dtypes, placements) equals the previous cached save's on the same process group skips
    the gather and dedup: ranks exchange a digest and reuse their write lists; any change is
    detected by the digest and planned in full. Returns the committed metadata.
    ``format_version``: 2 (the default) keeps the chunk table in a chunk index each loading rank
    reads in part; 1 writes everything into ``metadata.json``, for readers older than version 2.
    """
    if format_version not in READ_VERSIONS or type(format_version) is not int:
        raise ConfigError(f"format_version must be one of {list(READ_VERSIONS)}, got {format_version!r}")
    _check_extra(extra)
    path = _checkpoint_path(checkpoint_id, storage_writer)
    comm = Comm.create(process_group, timeout)
    writer = storage_writer or open_writer(path)
    timer = timer or PhaseTimer()
    steps = SaveSteps(stateful_to_state_dict(state_dict)[0], comm, writer, planner or StandardSavePlanner(), path,
                      overwrite, allow_pickle, verify_replicas, extra, cache_plan=cache_plan and not verify_replicas,
                      format_version=format_version)
    staged = writer.counters.staged
    try:
        with timer.phase("plan"), staged("planning with the other ranks"):
            if not steps.summarize():  # a repeated structure: digests only
                steps.accept(comm.coordinate("save: plan", steps.local_plan, steps.global_plan))
        with timer.phase("write"), staged("writing"):
            comm.coordinate("save: write", steps.write, steps.keep_envelopes)
            steps.report()  # the chunk index's rows, to the coordinator as ranks report them
        with timer.phase("commit"), staged("committing" if comm.rank == 0 else "waiting for rank 0's commit"):
            # the coordinator builds the metadata, checks it and commits
            # every rank returns the committed metadata, as torch DCP does; parsed on first use
            text = comm.agree_root("save: commit", steps.commit)
    except BaseException:
        if comm.rank == 0 and steps.token is not None:
            writer.abort()
        writer.discard_own()
        raise
    source = join(path, METADATA_FILE) if path else METADATA_FILE
    opener = writer.committed_opener()
    if opener is None and path:  # a writer of the caller's own: the location's files, where it can open them
        opener = locate(path).file_opener()
    metadata = steps.committed if comm.rank == 0 else DeferredMetadata(text, source=source, open_file=opener)
    # (nothing here may touch ``metadata``'s fields on other ranks: that would parse it)
    log.debug("saved %s: %d bytes written here", path, writer.counters.bytes_written)
    return metadata


def read_metadata(checkpoint_id: str | os.PathLike, *, format: str = "auto", allow_pickle: bool = False,
                  rename: Sequence[Any] = (), **reader_kwargs: Any) -> Metadata:
    """Read and validate a checkpoint's metadata (single process, no collectives). ``format``:
    auto | hpdcp | hf | torch_dcp; ``rename``: the key renames a load with them would see."""
    reader = open_reader(checkpoint_id, format, allow_pickle=allow_pickle, **reader_kwargs)
    try:
        md = Metadata.from_json(reader.read_metadata_text(), source=metadata_source(reader, checkpoint_id),
                                open_file=reader.open_file)
    finally:
        reader.close()
    return rename_keys(md, rename, source=os.fspath(checkpoint_id))  # (a URI stays a URI)


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
    path = _checkpoint_path(checkpoint_id, storage_reader)
    caller, (state_dict, stateful) = state_dict, stateful_to_state_dict(state_dict)
    comm = Comm.create(process_group, timeout)
    reader = storage_reader or open_reader(path, format, allow_pickle=allow_pickle, files_kept=files_kept)
    timer = timer or PhaseTimer()
    steps = LoadSteps(state_dict, comm, reader, planner or StandardLoadPlanner(), path,
                      broadcast or BroadcastOptions(), allow_cast, allow_pickle, rename)
    staged = reader.counters.staged
    try:
        with timer.phase("metadata"), staged("reading the metadata"):  # rank 0 reads, every rank parses it
            steps.parse_metadata(comm.agree_root("load: metadata", steps.read_metadata))
        with timer.phase("plan"), staged("planning with the other ranks"):
            steps.accept(comm.coordinate("load: plan", steps.local_plan, steps.global_plan), strict)
        with timer.phase("read"), staged("reading"):  # storage reads overlap the replica broadcasts
            comm.agree("load: read", steps.transfer)
    finally:
        reader.close()
    restore_stateful(stateful, state_dict, caller)
    return LoadResult(tuple(steps.own.missing), steps.reply.unexpected, reader.counters.as_dict(),
                      dict(timer.seconds))


