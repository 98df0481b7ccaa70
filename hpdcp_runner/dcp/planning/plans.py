"""Plan types: what ranks exchange during a save or load. Frozen dataclasses with a compact
wire form (plain JSON; columnar for save plans), so gathering needs no pickle and the coordinator
decodes N plans without a Python object per item. The planner interfaces and the save dedup both
build on these; neither imports the other."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..core.columns import pack_ints, unpack_ints
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

    @property
    def ndim(self) -> int:
        return len(self.shape) if self.shape is not None else 0


@dataclass(frozen=True, eq=False)
class CompactPlan:
    """One rank's save plan in columnar form: ``item_key[i]`` indexes ``keys``; tensor items' boxes
    follow each other in ``boxes`` (offsets then sizes, ``ndim`` of the key each). The integer
    columns travel as base64 int64 arrays, so the coordinator decodes N plans without creating a
    Python object per item."""

    rank: int
    keys: tuple[KeyInfo, ...]
    item_key: torch.Tensor
    boxes: torch.Tensor
    nbytes: torch.Tensor
    checksums: tuple[str | None, ...] | None = None

    @classmethod
    def from_plan(cls, plan: SavePlan) -> "CompactPlan":
        index: dict[str, int] = {}
        keys: list[KeyInfo] = []
        item_key, boxes, nbytes, sums = [], [], [], []
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
        has_sums = any(s is not None for s in sums)
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(plan.rank, tuple(keys), as_t(item_key), as_t(boxes), as_t(nbytes),
                   tuple(sums) if has_sums else None)

    def to_wire(self) -> dict:
        table = json.dumps([[k.fqn, k.kind, k.dtype, None if k.shape is None else list(k.shape), list(k.path)]
                            for k in self.keys], separators=(",", ":"))
        return {"rank": self.rank, "keys": table, "digest": hashlib.blake2b(table.encode(), digest_size=16).hexdigest(),
                "k": pack_ints(self.item_key), "b": pack_ints(self.boxes), "n": pack_ints(self.nbytes),
                "c": None if self.checksums is None else list(self.checksums)}

    @classmethod
    def from_wire(cls, w: Mapping, tables: dict[str, tuple[KeyInfo, ...]] | None = None) -> "CompactPlan":
        """``tables`` caches parsed key tables by digest across the ranks of one gather."""
        tables = {} if tables is None else tables
        keys = tables.get(w["digest"])
        if keys is None:
            keys = tables[w["digest"]] = tuple(
                KeyInfo(f, kind, dt, None if shape is None else tuple(shape), tuple(path))
                for f, kind, dt, shape, path in json.loads(w["keys"]))
        return cls(w["rank"], keys, unpack_ints(w["k"]), unpack_ints(w["b"]), unpack_ints(w["n"]),
                   None if w["c"] is None else tuple(w["c"]))


@dataclass(frozen=True)
class GlobalSavePlan:
    """Who writes what. ``write_idx[r]`` (``writes[r]`` as ints): indices into rank r's plan items. ``owned``: one int64 row per
    written chunk or object, ``[key id, rank, offsets (ndim padded to D with 0), sizes (padded with
    1)]``, keys indexing ``keys``, in write order: by rank, then as ``write_idx`` (so row i of
    ``owned`` is item ``cat(write_idx)[i]``). ``plans`` holds the full plans when built from them
    (offline tools)."""

    write_idx: tuple[torch.Tensor, ...]
    keys: tuple[KeyInfo, ...]
    owned: torch.Tensor
    plans: tuple[SavePlan, ...] = ()

    @property
    def writes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.tolist()) for t in self.write_idx)
