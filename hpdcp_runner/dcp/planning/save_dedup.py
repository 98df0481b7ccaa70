"""Save dedup at scale: the coordinator decides only what needs deciding. Pure.

A save's global plan says which holder writes each chunk that several ranks may hold. Ranks
never send the coordinator a chunk no other rank can hold (``WriteItem.unique``: a DTensor
sharded over a mesh as large as the group; its holder writes it), and ranks whose remaining
("shared") items are identical send them once: the coordinator sees one ``CompactPlan`` per
distinct layout with the ranks that hold it (``SaveLayouts``), so its input grows with the
distinct layouts, not with ranks x tensors. At 8,192 ranks x 2,000 tensors (9 of 10 FSDP-sharded,
1 of 10 replicated) that is one layout of 200 rows instead of 16.4M rows (docs/benchmarks.md).

Duplicates are found with one lexicographic sort over the layouts' rows (``group_rows``); the
balanced choice (the holder with the fewest bytes so far, largest chunks first) keeps one heap
per distinct holder set, so a chunk held by 8,192 ranks costs a heap pop, not 8,192 comparisons.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.columns import group_rows, padded_boxes
from ..core.errors import CoverageError, ReplicaMismatchError, ShapeMismatchError, StateDictError
from ..core.geometry import tiling_problem
from .plans import TENSOR, CompactPlan, GlobalSavePlan, KeyInfo, SavePlan

POLICIES = ("balanced", "minimum_rank")


@dataclass(frozen=True, eq=False)
class SaveLayouts:
    """The coordinator's input: every distinct key table and shared layout once, with the ranks
    that have it. ``tables[table_of[r]]`` is rank r's key table; ``plans[layout_of[r]]`` its
    shared items (-1: none), each plan's ``rank`` the lowest rank holding it and its ``keys``
    that rank's table; ``unique_bytes[r]``: what rank r writes in any case (its unique chunks),
    which the balanced choice counts."""

    world_size: int
    tables: tuple[tuple[KeyInfo, ...], ...]
    table_of: torch.Tensor
    plans: tuple[CompactPlan, ...]
    layout_of: torch.Tensor
    unique_bytes: torch.Tensor

    @classmethod
    def from_plans(cls, plans: Sequence[SavePlan | CompactPlan]) -> tuple["SaveLayouts", list[torch.Tensor],
                                                                           list[torch.Tensor]]:
        """Every rank's full plan given (offline tools, tests): each plan its own layout. Also
        returns, per rank in rank order, the shared items' plan indices and the unique ones'."""
        compact = sorted((CompactPlan.from_plan(p) if isinstance(p, SavePlan) else p for p in plans),
                         key=lambda p: p.rank)
        world = (compact[-1].rank + 1) if compact else 0
        by_rank = {p.rank: p for p in compact}
        tables: list[tuple[KeyInfo, ...]] = []
        table_id: dict[int, int] = {}
        table_of = torch.full((world,), -1, dtype=torch.int64)
        layout_of = torch.full((world,), -1, dtype=torch.int64)
        unique_bytes = torch.zeros(world, dtype=torch.int64)
        shared_plans, shared_idx, unique_idx = [], [], []
        for r in range(world):
            p = by_rank.get(r)
            if p is None:
                shared_idx.append(torch.empty(0, dtype=torch.int64))
                unique_idx.append(torch.empty(0, dtype=torch.int64))
                continue
            t = table_id.get(id(p.keys))
            if t is None:
                t = table_id[id(p.keys)] = len(tables)
                tables.append(p.keys)
            table_of[r] = t
            sp, idx = p.shared()
            if idx.numel():
                layout_of[r] = len(shared_plans)
                shared_plans.append(sp)
            unique_bytes[r] = p.unique_bytes()
            shared_idx.append(idx)
            unique_idx.append(p.unique_items())
        return cls(world, tuple(tables), table_of, tuple(shared_plans), layout_of, unique_bytes), shared_idx, unique_idx


def assign_owners(plans: Sequence[SavePlan | CompactPlan], policy: str = "balanced", *,
                  verify_replicas: bool = False) -> GlobalSavePlan:
    """``assign_layouts`` over every rank's full plan (offline tools, tests): ``write_idx[r]``
    are indices into rank r's plan items, its unique ones included."""
    layouts, shared_idx, unique_idx = SaveLayouts.from_plans(plans)
    g = assign_layouts(layouts, policy, verify_replicas=verify_replicas)
    writes = tuple(torch.sort(torch.cat([s[w], u])).values for s, w, u in zip(shared_idx, g.write_idx, unique_idx))
    full = tuple(sorted((p for p in plans if isinstance(p, SavePlan)), key=lambda p: p.rank))
    return GlobalSavePlan(writes, g.keys, g.table_maps, g.table_of, g.ndim, full)


def merge_tables(tables: Sequence[tuple[KeyInfo, ...]], first_rank: Sequence[int]
                 ) -> tuple[list[KeyInfo], list[torch.Tensor]]:
    """One global key table, and per table the global id of each of its keys. Every table must
    agree on a key's kind, dtype and global shape (``first_rank[t]``: a rank of table t, for the
    error)."""
    gid: dict[str, int] = {}
    seen_rank: list[int] = []
    keys: list[KeyInfo] = []
    maps = []
    for t, table in enumerate(tables):
        ids = []
        for k in table:
            g = gid.get(k.fqn)
            if g is None:
                g = gid[k.fqn] = len(keys)
                keys.append(k)
                seen_rank.append(first_rank[t])
            else:
                _check_same(keys[g], seen_rank[g], k, first_rank[t])
                if k.unique and not keys[g].unique:
                    keys[g] = k
            ids.append(g)
        maps.append(torch.tensor(ids, dtype=torch.int64))
    return keys, maps


def _check_same(a: KeyInfo, ra: int, b: KeyInfo, rb: int) -> None:
    if a.kind != b.kind:
        raise ShapeMismatchError(f"key {a.fqn!r} is a {a.kind} on rank {ra} but a {b.kind} on rank {rb}")
    if a.kind == TENSOR and (a.dtype, a.shape) != (b.dtype, b.shape):
        raise ShapeMismatchError(
            f"key {a.fqn!r}: rank {ra} has {a.dtype} {list(a.shape)} but rank {rb} has {b.dtype} {list(b.shape)}; "
            f"every rank must agree on a key's global shape and dtype")


def _rows(p: CompactPlan, layout: int, gids: torch.Tensor, dims: torch.Tensor, d: int) -> torch.Tensor:
    """[items, 3 + 2d] int64: key id, layout, item index, offsets (padded 0), sizes (padded 1)."""
    n = p.item_key.numel()
    rows = torch.zeros((n, 3 + 2 * d), dtype=torch.int64)
    if n:
        rows[:, 0], rows[:, 1], rows[:, 2] = gids, layout, torch.arange(n)
        rows[:, 3:] = padded_boxes(p.boxes, dims[gids], d)
    return rows


def assign_layouts(layouts: SaveLayouts, policy: str = "balanced", *, verify_replicas: bool = False) -> GlobalSavePlan:
    """Dedup over distinct layouts: one writer per distinct chunk among the ranks holding it;
    balanced = the holder with the fewest bytes so far (its unique chunks counted), largest
    chunks first (ties: first seen in rank order, then item order); minimum_rank = the lowest
    holder. Then the written chunks of every key no rank holds uniquely must tile it (the rest
    are checked with the chunk index). Deterministic given the layouts."""
    if policy not in POLICIES:
        raise StateDictError(f"unknown save dedup policy {policy!r}")
    world = layouts.world_size
    table_of, layout_of = layouts.table_of, layouts.layout_of
    first_rank = [int(torch.nonzero(table_of == t).flatten()[0]) for t in range(len(layouts.tables))]
    keys, maps = merge_tables(layouts.tables, first_rank)
    dims = torch.tensor([k.ndim for k in keys] or [0], dtype=torch.int64)
    d = max(1, int(dims.max()))
    plans = layouts.plans
    holders = [torch.nonzero(layout_of == g).flatten() for g in range(len(plans))]
    gids = [maps[int(table_of[p.rank])][p.item_key] for p in plans]
    rows = torch.cat([_rows(p, g, ids, dims, d) for g, (p, ids) in enumerate(zip(plans, gids))]) if plans else \
        torch.zeros((0, 3 + 2 * d), dtype=torch.int64)
    nbytes = torch.cat([p.nbytes for p in plans]) if plans else torch.empty(0, dtype=torch.int64)
    order, _, starts = group_rows(torch.cat([rows[:, :1], rows[:, 3:]], 1))
    counts = torch.diff(starts, append=torch.tensor([len(order)]))
    if verify_replicas:
        _verify(plans, rows, order, starts, counts, keys)
    owner_rank, owner_row = _choose(rows, nbytes, order, starts, counts, holders, layout_of, layouts.unique_bytes,
                                     policy, world)
    _check_tiling(keys, rows[owner_row], d)
    write_idx = _writes(owner_rank, rows[owner_row, 2], world)
    return GlobalSavePlan(write_idx, tuple(keys), tuple(maps), table_of, d)


def _choose(rows: torch.Tensor, nbytes: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
            counts: torch.Tensor, holders: Sequence[torch.Tensor], layout_of: torch.Tensor, unique_bytes: torch.Tensor,
            policy: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk group: the owning rank, and the row (of the owner's layout) it writes."""
    ngroups = len(starts)
    if not ngroups:
        e = torch.empty(0, dtype=torch.int64)
        return e, e
    layout = rows[:, 1]
    first = order[starts]  # layouts are in rank order and sorts are stable: the lowest holder's row
    reps = torch.tensor([int(h[0]) for h in holders], dtype=torch.int64)
    nhold = torch.tensor([len(h) for h in holders], dtype=torch.int64)
    owner_rank = reps[layout[first]]
    owner_row = first.clone()
    if policy == "minimum_rank":
        return owner_rank, owner_row
    single = (counts == 1) & (nhold[layout[first]] == 1)  # one layout held by one rank: no choice
    load = unique_bytes.clone() if len(unique_bytes) == world else torch.zeros(world, dtype=torch.int64)
    load.index_add_(0, owner_rank[single], nbytes[first[single]].clamp(min=1))
    dup = torch.nonzero(~single).flatten()
    if not len(dup):
        return owner_rank, owner_row
    dup = dup[torch.argsort(first[dup], stable=True)]  # ties: first appearance (rank, then item order)
    dup = dup[torch.argsort(-nbytes[first[dup]], stable=True)]  # largest first
    load_l = load.tolist()
    lay_sorted = layout[order].tolist()
    starts_l, counts_l = starts.tolist(), counts.tolist()
    sizes = nbytes[first[dup]].clamp(min=1).tolist()
    heaps: dict[tuple, list] = {}  # one per distinct holder set (the layouts holding a chunk)
    lay_of_rank = layout_of.tolist()
    picks_rank, picks_row = [], []
    order_l = order.tolist()
    for c, size in zip(dup.tolist(), sizes):
        a, n = starts_l[c], counts_l[c]
        lays = tuple(lay_sorted[a:a + n])
        heap = heaps.get(lays)
        if heap is None:
            ranks = torch.cat([holders[g] for g in lays]) if n > 1 else holders[lays[0]]
            heap = heaps[lays] = [(load_l[r], r) for r in ranks.tolist()]
            heapq.heapify(heap)
        while True:  # lazy: an entry whose load went up elsewhere is refreshed when it surfaces
            lo, r = heap[0]
            if lo == load_l[r]:
                break
            heapq.heapreplace(heap, (load_l[r], r))
        load_l[r] += size
        heapq.heapreplace(heap, (load_l[r], r))
        picks_rank.append(r)
        g = lay_of_rank[r]  # the owner's own layout row of this chunk
        picks_row.append(order_l[a] if n == 1 else next(order_l[i] for i in range(a, a + n) if lay_sorted[i] == g))
    owner_rank[dup] = torch.tensor(picks_rank, dtype=torch.int64)
    owner_row[dup] = torch.tensor(picks_row, dtype=torch.int64)
    return owner_rank, owner_row


def _verify(plans: Sequence[CompactPlan], rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
            counts: torch.Tensor, keys: Sequence[KeyInfo]) -> None:
    """Checksums of one chunk agree across the layouts holding it (ranks of one layout sent
    equal checksums: their layouts' digests cover them)."""
    sums = [s for p in plans for s in (p.checksums or (None,) * p.item_key.numel())]
    reps = [p.rank for p in plans]
    layout = rows[:, 1].tolist()
    order_l = order.tolist()
    for g in torch.nonzero(counts > 1).flatten().tolist():
        a = int(starts[g])
        members = order_l[a:a + int(counts[g])]
        got = {reps[layout[i]]: sums[i] for i in members}
        if len(set(got.values())) > 1:
            key = keys[int(rows[members[0], 0])]
            raise ReplicaMismatchError(
                f"key {key.fqn!r} differs across the ranks that hold it: checksums {got}; replicated values "
                f"must be identical (or give per-rank keys)")


def _writes(owner_rank: torch.Tensor, item: torch.Tensor, world: int) -> tuple[torch.Tensor, ...]:
    """Per rank, the sorted shared-item indices it writes."""
    if not len(owner_rank):
        return tuple(torch.empty(0, dtype=torch.int64) for _ in range(world))
    o = torch.argsort(item, stable=True)
    o = o[torch.argsort(owner_rank[o], stable=True)]
    parts = torch.split(item[o], torch.bincount(owner_rank, minlength=world).tolist())
    return tuple(parts[:world])


def _check_tiling(keys: Sequence[KeyInfo], owned: torch.Tensor, d: int) -> None:
    """The written chunks of every tensor no rank holds uniquely cover it exactly once
    (``geometry.tiling_problem``); a key with unique chunks is checked on the chunk index."""
    checked = torch.tensor([k.kind == TENSOR and not k.unique for k in keys] or [False])
    rows = owned[checked[owned[:, 0]]] if len(owned) else owned
    rows = torch.cat([rows[:, :1], rows[:, 3:]], 1)
    shapes = [k.shape if k.kind == TENSOR and not k.unique else None for k in keys]
    found = tiling_problem(shapes, rows)
    if found is not None:
        i, problem = found
        raise CoverageError(f"key {keys[i].fqn!r}: the ranks' chunks do not tile shape {list(keys[i].shape)}: {problem}")
