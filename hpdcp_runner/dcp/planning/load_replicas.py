"""Who reads each replicated destination shard, and how its broadcast is batched. Pure.

The coordinator (rank 0) computes it from every rank's shard summaries and sends each rank only
the batches it takes part in, in the one global order: destination shards held
by several ranks (data-parallel replicas, replicated tensors, the tp-replicated dims of a 2-D
mesh) form replica groups keyed by the shard; one member reads it from storage and broadcasts it
to the others. Readers are balanced by bytes (largest shard first), so replicas split the reading.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.errors import ConfigError
from ..core.columns import group_rows, pack_ints, padded_boxes, singletons, unpack_ints

MODES = ("always", "never", "auto")


@dataclass(frozen=True)
class ShardSummary:
    """One destination shard of one rank, as gathered: what it needs and whether it can be sent."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    dtype: str
    device: str  # "cpu" or "cuda"; holders must agree for a broadcast

    @property
    def key(self) -> tuple:
        return (self.fqn, self.offsets, self.sizes)


@dataclass(frozen=True)
class BroadcastOp:
    """Shard ``key`` read by ``src`` and broadcast to every rank in ``ranks`` (src included)."""

    key: tuple
    ranks: tuple[int, ...]
    src: int
    nbytes: int
    dtype: str
    device: str


@dataclass(frozen=True)
class Batch:
    """Ops broadcast together: one packed flat buffer (``packed``) or one op straight from its
    destination buffer."""

    ranks: tuple[int, ...]
    src: int
    dtype: str
    device: str
    ops: tuple[BroadcastOp, ...]
    packed: bool

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.ops)

    def to_wire(self) -> list:
        return [list(self.ranks), self.src, self.dtype, self.device, self.packed,
                [[o.key[0], list(o.key[1]), list(o.key[2]), o.nbytes] for o in self.ops]]

    @classmethod
    def from_wire(cls, w: list) -> "Batch":
        ranks, src, dtype, device, packed, ops = w
        ranks = tuple(ranks)
        return cls(ranks, src, dtype, device,
                   tuple(BroadcastOp((f, tuple(o), tuple(s)), ranks, src, n, dtype, device) for f, o, s, n in ops), packed)


@dataclass(frozen=True, eq=False)
class CompactShards:
    """One rank's shard summaries in columnar form, as the coordinator gathers them: a table of
    (fqn, dtype, device, ndim) sent once with its digest, and per shard a table index, the box and
    the byte count as int64 arrays (``columns.pack_ints``)."""

    keys: tuple[tuple[str, str, str, int], ...]
    key_idx: torch.Tensor
    boxes: torch.Tensor
    nbytes: torch.Tensor

    @classmethod
    def from_summaries(cls, shards: Sequence[ShardSummary]) -> "CompactShards":
        index: dict[tuple, int] = {}
        idx, boxes, nbytes = [], [], []
        for s in shards:
            k = (s.fqn, s.dtype, s.device, len(s.offsets))
            idx.append(index.setdefault(k, len(index)))
            boxes.extend(s.offsets)
            boxes.extend(s.sizes)
            nbytes.append(s.nbytes)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(tuple(index), t(idx), t(boxes), t(nbytes))

    def to_wire(self) -> dict:
        table = json.dumps([list(k) for k in self.keys], separators=(",", ":"))
        return {"keys": table, "digest": hashlib.blake2b(table.encode(), digest_size=16).hexdigest(),
                "k": pack_ints(self.key_idx), "b": pack_ints(self.boxes), "n": pack_ints(self.nbytes)}

    @classmethod
    def from_wire(cls, w: dict, tables: dict | None = None) -> "CompactShards":
        tables = {} if tables is None else tables
        keys = tables.get(w["digest"])
        if keys is None:
            keys = tables[w["digest"]] = tuple(tuple(k) for k in json.loads(w["keys"]))
        return cls(keys, unpack_ints(w["k"]), unpack_ints(w["b"]), unpack_ints(w["n"]))


def plan_replica_reads(per_rank: Sequence[Sequence[ShardSummary] | CompactShards], *, mode: str, nodes: Sequence[str],
                       slow_storage: bool, policy: str = "balanced") -> list[BroadcastOp]:
    """The broadcast ops of one load, in one global order (the coordinator computes it once).

    ``mode='never'`` (or a single rank) gives none: every rank reads its own. ``'auto'``
    broadcasts a group only when it spans nodes or the storage is declared shared/slow; on one
    node the page cache beats gloo (peer_baseline.md §3b). Shards whose holders disagree on
    dtype, device or size are read by each holder. Order: largest first, then by key (balanced),
    or by key (minimum_rank). Vectorised over all ranks' shards (Python only for the replicated
    ones): 8,192 ranks x 2,000 shards took 49 s one object per shard.
    """
    if mode not in MODES:
        raise ConfigError(f"broadcast mode must be one of {MODES}, got {mode!r}")
    if mode == "never" or len(per_rank) < 2:
        return []
    shards = [p if isinstance(p, CompactShards) else CompactShards.from_summaries(p) for p in per_rank]
    rows, attrs, fqns, dtypes = _shard_rows(shards)
    # only shards with bytes that another rank also holds can form a group worth broadcasting
    keep = (attrs[:, 2] > 0) & ~singletons(rows[:, 1:])
    rows, attrs = rows[keep], attrs[keep]
    if not len(rows):
        return []
    order, _, starts = group_rows(rows[:, 1:])
    counts = torch.diff(starts, append=torch.tensor([len(order)]))
    first = order[starts]
    # same dtype, device and size on every holder, and a device some backend carries
    same = (attrs[order] == attrs[first].repeat_interleave(counts, 0)).all(1)
    ok = torch.zeros(len(starts), dtype=torch.int64).index_add_(
        0, torch.arange(len(starts)).repeat_interleave(counts), (~same).to(torch.int64)) == 0
    ok &= (counts > 1) & (attrs[first, 1] != _DEVICES.index("none"))
    if mode == "auto" and not slow_storage:
        node_ids = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
        node = torch.tensor([node_ids[n] for n in nodes], dtype=torch.int64)[rows[order, 0]]
        grp = torch.arange(len(starts)).repeat_interleave(counts)
        lo = torch.full((len(starts),), len(node_ids), dtype=torch.int64).scatter_reduce(0, grp, node, "amin")
        hi = torch.full((len(starts),), -1, dtype=torch.int64).scatter_reduce(0, grp, node, "amax")
        ok &= lo != hi
    cand = torch.nonzero(ok).flatten()  # groups are in key order already
    nbytes = attrs[first, 2]
    if policy == "balanced":  # largest first; equal sizes stay in key order
        cand = cand[torch.argsort(-nbytes[cand], stable=True)]
    return _assign_sources(cand, order, starts, counts, rows, attrs, fqns, dtypes, policy)


_DEVICES = ("cpu", "cuda", "none")


def _shard_rows(shards: Sequence[CompactShards]) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """All shards, rank-major, as int64 rows ``[rank, fqn order, offsets (padded 0), sizes (padded
    1)]`` (fqns numbered in sorted order, so sorted rows are in key order) and attributes
    ``[dtype id, device id, nbytes, ndim]``; plus the fqn and dtype names. Each distinct key
    table (ranks of one layout share one, see ``CompactShards.from_wire``) is turned into numbers
    once; everything per shard is one tensor operation over all ranks."""
    distinct: dict[int, tuple[int, tuple]] = {}  # id(keys) -> (table number, keys)
    for s in shards:
        distinct.setdefault(id(s.keys), (len(distinct), s.keys))
    all_keys = [keys for _, keys in distinct.values()]
    fqns = sorted({k[0] for keys in all_keys for k in keys})
    fid = {f: i for i, f in enumerate(fqns)}
    dtypes = sorted({k[1] for keys in all_keys for k in keys})
    did = {t: i for i, t in enumerate(dtypes)}
    d = max([k[3] for keys in all_keys for k in keys] or [1]) or 1
    tables = [torch.tensor([[fid[k[0]], did[k[1]], _DEVICES.index(k[2] if k[2] in _DEVICES else "none"), k[3]]
                            for k in keys], dtype=torch.int64).view(-1, 4) for keys in all_keys]
    base = torch.tensor([0] + [len(keys) for keys in all_keys], dtype=torch.int64).cumsum(0)
    counts = torch.tensor([s.key_idx.numel() for s in shards], dtype=torch.int64)
    n = int(counts.sum())
    if not n:
        return torch.zeros((0, 2 + 2 * d), dtype=torch.int64), torch.zeros((0, 4), dtype=torch.int64), fqns, dtypes
    table_of = torch.tensor([distinct[id(s.keys)][0] for s in shards], dtype=torch.int64)
    idx = torch.cat([s.key_idx for s in shards]) + base[table_of].repeat_interleave(counts)
    per = torch.cat(tables)[idx]
    nd = per[:, 3]
    rows = torch.empty((n, 2 + 2 * d), dtype=torch.int64)
    rows[:, 0] = torch.arange(len(shards), dtype=torch.int64).repeat_interleave(counts)
    rows[:, 1] = per[:, 0]
    rows[:, 2:] = padded_boxes(torch.cat([s.boxes for s in shards]), nd, d)
    attrs = torch.stack([per[:, 1], per[:, 2], torch.cat([s.nbytes for s in shards]), nd], 1)
    return rows, attrs, fqns, dtypes


def _assign_sources(cand: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                    rows: torch.Tensor, attrs: torch.Tensor, fqns: Sequence[str], dtypes: Sequence[str],
                    policy: str) -> list[BroadcastOp]:
    """One op per candidate group (in ``cand`` order); only candidate rows become Python ints.
    Holders come out of ``group_rows`` in rank order (rows are rank-major, the sort is stable);
    the balanced choice (least bytes assigned so far, then lowest rank) is one ``argmin`` over a
    group's holders, not a Python loop."""
    d = (rows.shape[1] - 2) // 2
    is_cand = torch.zeros(len(starts), dtype=torch.bool)
    is_cand[cand] = True
    holders = rows[order[is_cand.repeat_interleave(counts)], 0]
    holder_rank = holders.tolist()
    ccounts = torch.where(is_cand, counts, 0)
    cstart = (torch.cumsum(ccounts, 0) - ccounts)[cand].tolist()
    first = order[starts[cand]]
    heads, head_attrs = rows[first].tolist(), attrs[first].tolist()
    ops = []
    assigned = torch.zeros(int(rows[:, 0].max()) + 1, dtype=torch.int64)
    for a, n, head, (dt_id, dev_id, nbytes, nd) in zip(cstart, counts[cand].tolist(), heads, head_attrs):
        ranks = tuple(holder_rank[a:a + n])
        key = (fqns[head[1]], tuple(head[2:2 + nd]), tuple(head[2 + d:2 + d + nd]))
        if policy == "minimum_rank":
            src = ranks[0]
        else:
            group = holders[a:a + n]
            src = int(group[torch.argmin(assigned[group])])  # the first minimum: the lowest rank
        assigned[src] += nbytes
        ops.append(BroadcastOp(key, ranks, src, nbytes, dtypes[dt_id], _DEVICES[dev_id]))
    return ops


def batch_ops(ops: Sequence[BroadcastOp], batch_bytes: int) -> list[Batch]:
    """Pack ops smaller than ``batch_bytes`` per (group, source, dtype, device) into batches that
    never exceed ``batch_bytes``; larger ops (or all, when ``batch_bytes`` is 0) go alone.
    Batches keep the global order of their first op."""
    out: list[tuple[int, Batch]] = []
    open_batches: dict[tuple, tuple[int, list[BroadcastOp], int]] = {}

    def close(k: tuple) -> None:
        pos, members, _ = open_batches.pop(k)
        out.append((pos, Batch(k[0], k[1], k[2], k[3], tuple(members), True)))

    for pos, op in enumerate(ops):
        k = (op.ranks, op.src, op.dtype, op.device)
        if batch_bytes <= 0 or op.nbytes >= batch_bytes:
            out.append((pos, Batch(*k, (op,), False)))
            continue
        if k in open_batches and open_batches[k][2] + op.nbytes > batch_bytes:
            close(k)
        if k not in open_batches:
            open_batches[k] = (pos, [], 0)
        p, members, size = open_batches[k]
        members.append(op)
        open_batches[k] = (p, members, size + op.nbytes)
    for k in list(open_batches):
        close(k)
    out.sort(key=lambda pb: pb[0])
    return [b for _, b in out]
