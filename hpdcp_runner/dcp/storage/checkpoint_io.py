"""The reader and the writer of a checkpoint at any location: a local directory (ours, or a
Hugging Face or torch DCP checkpoint in one) or a store URI. Every caller opens checkpoints through
here; the location (``location.locate``) and its format (``foreign.detect_format``) decide which."""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import MetadataError
from .formats.foreign import FORMATS, HfReader, TorchDcpReader, engine_format
from .interfaces import StorageReader, StorageWriter
from .location import locate
from .reader import CheckpointReader

def open_reader(path: str | os.PathLike, format: str = "auto", *, allow_pickle: bool = False,
                store_options: object = None, weights: str = "fp32", hf_config: dict | None = None,
                config_source: str = "config.json", **reader_kwargs: Any) -> StorageReader:
    """The reader for ``path`` (a local path or a store URI) in ``format`` (auto: from what is
    there): one reader per format, over the location's files. ``store_options``: an
    ``ObjectStoreOptions`` for a store (default: the process's). ``weights``: which weights of a
    DeepSpeed checkpoint (``fp32`` master copy or ``module``; see ``storage/formats/deepspeed.py``).
    ``hf_config``: a Megatron-Core checkpoint's model as a Hugging Face ``config.json`` (read from
    ``config_source``): its weights then read under Hugging Face names (``storage/formats/megatron.py``)."""
    if format not in FORMATS:
        raise MetadataError(f"unknown checkpoint format {format!r} (one of {', '.join(FORMATS)})")
    loc = locate(path, options=store_options)
    fmt = engine_format(loc, format)
    if fmt == "hpdcp":
        return CheckpointReader(loc.checkpoint_files(committed=True), **reader_kwargs)
    only = None
    if fmt == "hf" and loc.url.endswith(".safetensors") and loc.is_file():  # one file: its directory, that file
        only, loc = loc.name, locate(loc.parent().url, options=store_options)
    if fmt == "deepspeed":
        from .formats.deepspeed import DeepSpeedReader, DeepSpeedUniversalReader, step_directory
        from .formats.format_marks import is_deepspeed_universal

        loc = step_directory(loc, store_options)
        names = sorted(loc.files())
        cls = DeepSpeedUniversalReader if is_deepspeed_universal(set(names)) else DeepSpeedReader
        return cls(loc.checkpoint_files(committed=False), names=names, weights=weights, **reader_kwargs)
    if fmt == "megatron":
        from .formats.megatron import MegatronReader, step_directory as megatron_step

        loc, rank_dirs = megatron_step(loc, store_options)
        if rank_dirs:  # Megatron-LM's legacy format
            from .formats.megatron_legacy import MegatronLegacyReader

            return MegatronLegacyReader(loc.checkpoint_files(committed=False), rank_dirs=rank_dirs,
                                        hf_config=hf_config, config_source=config_source, **reader_kwargs)
        return MegatronReader(loc.checkpoint_files(committed=False), allow_pickle=allow_pickle, hf_config=hf_config,
                              config_source=config_source, **reader_kwargs)
    files = loc.checkpoint_files(committed=False)
    if fmt == "hf":
        return HfReader(files, only=only, **reader_kwargs)
    return TorchDcpReader(files, allow_pickle=allow_pickle, **reader_kwargs)


def open_writer(path: str | os.PathLike, *, fsync: bool = True, store_options: object = None) -> StorageWriter:
    """The writer of a checkpoint at ``path``, as its location makes it (``Location.open_writer``:
    the rename commit on a file system, the commit object on a store)."""
    return locate(path, options=store_options).open_writer(fsync=fsync)
