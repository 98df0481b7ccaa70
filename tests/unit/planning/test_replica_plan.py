import random

import pytest

from hpdcp_runner.dcp.planning.load_replicas import ShardSummary, batch_ops, plan_replica_reads


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


def _reference_ops(per_rank, mode, nodes, slow_storage, policy):
    """The rule as specified, one object per shard (the vectorised plan must agree exactly)."""
    if mode == "never" or len(per_rank) < 2:
        return []
    holders = {}
    for rank, shards in enumerate(per_rank):
        for s in shards:
            if s.nbytes:  # a shard without bytes has nothing to read or send
                holders.setdefault(s.key, []).append((rank, s))
    cands = []
    for key, hs in holders.items():
        first = hs[0][1]
        if len(hs) < 2 or first.device == "none" or any(
                (s.dtype, s.device, s.nbytes) != (first.dtype, first.device, first.nbytes) for _, s in hs):
            continue
        ranks = tuple(sorted(r for r, _ in hs))
        if mode == "auto" and not slow_storage and len({nodes[r] for r in ranks}) < 2:
            continue
        cands.append((key, ranks, first))
    cands.sort(key=(lambda c: (-c[2].nbytes, c[0])) if policy == "balanced" else (lambda c: c[0]))
    load, ops = {}, []
    for key, ranks, s in cands:
        src = ranks[0] if policy == "minimum_rank" else min(ranks, key=lambda r: (load.get(r, 0), r))
        load[src] = load.get(src, 0) + s.nbytes
        ops.append((key, ranks, src, s.nbytes, s.dtype, s.device))
    return ops


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_replica_plan_matches_reference(seed):
    import random

    rnd = random.Random(seed)
    ws = rnd.choice([2, 3, 4, 6])
    nodes = [f"n{r % rnd.choice([1, 2])}" for r in range(ws)]
    per_rank = [[] for _ in range(ws)]
    for k in range(rnd.randint(1, 12)):
        ndim = rnd.choice([0, 1, 2])
        size = 0 if ndim and rnd.random() < 0.2 else 4  # some keys have empty shards (more ranks than rows)
        for r in range(ws):
            if rnd.random() < 0.3:
                continue  # this rank does not hold this key
            offs = tuple(rnd.choice([0, 4]) for _ in range(ndim))
            sizes = tuple(size for _ in range(ndim))
            dtype = "float32" if rnd.random() < 0.9 else "bfloat16"
            device = rnd.choice(["cpu"] * 8 + ["cuda", "none"])
            nb = 4 * size ** ndim if rnd.random() < 0.95 or not size else 7
            per_rank[r].append(ShardSummary(f"w{k % 7}.{k}", offs, sizes, nb, dtype, device))
    for mode in ("always", "auto"):
        for slow in (False, True):
            for policy in ("balanced", "minimum_rank"):
                got = plan_replica_reads(per_rank, mode=mode, nodes=nodes, slow_storage=slow, policy=policy)
                assert [(o.key, o.ranks, o.src, o.nbytes, o.dtype, o.device) for o in got] == \
                    _reference_ops(per_rank, mode, nodes, slow, policy), (mode, slow, policy)
