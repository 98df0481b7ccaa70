"""A format-v2 tensor's chunks, read from the chunk index (``chunk_index``) row by row as they are
used, each row checked as it is read."""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

from ..core.errors import MetadataError
from ..core.geometry import Box, boxes_tile, intersect, relative
from .chunk_index import BLOCK_COUNT, BLOCK_START, BYTE_OFFSET, CHECKSUM, FILE, TENSOR, ChunkIndex, i64_to_hex
from .records import ChunkMeta, FileMeta, chunk_key, element_size

_SCAN_ROWS = 16  # tensors with at most this many chunks are scanned whole instead of bisected


class IndexedChunks(Sequence[ChunkMeta]):
    """A format-v2 tensor's chunks: rows of the chunk index read on demand, each checked as it is
    read (its tensor, bounds against the shape and its file, block count, sort key). A rank that
    loads a few shards reads a few rows (``overlapping``); anything that iterates reads them all."""

    def __init__(self, index: ChunkIndex, tid: int, key: str, shape: tuple[int, ...], dtype: str,
                 files: Sequence[FileMeta], block_bytes: int) -> None:
        self.index, self.tid, self.key, self.shape, self.dtype = index, tid, key, shape, dtype
        self.files, self.block_bytes = files, block_bytes
        self.lo, self.hi = index.row_range(tid)
        self.n = self.hi - self.lo
        self._cache: dict[int, ChunkMeta] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        c = self._cache.get(i)
        if c is None:
            self._load(self.lo + i, self.lo + i + 1)
            c = self._cache[i]
        return c

    def __iter__(self) -> Iterator[ChunkMeta]:
        """Every chunk, in order. Rows not already held are read and described but not kept: a
        walk over every tensor of a huge checkpoint (verify in a store, full-tensor digests)
        holds one tensor's chunks at a time, not the whole table."""
        if len(self._cache) == len(self):
            return (self._cache[i] for i in range(len(self)))
        return (self._cache.get(j - self.lo) or self._chunk(j, row)
                for j, row in zip(range(self.lo, self.hi), self.index.rows(self.lo, self.hi)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list, IndexedChunks)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"IndexedChunks({self.key!r}, rows {self.lo}..{self.hi} of {self.index.name})"

    def _bad(self, row: int, what: str) -> MetadataError:
        return MetadataError(f"{self.index.name}: row {row} (tensor {self.key!r}): {what}")

    def _load(self, a: int, b: int) -> None:
        for j, row in enumerate(self.index.rows(a, b)):
            if a + j - self.lo not in self._cache:
                self._cache[a + j - self.lo] = self._chunk(a + j, row)

    def _chunk(self, r: int, row: list[int]) -> ChunkMeta:
        d, nd, shape = self.index.ndim, len(self.shape), self.shape
        offs, sizes = row[6:6 + d], row[6 + d:6 + 2 * d]
        if row[TENSOR] != self.tid:
            raise self._bad(r, f"belongs to tensor id {row[TENSOR]}, not {self.tid} (rows out of order)")
        for k in range(d):
            o, z = offs[k], sizes[k]
            if not (0 <= o and 0 <= z and (o + z <= shape[k] if k < nd else (o == 0 and z == 1))):
                raise self._bad(r, f"chunk offsets={offs[:nd]} sizes={sizes[:nd]} outside shape {list(shape)}")
        dim, span = self.index.tensor_sort[self.tid]
        if sizes[dim] > span or self.index.key(r) != offs[dim]:
            raise self._bad(r, f"its key {self.index.key(r)} / size {sizes[dim]} disagree with its offset "
                               f"{offs[dim]} along sort dimension {dim} (span {span})")
        fid = row[FILE]
        if not 0 <= fid < len(self.files):
            raise self._bad(r, f"file id {fid} is not one of the {len(self.files)} files of metadata.json")
        f = self.files[fid]
        n = math.prod(sizes[:nd]) * element_size(self.dtype)
        boff = row[BYTE_OFFSET]
        if boff < 0 or boff + n > f.size:
            raise self._bad(r, f"chunk bytes [{boff}, {boff + n}) lie beyond the end of {f.name} ({f.size} bytes)")
        bb, start, count = self.block_bytes, row[BLOCK_START], row[BLOCK_COUNT]
        want = -(-n // bb) if bb and n > bb else 0
        if count not in (0, want) or start < 0 or start + count > self.index.nblocks:  # 0: none recorded
            raise self._bad(r, f"block digests [{start}, {start + count}) of {self.index.nblocks}: a "
                               f"{n}-byte chunk has 0 or {want}")
        hexes = "".join(map(i64_to_hex, self.index.blocks(start, count))) if count else ""
        o = tuple(offs[:nd])
        return ChunkMeta(o, tuple(sizes[:nd]), f.name, chunk_key(self.key, o), boff, i64_to_hex(row[CHECKSUM]), hexes)

    def overlaps(self, box: Box) -> list[tuple[int, Box]]:
        """(index, overlap with ``box``) of every chunk that intersects ``box``: a bisection of the
        sort keys and the rows around it, nothing else of the tensor. Keys out of order around
        the answer are an error naming the row; disorder elsewhere shows as a coverage gap
        (``check_all`` then names it). Only rows that intersect are checked and described (a
        row this rank does not read costs an intersection of its integers, not a ``ChunkMeta``):
        a plan touches every tensor of the checkpoint, so this runs ~2,000 times per load."""
        n = self.n
        if not n or not box.numel:
            return []
        if n <= _SCAN_ROWS:  # a few chunks: read and intersect them all (no bisection)
            a, b = self.lo, self.hi
            self._check_order(a, b)
        else:
            dim, span = self.index.tensor_sort[self.tid]
            q_lo = box.offsets[dim] if dim < len(box.offsets) else 0
            q_hi = q_lo + (box.sizes[dim] if dim < len(box.sizes) else 1)
            a, b = self.index.search(self.tid, q_lo - span + 1, q_hi, self.shape[dim] if dim < len(self.shape) else 1)
            self._check_order(max(a - 1, self.lo), min(b + 1, self.hi))
        if a >= b:
            return []
        out = []
        cache, d, offsets, sizes = self._cache, self.index.ndim, box.offsets, box.sizes
        dims = range(len(offsets))
        for j, row in zip(range(a, b), self.index.rows(a, b)):
            lo, hi = [], []
            for k in dims:  # the row's box (offsets at 6.., sizes at 6 + d..) against ``box``
                o = row[6 + k]
                lo.append(o if o > offsets[k] else offsets[k])
                e = o + row[6 + d + k]
                hi.append(e if e < offsets[k] + sizes[k] else offsets[k] + sizes[k])
                if lo[-1] >= hi[-1]:
                    break
            else:
                i = j - self.lo
                if i not in cache:
                    cache[i] = self._chunk(j, row)  # checked before it is used
                out.append((i, Box(tuple(lo), tuple(h - x for h, x in zip(hi, lo)))))
        return out

    def _check_order(self, a: int, b: int) -> None:
        """Rows [a, b) have ascending sort keys (what the bisection relies on)."""
        prev = None
        for j in range(a, b):
            k = self.index.key(j)
            if prev is not None and k < prev:
                raise self._bad(j, f"sort key {k} after {prev}: rows out of order")
            prev = k

    def check_disjoint(self, box: Box, found: Sequence[int]) -> None:
        """The chunks a rank uses tile its box: no two overlap inside it (with the volume check
        of the caller, an exact tiling of what this rank reads)."""
        if len(found) > 1:
            parts = []
            for i in found:
                ov = intersect(self[i].box, box)
                parts.append(Box(relative(ov, box), ov.sizes))
            problem = boxes_tile(box.sizes, parts)
            if problem and "overlap" in problem:
                raise MetadataError(f"{self.index.name}: tensor {self.key!r}: {problem} inside the box at offsets "
                                    f"{list(box.offsets)} sizes {list(box.sizes)}")

    def check_all(self) -> None:
        """Every row of the tensor read and checked, keys ascending, and the chunks tiling the
        tensor exactly: what ``verify`` runs, and what explains a coverage gap. Nothing is cached
        (a whole-checkpoint check holds one tensor's rows at a time)."""
        chunks = [self._chunk(self.lo + j, row) for j, row in enumerate(self.index.rows(self.lo, self.hi))]
        keys = [self.index.key(j) for j in range(self.lo, self.hi)]
        for j in range(1, len(keys)):
            if keys[j] < keys[j - 1]:
                raise self._bad(self.lo + j, f"sort key {keys[j]} after {keys[j - 1]}: rows out of order")
        if math.prod(self.shape) or chunks:
            problem = boxes_tile(self.shape, [c.box for c in chunks])
            if problem:
                raise MetadataError(f"{self.index.name}: tensor {self.key!r} (rows {self.lo}..{self.hi}): {problem}")


def chunk_overlaps(chunks: Sequence[ChunkMeta], box: Box, index: Any = None) -> list[tuple[int, Box]]:
    """(index, overlap) of every chunk of ``chunks`` that meets ``box`` (``index``: a
    ``BoxIndex`` over a tuple)."""
    if isinstance(chunks, IndexedChunks):
        return chunks.overlaps(box)
    cand = index.overlapping(box) if index is not None else range(len(chunks))
    out = []
    for c in cand:
        ov = intersect(box, chunks[c].box)
        if ov is not None:
            out.append((c, ov))
    return out
