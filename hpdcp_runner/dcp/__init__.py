"""hpdcp_runner.dcp — a torch-only distributed checkpoint engine.

    from hpdcp_runner.dcp import save, load
    save(model.state_dict(), checkpoint_id="ckpt/step100")
    load(model.state_dict(), checkpoint_id="ckpt/step100")

No Hydra, no OmegaConf: usable from any training script.
"""

from .api import LoadResult, load, read_metadata, save
from .background.saver import (AsyncSaveResponse, async_save, release_staging_buffers, start_async_persist,
                            wait_for_async_saves)
from .comm.broadcast import BroadcastOptions, release_broadcast_groups
from .background.drain import Drainer, copy_checkpoint
from .core import faults  # noqa: F401  test-only fault points (HPDCP_FAULTS): hpdcp_runner.dcp.faults
from .core.errors import (CheckpointChangedError, CheckpointExistsError, CheckpointNotFoundError, CommitDurabilityError, CollectiveTimeoutError, ConfigError, PeerLostError,
                     CorruptCheckpointError, CoverageError, DistributedError, HpdcpError, InsufficientMemoryError,
                     KeyMismatchError, PersistProcessError,
                     MetadataError, PickleNotAllowedError, ReplicaMismatchError, ShapeMismatchError, StateDictError,
                     StorageAccessError)
from .storage.posix.filesystem import FileSystemReader, FileSystemWriter
from .storage.formats.foreign import HfReader, TorchDcpReader
from .storage.checkpoint_io import open_reader, open_writer
from .storage.objects.object_checkpoint import ObjectStoreWriter
from .storage.objects.object_reader import ObjectStoreReader
from .format.metadata import Metadata
from .planning.interfaces import LoadPlanner, SavePlanner
from .core.ragged import FlatShard, FusedShard, LocalShard, ShardPieces
from .format.renames import rename_keys
from .planning.standard import (MinimumRankLoadPlanner, MinimumRankSavePlanner, StandardLoadPlanner,
                               StandardSavePlanner)
from .state_dict import get_model_state_dict, get_optim_state_dict, set_model_state_dict, set_optim_state_dict
from .storage.interfaces import StorageReader, StorageWriter

SAVE_PLANNERS = {"standard": StandardSavePlanner, "minimum_rank": MinimumRankSavePlanner}
LOAD_PLANNERS = {"standard": StandardLoadPlanner, "minimum_rank": MinimumRankLoadPlanner}

__all__ = [
    "save", "load", "read_metadata", "async_save", "AsyncSaveResponse", "wait_for_async_saves", "start_async_persist",
    "copy_checkpoint", "Drainer",
    "release_staging_buffers", "get_optim_state_dict", "set_optim_state_dict", "get_model_state_dict",
    "set_model_state_dict", "BroadcastOptions", "release_broadcast_groups", "MinimumRankLoadPlanner",
    "LOAD_PLANNERS", "LoadResult", "Metadata",
    "SavePlanner", "LoadPlanner", "StandardSavePlanner", "MinimumRankSavePlanner", "StandardLoadPlanner",
    "StorageWriter", "StorageReader", "FileSystemWriter", "FileSystemReader", "HfReader", "TorchDcpReader",
    "open_reader", "open_writer", "ObjectStoreReader", "ObjectStoreWriter", "rename_keys", "FlatShard",
    "FusedShard", "LocalShard", "ShardPieces",
    "SAVE_PLANNERS", "HpdcpError", "ConfigError", "CheckpointNotFoundError", "CheckpointExistsError",
    "CommitDurabilityError", "CheckpointChangedError",
    "MetadataError", "CorruptCheckpointError", "StateDictError", "KeyMismatchError", "ShapeMismatchError",
    "CoverageError", "PickleNotAllowedError", "StorageAccessError", "ReplicaMismatchError", "DistributedError", "InsufficientMemoryError", "CollectiveTimeoutError", "PeerLostError",
    "PersistProcessError",
]
