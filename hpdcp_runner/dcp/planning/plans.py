"""Plan types: what ranks exchange during a save or load. Frozen dataclasses with a compact
wire form (JSON, with a save plan's integer columns as raw bytes beside it), so gathering needs no
pickle and the coordinator reads N plans without a Python object per item. The planner interfaces
and the save dedup both build on these; neither imports the other."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..core.utils import byte_view
from ..core.geometry import Box
from .load_replicas import ShardSummary

TENSOR = "tensor"
OBJECT = "object"


@dataclass(frozen=True)
class WriteItem:
    """One chunk (or object) a rank holds and could write."""

    fqn: str
    kind: str
    box: Box | None
    dtype: str | None
    global_shape: tuple[int, ...] | None
    nbytes: int
    piece: int = 0
    checksum: str | None = None
    #: no other rank can hold this chunk (a DTensor sharded over a mesh as large as the group):
    #: it is written by its holder and never enters the coordinator's dedup
    unique: bool = False

    @property
    def dedup_key(self) -> tuple:
        return (self.fqn, self.box.offsets, self.box.sizes) if self.box is not None else (self.fqn,)


@dataclass(frozen=True)
class SavePlan:
    rank: int
    items: tuple[WriteItem, ...]
    paths: Mapping[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadItem:
    """Copy ``overlap`` (global coordinates) of saved chunk ``chunk`` into local piece ``dest``."""

    fqn: str
    dest: int
    dest_box: Box
    chunk: int
    overlap: Box


@dataclass(frozen=True)
class LoadPlan:
    rank: int
    items: tuple[ReadItem, ...]
    objects: tuple[str, ...]
    missing: tuple[str, ...]
    requested: frozenset[str]
    shards: tuple[ShardSummary, ...] = ()
    # (fqn, dest offsets) -> rank that reads it from storage; absent: this rank reads it itself.
    sources: Mapping[tuple, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KeyInfo:
    fqn: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    path: tuple
    #: some chunk of this key is held by one rank only (``WriteItem.unique``) on the rank whose
    #: table this is: the key's tiling is checked when the chunk index is built, not before
    unique: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape) if self.shape is not None else 0


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, eq=False)
class CompactPlan:
    """One rank's save plan in columnar form: ``item_key[i]`` indexes ``keys``; tensor items' boxes
    follow each other in ``boxes`` (offsets then sizes, ``ndim`` of the key each); ``unique``
    marks the items no other rank can hold. The key table travels as JSON once per distinct
    table (its digest says which), the columns as raw int64 bytes (``to_frame``), so the
    coordinator reads N plans without a Python object per item."""

    rank: int
    keys: tuple[KeyInfo, ...]
    item_key: torch.Tensor
    boxes: torch.Tensor
    nbytes: torch.Tensor
    checksums: tuple[str | None, ...] | None = None
    unique: torch.Tensor | None = None  # bool per item; None: none unique

    @classmethod
    def from_plan(cls, plan: SavePlan) -> "CompactPlan":
        index: dict[str, int] = {}
        keys: list[KeyInfo] = []
        uniq_keys: set[int] = set()
        item_key, boxes, nbytes, sums, uniq = [], [], [], [], []
        for it in plan.items:
            k = index.get(it.fqn)
            if k is None:
                k = index[it.fqn] = len(keys)
                keys.append(KeyInfo(it.fqn, it.kind, it.dtype, it.global_shape,
                                    tuple(plan.paths.get(it.fqn, (it.fqn,)))))
            item_key.append(k)
            if it.kind == TENSOR:
                boxes.extend(it.box.offsets)
                boxes.extend(it.box.sizes)
            nbytes.append(it.nbytes)
            sums.append(it.checksum)
            uniq.append(it.unique)
            if it.unique:
                uniq_keys.add(k)
        if uniq_keys:
            keys = [KeyInfo(k.fqn, k.kind, k.dtype, k.shape, k.path, True) if i in uniq_keys else k
                    for i, k in enumerate(keys)]
        has_sums = any(s is not None for s in sums)
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(plan.rank, tuple(keys), as_t(item_key), as_t(boxes), as_t(nbytes),
                   tuple(sums) if has_sums else None, torch.tensor(uniq, dtype=torch.bool) if uniq_keys else None)

    # -- the key table ---------------------------------------------------------------------
    def table_text(self) -> str:
        return table_text(self.keys)

    def table_digest(self) -> str:
        return _digest(self.table_text().encode())

    # -- unique and shared items: what the coordinator never sees, and what it deduplicates ------
    def unique_items(self) -> torch.Tensor:
        """Indices of the items no other rank can hold."""
        return torch.nonzero(self.unique).flatten() if self.unique is not None else torch.empty(0, dtype=torch.int64)

    def unique_bytes(self) -> int:
        """What this rank writes in any case (an empty chunk counts 1: the balanced choice's rule)."""
        return int(self.nbytes[self.unique_items()].clamp(min=1).sum())

    def ndims(self) -> torch.Tensor:
        """Each item's box rank (0 for objects)."""
        per_key = torch.tensor([k.ndim for k in self.keys] or [0], dtype=torch.int64)
        return per_key[self.item_key] if self.item_key.numel() else self.item_key

    def shared(self) -> tuple["CompactPlan", torch.Tensor]:
        """The plan restricted to its items another rank may hold (all but ``unique``), and their
        indices in this plan. Its ``keys`` are this plan's (the same table)."""
        n = self.item_key.numel()
        if self.unique is None or not bool(self.unique.any()):
            return self, torch.arange(n)
        keep = ~self.unique
        idx = torch.nonzero(keep).flatten()
        nd = self.ndims()
        per_item = torch.repeat_interleave(keep, 2 * nd)
        sums = None if self.checksums is None else tuple(self.checksums[i] for i in idx.tolist())
        return CompactPlan(self.rank, self.keys, self.item_key[idx], self.boxes[per_item], self.nbytes[idx],
                           sums), idx

    def columns_digest(self) -> str:
        """The items' structure (keys by table index, boxes, sizes, checksums): with the table
        digest, equal digests mean the same plan."""
        h = hashlib.blake2b(digest_size=16)
        cols = [self.item_key, self.boxes, self.nbytes]
        if self.unique is not None:
            cols.append(self.unique.to(torch.int64))
        for t in cols:
            t = t.contiguous()  # kept alive while its bytes are read
            h.update(str(t.numel()).encode() + b":")
            h.update(byte_view(t) if t.numel() else b"")  # (no copy: the hash reads the bytes in place)
        h.update(json.dumps(self.checksums).encode() if self.checksums is not None else b"-")
        return h.hexdigest()

    def to_frame(self) -> dict:
        """The columns for ``encode_frame`` (the key table travels apart, by digest)."""
        return {"rank": self.rank, "k": self.item_key, "b": self.boxes, "n": self.nbytes,
                "c": None if self.checksums is None else list(self.checksums)}

    @classmethod
    def from_frame(cls, w: Mapping, keys: tuple[KeyInfo, ...]) -> "CompactPlan":
        return cls(int(w["rank"]), keys, w["k"], w["b"], w["n"], None if w["c"] is None else tuple(w["c"]))


def table_text(keys: tuple[KeyInfo, ...]) -> str:
    """A key table as JSON: what one rank of each distinct table sends the coordinator."""
    return json.dumps([[k.fqn, k.kind, k.dtype, None if k.shape is None else list(k.shape), list(k.path), k.unique]
                       for k in keys], separators=(",", ":"))


def parse_table(text: str) -> tuple[KeyInfo, ...]:
    return tuple(KeyInfo(f, kind, dt, None if shape is None else tuple(shape), tuple(path), bool(u))
                 for f, kind, dt, shape, path, u in json.loads(text))


@dataclass(frozen=True)
class GlobalSavePlan:
    """Who writes what. ``write_idx[r]``: the items rank r writes beyond its ``unique`` ones, as
    indices into its shared items (``CompactPlan.shared``; for ``assign_owners`` over full plans,
    indices into its plan's items, unique ones included). ``keys``: every key of every rank's
    table; ``table_maps[t]`` maps table t's key indices to ``keys``, ``table_of[r]`` is rank r's
    table; ``ndim``: the largest tensor rank (the chunk index's D). ``plans``: the full plans when
    built from them (offline tools)."""

    write_idx: tuple[torch.Tensor, ...]
    keys: tuple[KeyInfo, ...]
    table_maps: tuple[torch.Tensor, ...]
    table_of: torch.Tensor
    ndim: int
    plans: tuple[SavePlan, ...] = ()

    @property
    def writes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.tolist()) for t in self.write_idx)
