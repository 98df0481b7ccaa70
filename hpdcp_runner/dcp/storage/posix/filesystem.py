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
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ...core import faults
from ...core.rafile import open_regular  # noqa: F401  (re-exported: api, retention)
from ...core.utils import get_logger
from ...format import objects as objcodec
from ...format.chunk_index import INDEX_FILE
from ...format.metadata import METADATA_FILE, FileMeta, Metadata, check_file_name, dtype_name
from ...format.safetensors_io import SafetensorsStreamWriter, digest, naming, write_index
from .commit import USER_FIXES, RenameCommit, storage_access_error
from ..interfaces import IOCounters, StorageWriter, WriteResult
from .posix_files import PinnedDirectory
from ..reader import DEFAULT_FILES_KEPT, CheckpointReader, ReaderOptions  # noqa: F401  (re-exported)

log = get_logger(__name__)
CHECKPOINT_EXISTS = ("checkpoint {path} already exists; pass overwrite=True to replace it (the old one stays loadable "
                     "until the new one commits)")


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


class FileSink:
    """A file of the staging area written block by block (a copied file): ``close`` makes it
    durable, ``abort`` removes it."""

    def __init__(self, path: str, fsync: bool, counters: IOCounters) -> None:
        self.path, self.fsync, self.counters = path, fsync, counters
        self._f = open(path, "xb")

    def write(self, data: bytes) -> None:
        with naming(self.path):
            self._f.write(data)
        self.counters.bytes_written += len(data)

    def close(self) -> None:
        with naming(self.path):
            self._f.flush()
            if self.fsync:
                os.fdatasync(self._f.fileno())
            self._f.close()
        self.counters.files_written += 1

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class FileSystemWriter(StorageWriter):
    """Per-rank safetensors files in a staging directory beside the checkpoint, committed by one
    rename (see ``storage/posix/commit.py``)."""

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.path

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True, node_local: bool = False) -> None:
        self.overwrite = False
        #: the path is each node's own disk (``node_tier``): a rank whose node lacks the
        #: coordinator's staging directory makes one of the same name there, and only node 0's
        #: part is committed by ``commit`` (``node_tier.publish_parts`` commits the others)
        self.node_local = node_local
        self.path = os.path.abspath(os.fspath(path))
        self.fsync = fsync
        self.staging: str | None = None
        self._commit: RenameCommit | None = None
        self.rank = 0
        self.counters = IOCounters()

    def begin(self, *, overwrite: bool) -> str:
        self.overwrite = overwrite
        self._commit = RenameCommit.begin(self.path, overwrite, exists=CHECKPOINT_EXISTS, what="the checkpoint")
        self.staging = self._commit.staging
        return self._commit.token

    @property
    def staging_token(self) -> str | None:
        """The staging directory's name this save used (kept after the commit: node_tier's publish)."""
        return self._commit.token if self._commit is not None else None

    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        if self._commit is None or self._commit.token != token:  # (the coordinator keeps its own, lock held)
            self._commit = RenameCommit.adopt(self.path, token, self.overwrite)
        self.staging = self._commit.staging
        if self.node_local and not os.path.isdir(self.staging):
            with self._user_fixes("staging"):
                os.makedirs(self.staging, exist_ok=True)
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
            with self.counters.staged("flushing to disk" if self.fsync else "closing the file"):
                name, wf = stream.close()
            self.counters.files_written += 1  # (counted as each completes: progress shows it move)
            files.append(FileMeta(name, wf.size, wf.checksum, rank))
            for e in wf.entries:
                chunks[e.key] = (name, e.byte_offset, e.checksum, e.blocks)
        if objects:
            name = rank_file(rank, "objects.json")
            body, digests = objcodec.encode_object_file(objects)
            with open(os.path.join(self.staging, name), "xb") as f, naming(f.name), \
                    self.counters.staged("flushing to disk" if self.fsync else "closing the file"):
                f.write(body)
                f.flush()
                if self.fsync:
                    faults.point("file.fsync", path=f.name)
                    os.fsync(f.fileno())
            files.append(FileMeta(name, len(body), digest(body), rank))
            objs.update((k, (name, d)) for k, d in digests.items())
            self.counters.bytes_written += len(body)
            self.counters.files_written += 1
        return WriteResult(rank, tuple(files), chunks, objs)

    def commit(self, metadata: Metadata) -> None:
        with self._user_fixes("committing"):
            if metadata.index is not None:  # format v2: the chunk index first, metadata.json last
                write_index(os.path.join(self.staging, INDEX_FILE), metadata.index, fsync=self.fsync)
        self.commit_copy(metadata, metadata.to_json().encode())

    def commit_copy(self, metadata: Metadata, body: bytes) -> None:
        with self._user_fixes("committing"):
            with open(os.path.join(self.staging, METADATA_FILE), "xb") as f, naming(f.name):
                f.write(body)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        self._commit.publish(fsync=self.fsync)
        self.staging = None

    def open_sink(self, name: str, size: int) -> "FileSink":
        return FileSink(os.path.join(self.staging, check_file_name(name)), self.fsync, self.counters)

    def reopen_args(self) -> dict[str, Any] | None:
        # (exactly this class: a subclass may do what a plain writer reopened elsewhere would not)
        return {"path": self.path, "fsync": self.fsync} if type(self) is FileSystemWriter else None

    def committed_opener(self) -> Callable[[str], Any]:
        path = self.path
        return lambda name: open_regular(os.path.join(path, check_file_name(name)))

    def abort(self) -> None:
        if self._commit is not None:
            self._commit.abort()
        self.staging = None


class FileSystemReader(CheckpointReader):
    """The reader of our checkpoint in a local directory: a :class:`CheckpointReader` over the
    directory pinned by a descriptor (``posix_files.PinnedDirectory``)."""

    def __init__(self, path: str | os.PathLike, aliases: Mapping[str, str] | None = None, **options: Any) -> None:
        super().__init__(PinnedDirectory(path, aliases), **options)
