"""Explicitly placed shards: ragged flat intervals and tagged boxes.

``FlatShard`` is a rank's contiguous row-major flat interval ``[start, start + numel)`` of a
global tensor (the layout of flat-parameter FSDP and of ragged sharding). On save it is split
into regular N-D boxes, so ragged shards reshard like any other chunk. ``LocalShard`` is a plain
tensor tagged with its offsets inside a global tensor (the "chunk info" case). ``FusedShard``
is a rank's shard of a fused tensor (q, k and v concatenated, gate and up, stacked experts):
one local tensor that is the concatenation of several boxes of the global tensor along one
dimension, e.g. the rank's heads of q, of k and of v, as a tensor-parallel kernel needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import StateDictError
from .geometry import Box


@dataclass(frozen=True)
class FlatPiece:
    """One regular box of a flat interval and where its elements sit in the local 1-D tensor."""

    box: Box
    local_start: int
    local_stop: int


def decompose_flat_interval(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Split the row-major flat interval ``[start, stop)`` of ``shape`` into ordered boxes.

    Concatenating the boxes' elements (each in row-major order) gives ``range(start, stop)``.
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise StateDictError("a flat interval needs a tensor of at least one dimension")
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise StateDictError(f"flat interval [{start}, {stop}) is outside 0..{total} for shape {shape}")
    return _decompose(shape, start, stop)


def _decompose(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start == stop:
        return []
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    rest_zero = tuple(0 for _ in shape[1:])
    out: list[Box] = []
    row = start // inner
    if start % inner:
        row_stop = min(stop, (row + 1) * inner)
        for b in _decompose(shape[1:], start - row * inner, row_stop - row * inner):
            out.append(Box((row,) + b.offsets, (1,) + b.sizes))
        start = row_stop
        row += 1
        if start == stop:
            return out
    full_rows = stop // inner - row
    if full_rows > 0:
        out.append(Box((row,) + rest_zero, (full_rows,) + shape[1:]))
        row += full_rows
    tail = stop - row * inner
    if tail > 0:
        for b in _decompose(shape[1:], 0, tail):
            out.append(Box((row,) + b.offsets, (1,) + b.sizes))
    return out


class FlatShard:
    """A rank's 1-D slice ``[start, start + local.numel())`` of a row-major global tensor."""

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], start: int) -> None:
        if local.dim() != 1:
            raise StateDictError(f"FlatShard needs a 1-D local tensor, got shape {tuple(local.shape)}")
        self.local = local
        self.global_shape = tuple(int(d) for d in global_shape)
        self.start = int(start)
        self.pieces = tuple(self._pieces())

    @classmethod
    def from_units(cls, full_or_local: torch.Tensor, global_shape: Sequence[int], dims: int,
                   local_units: Sequence[int], index: int, *, local: bool = False) -> "FlatShard":
        """Ragged sharding: the leading ``dims`` dims are split in units; rank ``index`` owns
        ``local_units[index]`` units. Pass the full tensor (sliced here) or ``local=True``."""
        shape = tuple(int(d) for d in global_shape)
        prefix = math.prod(shape[:dims])
        units = sum(local_units)
        if units <= 0 or prefix % units:
            raise StateDictError(f"{prefix} leading cells cannot be split into {units} units ({list(local_units)})")
        per_unit = prefix // units * math.prod(shape[dims:])
        start = sum(local_units[:index]) * per_unit
        stop = start + local_units[index] * per_unit
        t = full_or_local if local else full_or_local.reshape(-1)[start:stop]
        return cls(t, shape, start)

    def _pieces(self) -> list[FlatPiece]:
        stop = self.start + self.local.numel()
        pos, out = 0, []
        for box in decompose_flat_interval(self.global_shape, self.start, stop):
            out.append(FlatPiece(box, pos, pos + box.numel))
            pos += box.numel
        return out

    def piece_view(self, piece: FlatPiece) -> torch.Tensor:
        """A view of the local tensor shaped as the piece's box."""
        return self.local[piece.local_start : piece.local_stop].view(piece.box.sizes)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"FlatShard(global_shape={self.global_shape}, start={self.start}, numel={self.local.numel()})"


class LocalShard:
    """A plain tensor tagged as the box at ``offsets`` of a tensor of ``global_shape``."""

    def __init__(self, local: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]) -> None:
        self.local = local
        self.global_shape = tuple(int(d) for d in global_shape)
        self.box = Box(tuple(int(o) for o in offsets), tuple(int(d) for d in local.shape))
        if not self.box.within(self.global_shape):
            raise StateDictError(f"LocalShard box {self.box} does not fit global shape {self.global_shape}")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"LocalShard(offsets={self.box.offsets}, sizes={self.box.sizes}, global_shape={self.global_shape})"


class FusedShard:
    """A local tensor that is the concatenation along ``dim`` of ``boxes`` of a global tensor.

    Why: a fused projection (``qkv_proj``, ``gate_up_proj``) is sharded part by part, so each
    rank's local tensor holds its rows of every part, which no single box (and no DTensor
    placement for unequal parts) describes. Saved, each box is an ordinary chunk of the global
    tensor, so a fused shard reshards to and from any other layout.
    """

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], boxes: Sequence[Box], dim: int) -> None:
        self.local = local
        self.global_shape = tuple(int(d) for d in global_shape)
        nd = len(self.global_shape)
        self.dim = dim + nd if dim < 0 else dim
        if not 0 <= self.dim < nd or local.dim() != nd:
            raise StateDictError(f"FusedShard: dim {dim} and a {local.dim()}-D local tensor do not fit global "
                                 f"shape {self.global_shape}")
        self.boxes = tuple(boxes)
        pos = 0
        for b in self.boxes:
            if not b.within(self.global_shape):
                raise StateDictError(f"FusedShard box {b} does not fit global shape {self.global_shape}")
            if any(b.sizes[i] != local.shape[i] for i in range(nd) if i != self.dim):
                raise StateDictError(f"FusedShard box {b} does not match the local shape {tuple(local.shape)} "
                                     f"outside dim {self.dim}")
            pos += b.sizes[self.dim]
        if pos != local.shape[self.dim]:
            raise StateDictError(f"FusedShard boxes hold {pos} along dim {self.dim}, the local tensor "
                                 f"{local.shape[self.dim]}")

    def pieces(self) -> list[tuple[Box, torch.Tensor]]:
        """Each box with the view of the local tensor that holds it (loads write into these)."""
        out, pos = [], 0
        for b in self.boxes:
            n = b.sizes[self.dim]
            out.append((b, self.local.narrow(self.dim, pos, n)))
            pos += n
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"FusedShard(global_shape={self.global_shape}, dim={self.dim}, boxes={list(self.boxes)})"


class ShardPieces:
    """Several boxes of one global tensor, each in a tensor of its own (``pieces``: (box, tensor)).

    Why: a rank may hold parts of a tensor that live apart in its memory, e.g. the experts it owns
    of a stacked ``[experts, ...]`` checkpoint tensor, held as separate per-expert tensors. Each
    piece is read into (and saved from) its own tensor; nothing is copied into one buffer.
    """

    def __init__(self, global_shape: Sequence[int], pieces: Sequence[tuple[Box, torch.Tensor]]) -> None:
        self.global_shape = tuple(int(d) for d in global_shape)
        self.pieces = tuple(pieces)
        if not self.pieces:
            raise StateDictError("ShardPieces needs at least one piece (leave the key out instead)")
        dtypes = {t.dtype for _, t in self.pieces}
        if len(dtypes) != 1:
            raise StateDictError(f"ShardPieces pieces have several dtypes: {sorted(map(str, dtypes))}")
        for b, t in self.pieces:
            if not b.within(self.global_shape) or tuple(t.shape) != b.sizes:
                raise StateDictError(f"ShardPieces piece {b} (tensor {tuple(t.shape)}) does not fit global shape "
                                     f"{self.global_shape}")

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0][1].dtype

    def __repr__(self) -> str:
        return f"ShardPieces(global_shape={self.global_shape}, boxes={[b for b, _ in self.pieces]})"
