import dataclasses
import random

import pytest
import torch

from hpdcp_runner.dcp.core.errors import CoverageError, ReplicaMismatchError, ShapeMismatchError
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.planning.interfaces import OBJECT, TENSOR, SavePlan, WriteItem
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


def test_compact_frame_round_trip_with_the_table_apart():
    from hpdcp_runner.dcp.core.columns import decode_frame, encode_frame
    from hpdcp_runner.dcp.planning.plans import CompactPlan, parse_table

    def items(r):
        return (_item("a", (4, 4), Box((min(r, 1) * 2, 0), (2, 4)), checksum="x"), _item("b", (3,)))

    plans = [CompactPlan.from_plan(SavePlan(r, items(r), {"a": ("m", "a"), "b": ("b",)})) for r in range(3)]
    assert len({p.table_digest() for p in plans}) == 1  # one table: sent once by its lowest rank
    keys = parse_table(plans[0].table_text())
    back = [CompactPlan.from_frame(decode_frame(encode_frame(p.to_frame())), keys) for p in plans]
    for a, b in zip(back, plans):
        assert (a.rank, a.keys, a.checksums) == (b.rank, b.keys, b.checksums)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("item_key", "boxes", "nbytes"))
    assert plans[1].columns_digest() == plans[2].columns_digest() != plans[0].columns_digest()
    gplan = assign_owners(back)
    assert [(k.fqn, k.path) for k in gplan.keys] == [("a", ("m", "a")), ("b", ("b",))]


def _layouts_of(plans):
    """The coordinator's view of full plans: ranks with identical shared items form one layout,
    sent once (what the save protocol gathers)."""
    from hpdcp_runner.dcp.planning.plans import CompactPlan
    from hpdcp_runner.dcp.planning.save_dedup import SaveLayouts

    compact = [CompactPlan.from_plan(p) for p in plans]
    tables, table_of, layout, layout_of, ubytes, shared_idx, unique_idx = {}, [], {}, [], [], [], []
    for c in compact:
        t = tables.setdefault(c.table_digest(), (len(tables), c.keys))
        table_of.append(t[0])
        sp, idx = c.shared()
        shared_idx.append(idx)
        unique_idx.append(c.unique_items())
        ubytes.append(c.unique_bytes())
        if idx.numel():
            g = layout.setdefault((c.table_digest(), sp.columns_digest()), (len(layout), sp))
            layout_of.append(g[0])
        else:
            layout_of.append(-1)
    lay = SaveLayouts(len(plans), tuple(k for _, k in sorted(tables.values(), key=lambda v: v[0])),
                      torch.tensor(table_of), tuple(p for _, p in sorted(layout.values(), key=lambda v: v[0])),
                      torch.tensor(layout_of), torch.tensor(ubytes))
    return lay, shared_idx, unique_idx


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("policy", ["balanced", "minimum_rank"])
def test_layouts_sent_once_give_the_owners_of_every_plan(seed, policy):
    """Ranks with equal shared items send them once, and ranks' unique chunks never reach the
    dedup: the owners are exactly those of the dedup over every rank's full plan."""
    from hpdcp_runner.dcp.planning.save_dedup import assign_layouts

    rnd = random.Random(seed)
    ws = rnd.choice([2, 3, 4, 6, 8])
    dp = rnd.choice([d for d in (1, 2, 3) if ws % d == 0])
    tp = ws // dp
    plans = []
    perm = list(range(5))
    rnd.shuffle(perm)  # any order of the state dict, the same on every rank
    extra = rnd.random() < 0.5
    for r in range(ws):
        items = [_item("norm", (6,)), WriteItem("step", OBJECT, None, None, None, 12, 0)]
        # FSDP over the whole group: unique, written by its holder
        start, size = r * 2, 2
        items.append(dataclasses.replace(_item("fsdp", (2 * ws, 3), Box((start, 0), (size, 3))), unique=True))
        # TP inside each data-parallel replica: the same box on dp ranks
        t = r % tp
        items.append(_item("tp", (tp * 4, 5), Box((4 * t, 0), (4, 5))))
        if extra:
            items.append(_item("extra", (tp, 7), Box((t, 0), (1, 7))))
        items = [items[i] for i in perm if i < len(items)]
        plans.append(SavePlan(r, tuple(items), {}))
    lay, shared_idx, unique_idx = _layouts_of(plans)
    assert len(lay.plans) == tp  # one layout per TP position, not one per rank
    g = assign_layouts(lay, policy)
    got = sorted((r, int(i)) for r in range(ws)
                 for i in torch.cat([shared_idx[r][g.write_idx[r]], unique_idx[r]]).tolist())
    assert got == _reference_owners(plans, policy)
    assert got == sorted((r, i) for r, idxs in enumerate(assign_owners(plans, policy).writes) for i in idxs)


def test_a_chunk_held_by_thousands_of_ranks_is_one_heap_pop():
    """8,192 ranks in one layout (replicated norms) and their unique shards: the balanced choice
    spreads the replicated chunks over the ranks with the fewest bytes, lowest rank first."""
    from hpdcp_runner.dcp.planning.plans import CompactPlan
    from hpdcp_runner.dcp.planning.save_dedup import SaveLayouts, assign_layouts

    n = 8192
    norms = SavePlan(0, tuple(_item(f"n{i}", (64,)) for i in range(300)), {})
    cp = CompactPlan.from_plan(norms)
    ubytes = torch.full((n,), 1000, dtype=torch.int64)
    ubytes[5:10] = 0  # five ranks write nothing of their own
    lay = SaveLayouts(n, (cp.keys,), torch.zeros(n, dtype=torch.int64), (cp,), torch.zeros(n, dtype=torch.int64), ubytes)
    g = assign_layouts(lay)
    # 256-byte chunks: the idle ranks take four each (to 1,024 bytes), then one per rank in rank order
    assert [g.write_idx[r].tolist() for r in (5, 9)] == [[0, 5, 10, 15], [4, 9, 14, 19]]
    assert [g.write_idx[r].tolist() for r in (0, 4, 10, 284, 285)] == [[20], [24], [25], [299], []]
