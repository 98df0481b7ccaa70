"""The coordinator's metadata build: the rows ranks report become the chunk index without a Python
object per chunk, and must tile every tensor (a rank that reports a chunk twice, misses one, or
names a key or file it does not have is an error naming the key or rank, never a wrong index)."""

from __future__ import annotations

import pytest
import torch

from hpdcp_runner.dcp import LocalShard, MetadataError, StandardSavePlanner
from hpdcp_runner.dcp import CoverageError
from hpdcp_runner.dcp.core.columns import decode_frame, encode_frame
from hpdcp_runner.dcp.format.metadata import FileMeta, ReportedRows, WriteResult, WrittenRows, chunk_key
from hpdcp_runner.dcp.planning.interfaces import TENSOR
from hpdcp_runner.dcp.planning.save_dedup import assign_owners
from hpdcp_runner.dcp.planning import standard
from hpdcp_runner.dcp.planning.standard import build_metadata, written_rows

CUTS = [0, 4, 4, 9]  # rank 1 holds no rows of w
WIDTH = 300_000  # 1.2 MB per row of w: its chunks carry block digests (5 and 6 of 1 MiB)


@pytest.fixture(autouse=True, params=["whole", "one rank and one tensor at a time"])
def blocks(request, monkeypatch):
    """Every test twice: as at scale (ranks renumbered in groups, the sorted rows checked in
    blocks of tensors beside the gather), with groups and blocks of one rank and one tensor."""
    if request.param != "whole":
        monkeypatch.setattr(standard, "_RENUMBER_ROWS", 1)
        monkeypatch.setattr(standard, "_CHECK_ROWS", 1)
    return request.param


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
            items.append(i)
            expected[(it.fqn, it.box.offsets)] = (it.box.sizes, name, 64 + 1000 * i, f"{r * 1000 + i:016x}", hexes)
        if tamper and r == tamper[0]:
            items = tamper[1](items)
        res = WriteResult(r, (FileMeta(name, 1 << 30, "x", r),) + ((FileMeta(f"rank{r:05d}.objects.json", 9, "y", r),)
                                                                    if objects else ()), chunks, objects)
        out.append(written_rows(plan, list(reversed(items)), res, gplan.ndim))  # any write order
    return out, expected


def _through_the_wire(written, ws):
    """What the coordinator holds after the report: envelopes gathered, rows received in place."""
    envs = [decode_frame(encode_frame(w.envelope())) for w in written]
    return ReportedRows.from_envelopes(envs, torch.cat([w.rows for w in written]),
                                       torch.cat([w.blocks for w in written]))


def test_the_index_holds_every_written_chunk_where_its_rank_said():
    plans = _plans()
    gplan = assign_owners(plans)
    written, expected = _written(plans, gplan)
    md = build_metadata(gplan, _through_the_wire(written, 3), 3)
    got = {(k, c.offsets): (c.sizes, c.file, c.byte_offset, c.checksum, c.blocks)
           for k, t in md.tensors.items() for c in t.chunks}
    assert got == expected
    assert sorted(md.tensors) == ["m.b", "rep", "w"] and md.objects["step"].checksum == "c0ffee"
    assert md.objects["step"].path == ("step",)
    assert [c.key for c in md.tensors["w"].chunks] == ["w@0,0", "w@4,0"]


@pytest.mark.parametrize("how", ["missing", "extra"])
def test_a_chunk_reported_twice_or_not_at_all_is_refused(how):
    plans = _plans()
    gplan = assign_owners(plans)
    victim = next(r for r, w in enumerate(_written(plans, gplan)[0]) if len(w.rows) >= 2)
    edit = {"missing": lambda items: items[1:], "extra": lambda items: items + [items[0]]}[how]
    written, _ = _written(plans, gplan, (victim, edit))
    with pytest.raises(CoverageError, match="do not tile"):
        build_metadata(gplan, _through_the_wire(written, 3), 3)


def test_a_row_naming_a_key_or_file_the_rank_lacks_is_refused():
    plans = _plans()
    gplan = assign_owners(plans)
    for col, value in ((0, 99), (0, -1), (1, 5), (1, -1), (4, 10**6), (4, -1), (5, -1)):
        # key id, file id, block start, block count; in the last rank that wrote a row
        written, _ = _written(plans, gplan)
        w = next(w for w in reversed(written) if len(w.rows))
        w.rows[0, col] = value
        with pytest.raises(MetadataError, match=f"rank {w.rank} reported a chunk"):
            build_metadata(gplan, _through_the_wire(written, 3), 3)
