"""A file's recorded checksum, computed from its bytes as they pass in order.

A copy to another store, a transfer between nodes or a download can then verify a file in the
pass that moves it, instead of reading it a second time after it lands. The checksum is the one
``metadata.json`` records: for a safetensors file the hash of its header and of each entry's
digest (``checksums.file_checksum``), for any other file the digest of its bytes.
"""

from __future__ import annotations

import struct

import xxhash

from ..core.errors import CorruptCheckpointError
from .checksums import file_checksum
from .safetensors_io import MAX_HEADER_BYTES, parse_header


class FileDigest:
    """``update`` with the file's bytes in order, then ``hexdigest``. ``name`` is the file's name
    in the checkpoint (it says whether the file is safetensors) and ``size`` its recorded size:
    a header that does not fit it, or fewer or more bytes than it, is ``CorruptCheckpointError``."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.pos = 0  # bytes hashed so far (after the header is known)
        self._pending: bytearray | None = bytearray() if name.endswith(".safetensors") else None
        self._raw: bytes | None = None
        self._spans: list[tuple[int, int]] = [(0, size)]
        self._hashers = [xxhash.xxh3_64()]
        self._i = 0  # the first span not yet hashed to its end

    def update(self, block: bytes | bytearray | memoryview) -> None:
        view = memoryview(block).cast("B")
        if self._pending is None:
            self._feed(view)
            return
        self._pending += view
        if len(self._pending) < 8:
            return
        (hlen,) = struct.unpack_from("<Q", self._pending)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > self.size or len(self._pending) >= 8 + hlen:
            self._start(bytes(self._pending))  # parses the header (or raises, naming the file)

    def _start(self, head: bytes) -> None:
        """The header is in ``head`` (the file's first bytes): the entries' spans are known."""
        raw, entries = parse_header(self.name, self.size, lambda n, off: head[off:off + n])
        self._raw, self._pending = raw, None
        self._spans = [(e.byte_offset, e.byte_offset + e.nbytes) for e in entries]
        self._hashers = [xxhash.xxh3_64() for _ in self._spans]
        self._feed(memoryview(head))

    def _feed(self, view: memoryview) -> None:
        pos, end = self.pos, self.pos + len(view)
        if end > self.size:
            raise CorruptCheckpointError(f"{self.name}: more than the {self.size} bytes metadata.json records")
        spans, j = self._spans, self._i
        while j < len(spans) and spans[j][0] < end:  # every entry this block touches
            lo, hi = max(spans[j][0], pos), min(spans[j][1], end)
            if hi > lo:
                self._hashers[j].update(view[lo - pos: hi - pos])
            if spans[j][1] <= end:
                self._i = j + 1
            j += 1
        self.pos = end

    def hexdigest(self) -> str:
        """The checksum of every byte given; the file must have ended at its recorded size."""
        if self._pending is not None:
            self._start(bytes(self._pending))  # a file too short for its header raises here
        if self.pos != self.size:
            raise CorruptCheckpointError(f"{self.name}: ended at {self.pos} of the {self.size} bytes metadata.json "
                                         f"records")
        digests = [h.hexdigest() for h in self._hashers]
        return file_checksum(self._raw, digests) if self._raw is not None else digests[0]
