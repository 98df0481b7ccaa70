"""Format v2's chunk index: a rank reads the rows of its own shards, any grid layout loads
bitwise (a hostile index: tests/faults/test_index_faults.py)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import LocalShard, StandardLoadPlanner, load, read_metadata
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.format import chunk_index, metadata
from hpdcp_runner.dcp.format.chunk_index import INDEX_FILE
from hpdcp_runner.dcp.offline.transforms import import_checkpoint, shard_dim0
from hpdcp_runner.dcp.tools import verify


def _grid(parts: dict[str, tuple[int, ...]]):
    """Boxes of a grid layout: tensor ``k`` cut into ``parts[k]`` pieces per dimension (torch.chunk
    sizes), cell ``r`` written by rank ``r``."""

    def cuts(n: int, p: int) -> list[tuple[int, int]]:
        step = -(-n // p)
        return [(a, min(step, n - a)) for a in range(0, n, step)]

    def boxes(fqn, shape, rank):
        if not shape:
            return [Box((), ())] if rank == 0 else []
        per_dim = [cuts(n, p) for n, p in zip(shape, parts[fqn])]
        cells = [[]]
        for options in per_dim:
            cells = [c + [o] for c in cells for o in options]
        if rank >= len(cells):
            return []
        cell = cells[rank]
        return [Box(tuple(a for a, _ in cell), tuple(z for _, z in cell))]

    return boxes


def _checkpoint(tmp_path, full: dict[str, torch.Tensor], world_size: int, boxes) -> str:
    src = tmp_path / "src.safetensors"
    save_file(full, str(src))
    ck = str(tmp_path / "ck")
    import_checkpoint(str(src), ck, world_size=world_size, boxes=boxes, fsync=False)
    return ck


def _plan(md, sd) -> None:
    p = StandardLoadPlanner()
    p.configure(sd, md, rank=0, world_size=1)
    p.create_local_plan()


def test_a_rank_reads_the_rows_of_its_own_shards_only(tmp_path, monkeypatch):
    """4,096 chunks of one tensor: planning one 4-row shard reads a few KiB of a ~330 KiB index
    (one page of sort keys, the candidate rows) and loads bitwise; a whole-tensor load reads all.
    (Indexes under 1 MiB are read whole on open; this one is read in ranges as a large one is.)"""
    monkeypatch.setattr(chunk_index, "_WHOLE_BELOW", 0)
    full = {"w": torch.randn(16384, 4, generator=torch.Generator().manual_seed(0)),
            "b": torch.arange(12, dtype=torch.int16)}
    ck = _checkpoint(tmp_path, full, 4096, shard_dim0(4096))
    md = read_metadata(ck)
    assert md.format_version == 2 and len(md.tensors["w"].chunks) == 4096
    size = os.path.getsize(os.path.join(ck, INDEX_FILE))
    before = md.index.bytes_read
    box = (5000, 0)
    _plan(md, {"w": LocalShard(torch.zeros(4, 4), box, (16384, 4))})
    assert md.index.bytes_read - before <= 8 << 10 < size // 40
    assert len(md.tensors["w"].chunks._cache) <= 3  # the chunk and its sorted neighbours at most
    got = torch.full((4, 4), 7.0)
    load({"w": LocalShard(got, box, (16384, 4))}, checkpoint_id=ck, strict=False)
    assert torch.equal(got, full["w"][5000:5004])
    whole = {"w": torch.zeros(16384, 4), "b": torch.zeros(12, dtype=torch.int16)}
    load(whole, checkpoint_id=ck)
    assert all(torch.equal(whole[k], full[k]) for k in full)


@pytest.mark.parametrize("seed", range(10))
def test_any_grid_layout_loads_bitwise_reading_few_rows(tmp_path, seed, monkeypatch):
    """Random shapes, dtypes and grid layouts (split along any dimensions), random destination
    boxes: every load is bitwise, and the rows read are bounded by the bands the box meets along
    the sort dimension times the cells of the other dimensions."""
    monkeypatch.setattr(chunk_index, "_WHOLE_BELOW", 0 if seed % 2 else 1 << 30)  # both ways of reading
    if seed % 2:  # bisect every tensor (by default tensors of <= 16 chunks are scanned whole)
        monkeypatch.setattr(metadata, "_SCAN_ROWS", 0)
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]
    full, parts = {}, {}
    for i in range(3):
        nd = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 24) for _ in range(nd))
        dt = rng.choice(dtypes)
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 10 + i)) * 50
        full[f"t{i}"] = t.to(dt)
        parts[f"t{i}"] = tuple(rng.randint(1, min(n, 6)) for n in shape)
    ws = max(math.prod(p) for p in parts.values())
    ck = _checkpoint(tmp_path, full, ws, _grid(parts))
    assert verify(ck).ok
    for _ in range(4):
        key = rng.choice(sorted(full))
        t = full[key]
        offs = tuple(rng.randint(0, n - 1) for n in t.shape)
        sizes = tuple(rng.randint(1, n - o) for n, o in zip(t.shape, offs))
        md = read_metadata(ck)
        got = torch.zeros(sizes, dtype=t.dtype)
        _plan(md, {key: LocalShard(got, offs, t.shape)})
        chunks = md.tensors[key].chunks
        dim, span = md.index.tensor_sort[chunks.tid]
        step = -(-t.shape[dim] // parts[key][dim])
        bands = (offs[dim] + sizes[dim] - 1) // step - offs[dim] // step + 1
        bound = (bands + 1) * math.prod(len(range(0, n, -(-n // p)))
                                        for d, (n, p) in enumerate(zip(t.shape, parts[key])) if d != dim)
        assert len(chunks._cache) <= (bound if len(chunks) > metadata._SCAN_ROWS else len(chunks))
        load({key: LocalShard(got, offs, t.shape)}, checkpoint_id=ck, strict=False)
        want = t[tuple(slice(o, o + z) for o, z in zip(offs, sizes))]
        assert torch.equal(got, want), (seed, key, offs, sizes)
