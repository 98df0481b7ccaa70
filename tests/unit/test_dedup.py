import pytest

from hpdcp_runner.dcp.errors import CoverageError, ReplicaMismatchError, ShapeMismatchError
from hpdcp_runner.dcp.geometry import Box
from hpdcp_runner.dcp.planner import TENSOR, SavePlan, WriteItem
from hpdcp_runner.dcp.standard_planner import assign_owners


def _item(fqn, shape=(4, 4), box=None, nbytes=None, dtype="float32", checksum=None):
    box = box or Box((0,) * len(shape), shape)
    return WriteItem(fqn, TENSOR, box, dtype, shape, nbytes if nbytes is not None else box.numel * 4, 0, checksum)


def _owners(gplan):
    return {gplan.plans[r].items[i].fqn: gplan.plans[r].rank for r, idxs in enumerate(gplan.writes) for i in idxs}


def test_four_ranks_four_equal_replicated_tensors_get_four_writers():
    plans = [SavePlan(r, tuple(_item(f"t{k}") for k in range(4)), {}) for r in range(4)]
    owners = _owners(assign_owners(plans))
    assert sorted(owners.values()) == [0, 1, 2, 3]


def test_largest_first_then_fewest_bytes():
    items = (_item("big", (8, 8)), _item("s1", (2, 2)), _item("s2", (2, 2)))
    owners = _owners(assign_owners([SavePlan(0, items, {}), SavePlan(1, items, {})]))
    assert owners["big"] == 0 and owners["s1"] == 1 and owners["s2"] == 1


def test_unique_chunks_count_toward_balance():
    r0 = (_item("only0", (8, 8)), _item("rep", (2, 2)))
    r1 = (_item("rep", (2, 2)),)
    assert _owners(assign_owners([SavePlan(0, r0, {}), SavePlan(1, r1, {})]))["rep"] == 1


def test_minimum_rank_policy():
    items = tuple(_item(f"t{k}") for k in range(4))
    gplan = assign_owners([SavePlan(r, items, {}) for r in range(3)], "minimum_rank")
    assert set(_owners(gplan).values()) == {0}


def test_every_chunk_written_exactly_once():
    plans = [SavePlan(r, (_item("w", (4, 4), Box((2 * (r % 2), 0), (2, 4))),), {}) for r in range(4)]
    gplan = assign_owners(plans)
    assert sum(len(w) for w in gplan.writes) == 2


def test_shape_disagreement_names_key_and_ranks():
    plans = [SavePlan(0, (_item("w", (4, 4)),), {}), SavePlan(1, (_item("w", (4, 5)),), {})]
    with pytest.raises(ShapeMismatchError, match=r"key 'w': rank 0 has float32 \[4, 4\] but rank 1 has float32 \[4, 5\]"):
        assign_owners(plans)


def test_dtype_disagreement():
    plans = [SavePlan(0, (_item("w"),), {}), SavePlan(1, (_item("w", dtype="bfloat16"),), {})]
    with pytest.raises(ShapeMismatchError, match="bfloat16"):
        assign_owners(plans)


def test_replica_checksums_compared_when_asked():
    plans = [SavePlan(0, (_item("rng", checksum="aa"),), {}), SavePlan(1, (_item("rng", checksum="bb"),), {})]
    assign_owners(plans)  # off by default: one copy kept
    with pytest.raises(ReplicaMismatchError, match="key 'rng'"):
        assign_owners(plans, verify_replicas=True)


def test_incomplete_tiling_is_an_error():
    plans = [SavePlan(0, (_item("w", (4, 4), Box((0, 0), (2, 4))),), {})]
    with pytest.raises(CoverageError, match="key 'w'"):
        assign_owners(plans)
