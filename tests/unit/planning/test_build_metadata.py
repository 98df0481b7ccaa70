"""The coordinator's metadata build: ranks' written columns joined with the global plan without a
Python object per chunk, checked to line up with the plan (a writer that reports chunks out of
order, or misses one, is an error naming the chunk, never a silently wrong index)."""

from __future__ import annotations

import pytest
import torch

from hpdcp_runner.dcp import LocalShard, MetadataError, StandardSavePlanner
from hpdcp_runner.dcp.format.metadata import FileMeta, WriteResult, WrittenChunks, chunk_key
from hpdcp_runner.dcp.planning.interfaces import TENSOR
from hpdcp_runner.dcp.planning.save_dedup import assign_owners
from hpdcp_runner.dcp.planning.standard import build_metadata

CUTS = [0, 4, 4, 9]  # rank 1 holds no rows of w
WIDTH = 300_000  # 1.2 MB per row of w: its chunks carry block digests (5 and 6 of 1 MiB)


def _plans():
    plans = []
    for r in range(3):
        sd = {"w": LocalShard(torch.zeros(CUTS[r + 1] - CUTS[r], WIDTH), (CUTS[r], 0), (9, WIDTH)),
              "rep": torch.ones(5, dtype=torch.bfloat16), "m": {"b": torch.ones(2, 3, 4)}, "step": 3}
        p = StandardSavePlanner()
        p.configure(sd, rank=r, world_size=3)
        plans.append(p.create_local_plan())
    return plans


def _written(plans, gplan, tamper=None):
    out, expected = [], {}
    for r, (plan, idxs) in enumerate(zip(plans, gplan.writes)):
        name = f"rank{r:05d}.safetensors"
        items, chunks, objects = [], {}, {}
        for i in idxs:
            it = plan.items[i]
            if it.kind != TENSOR:
                objects[it.fqn] = (f"rank{r:05d}.objects.json", "c0ffee")
                continue
            if not it.box.numel:
                continue
            key = chunk_key(it.fqn, it.box.offsets)
            blocks = -(-it.box.numel * 4 // (1 << 20)) if it.fqn == "w" else 0
            hexes = "".join(f"{(r * 100 + i) * 7 + b:016x}" for b in range(blocks))
            chunks[key] = (name, 64 + 1000 * i, f"{r * 1000 + i:016x}", hexes)
            items.append((i, key))
            expected[(it.fqn, it.box.offsets)] = (it.box.sizes, name, 64 + 1000 * i, f"{r * 1000 + i:016x}", hexes)
        if tamper and r == tamper[0]:
            items = tamper[1](items)
        res = WriteResult(r, (FileMeta(name, 1 << 30, "x", r),) + ((FileMeta(f"rank{r:05d}.objects.json", 9, "y", r),)
                                                                    if objects else ()), chunks, objects)
        out.append(WrittenChunks.from_result(res, items))
    return out, expected


def test_the_index_holds_every_written_chunk_where_its_rank_said():
    plans = _plans()
    gplan = assign_owners(plans)
    written, expected = _written(plans, gplan)
    wire = [WrittenChunks.from_wire(w.to_wire()) for w in written]  # through the protocol's form
    md = build_metadata(gplan, wire, 3)
    got = {(k, c.offsets): (c.sizes, c.file, c.byte_offset, c.checksum, c.blocks)
           for k, t in md.tensors.items() for c in t.chunks}
    assert got == expected
    assert sorted(md.tensors) == ["m.b", "rep", "w"] and md.objects["step"].checksum == "c0ffee"
    assert [c.key for c in md.tensors["w"].chunks] == ["w@0,0", "w@4,0"]


@pytest.mark.parametrize("how", ["swapped", "missing", "extra"])
def test_chunks_reported_out_of_plan_order_are_refused(how):
    plans = _plans()
    gplan = assign_owners(plans)
    victim = next(r for r, w in enumerate(_written(plans, gplan)[0]) if len(w.items) >= 2)
    edit = {"swapped": lambda items: [items[1], items[0], *items[2:]],
            "missing": lambda items: items[1:],
            "extra": lambda items: items + [items[0]]}[how]
    written, _ = _written(plans, gplan, (victim, edit))
    with pytest.raises(MetadataError, match="do not match the plan"):
        build_metadata(gplan, written, 3)
