"""Who reads each replicated destination shard, and how its broadcast is batched. Pure.

The coordinator (rank 0) computes it from every rank's shard summaries and sends each rank only
the batches it takes part in, in the one global order: destination shards held
by several ranks (data-parallel replicas, replicated tensors, the tp-replicated dims of a 2-D
mesh) form replica groups keyed by the shard; one member reads it from storage and broadcasts it
to the others. Readers are balanced by bytes (largest shard first), so replicas split the reading.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

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

    def to_wire(self) -> list:
        return [self.fqn, list(self.offsets), list(self.sizes), self.nbytes, self.dtype, self.device]

    @classmethod
    def from_wire(cls, w: list) -> "ShardSummary":
        return cls(w[0], tuple(w[1]), tuple(w[2]), w[3], w[4], w[5])


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


def plan_replica_reads(per_rank: Sequence[Sequence[ShardSummary]], *, mode: str, nodes: Sequence[str],
                       slow_storage: bool, policy: str = "balanced") -> list[BroadcastOp]:
    """The broadcast ops of one load, in one global order identical on every rank.

    ``mode='never'`` (or a single rank) gives none: every rank reads its own. ``'auto'``
    broadcasts a group only when it spans nodes or the storage is declared shared/slow; on one
    node the page cache beats gloo (peer_baseline.md §3b). Shards whose holders disagree on
    dtype or device are read by each holder.
    """
    if mode not in MODES:
        raise ValueError(f"broadcast mode must be one of {MODES}, got {mode!r}")
    if mode == "never" or len(per_rank) < 2:
        return []
    holders: dict[tuple, list[tuple[int, ShardSummary]]] = {}
    for rank, shards in enumerate(per_rank):
        for s in shards:
            holders.setdefault(s.key, []).append((rank, s))
    candidates = []
    for key, hs in holders.items():
        if len(hs) < 2:
            continue
        first = hs[0][1]
        if first.device == "none" or any((s.dtype, s.device, s.nbytes) != (first.dtype, first.device, first.nbytes) for _, s in hs):
            continue
        ranks = tuple(sorted(r for r, _ in hs))
        if mode == "auto" and not slow_storage and len({nodes[r] for r in ranks}) < 2:
            continue
        candidates.append((key, ranks, first))
    assigned: dict[int, int] = defaultdict(int)
    if policy == "balanced":
        candidates.sort(key=lambda c: (-c[2].nbytes, c[0]))
    else:
        candidates.sort(key=lambda c: c[0])
    ops = []
    for key, ranks, s in candidates:
        src = ranks[0] if policy == "minimum_rank" else min(ranks, key=lambda r: (assigned[r], r))
        assigned[src] += s.nbytes
        ops.append(BroadcastOp(key, ranks, src, s.nbytes, s.dtype, s.device))
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
