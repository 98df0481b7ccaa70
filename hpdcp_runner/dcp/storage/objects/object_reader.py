"""Loading our checkpoint from an object store: the save a commit object names (see
``object_checkpoint``), or a checkpoint directory uploaded as it is. The reader is the one every
storage uses (``reader.CheckpointReader``); only its files differ (``object_files.StorePrefix``:
ranged GETs fetched ahead concurrently, round by round)."""

from __future__ import annotations

from typing import Any

from ..location import ObjectLocation
from .object_store import ObjectStoreOptions
from ..reader import CheckpointReader


class ObjectStoreReader(CheckpointReader):
    """The reader of our checkpoint at ``uri``: a :class:`CheckpointReader` over the prefix's
    committed save."""

    def __init__(self, uri: str, *, options: ObjectStoreOptions | None = None, **reader_options: Any) -> None:
        super().__init__(ObjectLocation(uri, options).checkpoint_files(committed=True), **reader_options)
