import random

import pytest

from hpdcp_runner.dcp.replica_plan import ShardSummary, batch_ops, plan_replica_reads


def _s(fqn, nbytes, offsets=(0,), dtype="float32", device="cpu"):
    return ShardSummary(fqn, offsets, (nbytes // 4,), nbytes, dtype, device)


ONE_NODE = ["h#0"] * 4


def test_four_ranks_four_equal_tensors_four_distinct_readers():
    per_rank = [[_s(f"t{k}", 400) for k in range(4)] for _ in range(4)]
    ops = plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE, slow_storage=False)
    assert sorted(op.src for op in ops) == [0, 1, 2, 3]
    assert all(op.ranks == (0, 1, 2, 3) for op in ops)


def test_big_first_then_the_small_ones_land_together_on_the_other_rank():
    per_rank = [[_s("big", 1000), _s("a", 100), _s("b", 100)] for _ in range(2)]
    ops = {op.key[0]: op.src for op in plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:2],
                                                          slow_storage=False)}
    assert ops == {"big": 0, "a": 1, "b": 1}


def test_decisions_do_not_depend_on_gather_order_of_items():
    base = [_s(f"t{k}", 4 * (k % 3 + 1), offsets=(k,)) for k in range(12)]
    results = set()
    for seed in range(5):
        per_rank = []
        for _ in range(3):
            items = base[:]
            random.Random(seed).shuffle(items)
            per_rank.append(items)
        ops = plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:3], slow_storage=False)
        results.add(tuple(ops))
    assert len(results) == 1


def test_interleaved_groups_are_independent():
    per_rank = [[_s("w", 64, offsets=(0,))], [_s("w", 64, offsets=(16,))],
                [_s("w", 64, offsets=(0,))], [_s("w", 64, offsets=(16,))]]
    ops = plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE, slow_storage=False)
    assert sorted(op.ranks for op in ops) == [(0, 2), (1, 3)]


def test_modes_and_minimum_rank():
    per_rank = [[_s("w", 64)] for _ in range(4)]
    assert plan_replica_reads(per_rank, mode="never", nodes=ONE_NODE, slow_storage=True) == []
    assert plan_replica_reads(per_rank, mode="auto", nodes=ONE_NODE, slow_storage=False) == []
    assert len(plan_replica_reads(per_rank, mode="auto", nodes=ONE_NODE, slow_storage=True)) == 1
    two_nodes = ["h#0", "h#0", "h#1", "h#1"]
    assert len(plan_replica_reads(per_rank, mode="auto", nodes=two_nodes, slow_storage=False)) == 1
    per_rank = [[_s(f"t{k}", 64) for k in range(3)] for _ in range(3)]
    ops = plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:3], slow_storage=False, policy="minimum_rank")
    assert {op.src for op in ops} == {0}
    with pytest.raises(ValueError, match="mode"):
        plan_replica_reads(per_rank, mode="sometimes", nodes=ONE_NODE[:3], slow_storage=False)


def test_holders_that_disagree_or_cannot_send_read_themselves():
    per_rank = [[_s("w", 64)], [_s("w", 64, dtype="bfloat16")]]
    assert plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:2], slow_storage=False) == []
    per_rank = [[_s("w", 64, device="none")], [_s("w", 64, device="none")]]
    assert plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:2], slow_storage=False) == []


@pytest.mark.parametrize("batch_bytes", [0, 1, 100, 1024, 10**9])
def test_batches_never_exceed_batch_bytes_and_keep_every_op_once(batch_bytes):
    per_rank = [[_s(f"t{k}", 4 * (k * 37 % 50 + 1), offsets=(k,)) for k in range(60)] for _ in range(2)]
    ops = plan_replica_reads(per_rank, mode="always", nodes=ONE_NODE[:2], slow_storage=False)
    batches = batch_ops(ops, batch_bytes)
    assert sorted(op.key for b in batches for op in b.ops) == sorted(op.key for op in ops)
    for b in batches:
        assert len({(op.ranks, op.src, op.dtype) for op in b.ops}) == 1
        if b.packed:
            assert b.nbytes <= batch_bytes and batch_bytes > 0
        else:
            assert len(b.ops) == 1 and (batch_bytes == 0 or b.ops[0].nbytes >= batch_bytes)
    if batch_bytes == 0:
        assert not any(b.packed for b in batches)
    if batch_bytes == 10**9:
        assert len(batches) == 2  # one packed batch per source
