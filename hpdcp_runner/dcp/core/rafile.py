"""Random access to one checkpoint file, whatever holds it: a local descriptor or an object in
an object store. Readers of parts of a file (the format-v2 chunk index) take either."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable


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
