"""A checkpoint in a local directory, pinned by a descriptor (see ``checkpoint_files``)."""

from __future__ import annotations

import errno
import os
import stat
import threading
from typing import Any, Iterable, Mapping

from ...core.errors import CheckpointNotFoundError, CorruptCheckpointError, HpdcpError, MetadataError
from ...core.rafile import FdFile, RandomAccessFile, open_regular, open_regular_file
from ...format.metadata import METADATA_FILE
from ...format.safetensors_io import pread_into
from ..checkpoint_files import CheckpointFiles, plain_name
from .commit import STAGING_MARK, interrupted_swap, storage_access_error

_FOREIGN_HINTS = {
    ".metadata": "a torch.distributed.checkpoint directory (read it with format='torch_dcp' or 'auto', e.g. "
                 "job.source.format=auto)",
    "model.safetensors": "a Hugging Face model directory (read it with format='hf' or 'auto', e.g. "
                         "job.source.format=auto)",
    "model.safetensors.index.json": "a Hugging Face model directory (read it with format='hf' or 'auto', e.g. "
                                    "job.source.format=auto)"}


class PinnedDirectory(CheckpointFiles):
    """Hold the checkpoint directory open and open every file through it: an overwrite or a
    retention that renames the directory away mid-load cannot mix two checkpoints; this load
    keeps reading the one it started with, or fails saying it changed. Files are opened without
    following links and must be regular files (no FIFO or device can hang a load)."""

    def __init__(self, path: str | os.PathLike, aliases: Mapping[str, str] | None = None) -> None:
        self.url = os.path.abspath(os.fspath(path))
        #: a checkpoint file's name -> the name it is read under here (a node-local restore's
        #: file holding only the ranges its ranks read: never under the checkpoint's name)
        self.aliases = dict(aliases or {})
        self._dir_fd: int | None = None
        self._subdirs: dict[str, int] = {}  # a subdirectory's path: its descriptor, opened inside the pin
        self._subdirs_lock = threading.Lock()

    def _join(self, name: str) -> str:
        return os.path.join(self.url, self.aliases.get(name, name))

    # -- the pin ------------------------------------------------------------------------------
    def pin_directory(self) -> None:
        if self._dir_fd is None:
            # an overwrite between its two renames (or killed there) leaves the committed checkpoint
            # under its displaced name: read it there, as it is (repairing is for writers)
            where = interrupted_swap(self.url) or self.url
            try:
                self._dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise self.not_found() from None
            except OSError as e:
                raise storage_access_error(e, f"cannot open the checkpoint {self.url}") from None

    def pin(self) -> Any:
        """The identity of the directory whose metadata was read (its inode)."""
        return os.fstat(self._dir_fd).st_ino if self._dir_fd is not None else None

    def attach(self, pin: Any) -> None:
        self.pin_directory()
        if pin is not None and os.fstat(self._dir_fd).st_ino != pin:
            raise self.changed("it was replaced between the coordinator reading its metadata and this rank "
                               "opening it")

    def metadata_text(self, name: str, max_bytes: int) -> str:
        mpath = self._join(name)
        if os.path.exists(self.url) and not os.path.isdir(self.url):
            raise CheckpointNotFoundError(f"{self.url} is a file, not a checkpoint directory")
        if os.path.lexists(self.url) and (not os.path.isdir(self.url) or not os.path.lexists(mpath)):
            raise self.not_found()
        self.pin_directory()  # (the name, or where an interrupted overwrite left it; else not found)
        try:
            fd = open_regular(mpath, self._dir_fd)
        except FileNotFoundError:
            raise self.not_found() from None
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise MetadataError(f"{mpath} is {size} bytes, over the {max_bytes}-byte limit")
            body = bytearray(size)
            pread_into(fd, 0, memoryview(body), name=mpath)
        finally:
            os.close(fd)
        return body.decode("utf-8", errors="replace")

    def not_found(self) -> CheckpointNotFoundError:
        parent, name = os.path.split(self.url)
        pending = [n for n in (os.listdir(parent) if os.path.isdir(parent) else [])
                   if n.startswith(f".{name}{STAGING_MARK}")]
        hint = f" (an uncommitted save is in {os.path.join(parent, pending[0])})" if pending else ""
        for marker, what in _FOREIGN_HINTS.items():
            if os.path.isfile(self._join(marker)):
                hint = f"; it looks like {what}"
                break
        return CheckpointNotFoundError(f"no committed checkpoint at {self.url}{hint}")

    def missing(self, name: str) -> HpdcpError:
        """The directory is unlinked or no longer the one under its name: it changed; else the
        file is really missing from the current one."""
        st = os.fstat(self._dir_fd)
        try:
            now = os.stat(self.url)
            same = (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)
        except FileNotFoundError:
            same = False
        if st.st_nlink == 0 or not same:
            return self.changed("the directory it was reading is no longer the one under its name")
        return CheckpointNotFoundError(f"checkpoint file {self._join(name)} is missing (listed in {METADATA_FILE})")

    # -- files --------------------------------------------------------------------------------
    def require_directory(self) -> None:
        if not os.path.isdir(self.url):
            raise CheckpointNotFoundError(f"no checkpoint directory at {self.url}")
        self.pin_directory()

    def _parent(self, name: str) -> tuple[int, str]:
        """(a descriptor of the directory holding ``name``, its last part): a name in a
        subdirectory (``zero/<param>/fp32.pt``) reaches it one directory at a time, each opened
        inside the pinned one without following a link, so no link can lead a load outside."""
        self.pin_directory()
        *dirs, base = plain_name(self.aliases.get(name, name), self.url).split("/")
        fd = self._dir_fd
        for i in range(len(dirs)):
            sub = "/".join(dirs[:i + 1])
            with self._subdirs_lock:  # (readers' threads share the descriptors)
                if sub not in self._subdirs:
                    self._subdirs[sub] = self._open_subdir(dirs[i], fd, sub, name)
                fd = self._subdirs[sub]
        return fd, base

    def _open_subdir(self, part: str, parent: int, sub: str, name: str) -> int:
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(part, flags, dir_fd=parent)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self._join(name)} is missing (no directory {self._join(sub)})") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError(f"{self._join(sub)} is a link or not a directory (a checkpoint's "
                                             f"subdirectories must be directories inside it)") from None
            raise storage_access_error(e, f"cannot open {self._join(sub)}") from None

    def _stat(self, name: str) -> os.stat_result:
        fd, base = self._parent(name)
        try:
            st = os.stat(base, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self._join(name)} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{self._join(name)} is not a regular file (links and directories are "
                                         f"refused)")
        return st

    def exists(self, name: str) -> bool:
        try:
            fd, base = self._parent(name)
            os.stat(base, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, CheckpointNotFoundError):
            return False
        return True

    def size_of(self, name: str) -> int:
        return self._stat(name).st_size

    def read_small(self, name: str, max_bytes: int) -> bytes:
        fd, _ = self._parent(name)
        try:
            with open_regular_file(self._join(name), fd) as f:
                body = f.read(max_bytes + 1)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self._join(name)} is missing") from None
        if len(body) > max_bytes:
            raise MetadataError(f"{self._join(name)} is over the {max_bytes}-byte limit")
        return body

    def open_random(self, name: str) -> RandomAccessFile:
        fd, _ = self._parent(name)
        try:
            return FdFile(open_regular(self._join(name), fd))
        except FileNotFoundError:
            raise self.missing(name) from None

    def check_sizes(self, names: Iterable[str], expected: dict[str, int]) -> None:
        self.pin_directory()
        for name in names:
            try:
                fd, base = self._parent(name)
                st = os.stat(base, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, CheckpointNotFoundError):
                raise self.missing(name) from None
            full = self._join(name)
            if stat.S_ISLNK(st.st_mode):
                raise CorruptCheckpointError(f"{full} is a symbolic link; checkpoint files must be regular files "
                                             f"inside the checkpoint directory")
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{full} is not a regular file")
            if name in expected and st.st_size != expected[name]:
                raise CorruptCheckpointError(f"checkpoint file {full} is {st.st_size} bytes but {METADATA_FILE} "
                                             f"records {expected[name]} (truncated or modified)")

    def open_handle(self, name: str, expected: int | None) -> int:
        parent, _ = self._parent(name)
        full = self._join(name)
        try:
            fd = open_regular(full, parent)
        except FileNotFoundError:
            raise self.missing(name) from None
        actual = os.fstat(fd).st_size
        if expected is not None and actual != expected:
            os.close(fd)
            raise CorruptCheckpointError(f"checkpoint file {full} is {actual} bytes but {METADATA_FILE} records "
                                         f"{expected} (truncated or modified)")
        return fd

    def close_handle(self, handle: int) -> None:
        os.close(handle)

    def size(self, handle: int) -> int:
        return os.fstat(handle).st_size

    def pread_into(self, handle: int, offset: int, view: memoryview, name: str) -> None:
        pread_into(handle, offset, view, name=name)

    def vectored_fd(self, handle: int) -> int:
        return handle

    def close(self) -> None:
        for fd in self._subdirs.values():
            os.close(fd)
        self._subdirs.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
