"""Where a checkpoint lives decides its reader and writer: a local directory (or a foreign
checkpoint in one), or an object-store URI. Every caller opens checkpoints through here."""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import MetadataError
from .filesystem import FileSystemWriter
from .foreign import FORMATS, open_local_reader
from .interfaces import StorageReader, StorageWriter
from .object_checkpoint import ObjectStoreWriter
from .object_reader import open_object_reader
from .uri import is_uri, normalize


def open_reader(path: str | os.PathLike, format: str = "auto", *, allow_pickle: bool = False,
                store_options: Any = None, **reader_kwargs: Any) -> StorageReader:
    """The reader for ``path`` (a local path or an ``s3://`` URI) in ``format`` (auto: from the
    files present). ``store_options``: an ``ObjectStoreOptions`` for URIs (default: the process's)."""
    if format not in FORMATS:
        raise MetadataError(f"unknown checkpoint format {format!r} (one of {', '.join(FORMATS)})")
    if is_uri(path):
        return open_object_reader(normalize(path), format, allow_pickle=allow_pickle, options=store_options,
                                  **reader_kwargs)
    return open_local_reader(path, format, allow_pickle=allow_pickle, **reader_kwargs)


def open_writer(path: str | os.PathLike, *, fsync: bool = True, store_options: Any = None) -> StorageWriter:
    """The writer for a checkpoint at ``path``: a local directory, or an ``s3://`` URI."""
    if is_uri(path):
        return ObjectStoreWriter(normalize(path), options=store_options)
    return FileSystemWriter(path, fsync=fsync)
