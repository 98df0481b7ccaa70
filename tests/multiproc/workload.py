"""Deterministic test state dicts under named layouts (shared by the multi-process tests)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hpdcp_runner.dcp import FlatShard, FusedShard
from hpdcp_runner.dcp.tools import Box, split_piece

SPECS = {
    "w": ((7, 5), torch.float32),
    "big": ((16, 8), torch.float32),
    "tiny": ((3, 2), torch.float16),
    "bf": ((6, 4), torch.bfloat16),
    "ids": ((5, 3), torch.int64),
    "i32": ((4, 4), torch.int32),
    "u8": ((9, 2), torch.uint8),
    "mask": ((4, 2), torch.bool),
    "layers.0.k": ((8, 3), torch.float32),
    "layers.1.k": ((8, 3), torch.float32),
}
LAYOUTS_BY_WS = {
    1: ["plain", "rep", "s0", "s1", "ragged"],
    2: ["plain", "rep", "s0", "s1", "ragged", "fused"],
    4: ["plain", "rep", "s0", "s1", "ragged", "2d_s0s1", "2d_rs0", "fused"],
}


def reference(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    seed = sum(map(ord, name))
    base = (torch.arange(math.prod(shape), dtype=torch.int64) * 7 + seed) % 97
    if dtype == torch.bool:
        return (base % 3 == 0).reshape(shape)
    if dtype.is_floating_point:
        return (base.to(torch.float64) / 8 - 5).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def reference_objects() -> dict:
    return {"step": 7, "meta": {"name": "run-a", "lr": 0.1, "blob": b"\x00\xff\x10", "sizes": (1, 2), "none": None},
            "scalar": torch.tensor(3.25), "empty": torch.zeros(0, 3)}


def ragged_units(numel: int, ws: int) -> list[int]:
    """Uneven element counts per rank (some ranks may get 0 when the tensor is small)."""
    total = ws * (ws + 1) // 2
    cuts = [numel * (k * (k + 1) // 2) // total for k in range(ws + 1)]
    return [cuts[k + 1] - cuts[k] for k in range(ws)]


_MESHES: dict = {}


def mesh(kind: str) -> DeviceMesh:
    ws = dist.get_world_size()
    if kind not in _MESHES:
        shape = (ws,) if kind == "1d" else (2, ws // 2)
        _MESHES[kind] = DeviceMesh("cpu", torch.arange(ws).reshape(shape))
    return _MESHES[kind]


def fused_parts(rows: int) -> list[int]:
    """Dim 0 as two unequal parts (q and kv-like), each split over the ranks on its own."""
    return [rows - rows // 3, rows // 3]


def place(full: torch.Tensor, layout: str):
    if layout == "plain":
        return full.clone()
    if layout == "fused":  # each rank: its piece of every part, concatenated (may be empty)
        ws, rank = dist.get_world_size(), dist.get_rank()
        boxes, start = [], 0
        for size in fused_parts(full.shape[0]):
            off, n = split_piece(size, ws, rank)
            boxes.append(Box((start + off,) + (0,) * (full.dim() - 1), (n,) + tuple(full.shape[1:])))
            start += size
        local = torch.cat([full[b.offsets[0]:b.offsets[0] + b.sizes[0]] for b in boxes]).clone()
        return FusedShard(local, full.shape, boxes, 0)
    if layout == "ragged":
        ws, rank = dist.get_world_size(), dist.get_rank()
        units = ragged_units(full.numel(), ws)
        return FlatShard.from_units(full.clone(), full.shape, full.dim(), units, rank)
    placements = {"rep": [Replicate()], "s0": [Shard(0)], "s1": [Shard(1)],
                  "2d_s0s1": [Shard(0), Shard(1)], "2d_rs0": [Replicate(), Shard(0)]}[layout]
    m = mesh("2d" if layout.startswith("2d") else "1d")
    return distribute_tensor(full.clone(), m, placements)


def build(layout: str, *, zeros: bool = False) -> dict:
    """The nested workload state dict under ``layout``; ``zeros`` gives a load target."""
    def value(name: str):
        ref = reference(name)
        return place(torch.zeros_like(ref) if zeros else ref, layout)

    sd = {k: value(k) for k in SPECS if not k.startswith("layers.")}
    sd["layers"] = [{"k": value("layers.0.k")}, {"k": value("layers.1.k")}]
    objs = reference_objects()
    if zeros:
        objs = {"step": 0, "meta": {"name": "", "lr": 0.0, "blob": b"", "sizes": (), "none": 1},
                "scalar": torch.tensor(0.0), "empty": torch.ones(0, 3)}
    sd.update(objs)
    return sd


def full_value(v) -> torch.Tensor:
    """The global tensor behind a leaf (collective for DTensor and FlatShard)."""
    if isinstance(v, DTensor):
        return v.full_tensor()
    if isinstance(v, FlatShard):
        n = math.prod(v.global_shape)
        ws = dist.get_world_size()
        sizes = ragged_units(n, ws)
        parts = [torch.empty(s, dtype=v.local.dtype) for s in sizes]
        gathered = [torch.empty(max(sizes), dtype=v.local.dtype) for _ in sizes]
        pad = torch.zeros(max(sizes), dtype=v.local.dtype)
        pad[: v.local.numel()] = v.local
        dist.all_gather(gathered, pad)
        for p, g, s in zip(parts, gathered, sizes):
            p.copy_(g[:s])
        return torch.cat(parts).reshape(v.global_shape)
    if isinstance(v, FusedShard):
        out = torch.zeros(v.global_shape, dtype=v.local.dtype)
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, [(b, t.clone()) for b, t in v.pieces()])
        for pieces in held:
            for b, t in pieces:
                out[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] = t
        return out
    return v


def check(sd: dict) -> list[str]:
    """Problems found comparing a loaded state dict with the reference (empty list = bitwise equal)."""
    problems = []
    flat = {k: sd[k] for k in SPECS if not k.startswith("layers.")}
    flat["layers.0.k"] = sd["layers"][0]["k"]
    flat["layers.1.k"] = sd["layers"][1]["k"]
    for k, v in flat.items():
        got, ref = full_value(v), reference(k)
        if got.dtype != ref.dtype or not torch.equal(got, ref):
            problems.append(f"{k}: not bitwise equal")
    ref_objs = reference_objects()
    for k in ("step", "meta"):
        if sd[k] != ref_objs[k] or type(sd[k]) is not type(ref_objs[k]):
            problems.append(f"{k}: {sd[k]!r} != {ref_objs[k]!r}")
    if not torch.equal(sd["scalar"], ref_objs["scalar"]):
        problems.append("scalar differs")
    return problems
