"""Checkpoints as directories of per-rank safetensors files plus ``metadata.json``.

Layout and commit protocol::

    parent/.NAME.tmp-<token>/     staging: every rank writes its files here, fsynced
        rank00000.safetensors     tensors rank 0 owns after dedup
        rank00000.objects.json    non-tensor leaves rank 0 owns (safe tagged JSON)
        metadata.json             written last by the coordinator
    parent/NAME/                  appears only when staging is renamed: the commit

An existing ``NAME`` is kept loadable until the new one commits: with ``overwrite`` the two
directories are swapped atomically (``renameat2(RENAME_EXCHANGE)`` where the kernel has it) and
the old one is then moved to a trash name and deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import stat
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..core import faults
from ..format import jsondoc
from ..format import objects as objcodec
from ..core.utils import byte_view
from ..core.rafile import open_regular  # noqa: F401  (re-exported: api, retention)
from ..format.chunk_index import INDEX_FILE
from ..format.safetensors_io import SafetensorsStreamWriter, digest, naming, pread_into, write_index
from ..core.errors import (CheckpointChangedError, ConfigError, HpdcpError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     MetadataError)
from ..core.geometry import Box, flat_span, row_major_strides, run_dim, run_starts, runs_contiguous_in
from ..format.metadata import (DEFAULT_MAX_METADATA_BYTES, METADATA_FILE, FileMeta, Metadata, ObjectMeta, check_file_name,
                       dtype_from_name, dtype_name, element_size)
from .commit import (STAGING_LOCK, STAGING_MARK, clear_abandoned, fsync_dir, hold_staging_lock, interrupted_swap, publish_dir,
                     recover_displaced, storage_access_error, USER_FIXES)
from .interfaces import IOCounters, ReadRequest, StorageReader, StorageWriter, WriteResult
from .vectored import (DEFAULT_MAX_REQUEST_BYTES, SCRATCH_WINDOW, ReadCostModel, Sink, check_destination,
                       measured_cost_model, read_ranges)
from ..core.utils import get_logger, rank_of_env

log = get_logger(__name__)
DEFAULT_FILES_KEPT = 8


def rank_file(rank: int, kind: str) -> str:
    return f"rank{rank:05d}.{kind}"


class RankFile:
    """One rank's safetensors file being written into staging (see ``open_rank_file``)."""

    def __init__(self, writer: "FileSystemWriter", rank: int, specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> None:
        self.writer, self.name = writer, rank_file(rank, "safetensors")
        self._w = SafetensorsStreamWriter(os.path.join(writer.staging, self.name), specs, meta={"format": "pt"},
                                          fsync=writer.fsync)
        self._counted = 0

    def append(self, key: str, t: torch.Tensor) -> None:
        self._w.append(key, t)
        n = t.numel() * t.element_size()
        self._counted += n
        self.writer.counters.bytes_written += n  # grows tensor by tensor (progress)

    def close(self) -> tuple[str, Any]:
        wf = self._w.close()
        # the file's real size (header included) replaces the running tensor count
        self.writer.counters.bytes_written += wf.size - self._counted
        return self.name, wf

    def abort(self) -> None:
        self._w.abort()


class FileSystemWriter(StorageWriter):
    """Per-rank safetensors files in a staging directory beside the checkpoint, committed by one
    rename (see ``storage/commit.py``)."""

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.path

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True) -> None:
        self.overwrite = False
        self.path = os.path.abspath(os.fspath(path))
        self.parent, self.name = os.path.split(self.path)
        self.fsync = fsync
        self.staging: str | None = None
        self.rank = 0
        self.counters = IOCounters()

    def begin(self, *, overwrite: bool) -> str:
        recover_displaced(self.path)
        if os.path.lexists(self.path) and not overwrite:
            raise CheckpointExistsError(f"checkpoint {self.path} already exists; pass overwrite=True to replace it "
                                        f"(the old one stays loadable until the new one commits)")
        self.overwrite = overwrite
        token = f".{self.name}{STAGING_MARK}{uuid.uuid4().hex[:12]}"
        try:
            os.makedirs(self.parent, exist_ok=True)
            os.mkdir(os.path.join(self.parent, token))
        except OSError as e:
            raise storage_access_error(e, f"cannot create the checkpoint {self.path}") from None
        self.staging = os.path.join(self.parent, token)
        self._lock_fd = hold_staging_lock(self.staging)
        try:  # what interrupted or killed saves left here goes now, whatever retention says
            clear_abandoned(self.parent)
        except OSError as e:  # best effort: never the reason a save fails
            log.warning("could not clear abandoned staging in %s: %s", self.parent, e)
        return token

    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        self.staging = os.path.join(self.parent, token)
        self.rank = rank

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], objects: Mapping[str, Any]) -> WriteResult:
        with self._user_fixes("writing"):
            stream = self.open_rank_file(self.rank, [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors]) \
                if tensors else None
            try:
                for key, t in tensors:
                    stream.append(key, t)
            except BaseException:
                stream.abort()
                raise
            return self.finish_rank(self.rank, stream, objects)

    @contextlib.contextmanager
    def _user_fixes(self, doing: str) -> Iterator[None]:
        """A full disk, a quota, a read-only or forbidden directory: a storage error naming the
        checkpoint and the place, not a bare ``OSError`` (which reads like a bug)."""
        try:
            yield
        except OSError as e:
            if e.errno not in USER_FIXES:
                raise
            raise storage_access_error(e, f"{doing} the checkpoint {self.path}") from e

    def open_rank_file(self, rank: int, specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> "RankFile":
        """The tensor file of ``rank`` in staging, declared up front (``specs``: key, dtype name,
        shape, in write order) and filled one tensor at a time: how ``write`` writes, and how
        the offline import writes several ranks' files while reading each source tensor once."""
        return RankFile(self, rank, specs)

    def finish_rank(self, rank: int, stream: "RankFile | None", objects: Mapping[str, Any]) -> WriteResult:
        """Close ``rank``'s tensor file (if any), write its objects, and describe what was
        written (files, chunk locations with checksums and block digests)."""
        files, chunks, objs = [], {}, {}
        if stream is not None:
            name, wf = stream.close()
            files.append(FileMeta(name, wf.size, wf.checksum, rank))
            for e in wf.entries:
                chunks[e.key] = (name, e.byte_offset, e.checksum, e.blocks)
        if objects:
            name = rank_file(rank, "objects.json")
            body, digests = objcodec.encode_object_file(objects)
            with open(os.path.join(self.staging, name), "xb") as f, naming(f.name):
                f.write(body)
                f.flush()
                if self.fsync:
                    faults.point("file.fsync", path=f.name)
                    os.fsync(f.fileno())
            files.append(FileMeta(name, len(body), digest(body), rank))
            objs.update((k, (name, d)) for k, d in digests.items())
            self.counters.bytes_written += len(body)
        self.counters.files_written += len(files)
        return WriteResult(rank, tuple(files), chunks, objs)

    def commit(self, metadata: Metadata) -> None:
        with self._user_fixes("committing"):
            if metadata.index is not None:  # format v2: the chunk index first, metadata.json last
                write_index(os.path.join(self.staging, INDEX_FILE), metadata.index, fsync=self.fsync)
            body = metadata.to_json().encode()
            with open(os.path.join(self.staging, METADATA_FILE), "xb") as f, naming(f.name):
                f.write(body)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        if self.fsync:
            fsync_dir(self.staging)
        try:
            publish_dir(self.staging, self.path, overwrite=self.overwrite, fsync=self.fsync)
        finally:
            if not os.path.isdir(self.staging):  # published: the lock has nothing left to guard
                self._release_lock()
        self.staging = None

    def committed_opener(self) -> Callable[[str], Any]:
        path = self.path
        return lambda name: open_regular(os.path.join(path, check_file_name(name)))

    def abort(self) -> None:
        if self.staging and os.path.isdir(self.staging):
            shutil.rmtree(self.staging, ignore_errors=True)
        self._release_lock()
        self.staging = None

    def _release_lock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            try:
                os.unlink(self.staging + STAGING_LOCK)
            except OSError:
                pass
            os.close(fd)


class _TokenBucket:
    """Caps throughput at ``rate`` bytes/s with a one-second burst."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self.tokens, self.last = self.rate, time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


@dataclass(frozen=True)
class ReaderOptions:
    """The filesystem reader's knobs, validated once (the runner builds one from its config);
    ``open_reader(path, fmt, **options.kwargs())``."""

    files_kept: int = DEFAULT_FILES_KEPT
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
    verify_checksums: bool = True
    shared_storage: bool = False
    max_read_bytes_per_s: int | None = None
    read_gap_bytes: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.files_kept < 1:
            raise ConfigError(f"files_kept must be >= 1, got {self.files_kept}")
        if self.max_read_bytes_per_s is not None and self.max_read_bytes_per_s <= 0:
            raise ConfigError(f"max_read_bytes_per_s must be positive, got {self.max_read_bytes_per_s}")
        if self.read_gap_bytes is not None and self.read_gap_bytes < 0:
            raise ConfigError(f"read_gap_bytes must be >= 0, got {self.read_gap_bytes}")
        if self.max_request_bytes < 4096:
            raise ConfigError(f"max_request_bytes must be >= 4096, got {self.max_request_bytes}")
        if self.max_metadata_bytes < 1:
            raise ConfigError(f"max_metadata_bytes must be >= 1, got {self.max_metadata_bytes}")

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


class FileSystemReader(StorageReader):
    """Reads into preallocated destinations. A whole chunk goes straight into a contiguous
    destination and is verified against its checksum. Part of a chunk: with checksums on, the
    blocks it touches are read window by window into a cache-sized scratch buffer, verified,
    and the part copied out; with checksums off (or a format without them) the measured cost
    model picks exact runs or vectored requests straight into the destination
    (``vectored.read_ranges``), or slabs. Reads are sorted by file and offset; open files live
    in an LRU."""

    format_name = "hpdcp"

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.path

    def __init__(self, path: str | os.PathLike, *, files_kept: int = DEFAULT_FILES_KEPT,
                 max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES, verify_checksums: bool = True,
                 shared_storage: bool = False, max_read_bytes_per_s: int | None = None,
                 read_gap_bytes: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        ReaderOptions(files_kept, max_metadata_bytes, verify_checksums, shared_storage, max_read_bytes_per_s,
                      read_gap_bytes, max_request_bytes)  # the checks, in one place
        # A per-process token bucket that models network storage on one machine.
        self.throttle = _TokenBucket(max_read_bytes_per_s) if max_read_bytes_per_s else None
        self.slow_storage = shared_storage or self.throttle is not None
        self.path = os.path.abspath(os.fspath(path))
        self.files_kept = files_kept
        self.read_gap_bytes = read_gap_bytes
        self.max_request_bytes = max_request_bytes
        self._sink = Sink()
        self.max_metadata_bytes = max_metadata_bytes
        self.verify_checksums = verify_checksums
        self.counters = IOCounters()
        self.metadata: Metadata | None = None
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._dir_fd: int | None = None  # the pinned checkpoint directory
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _not_found(self) -> CheckpointNotFoundError:
        parent, name = os.path.split(self.path)
        pending = [n for n in (os.listdir(parent) if os.path.isdir(parent) else [])
                   if n.startswith(f".{name}{STAGING_MARK}")]
        hint = f" (an uncommitted save is in {os.path.join(parent, pending[0])})" if pending else ""
        foreign = {".metadata": "a torch.distributed.checkpoint directory (read it with format='torch_dcp' or "
                                "'auto', e.g. job.source.format=auto)",
                   "model.safetensors": "a Hugging Face model directory (read it with format='hf' or 'auto', e.g. "
                                        "job.source.format=auto)",
                   "model.safetensors.index.json": "a Hugging Face model directory (read it with format='hf' or "
                                                   "'auto', e.g. job.source.format=auto)"}
        for marker, what in foreign.items():
            if os.path.isfile(os.path.join(self.path, marker)):
                hint = f"; it looks like {what}"
                break
        return CheckpointNotFoundError(f"no committed checkpoint at {self.path}{hint}")

    def read_metadata_text(self) -> str:
        mpath = os.path.join(self.path, METADATA_FILE)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"{self.path} is a file, not a checkpoint directory")
        if os.path.lexists(self.path) and (not os.path.isdir(self.path) or not os.path.lexists(mpath)):
            raise self._not_found()
        self._pin_directory()  # (the name, or where an interrupted overwrite left it; else not found)
        try:
            fd = open_regular(mpath, self._dir_fd)
        except FileNotFoundError:
            raise self._not_found() from None
        try:
            size = os.fstat(fd).st_size
            if size > self.max_metadata_bytes:
                raise MetadataError(f"{mpath} is {size} bytes, over the {self.max_metadata_bytes}-byte limit")
            body = bytearray(size)
            pread_into(fd, 0, memoryview(body), name=mpath)
        finally:
            os.close(fd)
        return body.decode("utf-8", errors="replace")

    def _pin_directory(self) -> None:
        """Hold the checkpoint directory open and open every file through it: an overwrite or a
        retention that renames the directory away mid-load cannot mix two checkpoints; this load
        keeps reading the one it started with, or fails saying it changed."""
        if self._dir_fd is None:
            # an overwrite between its two renames (or killed there) leaves the committed checkpoint
            # under its displaced name: read it there, as it is (repairing is for writers)
            where = interrupted_swap(self.path) or self.path
            try:
                self._dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise self._not_found() from None
            except OSError as e:
                raise storage_access_error(e, f"cannot open the checkpoint {self.path}") from None

    def pin(self) -> Any:
        """The identity of the directory whose metadata was read (its inode), for other ranks."""
        return os.fstat(self._dir_fd).st_ino if self._dir_fd is not None else None

    def attach_metadata(self, metadata: Metadata, pin: Any = None) -> None:
        """``pin``: the coordinator's :meth:`pin`; this rank's directory must be the same one."""
        self.metadata = metadata
        self._pin_directory()
        if pin is not None and os.fstat(self._dir_fd).st_ino != pin:
            raise self._changed("it was replaced between the coordinator reading its metadata and this rank "
                                "opening it")

    def _missing(self, full: str) -> HpdcpError:
        """A file the metadata lists is not in the pinned directory: the checkpoint was replaced or
        deleted under this load (the directory is unlinked, or no longer the one under its name),
        or, if it is still the one there, the file is really missing."""
        st = os.fstat(self._dir_fd)
        try:
            now = os.stat(self.path)
            same = (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)
        except FileNotFoundError:
            same = False
        if st.st_nlink == 0 or not same:
            return self._changed("the directory it was reading is no longer the one under its name")
        return CheckpointNotFoundError(f"checkpoint file {full} is missing (listed in {METADATA_FILE})")

    def _changed(self, how: str) -> CheckpointChangedError:
        return CheckpointChangedError(f"checkpoint {self.path} changed during the load ({how}: overwritten, moved "
                                      f"or deleted by another process); nothing loaded from it can be trusted")

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        check_file_name(name)
        full = os.path.join(self.path, name)
        self._pin_directory()
        try:
            fd = open_regular(full, self._dir_fd)
        except FileNotFoundError:
            raise self._missing(full) from None
        expected = self.metadata.files[name].size if self.metadata else None
        actual = os.fstat(fd).st_size
        if expected is not None and actual != expected:
            os.close(fd)
            raise CorruptCheckpointError(f"checkpoint file {full} is {actual} bytes but {METADATA_FILE} records "
                                         f"{expected} (truncated or modified)")
        self.counters.files_opened += 1
        self._fds[name] = fd
        while len(self._fds) > self.files_kept:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __del__(self) -> None:  # a reader dropped without close() must not leak descriptors
        try:
            self.close()
        except Exception:
            pass

    def open_file(self, name: str) -> int:
        """A file of the pinned checkpoint, opened read-only (no links, regular files only)."""
        check_file_name(name)
        self._pin_directory()
        full = os.path.join(self.path, name)
        try:
            return open_regular(full, self._dir_fd)
        except FileNotFoundError:
            raise self._missing(full) from None

    def read_metadata_once(self) -> Metadata:
        """Read, validate and attach the metadata (the v2 index stays open, its directory not),
        then release the directory (one-shot callers)."""
        try:
            md = Metadata.from_json(self.read_metadata_text(), source=os.path.join(self.path, METADATA_FILE),
                                    open_file=self.open_file)
        finally:
            self.close()
        self.metadata = md
        return md

    def _scratch_view(self, nbytes: int) -> torch.Tensor:
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def read_tensors(self, requests: Sequence[ReadRequest], on_done: Callable[[int], None] | None = None,
                     keep_order: bool = False) -> None:
        """Reads are sorted by (file, offset); ``keep_order`` keeps the caller's order instead (the
        order broadcasts need the data) when every file fits in the open-file LRU anyway."""
        plans = []
        for k, r in enumerate(requests):
            dt = dtype_from_name(r.dtype)
            esize = element_size(r.dtype)
            start, stop = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)
            plans.append((r.chunk.file, r.chunk.byte_offset + start * esize, (stop - start) * esize, r, dt, k))
        if not (keep_order and len({p[0] for p in plans}) <= self.files_kept):
            plans.sort(key=lambda p: (p[0], p[1]))
        for name, offset, nbytes, r, dt, k in plans:
            if nbytes:
                self._read_one(name, offset, nbytes, r, dt)
            if on_done is not None:
                on_done(k)

    def check_claims(self, md: Metadata) -> None:
        """Before anything is allocated from ``md``: every file it lists is here at its recorded
        size, and its tensors claim no more bytes than those files hold (chunks tile each
        tensor and never share bytes, so a valid checkpoint's tensor bytes fit in its files). A
        tiny file claiming a 1 TiB tensor fails here, naming the file or the tensor."""
        before, self.metadata = self.metadata, md
        try:
            self.check_files(sorted(md.files))
        finally:
            self.metadata = before
        have = sum(f.size for f in md.files.values())
        claimed = md.total_tensor_bytes
        if claimed > have:
            big = max(md.tensors.items(), key=lambda kv: kv[1].nbytes)
            raise CorruptCheckpointError(f"{self.path}: the metadata claims {claimed} bytes of tensors (e.g. "
                                         f"{big[0]!r}: {big[1].dtype} {list(big[1].shape)}, {big[1].nbytes} bytes) "
                                         f"but its files hold {have} bytes (damaged or hostile metadata)")

    def check_files(self, names: Iterable[str]) -> None:
        """Check these files now (inside the pinned directory: each a regular file of its recorded
        size) without opening them: a load checks every file it needs before any data moves, and
        callers that allocate from metadata shapes first make sure the bytes are really there."""
        self._pin_directory()
        for name in names:
            if name in self._fds:
                continue
            check_file_name(name)
            full = os.path.join(self.path, name)
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self._missing(full) from None
            if stat.S_ISLNK(st.st_mode):
                raise CorruptCheckpointError(f"{full} is a symbolic link; checkpoint files must be regular files "
                                             f"inside the checkpoint directory")
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{full} is not a regular file")
            expected = self.metadata.files[name].size if self.metadata and name in self.metadata.files else None
            if expected is not None and st.st_size != expected:
                raise CorruptCheckpointError(f"checkpoint file {full} is {st.st_size} bytes but {METADATA_FILE} "
                                             f"records {expected} (truncated or modified)")

    def _read_one(self, name: str, offset: int, nbytes: int, r: ReadRequest, dt: torch.dtype) -> None:
        """One request: ``offset``/``nbytes`` is the flat span of its part in the file."""
        faults.point("load.read", rank=rank_of_env(), path=self.path, file=name)
        fd = self._fd(name)
        if not self.verify_checksums:
            self._read_unverified(fd, name, r, dt)
            return
        whole_chunk = r.sub.sizes == r.chunk.sizes
        dest = r.dest
        direct = whole_chunk and dest.device.type == "cpu" and dest.dtype == dt and dest.is_contiguous()
        hexes = r.chunk.blocks
        if direct:  # the whole chunk into its destination, then its checksum
            view = byte_view(dest)
            self._check_bounds(fd, name, r, offset, nbytes)
            self._pread(fd, offset, view, name=name)
            self._count(nbytes, 1)
            self._verify(name, r, view)
        elif hexes:
            self._read_windows(fd, name, r, dt, hexes)
        else:  # a chunk of one block (or written before block digests): read whole, verify, copy
            chunk_bytes = r.chunk.box.numel * element_size(r.dtype)
            self._check_bounds(fd, name, r, r.chunk.byte_offset, chunk_bytes)
            buf = self._scratch_view(chunk_bytes)
            view = byte_view(buf)
            self._pread(fd, r.chunk.byte_offset, view, name=name)
            self._count(chunk_bytes, 1)
            self._verify(name, r, view)
            start = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)[0]
            dest.copy_(buf.view(dt).as_strided(r.sub.sizes, row_major_strides(r.chunk.sizes), start))

    def _pread(self, fd: Any, offset: int, view: memoryview, *, name: str) -> None:
        """Fill ``view`` from the file ``fd`` (what :meth:`_fd` returned) at ``offset``: the one
        place bytes come from, so another storage changes only this and :meth:`_file_size`."""
        pread_into(fd, offset, view, name=name)

    def _file_size(self, fd: Any) -> int:
        return os.fstat(fd).st_size

    def _count(self, nbytes: int, calls: int) -> None:
        self.counters.bytes_read += nbytes
        self.counters.reads += calls
        if self.throttle:
            self.throttle.take(nbytes)

    def _check_bounds(self, fd: int, name: str, r: ReadRequest, offset: int, nbytes: int) -> None:
        size = self._file_size(fd)
        if offset < 0 or offset + nbytes > size:
            raise CorruptCheckpointError(f"{os.path.join(self.path, name)}: chunk {r.chunk.key!r}: a read at offset "
                                         f"{offset} of {nbytes} bytes would end past the file's {size} bytes "
                                         f"(truncated file or bad metadata)")

    def _verify(self, name: str, r: ReadRequest, view: memoryview) -> None:
        if digest(view) != r.chunk.checksum:
            raise CorruptCheckpointError(f"checkpoint file {os.path.join(self.path, name)}: key {r.chunk.key!r} "
                                         f"fails its checksum (corrupted data)")
        self.counters.chunks_verified += 1

    def cost_model(self) -> ReadCostModel:
        """The measured read costs of this machine, bytes capped at the throttle's rate."""
        return measured_cost_model().capped(self.throttle.rate if self.throttle else None)

    def strategy(self, n: int, run: int, span: int) -> tuple[str, int]:
        """How to read ``n`` runs of ``run`` bytes over ``span`` bytes: ``exact``, ``through`` (with
        the largest gap read through) or ``slab`` (see ``vectored.ReadCostModel``). An explicit
        ``read_gap_bytes`` decides alone: 0 is exact, more is through."""
        if n <= 1:
            return "exact", 0
        if self.read_gap_bytes is not None:
            return ("exact", 0) if self.read_gap_bytes == 0 else ("through", self.read_gap_bytes)
        model = self.cost_model()
        how = model.choose(n, run, span)
        return how, model.gap_bytes if how == "through" else 0

    def _read_unverified(self, fd: int, name: str, r: ReadRequest, dt: torch.dtype) -> None:
        """Checksums off, or a format without them: the cheapest of exact runs, vectored requests
        reading short gaps through, or cache-sized slabs and a strided copy, by the measured cost
        model. Exact and through land in the destination itself; destinations they cannot land in
        (another dtype or device, runs not contiguous there) take slabs."""
        esize = element_size(r.dtype)
        dest = r.dest
        nd = len(r.chunk.sizes)
        k = run_dim(r.sub.sizes, r.chunk.sizes) if nd else 0
        strides = row_major_strides(r.chunk.sizes)
        run = (r.sub.sizes[k] * strides[k] if nd else 1) * esize
        n = r.sub.numel * esize // run if run else 0
        start, stop = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)
        how, gap = self.strategy(n, run, (stop - start) * esize)
        into = dest.device.type == "cpu" and dest.dtype == dt and runs_contiguous_in(dest, k)
        if how == "slab" or not into:
            self.counters.bump("partial_reads_slab", 1)
            self._read_windows(fd, name, r, dt, "")
            return
        self.counters.bump(f"partial_reads_{how}", 1)
        starts = run_starts(r.sub.offsets, r.sub.sizes, strides, k)
        what = f"chunk {r.chunk.key!r}"
        full = os.path.join(self.path, name)
        addrs = check_destination(dest, run_starts((0,) * nd, r.sub.sizes, dest.stride(), k) * esize, run,
                                  name=full, what=what)
        st = read_ranges(fd, r.chunk.byte_offset + starts * esize, run, addrs, gap_bytes=gap, sink=self._sink,
                         name=full, what=what, file_size=self._file_size(fd),
                         max_request_bytes=self.max_request_bytes)
        self._count(st.bytes_read, st.calls)

    def _windows(self, r: ReadRequest, esize: int) -> Iterator[tuple[Box, torch.Tensor]]:
        """The sub-box in slices of whole dim-0 indices whose span in the chunk is at most a
        scratch window (``SCRATCH_WINDOW``, or ``max_request_bytes`` if smaller; at least one
        index), each with its part of the destination: what bounds the scratch buffer and keeps
        it in the CPU cache for the copy out."""
        if not r.sub.sizes:
            yield r.sub, r.dest
            return
        per = max(1, math.prod(r.chunk.sizes[1:]) * esize)
        step = max(1, min(SCRATCH_WINDOW, self.max_request_bytes) // per)
        o0, n0 = r.sub.offsets[0], r.sub.sizes[0]
        for i in range(0, n0, step):
            m = min(step, n0 - i)
            yield Box((o0 + i, *r.sub.offsets[1:]), (m, *r.sub.sizes[1:])), r.dest.narrow(0, i, m)

    def _read_windows(self, fd: int, name: str, r: ReadRequest, dt: torch.dtype, hexes: str) -> None:
        """Window by window (:meth:`_windows`): read the window's span into the scratch buffer,
        then copy its part out (one strided copy, casting or moving to the destination's device
        as needed). With ``hexes`` (the chunk's block digests) every byte copied is verified:
        the read covers the whole blocks the window touches and each block is read and checked
        once (a block two windows share stays in the scratch buffer). That costs the blocks'
        extra bytes: up to a block at each end of a row range, the whole chunk for a column
        split."""
        esize = element_size(r.dtype)
        chunk_bytes = r.chunk.box.numel * esize
        block = self.metadata.block_bytes if hexes else 0
        strides = row_major_strides(r.chunk.sizes)
        full = os.path.join(self.path, name)
        parts = list(self._windows(r, esize))
        spans = [flat_span(p.offsets, p.sizes, r.chunk.sizes) for p, _ in parts]
        cap = max((stop - start) * esize for start, stop in spans) + 2 * block
        scratch = self._scratch_view(min(cap, chunk_bytes))  # one buffer for every window
        have_lo = have_hi = 0  # the chunk bytes the scratch holds (verified when ``block``)
        for (part, view), (start, stop) in zip(parts, spans):
            lo, hi = start * esize, stop * esize
            if block:
                lo, hi = lo // block * block, min(-(-hi // block) * block, chunk_bytes)
            keep = min(max(0, have_hi - lo), hi - lo) if lo >= have_lo else 0  # the last window's (verified) tail
            if keep:
                scratch[:keep].copy_(scratch[lo - have_lo:have_hi - have_lo].clone())
            if hi > lo + keep:
                self._check_bounds(fd, name, r, r.chunk.byte_offset + lo + keep, hi - lo - keep)
                self._pread(fd, r.chunk.byte_offset + lo + keep, byte_view(scratch[keep:hi - lo]), name=name)
                self._count(hi - lo - keep, 1)
            if block:
                bview = byte_view(scratch[:hi - lo])
                for b in range((lo + keep) // block, -(-hi // block)):
                    piece = bview[b * block - lo:min((b + 1) * block, hi) - lo]
                    if digest(piece) != hexes[16 * b:16 * b + 16]:
                        raise CorruptCheckpointError(
                            f"checkpoint file {full}: key {r.chunk.key!r} fails the checksum of its block {b} (bytes "
                            f"{r.chunk.byte_offset + b * block}..{r.chunk.byte_offset + b * block + len(piece)}; "
                            f"corrupted data)")
                self.counters.chunks_verified += 1
            have_lo, have_hi = lo, hi
            view.copy_(scratch[:hi - lo].view(dt).as_strided(part.sizes, strides, start - lo // esize))

    def read_objects(self, wanted: Mapping[str, ObjectMeta], *, allow_pickle: bool) -> dict[str, Any]:
        by_file: dict[str, list[str]] = {}
        for fqn, om in wanted.items():
            by_file.setdefault(om.file, []).append(fqn)
        out: dict[str, Any] = {}
        for name, fqns in sorted(by_file.items()):
            fd = self._fd(name)
            size = self._file_size(fd)
            body = bytearray(size)
            self._pread(fd, 0, memoryview(body), name=name)
            self.counters.bytes_read += size
            self.counters.bump("object_bytes_read", size)
            full = os.path.join(self.path, name)
            if self.metadata and digest(body) != self.metadata.files[name].checksum:
                raise CorruptCheckpointError(f"checkpoint file {full} fails its checksum (corrupted data)")
            doc = jsondoc.parse(body, f"checkpoint file {full}", CorruptCheckpointError)
            for fqn in fqns:
                if not isinstance(doc, dict) or fqn not in doc:
                    raise CorruptCheckpointError(f"checkpoint file {full} lacks object {fqn!r}")
                out[fqn] = objcodec.decode(doc[fqn], key=fqn, source=full, allow_pickle=allow_pickle)
        return out
