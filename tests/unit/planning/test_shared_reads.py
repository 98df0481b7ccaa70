"""The pure planning of shared reads: who reads each chunk that several ranks need parts of."""

from __future__ import annotations

import pytest

from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.planning.shared_reads import CompactParts, Part, SharedRead, by_rank, plan_shared_reads


def _col_parts(ranks: int, chunks: int, rows: int = 8, cols: int = 16, fqn: str = "w", dtype: str = "float32"):
    """Chunks are row blocks; rank r keeps the r-th column block of every chunk."""
    per = []
    for r in range(ranks):
        w = cols // ranks
        dest = Box((0, r * w), (rows * chunks, w))
        per.append([Part(fqn, dtype, c, dest, Box((c * rows, r * w), (rows, w))) for c in range(chunks)])
    return per


def test_each_chunk_read_once_by_a_member_and_balanced():
    ops = plan_shared_reads(_col_parts(2, 4), enabled=True, mode="always", nodes=["n"] * 2, slow_storage=False)
    assert [(o.chunk, o.union) for o in ops] == [(c, Box((c * 8, 0), (8, 16))) for c in range(4)]
    assert [o.src for o in ops] == [0, 1, 0, 1]  # the least loaded member, lowest rank on ties
    assert all(o.ranks == (0, 1) and len(o.parts) == 2 for o in ops)
    assert [o.seq for o in ops] == [0, 1, 2, 3]


def test_auto_shares_only_on_slow_storage_or_across_nodes():
    per = _col_parts(2, 2)
    kw = dict(enabled=True, mode="auto")
    assert plan_shared_reads(per, nodes=["a", "a"], slow_storage=False, **kw) == []
    assert len(plan_shared_reads(per, nodes=["a", "b"], slow_storage=False, **kw)) == 2
    assert len(plan_shared_reads(per, nodes=["a", "a"], slow_storage=True, **kw)) == 2
    assert plan_shared_reads(per, nodes=["a", "b"], slow_storage=True, enabled=True, mode="never") == []
    assert plan_shared_reads(per, nodes=["a", "b"], slow_storage=True, enabled=False, mode="always") == []


def test_parts_another_replica_reads_are_left_out():
    per = _col_parts(3, 1, cols=15)
    # rank 2's destination is read and broadcast by another holder: only ranks 0 and 1 share
    ops = plan_shared_reads(per, enabled=True, mode="always", nodes=["n"] * 3, slow_storage=False,
                            not_read=frozenset({(2, "w", (0, 10))}))
    assert len(ops) == 1 and ops[0].ranks == (0, 1)
    assert ops[0].union == Box((0, 0), (8, 10))  # the union of what the members keep, not the chunk
    assert ops[0].parts == ((0, (0, 0), (0, 0), (8, 5)), (1, (0, 5), (0, 5), (8, 5)))
    # a chunk one rank alone needs is not shared
    assert plan_shared_reads(per[:1] + [[], []], enabled=True, mode="always", nodes=["n"] * 3,
                             slow_storage=False) == []


def test_members_that_disagree_on_the_dtype_read_their_own():
    per = _col_parts(2, 1)
    per[1] = [Part(p.fqn, "bfloat16", p.chunk, p.dest, p.overlap) for p in per[1]]
    assert plan_shared_reads(per, enabled=True, mode="always", nodes=["n"] * 2, slow_storage=False) == []


def test_rounds_bound_what_a_source_holds():
    ops = plan_shared_reads(_col_parts(2, 8), enabled=True, mode="always", nodes=["n"] * 2, slow_storage=False,
                            round_bytes=2 * 8 * 16 * 4)  # two unions per source per round
    assert [o.round for o in ops if o.src == 0] == [0, 0, 1, 1]
    mine = by_rank(ops, 2)[1]
    assert [(o.round, o.seq) for o in mine] == sorted((o.round, o.seq) for o in ops)


def test_each_rank_is_told_its_own_parts_and_a_source_all():
    ops = plan_shared_reads(_col_parts(4, 2), enabled=True, mode="always", nodes=["n"] * 4, slow_storage=False)
    per = by_rank(ops, 4)
    for r in range(4):
        assert len(per[r]) == 2
        for o in per[r]:
            assert [p[0] for p in o.parts] == ([0, 1, 2, 3] if o.src == r else [r])
    assert by_rank(ops, 5)[4] == []


@pytest.mark.parametrize("nd", [0, 1, 3])
def test_wire_forms_round_trip(nd):
    box = Box(tuple(range(nd)), tuple(range(2, nd + 2)))
    parts = [Part("a.b", "bfloat16", 3, box, box), Part("c", "float32", 0, box, box)]
    compact = CompactParts.from_wire(CompactParts.from_parts(parts).to_wire())
    assert compact.parts() == parts
    assert CompactParts.from_wire(CompactParts.from_parts([]).to_wire()).parts() == []
    op = SharedRead("a.b", "bfloat16", 3, 1, box, ((0, box.offsets, box.offsets, box.sizes),
                                                  (1, box.offsets, box.offsets, box.sizes)), 2, 7)
    assert SharedRead.from_wire(op.to_wire()) == op


def test_past_the_part_cap_every_rank_reads_its_own(monkeypatch, caplog):
    import hpdcp_runner.dcp.planning.shared_reads as sr

    monkeypatch.setattr(sr, "MAX_PARTS", 7)
    per = _col_parts(2, 4)  # 8 parts
    assert plan_shared_reads(per, enabled=True, mode="always", nodes=["n"] * 2, slow_storage=False) == []
    assert "8 parts" in caplog.text
    monkeypatch.setattr(sr, "MAX_PARTS", 8)
    assert len(plan_shared_reads(per, enabled=True, mode="always", nodes=["n"] * 2, slow_storage=False)) == 4
