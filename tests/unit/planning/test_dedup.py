import pytest
import torch

from hpdcp_runner.dcp.core.errors import CoverageError, ReplicaMismatchError, ShapeMismatchError
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.planning.interfaces import TENSOR, SavePlan, WriteItem
from hpdcp_runner.dcp.planning.standard import assign_owners


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


# -- the vectorised coordinator pass against a direct reference ---------------------------------

def _reference_owners(plans, policy="balanced"):
    """The rule as specified, one Python object per item: (rank, item index) written per chunk."""
    buckets = {}
    for p in plans:
        for i, it in enumerate(p.items):
            buckets.setdefault(it.dedup_key, []).append((p.rank, i))
    by_rank = {p.rank: p for p in plans}
    load = {p.rank: 0 for p in plans}
    owner = {}
    dups = []
    for key, hs in buckets.items():
        if len(hs) == 1:
            owner[key] = hs[0]
            load[hs[0][0]] += max(by_rank[hs[0][0]].items[hs[0][1]].nbytes, 1)
        else:
            dups.append((key, hs))
    if policy == "balanced":
        dups.sort(key=lambda kh: -by_rank[kh[1][0][0]].items[kh[1][0][1]].nbytes)
    for key, hs in dups:
        choice = min(hs) if policy == "minimum_rank" else min(hs, key=lambda h: (load[h[0]], h[0]))
        owner[key] = choice
        load[choice[0]] += max(by_rank[choice[0]].items[choice[1]].nbytes, 1)
    return sorted(owner.values())


def _grid_items(fqn, shape, grid, coord, replicas_of=None):
    """The box of ``coord`` in an even split of ``shape`` by ``grid`` (ragged last pieces)."""
    offs, sizes = [], []
    for n, g, c in zip(shape, grid, coord):
        step = -(-n // g)
        lo, hi = min(c * step, n), min((c + 1) * step, n)
        offs.append(lo)
        sizes.append(hi - lo)
    return _item(fqn, shape, Box(tuple(offs), tuple(sizes)))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["balanced", "minimum_rank"])
def test_vectorised_dedup_matches_reference(seed, policy):
    import random

    from hpdcp_runner.dcp.planning.interfaces import OBJECT

    rnd = random.Random(seed)
    ws = rnd.choice([1, 2, 3, 4, 6, 8])
    specs = []
    for k in range(rnd.randint(1, 9)):
        ndim = rnd.choice([0, 1, 2, 3])
        shape = tuple(rnd.randint(1, 9) for _ in range(ndim))
        kind = rnd.choice(["replicated", "split", "grid", "object"]) if ndim else rnd.choice(["replicated", "object"])
        specs.append((f"k{k}", shape, kind, rnd.randrange(max(ndim, 1))))
    plans = []
    for r in range(ws):
        items = []
        for fqn, shape, kind, dim in specs:
            if kind == "object":
                items.append(WriteItem(fqn, OBJECT, None, None, None, 10 + len(fqn), 0))
            elif kind == "replicated":
                items.append(_item(fqn, shape))
            elif kind == "split":  # split over all ranks along ``dim``
                grid = tuple(ws if d == dim else 1 for d in range(len(shape)))
                items.append(_grid_items(fqn, shape, grid, tuple(r if d == dim else 0 for d in range(len(shape)))))
            else:  # 2 x (ws/2) mesh: dim split over the second mesh dim, replicated over the first
                half = max(ws // 2, 1)
                grid = tuple(half if d == dim else 1 for d in range(len(shape)))
                items.append(_grid_items(fqn, shape, grid, tuple(r % half if d == dim else 0 for d in range(len(shape)))))
        rnd.shuffle(items)
        plans.append(SavePlan(r, tuple(items), {}))
    got = assign_owners(plans, policy)
    assert sorted((r, i) for r, idxs in enumerate(got.writes) for i in idxs) == _reference_owners(plans, policy)


def test_two_dimensional_grid_tiles_and_overlap_is_found():
    shape = (4, 6)
    cells = [(i, j) for i in range(2) for j in range(3)]
    plans = [SavePlan(r, (_grid_items("w", shape, (2, 3), c),), {}) for r, c in enumerate(cells)]
    assert sum(len(w) for w in assign_owners(plans).writes) == 6
    # shift one cell by a column: it overlaps its neighbour and leaves a hole
    bad = list(plans)
    bad[0] = SavePlan(0, (_item("w", shape, Box((0, 1), (2, 2))),), {})
    with pytest.raises(CoverageError, match="overlap"):
        assign_owners(bad)


def test_one_dimensional_overlap_gap_and_out_of_bounds():
    shape = (8, 3)

    def rows(*spans):
        return [SavePlan(r, (_item("w", shape, Box((a, 0), (b - a, 3))),), {}) for r, (a, b) in enumerate(spans)]

    assert sum(len(w) for w in assign_owners(rows((0, 3), (3, 8))).writes) == 2
    assert sum(len(w) for w in assign_owners(rows((0, 0), (0, 8))).writes) == 2  # an empty chunk is fine
    with pytest.raises(CoverageError, match="overlap"):
        assign_owners(rows((0, 4), (3, 7), (7, 8)))
    with pytest.raises(CoverageError, match="overlap"):  # volumes add up; only adjacency tells
        assign_owners(rows((0, 4), (3, 7)))
    with pytest.raises(CoverageError, match="cover"):
        assign_owners(rows((0, 3), (4, 8)))
    with pytest.raises(CoverageError, match="outside"):
        assign_owners(rows((0, 4), (4, 9)))
    # the vectorised path's "one split dimension" must not accept chunks split along different dims
    mixed = [SavePlan(0, (_item("w", (4, 4), Box((0, 0), (2, 4))),), {}),
             SavePlan(1, (_item("w", (4, 4), Box((0, 0), (4, 2))),), {})]
    with pytest.raises(CoverageError):
        assign_owners(mixed)


def test_compact_wire_round_trip_parses_identical_key_tables_once():
    from hpdcp_runner.dcp.planning.save_dedup import CompactPlan

    def items(r):
        return (_item("a", (4, 4), Box((min(r, 1) * 2, 0), (2, 4)), checksum="x"), _item("b", (3,)))

    plans = [CompactPlan.from_plan(SavePlan(r, items(r), {"a": ("m", "a"), "b": ("b",)})) for r in range(3)]
    tables: dict = {}
    back = [CompactPlan.from_wire(p.to_wire(), tables) for p in plans]
    for a, b in zip(back, plans):
        assert (a.rank, a.keys, a.checksums) == (b.rank, b.keys, b.checksums)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("item_key", "boxes", "nbytes"))
    assert len(tables) == 1 and back[1].keys is back[2].keys
    gplan = assign_owners(back)
    assert [(k.fqn, k.path) for k in gplan.keys] == [("a", ("m", "a")), ("b", ("b",))]
