"""Format v2's chunk index: where every stored chunk is, as fixed-width int64 columns a rank reads
in part.

In format v1 every rank parsed the whole chunk table (``metadata.json``) to load its own shards:
~3.5 us and ~750 bytes per chunk of the whole checkpoint, 7.5 s and 1.5 GiB per rank at 1,024
ranks x 2,000 tensors. In v2 ``metadata.json`` keeps what is small (keys, dtypes, shapes, files,
objects) and the chunks live in ``chunk_index.safetensors``, a plain safetensors file of int64
arrays (docs/format.md):

    rows         [R, 6 + 2D]  tensor id, file id, byte offset, checksum, block start, block
                              count, offsets (D), sizes (D); a tensor's rows are contiguous
    keys         [R]          each row's offset along its tensor's sort dimension, ascending
                              within the tensor (what a rank bisects)
    tensor_rows  [T + 1]      tensor t owns rows [tensor_rows[t], tensor_rows[t + 1])
    tensor_sort  [T, 2]       per tensor: sort dimension, largest chunk size along it
    blocks       [B]          per-block digests of large chunks (XXH3-64 as int64 bits)

A loading rank reads ``tensor_rows`` and ``tensor_sort`` (O(tensors)), then per tensor it loads a
few 4 KiB pages of ``keys`` (bisection) and the rows that may intersect its shards: its cost
follows its own shards, not the checkpoint's chunk count. This module knows columns only; the
meaning of a row (bounds against shapes and files, tiling) is checked in ``indexed_chunks.py``
(the rows a load reads) and ``metadata_parse.py`` (all of them).
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from collections import OrderedDict
from typing import Callable, Iterator

import torch

from ..core.errors import CorruptCheckpointError, MetadataError
from ..core.rafile import RandomAccessFile, as_random_access
from ..core.utils import byte_view
from .checksums import digest, file_checksum

INDEX_FILE = "chunk_index.safetensors"
#: the fixed fields of a row, then ``offsets`` and ``sizes`` (D each)
ROW_FIELDS = ("tensor", "file", "byte_offset", "checksum", "block_start", "block_count")
TENSOR, FILE, BYTE_OFFSET, CHECKSUM, BLOCK_START, BLOCK_COUNT = range(6)
ENTRIES = ("rows", "keys", "tensor_rows", "tensor_sort", "blocks")  # in file order
_PAGE = 128  # keys per read while bisecting (1 KiB)
_PAGES_KEPT = 64
_WHOLE_BELOW = 1 << 20  # an index this small is read whole on open (~13k chunks of 2-D tensors)
_U64 = (1 << 64) - 1
WALK_ROWS = 1 << 20  # rows a whole-index walk holds at a time (~80 MiB of 2-D rows)


def hex_to_i64(hexes: str) -> int:
    """A 16-hex-digit digest as the int64 with the same bits."""
    v = int(hexes, 16)
    return v - (1 << 64) if v >> 63 else v


def i64_to_hex(v: int) -> str:
    return f"{v & _U64:016x}"


def entry_shapes(tensors: int, rows: int, ndim: int, blocks: int) -> dict[str, tuple[int, ...]]:
    return {"rows": (rows, len(ROW_FIELDS) + 2 * ndim), "keys": (rows,), "tensor_rows": (tensors + 1,),
            "tensor_sort": (tensors, 2), "blocks": (blocks,)}


def encode_header(tensors: int, rows: int, ndim: int, blocks: int) -> tuple[bytes, dict[str, int]]:
    """The index's safetensors header (fully determined by its four counts, so a reader compares
    it byte for byte) and each entry's start in the data section."""
    doc, starts, pos = {}, {}, 0
    for name, shape in entry_shapes(tensors, rows, ndim, blocks).items():
        n = 8
        for s in shape:
            n *= s
        doc[name] = {"dtype": "I64", "shape": list(shape), "data_offsets": [pos, pos + n]}
        starts[name] = pos
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data 8-byte aligned
    return raw, starts


class ChunkIndex:
    """The index of one checkpoint, read from its file (``open``) or held in memory (``from_rows``,
    on the coordinator of a save). Reads are ranged: ``rows``, ``key``, ``blocks``."""

    def __init__(self, name: str, counts: tuple[int, int, int, int], read: Callable[[str, int, int], memoryview],
                 columns: dict[str, torch.Tensor] | None = None, fd: "RandomAccessFile | None" = None) -> None:
        self.name = name  # what errors name: the index file's path
        self.tensors, self.nrows, self.ndim, self.nblocks = counts
        self.width = len(ROW_FIELDS) + 2 * self.ndim
        self._raw_read = read
        self.bytes_read = 0  # what the reads of this index returned (what a rank pays)
        self._columns = columns
        self._fd = fd
        self._pages: OrderedDict[int, memoryview] = OrderedDict()
        self.recorded: dict = {}  # the ``index`` entry of metadata.json (read with the file, or described)
        self.tensor_rows = self._read("tensor_rows", 0, self.tensors + 1).tolist()
        sort = self._read("tensor_sort", 0, 2 * self.tensors).tolist()
        self.tensor_sort = list(zip(sort[0::2], sort[1::2]))
        self._check_structure()

    # -- making one --------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, ntensors: int, ndims: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor,
                  name: str = INDEX_FILE,
                  on_block: Callable[[int, int, torch.Tensor], None] | None = None,
                  block_rows: int | None = None) -> "ChunkIndex":
        """From rows already in the file's layout (``[R, 6 + 2D]``, any order): they are sorted by
        tensor and by the offset along each tensor's sort dimension, the one with the most
        distinct offsets (estimated as the fewest chunks at offset 0), so a bisection finds a
        rank's chunks among few candidates. One sorted copy of the rows and a few [R] columns:
        no Python object per chunk, no temporary as wide as the rows.

        ``on_block(first tensor, end tensor, sorted rows)`` is called for consecutive blocks of
        whole tensors (``tensor_blocks(block_rows)``) while the next block is being gathered on a second
        thread: a check of the sorted rows (the coordinator's tiling) overlaps the sort's row
        gather instead of following it. Whatever it raises ends the build."""
        r, width = rows.shape
        d = (width - len(ROW_FIELDS)) // 2
        tensor = rows[:, TENSOR].contiguous()  # read by several passes: once strided, then contiguous
        if r:
            at_zero = torch.stack([torch.zeros(ntensors, dtype=torch.int64).index_add_(
                0, tensor, (rows[:, 6 + k] == 0).to(torch.int64)) for k in range(d)], 1)
            dims = torch.arange(d)[None, :]
            at_zero[dims >= ndims.clamp(min=1)[:, None]] = r + 1  # dimensions a tensor lacks are never chosen
            sort_dim = at_zero.argmin(1)
            del at_zero
        else:
            sort_dim = torch.zeros(ntensors, dtype=torch.int64)
        counts = torch.bincount(tensor, minlength=ntensors) if r else torch.zeros(ntensors, dtype=torch.int64)
        used = sort_dim[counts > 0].unique() if r else torch.zeros(1, dtype=torch.int64)
        if len(used) == 1:  # every chunk sorts along one dimension (the usual case): columns, not a gather
            j = int(used[0])
            keys, sizes = rows[:, 6 + j].contiguous(), rows[:, 6 + d + j]
        else:
            row_dim = sort_dim[tensor]
            keys = rows.gather(1, (6 + row_dim)[:, None]).flatten()
            sizes = rows.gather(1, (6 + d + row_dim)[:, None]).flatten()
            del row_dim
        span = torch.zeros(ntensors, dtype=torch.int64).scatter_reduce(0, tensor, sizes, "amax")
        del sizes
        top = int(keys.max()) if r else 0
        if r and top < (1 << 62) // max(ntensors, 1) and int(keys.min()) >= 0:
            combined = tensor * (top + 1) + keys  # one sort: (tensor, key); int32 where it fits sorts 2x faster
            if ntensors * (top + 1) < (1 << 31):
                combined = combined.to(torch.int32)
            order = torch.sort(combined, stable=True).indices
            del combined
        else:
            order = torch.argsort(keys, stable=True)
            order = order[torch.argsort(tensor[order], stable=True)]
        del tensor
        cols = {
            "rows": torch.empty_like(rows),
            "keys": keys.index_select(0, order),
            "tensor_rows": torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]),
            "tensor_sort": torch.stack([sort_dim, span], 1).contiguous(),
            "blocks": blocks.to(torch.int64).contiguous(),
        }
        del keys
        counts4 = (ntensors, r, d, len(blocks))

        def read(entry: str, start: int, count: int) -> memoryview:
            col = cols[entry].view(-1)
            return byte_view(col[start:start + count]).cast("q") if count else memoryview(b"").cast("q")

        index = cls(name, counts4, read, columns=cols)
        index._gather_sorted(rows, order, on_block, block_rows or WALK_ROWS)
        return index

    def _gather_sorted(self, rows: torch.Tensor, order: torch.Tensor,
                       on_block: Callable[[int, int, torch.Tensor], None] | None, block_rows: int) -> None:
        """Fill the sorted rows (``index_select``: a row gather ~2x faster than ``rows[order]``),
        block by block on a worker thread while ``on_block`` checks the blocks already done
        (torch releases the GIL inside both). A plain thread, not an executor: an async save's
        commit may run while the interpreter is exiting, when executors take no new work."""
        out = self._columns["rows"]
        spans = list(self.tensor_blocks(block_rows)) if on_block is not None and self.nrows else []
        if len(spans) < 2:
            torch.index_select(rows, 0, order, out=out)
            if on_block is not None:
                on_block(0, self.tensors, out)
            return
        ready = [threading.Event() for _ in spans]
        failed: list[BaseException] = []
        stop = threading.Event()

        def gather() -> None:
            try:
                for (_, _, lo, hi), done in zip(spans, ready):
                    if stop.is_set():
                        return
                    torch.index_select(rows, 0, order[lo:hi], out=out[lo:hi])
                    done.set()
            except BaseException as e:  # handed to the caller's thread
                failed.append(e)
            finally:
                for done in ready:
                    done.set()

        worker = threading.Thread(target=gather, name="hpdcp-index-sort", daemon=True)
        worker.start()
        try:
            for (t0, t1, lo, hi), done in zip(spans, ready):
                done.wait()
                if failed:
                    raise failed[0]
                on_block(t0, t1, out[lo:hi])
        finally:
            stop.set()
            worker.join()

    def sorted_rows(self) -> torch.Tensor:
        """The rows in file order (an index held in memory: the coordinator's)."""
        if self._columns is None:
            raise ValueError("sorted_rows() needs an index held in memory")
        return self._columns["rows"]

    def encode(self) -> tuple[bytes, list[torch.Tensor]]:
        """The file's header and its entries' data, in file order (held in memory only)."""
        if self._columns is None:
            raise ValueError("encode() needs an index held in memory")
        header, _ = encode_header(self.tensors, self.nrows, self.ndim, self.nblocks)
        return header, [self._columns[e] for e in ENTRIES]

    def describe(self) -> dict:
        """The ``index`` entry of ``metadata.json`` (size and checksum as the file will have them;
        hashed once: the commit writes the JSON and sends it to every rank)."""
        if not self.recorded:
            header, cols = self.encode()
            self.recorded = {"file": INDEX_FILE, "size": 8 + len(header) + sum(c.numel() * 8 for c in cols),
                             "checksum": file_checksum(header, (digest(byte_view(c)) for c in cols)),
                             "rows": self.nrows, "ndim": self.ndim, "blocks": self.nblocks}
        return dict(self.recorded)

    @classmethod
    def open(cls, fd: "int | RandomAccessFile", name: str, *, size: int, tensors: int, rows: int, ndim: int,
             blocks: int) -> "ChunkIndex":
        """The index file on ``fd`` (a descriptor or a random-access file of any storage; owned
        from now on), checked against what ``metadata.json`` says of it: its size, and a header
        equal byte for byte to the one those counts give."""
        f = as_random_access(fd)
        try:
            actual = f.size()
            expected_header, starts = encode_header(tensors, rows, ndim, blocks)
            want = 8 + len(expected_header) + 8 * (rows * (len(ROW_FIELDS) + 2 * ndim) + rows + tensors + 1
                                                   + 2 * tensors + blocks)
            if actual != size or size != want:
                raise CorruptCheckpointError(
                    f"{name}: {actual} bytes, but metadata.json records {size} and its counts ({tensors} tensors, "
                    f"{rows} rows, ndim {ndim}, {blocks} blocks) make {want} (truncated, or not this checkpoint's "
                    f"index)")
            head = f.pread(8 + len(expected_header), 0)
            if head[:8] != struct.pack("<Q", len(expected_header)) or head[8:] != expected_header:
                raise MetadataError(f"{name}: header disagrees with metadata.json (expected entries "
                                    f"{dict(entry_shapes(tensors, rows, ndim, blocks))} as int64)")
        except BaseException:
            f.close()
            raise
        base = 8 + len(expected_header)
        if size - base <= _WHOLE_BELOW:  # small: one read, then memory (no request per tensor)
            try:
                data = f.pread(size - base, base)
            finally:
                f.close()
            if len(data) != size - base:
                raise CorruptCheckpointError(f"{name}: short read (truncated while opening?)")
            whole = memoryview(data).cast("q")

            def from_memory(entry: str, start: int, count: int) -> memoryview:
                at = starts[entry] // 8 + start
                return whole[at:at + count]

            return cls(name, (tensors, rows, ndim, blocks), from_memory)

        def read(entry: str, start: int, count: int) -> memoryview:
            want_bytes = count * 8
            buf = f.pread(want_bytes, base + starts[entry] + start * 8) if count else b""
            if len(buf) != want_bytes:
                raise CorruptCheckpointError(f"{name}: short read of {entry} at element {start} (truncated?)")
            return memoryview(buf).cast("q")

        return cls(name, (tensors, rows, ndim, blocks), read, fd=f)

    def close(self) -> None:
        f, self._fd = self._fd, None
        if f is not None:
            f.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- structure (O(tensors), every rank) ----------------------------------------------------
    def _check_structure(self) -> None:
        tr = self.tensor_rows
        if tr[0] != 0 or tr[-1] != self.nrows:
            raise MetadataError(f"{self.name}: tensor_rows must run from 0 to {self.nrows} rows, got "
                                f"{tr[0]}..{tr[-1]}")
        for t in range(self.tensors):
            if tr[t + 1] < tr[t]:
                raise MetadataError(f"{self.name}: tensor_rows decreases at tensor {t} ({tr[t]} -> {tr[t + 1]}): rows "
                                    f"out of order")
            dim, span = self.tensor_sort[t]
            if not (0 <= dim < max(self.ndim, 1) and span >= 0):
                raise MetadataError(f"{self.name}: tensor_sort of tensor {t} is ({dim}, {span}); the sort dimension "
                                    f"must lie below ndim {self.ndim} and the span be non-negative")

    # -- ranged reads --------------------------------------------------------------------------
    def _read(self, entry: str, start: int, count: int) -> memoryview:
        self.bytes_read += 8 * count
        return self._raw_read(entry, start, count)

    def row_range(self, t: int) -> tuple[int, int]:
        return self.tensor_rows[t], self.tensor_rows[t + 1]

    def rows(self, lo: int, hi: int) -> list[list[int]]:
        flat = self._read("rows", lo * self.width, (hi - lo) * self.width).tolist()
        w = self.width
        return [flat[i:i + w] for i in range(0, len(flat), w)]

    def key(self, i: int) -> int:
        page = i // _PAGE
        keys = self._pages.get(page)
        if keys is None:  # kept as int64 memory: converting a page to Python ints costs ~7 us
            start = page * _PAGE
            keys = self._pages[page] = self._read("keys", start, min(_PAGE, self.nrows - start))
            if len(self._pages) > _PAGES_KEPT:
                self._pages.popitem(last=False)
        return keys[i - page * _PAGE]

    def search(self, t: int, lo_value: int, hi_value: int, extent: int = 0) -> tuple[int, int]:
        """Rows of tensor ``t`` whose key lies in [lo_value, hi_value), if its keys are sorted
        (callers check the neighbours of the answer; see ``metadata.IndexedChunks``).
        ``extent``: the tensor's size along its sort dimension, for the first guess."""
        return self._first_at_least(t, lo_value, extent), self._first_at_least(t, hi_value, extent)

    def _first_at_least(self, t: int, v: int, extent: int) -> int:
        """The first row of ``t`` with key >= v. An even layout puts row i at about i / (rows per
        band) bands of ``span``: that guess's page usually holds the answer (one 4 KiB read per
        tensor instead of log2(rows / 512) + 1 pages of a plain bisection)."""
        lo, hi = self.row_range(t)
        seq = _Keys(self)
        span = self.tensor_sort[t][1]
        if hi - lo > _PAGE and span > 0 and extent > 0:
            bands = -(-extent // span)
            g = min(max(lo + (max(v, 0) // span) * (hi - lo) // bands, lo), hi - 1)
            ps = max(lo, g - g % _PAGE)
            pe = min(hi, g - g % _PAGE + _PAGE)
            if (ps == lo or seq[ps] < v) and (pe == hi or seq[pe - 1] >= v):
                return bisect.bisect_left(seq, v, ps, pe)
        return bisect.bisect_left(seq, v, lo, hi)

    def blocks(self, start: int, count: int) -> list[int]:
        return self._read("blocks", start, count).tolist()

    # -- walking all of it in bounded memory (verify, inspect) ----------------------------------
    def rows_tensor(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) as an int64 ``[hi - lo, width]`` tensor (a copy)."""
        mv = self._read("rows", lo * self.width, (hi - lo) * self.width)
        out = torch.empty((hi - lo, self.width), dtype=torch.int64)
        if hi > lo:
            byte_view(out)[:] = mv.cast("B")
        return out

    def keys_tensor(self, lo: int, hi: int) -> torch.Tensor:
        mv = self._read("keys", lo, hi - lo)
        out = torch.empty(hi - lo, dtype=torch.int64)
        if hi > lo:
            byte_view(out)[:] = mv.cast("B")
        return out

    def tensor_blocks(self, budget: int = WALK_ROWS) -> Iterator[tuple[int, int, int, int]]:
        """(first tensor, end tensor, first row, end row) of consecutive tensors holding about
        ``budget`` rows together (one tensor at least): how a whole-index check holds a bounded
        part of the index at a time."""
        tr = self.tensor_rows
        t0 = 0
        while t0 < self.tensors:
            t1 = t0 + 1
            while t1 < self.tensors and tr[t1 + 1] - tr[t0] <= budget:
                t1 += 1
            yield t0, t1, tr[t0], tr[t1]
            t0 = t1

    def rows_by_file(self, nfiles: int, budget: int = 2 * WALK_ROWS, columns: list[int] | None = None
                     ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """For every file id in order: (file id, its rows sorted by byte offset, their row
        numbers); ``columns``: only those columns of the rows (less memory per row). Files are
        taken in groups of about ``budget`` rows, each group one pass over the index, so memory
        stays at a group's rows however large the checkpoint (a file's rows are one rank's
        chunks: a group holds one file at least)."""
        counts = torch.zeros(max(nfiles, 1), dtype=torch.int64)
        for _, _, lo, hi in self.tensor_blocks():
            f = self.rows_tensor(lo, hi)[:, FILE]
            ok = (f >= 0) & (f < nfiles)
            counts += torch.bincount(f[ok], minlength=max(nfiles, 1))
        f0 = 0
        cum = counts.tolist()
        width = self.width if columns is None else len(columns)
        empty = torch.empty((0, width), dtype=torch.int64)
        while f0 < nfiles:
            f1, total = f0 + 1, cum[f0]
            while f1 < nfiles and total + cum[f1] <= budget:
                total += cum[f1]
                f1 += 1
            parts, where, files, offs = [], [], [], []
            if total:
                for _, _, lo, hi in self.tensor_blocks():
                    rows = self.rows_tensor(lo, hi)
                    sel = torch.nonzero((rows[:, FILE] >= f0) & (rows[:, FILE] < f1)).flatten()
                    if len(sel):
                        picked = rows[sel]
                        files.append(picked[:, FILE])
                        offs.append(picked[:, BYTE_OFFSET])
                        parts.append(picked if columns is None else picked[:, columns])
                        where.append(sel + lo)
                    del rows
            rows = torch.cat(parts) if parts else empty
            at = torch.cat(where) if where else torch.empty(0, dtype=torch.int64)
            file = torch.cat(files) if files else at
            off = torch.cat(offs) if offs else at
            del parts, where, files, offs
            o = torch.argsort(off, stable=True)
            o = o[torch.argsort(file[o], stable=True)]
            rows, at, file = rows[o], at[o], file[o]
            bounds = torch.searchsorted(file.contiguous(), torch.arange(f0, f1 + 1)).tolist()
            for f in range(f0, f1):
                yield f, rows[bounds[f - f0]:bounds[f - f0 + 1]], at[bounds[f - f0]:bounds[f - f0 + 1]]
            f0 = f1


class _Keys:
    """``keys`` as a sequence for ``bisect``: reads pages on demand."""

    def __init__(self, index: ChunkIndex) -> None:
        self.index = index

    def __len__(self) -> int:
        return self.index.nrows

    def __getitem__(self, i: int) -> int:
        return self.index.key(i)
