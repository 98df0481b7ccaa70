"""One checkpoint file: streaming safetensors writes, ranged reads, checksums.

We write the safetensors layout ourselves (8-byte header length, JSON header, raw bytes) instead
of calling ``safetensors.torch.save_file``: that lets us stream tensors straight from their
memory (no dict of contiguous copies), fsync, and hash while writing. The files stay standard
safetensors, loadable by ``safetensors.torch.load_file``. Reads use ``os.preadv`` straight into
the destination tensor's memory.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import xxhash

from ..core import faults
from ..core.errors import CorruptCheckpointError, MetadataError
from ..core.rafile import open_regular_file
from ..core.utils import byte_view
from . import jsondoc
from .checksums import BLOCK_BYTES, digest, file_checksum
from .chunk_index import ChunkIndex, encode_header, entry_shapes
from .metadata import DTYPES, dtype_name, element_size

MAX_HEADER_BYTES = 100 * 1024 * 1024
_WRITE_BUFFER = 1 << 20
_SAFETENSORS_CODES = {name: code for name, (_, code) in DTYPES.items()}
_CODE_TO_NAME = {code: name for name, code in _SAFETENSORS_CODES.items()}
_MAX_INT = 1 << 62  # sizes, offsets and dims beyond this are hostile, not data (and overflow int64)


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def hash_and_write(view: memoryview, write: Callable[[memoryview], Any], block: int = BLOCK_BYTES) -> tuple[str, str]:
    """(digest, block digests) of ``view`` while writing it: block by block, so the chunk's
    hash, the block's hash and the copy into the file all read the block while it is in the CPU
    cache (one pass over memory instead of three; ~30% less CPU per byte saved, measured)."""
    n = len(view)
    if n <= block:
        write(view)
        return digest(view), ""
    whole, hexes = xxhash.xxh3_64(), []
    for i in range(0, n, block):
        piece = view[i:i + block]
        whole.update(piece)
        hexes.append(xxhash.xxh3_64_hexdigest(piece))
        write(piece)
    return whole.hexdigest(), "".join(hexes)


@dataclass(frozen=True)
class WrittenEntry:
    key: str
    byte_offset: int
    nbytes: int
    checksum: str
    blocks: str = ""  # per-block digests (see block_digests)


@dataclass(frozen=True)
class WrittenFile:
    size: int
    checksum: str
    entries: tuple[WrittenEntry, ...]


def _header(specs: Sequence[tuple[str, str, tuple[int, ...]]], meta: dict[str, str]) -> tuple[bytes, list[int], list[int]]:
    """The header for ``(key, dtype name, shape)`` specs, with each entry's start and byte size."""
    doc: dict[str, object] = {"__metadata__": meta} if meta else {}
    pos, starts, sizes = 0, [], []
    for key, dtype, shape in specs:
        n = math.prod(shape) * element_size(dtype)
        doc[key] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        starts.append(pos)
        sizes.append(n)
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return raw, starts, sizes


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_WRITEBACK_EVERY = 32 << 20


class _Writeback:
    """Start the kernel's writeback of what was written so far (Linux ``sync_file_range``), so the
    final fsync finds most bytes already on their way to disk: writing and flushing overlap."""

    def __init__(self, f) -> None:
        self.f, self.done, self.pending = f, 0, 0

    def wrote(self, n: int) -> None:
        self.pending += n
        if _SYNC_FILE_RANGE is None or self.pending < _WRITEBACK_EVERY:
            return
        self.f.flush()
        end = self.f.tell()
        _SYNC_FILE_RANGE(self.f.fileno(), self.done, end - self.done, 2)  # SYNC_FILE_RANGE_WRITE
        self.done, self.pending = end, 0


@contextmanager
def naming(path: str) -> Iterator[None]:
    """Give an OSError raised while writing ``path`` the file name (a full disk raises ENOSPC from
    a buffered write or flush with no name attached)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


class SafetensorsStreamWriter:
    """Writes one safetensors file whose entries are declared up front and appended one at a
    time, so a file of any size is written holding one tensor at a time (offline transforms)."""

    def __init__(self, path: str, specs: Sequence[tuple[str, str, tuple[int, ...]]], *,
                 meta: dict[str, str] | None = None, fsync: bool = True, sink: Any = None) -> None:
        """``sink``: instead of a local file at ``path``, any writer with ``write(bytes-like)`` and
        ``close()`` (an object store's streaming upload); ``path`` then only names it in errors."""
        self.path, self.fsync = path, fsync and sink is None
        self.specs = [(k, d, tuple(int(x) for x in s)) for k, d, s in specs]
        self.header, starts, self._sizes = _header(self.specs, meta or {})
        self._base = 8 + len(self.header)
        self._starts = starts
        self._next = 0
        self.entries: list[WrittenEntry] = []
        self._sink = sink
        # a sink may read what it was given only when it sends it (an object store's multipart
        # writer does not copy): the tensors stay referenced here until close()
        self._held: list[torch.Tensor] = []
        self._f = sink if sink is not None else open(path, "xb", buffering=_WRITE_BUFFER)
        try:
            with naming(path):
                self._f.write(struct.pack("<Q", len(self.header)) + self.header)
        except BaseException:
            self.abort()
            raise
        self._wb = _Writeback(self._f) if self.fsync else None

    def append(self, key: str, t: torch.Tensor) -> WrittenEntry:
        """Write the next declared entry; ``t`` must match its declared dtype and shape."""
        i = self._next
        if i >= len(self.specs) or self.specs[i][0] != key:
            expected = self.specs[i][0] if i < len(self.specs) else "nothing"
            raise ValueError(f"{self.path}: appended {key!r} but the header declares {expected!r} next")
        _, dtype, shape = self.specs[i]
        if dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{self.path}: {key!r} is {dtype_name(t.dtype)} {list(t.shape)}, "
                             f"declared {dtype} {list(shape)}")
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        faults.point("file.write", path=self.path)
        view = byte_view(t)
        with naming(self.path):
            if self._sink is not None:  # the sink buffers and uploads its parts itself
                self._held.append(t)
                checksum, blocks = hash_and_write(view, self._sink.write)
            elif len(view) <= _WRITE_BUFFER:  # small: coalesced by the file's buffer
                checksum, blocks = hash_and_write(view, self._f.write)
            else:  # large: straight from the tensor to the kernel, no copy into the buffer
                self._f.flush()
                fd = self._f.fileno()
                checksum, blocks = hash_and_write(view, lambda piece: _write_all(fd, piece))
        e = WrittenEntry(key, self._base + self._starts[i], len(view), checksum, blocks)
        self.entries.append(e)
        self._next += 1
        if self._wb:
            with naming(self.path):
                self._wb.wrote(len(view))
        return e

    def close(self) -> WrittenFile:
        """Flush (and fsync) once every declared entry was appended."""
        try:
            if self._next != len(self.specs):
                raise ValueError(f"{self.path}: {len(self.specs) - self._next} declared entries were never written")
            if self._sink is not None:
                size = self._base + sum(e.nbytes for e in self.entries)
                faults.point("file.fsync", path=self.path)
                self._sink.close()  # completes the upload: the object exists from here on
                self._held.clear()
                return WrittenFile(size, file_checksum(self.header, (e.checksum for e in self.entries)),
                                   tuple(self.entries))
            with naming(self.path):
                self._f.flush()
                if self.fsync:
                    faults.point("file.fsync", path=self.path)
                    os.fdatasync(self._f.fileno())
            size = self._f.tell()
        except BaseException:
            self.abort()  # closing must not replace the error that names the file
            raise
        self._f.close()
        return WrittenFile(size, file_checksum(self.header, (e.checksum for e in self.entries)), tuple(self.entries))

    def abort(self) -> None:
        if self._sink is not None:  # an upload never completed is never visible: drop it unclosed
            self._f = None
            self._held.clear()
            return
        try:
            self._f.close()
        except OSError:  # flushing the rest of a failed file (e.g. disk still full)
            pass


def write_file(path: str, entries: Sequence[tuple[str, torch.Tensor]], *, meta: dict[str, str] | None = None,
               fsync: bool = True, on_tensor: Callable[[int], None] | None = None, sink: Any = None) -> WrittenFile:
    """Write contiguous CPU tensors as one safetensors file; returns offsets and checksums.
    ``on_tensor(nbytes)`` is called after each tensor is appended (progress); ``sink``: see
    :class:`SafetensorsStreamWriter`."""
    w = SafetensorsStreamWriter(path, [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in entries],
                                meta=meta, fsync=fsync, sink=sink)
    try:
        for key, t in entries:
            w.append(key, t)
            if on_tensor is not None:
                on_tensor(t.numel() * t.element_size())
    except BaseException:
        w.abort()
        raise
    return w.close()


def write_index(path: str, index: ChunkIndex, *, fsync: bool = True) -> None:
    """Write a format-v2 chunk index (a safetensors file of int64 arrays) from memory."""
    with open(path, "xb") as f, naming(path):
        faults.point("file.write", path=path)
        for part in index_parts(index):
            f.write(part)
        f.flush()
        if fsync:
            faults.point("file.fsync", path=path)
            os.fdatasync(f.fileno())


def pread_into(fd: int, offset: int, view: memoryview, *, name: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short read means the file is truncated."""
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(
                f"{name}: unexpected end of file reading {total} bytes at offset {offset} (truncated?)"
            )
        done += n


@dataclass(frozen=True)
class HeaderEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int
    nbytes: int


def read_header(path: str, max_entries: int | None = None) -> tuple[bytes, list[HeaderEntry]]:
    """Parse and validate a safetensors header (used by inspect/verify and offline tools).
    ``max_entries`` bounds the work a foreign file can ask for before anything is read."""
    with open_regular_file(path) as f:  # not through a link swapped in after a check
        size = os.fstat(f.fileno()).st_size
        return parse_header(os.path.basename(path), size, lambda n, off: os.pread(f.fileno(), n, off), max_entries)


def parse_header(name: str, size: int, pread: Callable[[int, int], bytes],
                 max_entries: int | None = None) -> tuple[bytes, list[HeaderEntry]]:
    """:func:`read_header` of a file of ``size`` bytes read through ``pread(n, offset)`` (a local
    file, or an object read by ranges: two requests)."""
    head = pread(8, 0) if size >= 8 else b""
    if len(head) != 8:
        raise CorruptCheckpointError(f"{name}: too short to be a safetensors file ({size} bytes)")
    (hlen,) = struct.unpack("<Q", head)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise CorruptCheckpointError(f"{name}: header length {hlen} is invalid for a {size}-byte file")
    raw = pread(hlen, 8)
    if len(raw) != hlen:
        raise CorruptCheckpointError(f"{name}: short read of its {hlen}-byte header (truncated?)")
    doc = jsondoc.parse(raw, f"{name}: header", CorruptCheckpointError)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{name}: header is not a JSON object")
    declared = len(doc) - ("__metadata__" in doc)
    if max_entries is not None and declared > max_entries:
        raise CorruptCheckpointError(f"{name}: header declares {declared} tensors, over the limit of "
                                     f"{max_entries} per file for imports (each costs time and memory to import)")
    entries = []
    base = 8 + hlen
    for key, v in doc.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _CODE_TO_NAME[v["dtype"]]
            offsets, shape = v["data_offsets"], v["shape"]
        except (KeyError, TypeError):
            raise CorruptCheckpointError(f"{name}: bad header entry for {key!r}") from None
        # exact JSON integers only: int("3") and int(2.5) would quietly accept a malformed header
        if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)
                and all(type(x) is int and 0 <= x < _MAX_INT for x in (*offsets, *shape))):
            raise CorruptCheckpointError(f"{name}: entry {key!r}: shape and data_offsets must be non-negative "
                                         f"integers, got shape={shape!r:.60} data_offsets={offsets!r:.60}")
        lo, hi = offsets
        if not lo <= hi or base + hi > size:
            raise CorruptCheckpointError(f"{name}: entry {key!r} bytes [{lo}, {hi}) exceed the file")
        want = math.prod(shape) * element_size(dtype)
        if want != hi - lo:
            raise CorruptCheckpointError(f"{name}: entry {key!r} declares {dtype} {shape} ({want} bytes) but spans "
                                         f"{hi - lo} bytes")
        entries.append(HeaderEntry(key, dtype, tuple(shape), base + lo, hi - lo))
    entries.sort(key=lambda e: e.byte_offset)
    for a, b in zip(entries, entries[1:]):
        if b.byte_offset < a.byte_offset + a.nbytes:
            raise CorruptCheckpointError(f"{name}: entries {a.key!r} and {b.key!r} overlap in the file")
    return raw, entries


def index_parts(index: ChunkIndex) -> list:
    """A format-v2 chunk index file's bytes as the buffers it is made of, in file order (views of
    the columns held in memory, not copies: a streamed upload sends them as they are)."""
    header, cols = index.encode()
    return [struct.pack("<Q", len(header)), header, *(byte_view(c) for c in cols)]


def index_bytes(index: ChunkIndex) -> bytes:
    """A format-v2 chunk index file's bytes (for storages that write whole objects)."""
    return b"".join(index_parts(index))


class IndexStream:
    """A format-v2 chunk index written to ``sink`` (``write``/``close``/``abort``: a storage
    writer's ``open_sink``) while it is being built, on a thread of its own: the header first
    (the counts are known before the sort), the sorted rows block by block as the build gathers
    them (``put``), the small columns at ``finish``. At 8,192 ranks the index is 1.2 GB, whose
    write is the disk's (or the store's) time: it overlaps the sort and the tiling check
    instead of following them. The bytes are ``index_parts``' exactly."""

    def __init__(self, sink: Any, tensors: int, nrows: int, ndim: int, nblocks: int) -> None:
        self.sink = sink
        self.rows_bytes = 8 * math.prod(entry_shapes(tensors, nrows, ndim, nblocks)["rows"])
        self.header, _ = encode_header(tensors, nrows, ndim, nblocks)
        self._queue: deque[Any] = deque([struct.pack("<Q", len(self.header)), self.header])
        self._sent = 0  # bytes of rows handed over so far
        self._cv = threading.Condition()
        self._closing = self._stopped = self._ended = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hpdcp-index-write", daemon=True)
        self._thread.start()

    @staticmethod
    def size(tensors: int, nrows: int, ndim: int, nblocks: int) -> int:
        header, _ = encode_header(tensors, nrows, ndim, nblocks)
        return 8 + len(header) + 8 * sum(math.prod(s) for s in entry_shapes(tensors, nrows, ndim, nblocks).values())

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing and not self._stopped:
                    self._cv.wait()
                if self._stopped or (not self._queue and self._closing):
                    return
                part = self._queue.popleft()
            try:
                self.sink.write(part)
            except BaseException as e:  # handed to the building thread at its next put or finish
                with self._cv:
                    self._failed, self._stopped = e, True
                return

    def _push(self, part: Any) -> None:
        with self._cv:
            if self._failed is not None:
                raise self._failed
            self._queue.append(part)
            self._cv.notify()

    def put(self, rows: torch.Tensor) -> None:
        """The next block of sorted rows (kept unchanged in memory until ``finish``)."""
        self._sent += rows.numel() * 8
        self._push(byte_view(rows))

    def finish(self, index: ChunkIndex) -> None:
        """The columns after the rows, then the sink closed (durable); raises what the writing did."""
        header, cols = index.encode()
        if header != self.header or self._sent != self.rows_bytes or cols[0].numel() * 8 != self.rows_bytes:
            self.abort()
            raise MetadataError(f"chunk index: {self._sent} of {self.rows_bytes} bytes of rows were "
                                f"streamed, or its counts changed while it was built")
        for c in cols[1:]:
            self._push(byte_view(c))
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._failed is not None:
            self.abort()
            raise self._failed
        self._ended = True
        self.sink.close()

    def abort(self) -> None:
        """Stop writing and drop the sink (a failed build): nothing of it stays in staging. Once."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()
        if not self._ended:
            self._ended = True
            self.sink.abort()
