"""Shard geometry: boxes, intersections, DTensor local chunks, byte ranges inside a chunk.

Everything here is pure (no process group) so planning can be unit-tested in isolation.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import StateDictError


@dataclass(frozen=True)
class Box:
    """An axis-aligned region of a tensor: ``offsets`` and ``sizes`` per dimension.

    A 0-dim tensor is the empty box ``Box((), ())`` with one element.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape)
        )


def whole(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(d) for d in shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same rank, or None when they share no element."""
    if len(a.offsets) != len(b.offsets):
        raise StateDictError(f"box rank mismatch: {a} vs {b}")
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def narrow(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` covering the box ``offsets``/``sizes`` (one ``narrow`` per dim)."""
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def relative(inner: Box, outer: Box) -> tuple[int, ...]:
    """Offsets of ``inner`` relative to the origin of ``outer``."""
    return tuple(i - o for i, o in zip(inner.offsets, outer.offsets))


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def flat_span(sub_offsets: Sequence[int], sub_sizes: Sequence[int], chunk_sizes: Sequence[int]) -> tuple[int, int]:
    """Smallest contiguous element range ``[start, stop)`` of a row-major chunk holding a sub-box.

    When the sub-box is a run of whole rows (e.g. resharding along dim 0) the span is exactly the
    sub-box, so a reader fetches only the bytes it keeps.
    """
    if any(s == 0 for s in sub_sizes):
        return 0, 0
    strides = row_major_strides(chunk_sizes)
    first = sum(o * st for o, st in zip(sub_offsets, strides))
    last = sum((o + s - 1) * st for o, s, st in zip(sub_offsets, sub_sizes, strides))
    return first, last + 1


def run_dim(sub_sizes: Sequence[int], chunk_sizes: Sequence[int]) -> int:
    """The innermost dimension a sub-box does not span whole: its runs cover that dimension's
    extent and every dimension inside it."""
    k = len(chunk_sizes) - 1
    while k > 0 and sub_sizes[k] == chunk_sizes[k]:
        k -= 1
    return k


def run_starts(offsets: Sequence[int], sizes: Sequence[int], strides: Sequence[int], k: int) -> torch.Tensor:
    """Element start of each run of a box in memory of ``strides`` (dims ``< k`` enumerated in
    row-major order, one run per index): the same order for a chunk in a file and for a
    destination view, so the i-th file run lands in the i-th destination run."""
    starts = torch.tensor([sum(o * st for o, st in zip(offsets, strides))], dtype=torch.int64)
    for j in range(k - 1, -1, -1):  # outer dimensions, innermost last in the final order
        starts = (torch.arange(sizes[j], dtype=torch.int64)[:, None] * strides[j] + starts[None, :]).flatten()
    return starts


def runs_contiguous_in(t: torch.Tensor, k: int) -> bool:
    """True when each run of ``t``'s dims ``k..`` (its full extent there) is one contiguous
    stretch of its memory, so a read can land in ``t`` directly."""
    expect = 1
    for d in range(t.dim() - 1, k - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return False
        expect *= t.shape[d]
    return True


def span_is_exact(sub_offsets: Sequence[int], sub_sizes: Sequence[int], chunk_sizes: Sequence[int]) -> bool:
    """True when the flat span of the sub-box contains only the sub-box's elements."""
    start, stop = flat_span(sub_offsets, sub_sizes, chunk_sizes)
    return stop - start == math.prod(sub_sizes)


def split_piece(length: int, parts: int, index: int) -> tuple[int, int]:
    """Offset and size of piece ``index`` when ``torch.chunk`` splits ``length`` into ``parts``.

    This is DTensor's ``Shard`` rule: pieces of ``ceil(length/parts)``, trailing ones may be empty.
    """
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, min(start + step, length) - start


def dtensor_local_box(tensor: "torch.distributed.tensor.DTensor",
                      local: torch.Tensor | None = None) -> Box | None:
    """The global box this rank's local shard of a DTensor covers, or None if not on its mesh.

    Shard/Replicate placements are computed here; other shard-like placements (e.g. the strided
    shards of FSDP2 + TP) go through DTensor's own chunk list. The result is checked against the
    real local shape, so a placement we misunderstand is an error, never a silent wrong box.
    ``local``: the caller's ``tensor.to_local()``, if it has it (a plan asks once per tensor).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape = tuple(int(d) for d in tensor.shape)
    offs = [0] * len(shape)
    sizes = list(shape)
    simple = True
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Partial):
            raise StateDictError(
                f"DTensor with a Partial placement cannot be checkpointed (placements "
                f"{tensor.placements}); reduce it first, e.g. .redistribute(..., [Replicate()])"
            )
        if isinstance(placement, Replicate):
            continue
        if type(placement) is Shard:
            d = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
            start, size = split_piece(sizes[d], mesh.size(mesh_dim), coord[mesh_dim])
            offs[d] += start
            sizes[d] = size
            continue
        simple = False
        break
    if not simple:
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise StateDictError(f"unsupported DTensor placements {tensor.placements}: {len(chunks)} chunks")
        offs, sizes = list(chunks[0].offsets), list(chunks[0].sizes)
    local_shape = tuple((tensor.to_local() if local is None else local).shape)
    if tuple(sizes) != local_shape:
        raise StateDictError(
            f"DTensor placements {tensor.placements} imply a local shape {tuple(sizes)} but the local "
            f"tensor has shape {local_shape}"
        )
    return Box(tuple(offs), tuple(sizes))


def boxes_tile(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Check that ``boxes`` cover ``shape`` exactly once. Returns a problem description or None.

    Boxes must lie inside the shape, be pairwise disjoint and their volumes add up to the shape's.
    Disjointness is a sweep along the dimension with the most distinct offsets (the sharded one):
    O(k log k) for the k chunks of a 1-D sharding, instead of comparing all k^2/2 pairs, which
    at hundreds of ranks x thousands of tensors dominated a save's planning.
    """
    total = math.prod(shape)
    for b in boxes:
        if not b.within(shape):
            return f"chunk offsets={b.offsets} sizes={b.sizes} lies outside shape {tuple(shape)}"
    vol = sum(b.numel for b in boxes)
    try:
        overlap = first_overlap([b for b in boxes if b.numel])
    except IrregularLayoutError as e:
        return f"cannot check the tiling in bounded time: {e}"
    if overlap is not None:
        a, b = overlap
        return f"chunks {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} overlap"
    if vol != total:
        return f"chunks cover {vol} of {total} elements"
    return None


def _split_gaps(rows: torch.Tensor, g: torch.Tensor, dim: torch.Tensor, sel: torch.Tensor | None,
                suspect: torch.Tensor) -> None:
    """``tiling_problem``'s chunks split along one dimension (rows ``sel``, all if None; ``g``
    their tensor ids, ``dim`` that dimension): a tensor is suspect where its chunks split
    different dimensions, or, sorted along the split one, leave a gap or overlap."""
    k, d = len(suspect), rows.shape[1] // 2
    lo = torch.full((k,), d, dtype=torch.int64).scatter_reduce(0, g, dim, "amin")
    hi = torch.full((k,), -1, dtype=torch.int64).scatter_reduce(0, g, dim, "amax")
    suspect[g[lo[g] != hi[g]]] = True

    def column(c: int) -> torch.Tensor:
        return rows[:, c] if sel is None else rows[:, c][sel]
    start, size = column(0), column(d)
    for j in range(1, d):
        at = dim == j
        if bool(at.any()):
            start, size = torch.where(at, column(j), start), torch.where(at, column(d + j), size)
    end = start + size
    del size
    same = g[1:] == g[:-1]
    if not bool(((g[1:] > g[:-1]) | (same & (start[1:] >= start[:-1]))).all()):  # (a chunk index is sorted)
        o = torch.argsort(start, stable=True)
        o = o[torch.argsort(g[o], stable=True)]
        g, start, end = g[o], start[o], end[o]
        same = g[1:] == g[:-1]
    gap = same & (start[1:] != end[:-1])
    suspect[g[1:][gap]] = True


def tiling_problem(shapes: Sequence[Sequence[int] | None], rows: torch.Tensor,
                   ids: torch.Tensor | None = None) -> tuple[int, str] | None:
    """``boxes_tile`` for many tensors at once: ``rows`` are int64 ``[tensor id, offsets, sizes]``
    with ndim padded to D (offset 0, size 1); ``shapes[i]`` is tensor i's shape (None: not a
    tensor). Returns the first (tensor id, problem) or None. With ``ids`` (the tensor ids), ``rows``
    holds only the offsets and sizes: a view of a wider matrix is checked without a copy.

    Vectorised for the layouts that split one dimension (or none): inside the shape, volumes add
    up, and the non-empty chunks, sorted along the split dimension, are adjacent. Tensors split
    along several dimensions, and any that fail, go to the exact sweep (``boxes_tile``), which
    also words the problem. Checking one chunk costs ~1 us here instead of ~20 in Python.
    """
    gid, rows = (rows[:, 0], rows[:, 1:]) if ids is None else (ids, rows)
    d = rows.shape[1] // 2
    k = len(shapes)
    if not k:
        return None
    full = torch.ones((max(d, 1), k), dtype=torch.int64)
    numel = torch.zeros(k, dtype=torch.int64)
    for i, shp in enumerate(shapes):
        if shp is not None:
            if len(shp):
                full[:len(shp), i] = torch.tensor(list(shp), dtype=torch.int64)
            numel[i] = math.prod(shp)
    # One dimension at a time on 1-D columns: reductions across the few dimensions of an [R, D]
    # temporary cost several times an elementwise pass at millions of rows.
    outside = torch.zeros(len(rows), dtype=torch.bool)
    nsplit = torch.zeros(len(rows), dtype=torch.int64)
    dim = torch.zeros(len(rows), dtype=torch.int64)
    vol = torch.ones(len(rows), dtype=torch.int64)
    for j in range(d):
        off, size = rows[:, j], rows[:, d + j]
        shp = full[j][gid]
        outside |= (off < 0) | (size < 0) | (off + size > shp)
        part = size != shp
        nsplit += part
        dim.masked_fill_(part, j)
        vol *= size
        del shp, part
    suspect = torch.zeros(k, dtype=torch.bool)
    suspect[gid[outside]] = True
    del outside
    is_tensor = torch.tensor([s is not None for s in shapes])
    suspect |= is_tensor & (torch.zeros(k, dtype=torch.int64).index_add_(0, gid, vol) != numel)
    nsplit.masked_fill_(vol == 0, 0)  # an empty chunk splits nothing
    del vol
    suspect[gid[nsplit > 1]] = True
    one = nsplit == 1
    all_one = bool(one.all())
    sel = None if all_one else torch.nonzero(one).flatten()
    del nsplit, one
    if d and (all_one or len(sel)):
        _split_gaps(rows, gid if all_one else gid[sel], dim if all_one else dim[sel], None if all_one else sel,
                    suspect)
    for i in torch.nonzero(suspect).flatten().tolist():
        nd = len(shapes[i])
        boxes = [Box(tuple(r[:nd]), tuple(r[d:d + nd])) for r in rows[gid == i].tolist()]
        problem = boxes_tile(shapes[i], boxes)
        if problem:
            return i, problem
    return None


class BoxIndex:
    """Finds the boxes that may intersect a query box without scanning them all: boxes sorted by
    their start along the dimension with the most distinct offsets (the sharded one), bisected.
    A load into N ranks' shards from N saved chunks costs O(log N) per lookup instead of O(N)."""

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        ndim = len(self.boxes[0].offsets) if self.boxes else 0
        self.dim = max(range(ndim), key=lambda i: len({b.offsets[i] for b in self.boxes})) if ndim else None
        if self.dim is None:
            return
        self.order = sorted(range(len(self.boxes)), key=lambda i: self.boxes[i].offsets[self.dim])
        self.starts = [self.boxes[i].offsets[self.dim] for i in self.order]
        self.max_size = max((b.sizes[self.dim] for b in self.boxes), default=0)

    def overlapping(self, box: Box) -> list[int]:
        """Indices (into the boxes given) of those that intersect ``box``, in index order."""
        if self.dim is None:
            return [i for i, b in enumerate(self.boxes) if intersect(b, box) is not None]
        lo, hi = box.offsets[self.dim], box.offsets[self.dim] + box.sizes[self.dim]
        # a box starting before lo - max_size ends before lo; one starting at or after hi begins after
        first = bisect.bisect_right(self.starts, lo - self.max_size)
        last = bisect.bisect_left(self.starts, hi)
        return sorted(i for i in self.order[first:last] if intersect(self.boxes[i], box) is not None)


class IrregularLayoutError(Exception):
    """The chunks vary along three or more dimensions in a way the bounded check cannot decide."""


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes that share an element, or None.

    A sweep along the dimension with the most distinct offsets, comparing each box with those
    still open there: fast for real layouts (a 1-D sharding keeps one box open, an N x M grid
    about M). Its work is bounded (~32 comparisons per box): hostile layouts that keep many
    boxes open (strips of decreasing height) go to an O(n log n) sweep with a segment tree when
    the boxes vary along two dimensions, and are refused (``IrregularLayoutError``) beyond that.
    """
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0].offsets)
    if ndim == 0:
        return boxes[0], boxes[1]  # two non-empty scalars
    d = max(range(ndim), key=lambda i: len({b.offsets[i] for b in boxes}))
    budget = 32 * len(boxes) + 4096
    active: list[tuple[int, Box]] = []  # boxes whose extent along d is still open, with their end
    for b in sorted(boxes, key=lambda b: b.offsets[d]):
        start = b.offsets[d]
        active = [(end, a) for end, a in active if end > start]
        budget -= len(active) + 1
        if budget < 0:
            return _overlap_2d(boxes)
        for _, a in active:
            if intersect(a, b) is not None:
                return a, b
        active.append((start + b.sizes[d], b))
    return None


def _overlap_2d(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Exact overlap test in O(n log n) for boxes that vary along at most two dimensions: sweep
    along one, keeping a segment tree (range add, range max) of how many open boxes cover each
    interval of the other; a box whose range already has cover overlaps an open box."""
    ndim = len(boxes[0].offsets)
    varying = [i for i in range(ndim) if len({(b.offsets[i], b.sizes[i]) for b in boxes}) > 1]
    if len(varying) > 2:
        raise IrregularLayoutError(f"{len(boxes)} chunks split along {len(varying)} dimensions in an irregular "
                                   f"pattern (not a grid)")
    if len(varying) < 2:  # identical along every other dimension: a 1-D check, sorted
        i = varying[0] if varying else 0
        ordered = sorted(boxes, key=lambda b: b.offsets[i])
        for a, b in zip(ordered, ordered[1:]):
            if b.offsets[i] < a.offsets[i] + a.sizes[i]:
                return a, b
        return None
    x, y = varying
    ys = sorted({v for b in boxes for v in (b.offsets[y], b.offsets[y] + b.sizes[y])})
    where = {v: k for k, v in enumerate(ys)}
    tree = _MaxAddTree(len(ys) - 1)
    events = []  # (x, 0: close / 1: open, box index): closes first at the same x (half-open boxes)
    for k, b in enumerate(boxes):
        events.append((b.offsets[x], 1, k))
        events.append((b.offsets[x] + b.sizes[x], 0, k))
    events.sort()
    open_boxes: set[int] = set()
    for _, kind, k in events:
        b = boxes[k]
        lo, hi = where[b.offsets[y]], where[b.offsets[y] + b.sizes[y]]
        if kind == 0:
            tree.add(lo, hi, -1)
            open_boxes.discard(k)
            continue
        if tree.max(lo, hi) > 0:
            other = next(boxes[j] for j in open_boxes if intersect(boxes[j], b) is not None)
            return other, b
        tree.add(lo, hi, 1)
        open_boxes.add(k)
    return None


class _MaxAddTree:
    """Segment tree over ``n`` leaves: add a value to a range, query a range's maximum."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.top = [0] * (4 * self.n)
        self.lazy = [0] * (4 * self.n)

    def add(self, lo: int, hi: int, v: int, node: int = 1, a: int = 0, b: int | None = None) -> None:
        b = self.n if b is None else b
        if hi <= a or b <= lo:
            return
        if lo <= a and b <= hi:
            self.top[node] += v
            self.lazy[node] += v
            return
        m = (a + b) // 2
        self.add(lo, hi, v, 2 * node, a, m)
        self.add(lo, hi, v, 2 * node + 1, m, b)
        self.top[node] = self.lazy[node] + max(self.top[2 * node], self.top[2 * node + 1])

    def max(self, lo: int, hi: int, node: int = 1, a: int = 0, b: int | None = None) -> int:
        b = self.n if b is None else b
        if hi <= a or b <= lo:
            return -(1 << 62)
        if lo <= a and b <= hi:
            return self.top[node]
        m = (a + b) // 2
        return self.lazy[node] + max(self.max(lo, hi, 2 * node, a, m), self.max(lo, hi, 2 * node + 1, m, b))
