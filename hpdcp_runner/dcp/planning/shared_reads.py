"""Shared reads: a stored chunk that several ranks each need a part of, read once. Pure.

When a rank's part of a chunk is not one contiguous byte range of it (a column split of a
row-sharded tensor: each rank keeps half of every row), its reader fetches the span that covers
the part: with checksums, the whole chunk (its blocks are verified whole). N ranks that each keep
a part of one chunk then fetch it N times. On slow storage (an object store, a shared file system)
or across nodes, one of them reads the union of the parts once and sends each other rank its part
over the process group: the store serves each byte once, the network carries each rank only what
it keeps. On one node over a local disk the page cache serves the repeats cheaper than a send, so
``auto`` shares only where the replica broadcasts would (``load_replicas.plan_replica_reads``).

The coordinator plans it from what each rank reports: only the parts whose read costs at least
``AMPLIFIED`` times their bytes, so a load whose layout matches the checkpoint sends nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..core.columns import pack_ints, unpack_ints
from ..core.geometry import Box
from ..core.utils import get_logger
from ..format.metadata import element_size

log = get_logger(__name__)

#: a part is worth sharing when its read fetches at least this many times its own bytes
AMPLIFIED = 1.5
#: per source rank, the union bytes read before the parts are sent (bounds the held copies)
ROUND_BYTES = 256 << 20
#: the most parts the coordinator plans (Python per part: grouping, replies and their encoding
#: took 4.0 s at 250k parts here, so ~1.6 s at this cap): a load past it (a column reshard at
#: thousands of ranks) reads as before, every rank its own, and says so
MAX_PARTS = 100_000


@dataclass(frozen=True)
class Part:
    """A rank's part of a stored chunk (one its own read would fetch ``AMPLIFIED`` times over):
    its destination piece and the overlap, in global coordinates."""

    fqn: str
    dtype: str
    chunk: int
    dest: Box
    overlap: Box


@dataclass(frozen=True, eq=False)
class CompactParts:
    """One rank's parts in columnar form: a key table (fqn, dtype, ndim) and per part the int64
    row ``[key, chunk, dest offsets, dest sizes, overlap offsets, overlap sizes]`` (each box
    padded to the widest rank of this rank's parts)."""

    keys: tuple[tuple[str, str, int], ...]
    rows: torch.Tensor  # [n, 2 + 4d]

    @classmethod
    def from_parts(cls, parts: Sequence[Part]) -> "CompactParts":
        index: dict[tuple, int] = {}
        d = max([len(p.overlap.offsets) for p in parts] or [0])
        rows = []
        for p in parts:
            nd = len(p.overlap.offsets)
            k = index.setdefault((p.fqn, p.dtype, nd), len(index))
            pad0, pad1 = (0,) * (d - nd), (1,) * (d - nd)
            rows.append([k, p.chunk, *p.dest.offsets, *pad0, *p.dest.sizes, *pad1,
                         *p.overlap.offsets, *pad0, *p.overlap.sizes, *pad1])
        t = torch.tensor(rows, dtype=torch.int64).view(-1, 2 + 4 * d)
        return cls(tuple(index), t)

    def parts(self) -> list[Part]:
        return [Part(fqn, dtype, c, Box(do, ds), Box(oo, os_)) for fqn, dtype, c, do, ds, oo, os_ in self.raw()]

    def raw(self) -> list[tuple]:
        """The parts as plain tuples ``(fqn, dtype, chunk, dest offsets, dest sizes, overlap
        offsets, overlap sizes)``: what the coordinator groups (a dataclass per part cost it
        seconds at 250k parts)."""
        d = (self.rows.shape[1] - 2) // 4 if self.rows.numel() else 0
        out = []
        for row in self.rows.tolist():
            fqn, dtype, nd = self.keys[row[0]]
            at = [2 + i * d for i in range(4)]
            out.append((fqn, dtype, row[1], *(tuple(row[a:a + nd]) for a in at)))
        return out

    def to_wire(self) -> dict:
        table = json.dumps([list(k) for k in self.keys], separators=(",", ":"))
        return {"keys": table, "w": int(self.rows.shape[1]), "r": pack_ints(self.rows.flatten())}

    @classmethod
    def from_wire(cls, w: Mapping) -> "CompactParts":
        keys = tuple(tuple(k) for k in json.loads(w["keys"]))
        return cls(keys, unpack_ints(w["r"]).view(-1, int(w["w"])))


@dataclass(frozen=True)
class SharedRead:
    """Chunk ``chunk`` of ``fqn``: ``src`` reads the box ``union`` (global coordinates) once and
    sends each member its parts; ``parts`` are (rank, destination offsets, overlap offsets,
    overlap sizes), in rank order, the source's own included (a member other than the source is
    told its own parts only). ``round``: the source's reads are done in rounds of at most
    ``ROUND_BYTES`` (one read at least), each round's parts sent before the next is read.
    ``seq``: the op's place in the global order (message tags derive from it)."""

    fqn: str
    dtype: str
    chunk: int
    src: int
    union: Box
    parts: tuple[tuple[int, tuple, tuple, tuple], ...]
    round: int
    seq: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(p[0] for p in self.parts))

    def to_wire(self) -> list:
        # (tuples are JSON arrays as they are: no copy per part)
        return [self.fqn, self.dtype, self.chunk, self.src, self.union.offsets, self.union.sizes, self.parts,
                self.round, self.seq]

    @classmethod
    def from_wire(cls, w: list) -> "SharedRead":
        fqn, dtype, chunk, src, uo, us, parts, rnd, seq = w
        return cls(fqn, dtype, chunk, src, Box(tuple(uo), tuple(us)),
                   tuple((r, tuple(do), tuple(oo), tuple(os_)) for r, do, oo, os_ in parts), rnd, seq)


def plan_shared_reads(per_rank: Sequence[CompactParts | Sequence[Part]], *, enabled: bool, mode: str,
                      nodes: Sequence[str], slow_storage: bool, not_read: frozenset = frozenset(),
                      round_bytes: int = ROUND_BYTES) -> list[SharedRead]:
    """The shared reads of one load, in one global order (the coordinator computes it once).

    ``per_rank[r]``: the amplified parts rank r reported. ``not_read``: (rank, fqn, dest
    offsets) of destination pieces another replica holder reads and broadcasts: those parts are
    not this rank's to read. A chunk is shared when at least two ranks need parts of it, and (in
    ``auto``) the storage is slow or the ranks span nodes. The source is the member that was
    assigned the fewest bytes so far (largest unions first), the lowest rank on ties.
    """
    if not enabled or mode == "never" or len(per_rank) < 2:
        return []
    total = sum(len(p.rows) if isinstance(p, CompactParts) else len(p) for p in per_rank)
    if total > MAX_PARTS:
        log.warning("shared reads: %d parts of chunks to plan (more than %d); every rank reads the chunks it "
                    "needs parts of itself", total, MAX_PARTS)
        return []
    groups: dict[tuple, list[tuple]] = {}
    for rank, parts in enumerate(per_rank):
        raw = parts.raw() if isinstance(parts, CompactParts) else \
            [(p.fqn, p.dtype, p.chunk, p.dest.offsets, p.dest.sizes, p.overlap.offsets, p.overlap.sizes)
             for p in parts]
        for fqn, dtype, chunk, do, _, oo, os_ in raw:
            if not_read and (rank, fqn, do) in not_read:
                continue
            groups.setdefault((fqn, chunk), []).append((rank, do, oo, os_, dtype))
    node_of = list(nodes)
    cands = []
    for (fqn, chunk), members in sorted(groups.items()):
        ranks = {m[0] for m in members}
        if len(ranks) < 2 or len({m[4] for m in members}) != 1 or len({len(m[2]) for m in members}) != 1:
            continue
        if mode == "auto" and not slow_storage and len({node_of[r] for r in ranks}) < 2:
            continue
        nd = len(members[0][2])
        lo = [min(m[2][i] for m in members) for i in range(nd)]
        hi = [max(m[2][i] + m[3][i] for m in members) for i in range(nd)]
        union = Box(tuple(lo), tuple(h - o for o, h in zip(lo, hi)))
        members.sort(key=lambda m: m[0])  # stable: a rank's parts stay in its own order
        cands.append((union.numel * element_size(members[0][4]), fqn, chunk, union, members, sorted(ranks)))
    cands.sort(key=lambda c: -c[0])  # stable: equal sizes stay in key order
    assigned: dict[int, int] = {}
    ops = []
    for nbytes, fqn, chunk, union, members, ranks in cands:
        src = min(ranks, key=lambda r: assigned.get(r, 0))
        rnd = assigned.get(src, 0) // round_bytes if round_bytes > 0 else 0
        assigned[src] = assigned.get(src, 0) + nbytes
        ops.append(SharedRead(fqn, members[0][4], chunk, src, union, tuple(m[:4] for m in members), rnd, len(ops)))
    return ops


def by_rank(ops: Sequence[SharedRead], world_size: int) -> list[list[SharedRead]]:
    """Each rank's ops, in the order every member runs them (by round, then by the global order);
    a member that is not the source gets its own parts only. One pass over the parts."""
    out: list[list[SharedRead]] = [[] for _ in range(world_size)]
    for o in sorted(ops, key=lambda o: (o.round, o.seq)):
        own: dict[int, list] = {}
        for p in o.parts:
            own.setdefault(p[0], []).append(p)
        for r, parts in own.items():
            out[r].append(o if r == o.src else
                          SharedRead(o.fqn, o.dtype, o.chunk, o.src, o.union, tuple(parts), o.round, o.seq))
    return out
