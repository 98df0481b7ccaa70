"""Layout config -> DeviceMesh + placements per parameter, applied to full reference tensors.

Every rank holds the same deterministic full tensors, so placing is local slicing (no
collectives); the slicing follows DTensor's ``Shard`` rule (``torch.chunk`` sizes).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from .dcp import FlatShard
from .dcp.tools import Box, decompose_flat_interval, narrow, split_piece, whole
from .paths import find_conf_dir

PLACEMENT = re.compile(r"^(R|S-?\d+)$")


def preset_names() -> list[str]:
    """The layouts under ``conf/layout/`` (what ``job.source.layout`` may name)."""
    d = os.path.join(find_conf_dir(), "layout")
    return sorted(n[:-5] for n in os.listdir(d) if n.endswith(".yaml")) if os.path.isdir(d) else []


def mesh_shape(layout: Any, world_size: int) -> tuple[int, ...]:
    dims = list(layout.mesh)
    known = math.prod(d for d in dims if d != -1)
    return tuple(world_size // known if d == -1 else d for d in dims)


def problems(layout: Any, world_size: int) -> list[str]:
    out = []
    if layout.kind not in ("plain", "dtensor", "flat"):
        out.append(f"kind: {layout.kind!r} is not plain, dtensor or flat")
    dims = list(layout.mesh)
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims) or not dims:
        out.append(f"mesh: {dims} must be positive sizes with at most one -1")
    else:
        known = math.prod(d for d in dims if d != -1)
        if (world_size % known) if -1 in dims else (known != world_size):
            out.append(f"mesh: {dims} does not fit world size {world_size}")
    for i, rule in enumerate(layout.rules):
        try:
            re.compile(rule.pattern)
        except re.error as e:
            out.append(f"rules[{i}].pattern: bad regex {rule.pattern!r} ({e})")
        if len(rule.placements) != len(dims):
            out.append(f"rules[{i}].placements: {list(rule.placements)} needs one entry per mesh dim ({len(dims)})")
        bad = [p for p in rule.placements if not PLACEMENT.match(str(p))]
        if bad:
            out.append(f"rules[{i}].placements: {bad} are not R or S<dim>")
    if layout.kind == "flat":
        if len(dims) != 1:
            out.append("mesh: flat layouts use a 1-D mesh")
        if layout.flat_units and len(layout.flat_units) != world_size:
            out.append(f"flat_units: {list(layout.flat_units)} needs one entry per rank ({world_size})")
        if any(u < 0 for u in layout.flat_units) or (layout.flat_units and sum(layout.flat_units) == 0):
            out.append(f"flat_units: {list(layout.flat_units)} must be non-negative with a positive sum")
    return out


class Placer:
    """Applies one layout on this rank."""

    def __init__(self, layout: Any, rank: int, world_size: int, device: str = "cpu") -> None:
        self.layout, self.rank, self.world_size, self.device = layout, rank, world_size, device
        self.shape = mesh_shape(layout, world_size)
        self._mesh = None
        self._rules = [(re.compile(r.pattern), list(r.placements)) for r in layout.rules]

    @property
    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh(self.device, torch.arange(self.world_size).reshape(self.shape))
        return self._mesh

    def rule_for(self, fqn: str) -> int | None:
        """Index of the first rule whose pattern matches ``fqn`` in full, or None."""
        for i, (pat, _) in enumerate(self._rules):
            if pat.fullmatch(fqn):
                return i
        return None

    def placements_for(self, fqn: str, ndim: int) -> list[str]:
        i = self.rule_for(fqn)
        if i is None:
            return ["R"] * len(self.shape)
        pl = self._rules[i][1]
        if ndim == 0:  # a scalar (e.g. an optimizer step under its parameter's rule) cannot be split
            return ["R"] * len(pl)
        bad = [p for p in pl if p != "R" and _dim(p, ndim) is None]
        if bad:
            from .dcp import ConfigError

            raise ConfigError(f"layout {self.layout.name!r} rules[{i}] (pattern {self.layout.rules[i].pattern!r}, "
                              f"placements {list(pl)}) cannot apply to {fqn!r}: it has {ndim} dimension(s), so "
                              f"{bad[0]} does not exist; narrow the pattern or add an earlier rule for it")
        return list(pl)

    def unmatched(self, fqns: Any) -> list[str]:
        """The tensors no rule names (what ``layout.strict`` refuses)."""
        return [f for f in fqns if self.rule_for(f) is None]

    def local_numel(self, fqn: str, shape: tuple[int, ...]) -> int:
        """Elements :meth:`empty` allocates on this rank for a tensor of ``shape`` (no allocation)."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return math.prod(shape)
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), self.rank)
            return b - a
        return sum(b.numel for b in self.boxes(fqn, shape, self.rank))

    def empty(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """An uninitialised load target for a tensor of ``shape``: this rank's own shard only
        (never the full tensor), as a DTensor / FlatShard / plain tensor per the layout."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), self.rank)
            return FlatShard(torch.empty(b - a, dtype=dtype, device=self.device), shape, a)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        (box,) = self.boxes(fqn, shape, self.rank)
        placements = [Replicate() if p == "R" else Shard(_dim(p, len(shape))) for p in self.placements_for(fqn, len(shape))]
        local = torch.empty(box.sizes, dtype=dtype, device=self.device)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank`` (row-major over the mesh shape), no mesh needed."""
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def boxes(self, fqn: str, shape: tuple[int, ...], rank: int) -> list[Box]:
        """The boxes of a tensor of ``shape`` that ``rank`` holds under this layout (pure: the
        same geometry ``place`` uses, for offline imports that write rank files directly)."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return [whole(shape)]
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), rank)
            return decompose_flat_interval(shape, a, b)
        coord = self.coordinate(rank)
        offs, sizes = [0] * len(shape), list(shape)
        for mesh_dim, p in enumerate(self.placements_for(fqn, len(shape))):
            if p == "R":
                continue
            d = _dim(p, len(shape))
            start, size = split_piece(sizes[d], self.shape[mesh_dim], coord[mesh_dim])
            offs[d] += start
            sizes[d] = size
        return [Box(tuple(offs), tuple(sizes))]

    def place(self, fqn: str, full: torch.Tensor) -> Any:
        full = full.to(self.device)
        if self.layout.kind == "plain" or full.dim() == 0:
            return full.clone()
        if self.layout.kind == "flat":
            return self._flat(full)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        (box,) = self.boxes(fqn, tuple(full.shape), self.rank)
        local = narrow(full, box.offsets, box.sizes)
        placements = [Replicate() if p == "R" else Shard(_dim(p, full.dim()))
                      for p in self.placements_for(fqn, full.dim())]
        return DTensor.from_local(local.clone(), self.mesh, placements, run_check=False, shape=full.shape,
                                  stride=full.stride())

    def _flat_cuts(self, n: int, rank: int) -> tuple[int, int]:
        units = list(self.layout.flat_units) or [1] * self.world_size
        total = sum(units)
        return n * sum(units[:rank]) // total, n * sum(units[: rank + 1]) // total

    def _flat(self, full: torch.Tensor) -> FlatShard:
        a, b = self._flat_cuts(full.numel(), self.rank)
        return FlatShard(full.reshape(-1)[a:b].clone(), full.shape, a)


def _dim(p: str, ndim: int) -> int | None:
    d = int(p[1:])
    d = d + ndim if d < 0 else d
    return d if 0 <= d < ndim else None


def place_state(full_sd: Any, placer: Placer, prefix: str = "") -> Any:
    """Place every tensor leaf of a nested reference state dict; other leaves are copied."""
    if isinstance(full_sd, dict):
        return {k: place_state(v, placer, f"{prefix}{k}.") for k, v in full_sd.items()}
    if isinstance(full_sd, list):
        return [place_state(v, placer, f"{prefix}{i}.") for i, v in enumerate(full_sd)]
    if isinstance(full_sd, torch.Tensor):
        return placer.place(prefix[:-1], full_sd)
    return full_sd
