"""Planner interfaces and the plan data they exchange.

A save or load runs the same protocol on every rank (see ``dcp/api.py``): a local plan from the
rank's own state dict, a gather of every plan on the coordinator (rank 0), which computes the
global plan once and sends each rank only its own part. Plans are frozen dataclasses with a
compact wire form (plain JSON; columnar for save plans) so gathering needs no pickle, and no rank
but the coordinator holds or processes all N plans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

import torch

from ..format.metadata import Metadata
from .load_replicas import BroadcastOp, CompactShards
from .save_dedup import SaveLayouts
from .plans import (OBJECT, TENSOR, CompactPlan, GlobalSavePlan, KeyInfo, LoadPlan, ReadItem, SavePlan,
                    WriteItem)

# the plan types are re-exported: a planner implementation needs only this module
__all__ = ["SavePlanner", "LoadPlanner", "OBJECT", "TENSOR", "WriteItem", "SavePlan", "ReadItem", "LoadPlan",
           "KeyInfo", "CompactPlan", "GlobalSavePlan", "SaveLayouts"]


class SavePlanner(ABC):
    """Decides what each rank holds (local plan) and who writes each chunk (global plan)."""

    @abstractmethod
    def configure(self, state_dict: Mapping[str, Any], *, rank: int, world_size: int,
                  allow_pickle: bool = False, verify_replicas: bool = False) -> None: ...

    @abstractmethod
    def create_local_plan(self) -> SavePlan: ...

    @abstractmethod
    def create_global_plan(self, layouts: SaveLayouts) -> GlobalSavePlan:
        """Pure and deterministic; runs on the coordinator (rank 0) over the distinct layouts of
        the ranks' shared items (``save_dedup.SaveLayouts``: each sent once, with the ranks that
        hold it) and decides who writes each; items marked ``unique`` are written by their
        holder and never reach it."""

    @abstractmethod
    def resolve_data(self, item: WriteItem) -> Any:
        """The tensor (contiguous, CPU) or encoded object to write for ``item``."""


class LoadPlanner(ABC):
    """Matches the target state dict against checkpoint metadata and decides who reads what."""

    @abstractmethod
    def configure(self, state_dict: Mapping[str, Any], metadata: Metadata, *, rank: int, world_size: int,
                  allow_cast: bool = False, sendable: frozenset[str] = frozenset()) -> None:
        """``sendable``: the device types the job's broadcasts can carry ('cpu' with gloo, 'cuda'
        with NCCL); shards on other devices are read by each holder itself."""

    @abstractmethod
    def create_local_plan(self) -> LoadPlan: ...

    @abstractmethod
    def create_global_plan(self, shards: Sequence[CompactShards], *, mode: str, nodes: Sequence[str],
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
