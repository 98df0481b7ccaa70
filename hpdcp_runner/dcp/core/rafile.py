"""Random access to one checkpoint file, whatever holds it: a local descriptor or an object in
an object store. Readers of parts of a file (the format-v2 chunk index) take either."""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Protocol, runtime_checkable

from .errors import CorruptCheckpointError, StorageAccessError


def open_regular(full: str, dir_fd: int | None = None, what: str = "checkpoint file") -> int:
    """Open a file for reading: no symlinks, no FIFOs or devices (which could hang or read
    outside the checkpoint), only a regular file, checked on the descriptor itself (no window
    between a check and the open). With ``dir_fd``, the file's base name is opened inside that
    (pinned) directory. Returns the fd; ``what`` names the file in errors."""
    try:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(os.path.basename(full), flags, dir_fd=dir_fd) if dir_fd is not None else os.open(full, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{full} is a symbolic link; a {what} must be a regular file inside its "
                                         f"directory") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise StorageAccessError(f"cannot read the {what}: {e.strerror} ({full})") from None
        raise CorruptCheckpointError(f"cannot open {what} {full}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{full} is not a regular file")
    return fd


def open_regular_file(full: str, dir_fd: int | None = None, what: str = "checkpoint file") -> BinaryIO:
    """:func:`open_regular` as a binary file object."""
    return os.fdopen(open_regular(full, dir_fd, what), "rb")


@runtime_checkable
class RandomAccessFile(Protocol):
    """What a partial reader needs of a file: its size and bytes at an offset."""

    def size(self) -> int: ...

    def pread(self, n: int, offset: int) -> bytes: ...

    def close(self) -> None: ...


class FdFile:
    """A local file through an open descriptor (owned: ``close`` closes it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def as_random_access(src: "int | RandomAccessFile") -> RandomAccessFile:
    """A descriptor becomes an :class:`FdFile`; a random-access object is used as it is."""
    return FdFile(src) if isinstance(src, int) else src
