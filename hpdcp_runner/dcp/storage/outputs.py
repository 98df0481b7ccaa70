"""Outputs of the offline tools (a Hugging Face export or merge, a torch DCP export): a directory
of plain files with fixed names, made visible by the strategy its location allows.

* :class:`RenameOutput` (file systems): every file is written under a hidden staging name and
  the directory is renamed into place in one step (``commit.publish_dir``); an existing output
  stays in place until the new one is complete.
* :class:`InPlaceOutput` (object stores, no rename): files are uploaded in place, the side files
  first and the file that makes the directory usable (the shard index, or the one weights file)
  last, then a manifest of what this export wrote, so a later overwrite deletes only its own files.
  See ``object_checkpoint.ObjectDirectoryOutput``.

Both check every safetensors file written with the safetensors library itself (on a store: the
header read back, against the object's real size), so what is published is what the real reader
accepts. :func:`open_output` picks the strategy from the location's capabilities.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from ..core.errors import CorruptCheckpointError, HpdcpError
from ..core.rafile import RandomAccessFile
from ..format.metadata import dtype_name
from ..format.safetensors_io import SafetensorsStreamWriter
from .posix.commit import RenameCommit
from .location import Location, locate


def check_with_safetensors(path: str, shown: str | None = None) -> None:
    """Open ``path`` with the safetensors library itself (header only): an output file it would
    refuse is an error here, never a transform reported as done."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_slice(key).get_shape()
    except Exception as e:
        raise CorruptCheckpointError(f"{shown or path}: the safetensors library refuses the file written "
                                     f"({type(e).__name__}: {str(e)[:200]}); nothing was published") from None


def check_remote_with_safetensors(f: RandomAccessFile, shown: str) -> None:
    """The same check of a file in a store, without downloading it: its header (read back by
    range) is laid into a sparse local file of the object's real size, which the library opens."""
    import struct

    size = f.size()
    head = f.pread(8, 0)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
    if n > size - 8:
        raise CorruptCheckpointError(f"{shown}: header length {n} runs past the file's {size} bytes; nothing was "
                                     f"published")
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:
        tmp.write(head + f.pread(n, 8))
        tmp.truncate(size)  # sparse: no data blocks, the real length
        tmp.flush()
        check_with_safetensors(tmp.name, shown)


class DirectoryOutput(ABC):
    """An offline tool's output directory. The coordinator calls ``begin`` (refusing what the output
    must not replace) and passes its token to every other rank's ``adopt``; any rank writes files;
    the coordinator ``commit``s once every file is written, or ``abort``s."""

    url: str
    #: the storage keeps a reference to the bytes a stream writes until its upload completes (an
    #: object store's multipart writer does not copy): a writer must not reuse those buffers
    holds_written_buffers: bool = False

    @abstractmethod
    def begin(self) -> Any:
        """Coordinator: check the target and prepare; returns a JSON-able token."""

    @abstractmethod
    def adopt(self, token: Any) -> None:
        """Every other rank: the coordinator's token."""

    @abstractmethod
    def stream_safetensors(self, name: str, specs: Sequence[tuple[str, str, tuple[int, ...]]],
                           meta: dict | None) -> SafetensorsStreamWriter:
        """A safetensors file of these (key, dtype, shape) written one tensor at a time."""

    @abstractmethod
    def check_safetensors(self, name: str) -> None:
        """Open the written file with the safetensors library itself: refused is an error."""

    def write_safetensors(self, name: str, pairs: Sequence[tuple[str, torch.Tensor]], meta: dict | None) -> None:
        """Write one safetensors file and check it with the real library."""
        w = self.stream_safetensors(name, [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in pairs], meta)
        try:
            for k, t in pairs:
                w.append(k, t)
        except BaseException:
            w.abort()
            raise
        w.close()
        self.check_safetensors(name)

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Write one small file (config, tokenizer, an index)."""

    def put_file(self, name: str, local_path: str) -> None:
        """Copy one local file into the output (what another library wrote locally)."""
        with open(local_path, "rb") as f:
            self.put(name, f.read())

    def write_local(self, write: Callable[[str], None], written: list[str], last: Sequence[str] = ()) -> None:
        """What a tool of another library writes into a local directory (``write(directory)``:
        torch's own ``FileSystemWriter``) made files of this output: written in a scratch
        directory (``TMPDIR``), then each put here, the ``last`` ones last (a format's index),
        their names added to ``written``."""
        with tempfile.TemporaryDirectory(prefix="hpdcp-export-") as tmp:
            write(tmp)
            for name in sorted(os.listdir(tmp), key=lambda n: (n in last, n)):
                written.append(name)
                self.put_file(name, os.path.join(tmp, name))

    @abstractmethod
    def commit(self, written: Sequence[str]) -> None:
        """Coordinator: make the output visible; ``written`` names every file this export wrote."""

    @abstractmethod
    def abort(self, written: Sequence[str]) -> None:
        """Coordinator, best effort: remove what this export wrote; never what was there before."""


class RenameOutput(DirectoryOutput):
    """A local directory built under a staging name and renamed into place: the same commit as
    the engine's checkpoints (``commit.RenameCommit``)."""

    EXISTS = "{path} already exists; pass overwrite to replace it (the old one stays in place until the new one is complete)"

    def __init__(self, dst: str, overwrite: bool, fsync: bool = True) -> None:
        self.url, self.overwrite, self.fsync = dst, overwrite, fsync
        self._commit: RenameCommit | None = None

    def begin(self) -> str:
        self._commit = RenameCommit.begin(self.url, self.overwrite, exists=self.EXISTS)
        return self._commit.token

    def adopt(self, token: Any) -> None:
        if self._commit is None or self._commit.token != token:  # (the coordinator keeps its own, lock held)
            self._commit = RenameCommit.adopt(self.url, token, self.overwrite)

    @property
    def staging(self) -> str:
        """The staging directory (a local writer, e.g. torch's, may write into it directly)."""
        return self._begun().staging

    def _begun(self) -> RenameCommit:
        if self._commit is None:
            raise HpdcpError(f"{self.url}: the output was not begun (begin() on the coordinator, adopt() elsewhere)")
        return self._commit

    def stream_safetensors(self, name: str, specs: Sequence[tuple[str, str, tuple[int, ...]]],
                           meta: dict | None) -> SafetensorsStreamWriter:
        return SafetensorsStreamWriter(os.path.join(self.staging, name), specs, meta=meta, fsync=self.fsync)

    def check_safetensors(self, name: str) -> None:
        check_with_safetensors(os.path.join(self.staging, name))  # what we publish is what the real reader accepts

    def put(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.staging, name), "xb") as f:
            f.write(data)

    def write_local(self, write: Callable[[str], None], written: list[str], last: Sequence[str] = ()) -> None:
        write(self.staging)  # (the tool writes into the staging directory itself; the rename publishes it all)

    def commit(self, written: Sequence[str]) -> None:
        self._begun().publish(fsync=self.fsync)

    def abort(self, written: Sequence[str]) -> None:
        if self._commit is not None:
            self._commit.abort()


class InPlaceOutput(DirectoryOutput):
    """A directory in an object store, written in place (the usable-making file last)."""

    holds_written_buffers = True

    def __init__(self, location: Location, overwrite: bool, source: str | None = None) -> None:
        from .objects.object_checkpoint import ObjectDirectoryOutput

        self.url = location.url
        self._out = ObjectDirectoryOutput(self.url, overwrite, source=source)
        self._before: list[str] = []

    def begin(self) -> list[str]:
        self._before = self._out.begin()
        return self._before

    def adopt(self, token: Any) -> None:
        self._before = list(token or [])

    def stream_safetensors(self, name: str, specs: Sequence[tuple[str, str, tuple[int, ...]]],
                           meta: dict | None) -> SafetensorsStreamWriter:
        return SafetensorsStreamWriter(f"{self.url}/{name}", specs, meta=meta, sink=self._out.sink(name))

    def check_safetensors(self, name: str) -> None:
        from .objects.object_store import RemoteFile

        check_remote_with_safetensors(RemoteFile(self._out.bucket, self._out.key(name), None), f"{self.url}/{name}")

    def put(self, name: str, data: bytes) -> None:
        self._out.put(name, data)

    def put_file(self, name: str, local_path: str) -> None:
        self._out.bucket.upload_file(self._out.key(name), local_path)

    def commit(self, written: Sequence[str]) -> None:
        self._out.finish(self._before, list(written))

    def abort(self, written: Sequence[str]) -> None:
        self._out.abort(list(written))


def open_output(dst: str | os.PathLike, overwrite: bool, *, source: str | None = None,
                fsync: bool = True) -> DirectoryOutput:
    """The output directory at ``dst`` with the commit its storage allows: a rename where the
    storage has one, in-place writes with the usable-making file last where it does not."""
    loc = locate(dst)
    if loc.capabilities.atomic_rename:
        return RenameOutput(loc.url, overwrite, fsync)
    return InPlaceOutput(loc, overwrite, source=None if source is None else locate(source).url)
