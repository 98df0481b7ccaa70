"""Planner interfaces and the plan data they exchange.

A save or load runs the same protocol on every rank (see ``api.py``): a local plan from the
rank's own state dict, a gather of every plan on the coordinator (rank 0), which computes the
global plan once and sends each rank only its own part. Plans are frozen dataclasses with a
compact wire form (plain JSON; columnar for save plans) so gathering needs no pickle, and no rank
but the coordinator holds or processes all N plans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from .geometry import Box
from .metadata import Metadata
from .replica_plan import BroadcastOp, ShardSummary

if TYPE_CHECKING:
    from .dedup import CompactPlan, GlobalSavePlan
    from .replica_plan import CompactShards

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


class SavePlanner(ABC):
    """Decides what each rank holds (local plan) and who writes each chunk (global plan)."""

    @abstractmethod
    def configure(self, state_dict: Mapping[str, Any], *, rank: int, world_size: int,
                  allow_pickle: bool = False, verify_replicas: bool = False) -> None: ...

    @abstractmethod
    def create_local_plan(self) -> SavePlan: ...

    @abstractmethod
    def create_global_plan(self, plans: Sequence["CompactPlan"]) -> "GlobalSavePlan":
        """Pure and deterministic; runs on the coordinator (rank 0) over every rank's plan in
        compact form (``dedup.CompactPlan``) and decides who writes what."""

    @abstractmethod
    def resolve_data(self, item: WriteItem) -> Any:
        """The tensor (contiguous, CPU) or encoded object to write for ``item``."""


class LoadPlanner(ABC):
    """Matches the target state dict against checkpoint metadata and decides who reads what."""

    @abstractmethod
    def configure(self, state_dict: Mapping[str, Any], metadata: Metadata, *, rank: int, world_size: int,
                  allow_cast: bool = False) -> None: ...

    @abstractmethod
    def create_local_plan(self) -> LoadPlan: ...

    @abstractmethod
    def create_global_plan(self, shards: Sequence["CompactShards"], *, mode: str, nodes: Sequence[str],
                           slow_storage: bool) -> list[BroadcastOp]:
        """Pure and deterministic; runs on the coordinator: who reads each replicated shard and
        broadcasts it, from every rank's shard summaries (columnar), in one global order."""

    @abstractmethod
    def destination(self, key: tuple) -> torch.Tensor:
        """The detached local view of the destination shard ``(fqn, offsets, sizes)``."""

    @abstractmethod
    def acquire_tensor(self, item: ReadItem) -> torch.Tensor:
        """A detached view of the destination region of ``item`` (loading into Parameters works)."""

    @abstractmethod
    def apply_object(self, fqn: str, value: Any) -> None:
        """Put a loaded non-tensor leaf into the target state dict."""
