"""Public helpers for programs built on the engine (the runner is one), beside the API in
``hpdcp_runner.dcp``: box geometry, state-dict flattening, dtype names, the control-plane
``Comm``, reader options and formats, retention, inspection, renames, Hugging Face export and
the offline transforms. Programs import these from here, never from the layer modules, so the
layers can change without breaking them (``tests/unit/test_layers.py`` checks the runner)."""

from .background.saver import save_in_flight
from .comm.broadcast import node_id
from .comm.collectives import Comm
from .core.memory import available_bytes, check_allocation, check_together
from .core.geometry import Box, dtensor_local_box, intersect, narrow, split_piece, whole
from .core.ragged import decompose_flat_interval
from .core.utils import TENSOR_LEAVES, PhaseTimer, flatten_state_dict, get_logger, set_element
from .format.metadata import DTYPES, METADATA_FILE, dtype_from_name
from .format.jsondoc import parse as parse_json
from .format.renames import compile_rules, new_key_path, rename_key
from . import node_tier
from .offline import transforms
from .offline.hf_export import export_hf
from .offline.inspection import describe, full_tensor_digests, verify
from .offline.side_files import read_side_file
from .planning.standard import leaf_shape_dtype, local_pieces
from .storage.posix.filesystem import ReaderOptions
from .storage.objects.object_store import ObjectStoreOptions, configure as configure_object_store
from .storage.location import Location, fsspec_package, is_local, locate, refused as location_refused, resolve as resolve_location
from .storage.stores import SCHEMES as STORE_SCHEMES
from .storage.uri import credentials_refused, redact, join as join_location, dirname as location_dirname
from .storage.objects.object_checkpoint import remove_checkpoint
from .storage.formats.foreign import FORMATS, detect_format
from .storage.retention import (apply_retention, latest_checkpoint, list_checkpoints, series_extra, series_outsiders,
                                unrecorded_checkpoints)

__all__ = ["node_id", "save_in_flight", "available_bytes", "check_allocation", "check_together", "Comm", "Box", "dtensor_local_box", "intersect", "narrow", "split_piece", "whole", "decompose_flat_interval",
           "TENSOR_LEAVES", "PhaseTimer", "flatten_state_dict", "get_logger", "set_element", "DTYPES",
           "METADATA_FILE", "dtype_from_name", "parse_json", "compile_rules", "rename_key", "transforms", "node_tier", "export_hf", "describe",
           "full_tensor_digests", "verify", "read_side_file", "local_pieces", "leaf_shape_dtype", "new_key_path", "ReaderOptions",
           "ObjectStoreOptions", "configure_object_store", "STORE_SCHEMES", "redact", "credentials_refused", "Location", "fsspec_package", "is_local",
           "locate", "location_refused", "resolve_location", "join_location", "location_dirname", "remove_checkpoint", "FORMATS", "detect_format", "apply_retention",
           "latest_checkpoint", "list_checkpoints", "series_extra", "series_outsiders", "unrecorded_checkpoints"]
