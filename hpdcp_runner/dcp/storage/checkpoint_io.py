"""The reader and the writer of a checkpoint at any location: a local directory (ours, or a
Hugging Face or torch DCP checkpoint in one) or a store URI. Every caller opens checkpoints through
here; the location (``location.locate``) and its format (``foreign.detect_format``) decide which."""

from __future__ import annotations

import os

from ..core.errors import MetadataError
from .filesystem import FileSystemWriter
from .foreign import FORMATS, open_local_reader
from .interfaces import StorageReader, StorageWriter
from .object_checkpoint import ObjectStoreWriter
from .object_reader import open_object_reader
from .stores import is_remote
from .uri import check_uri, normalize

def open_reader(path: str | os.PathLike, format: str = "auto", *, allow_pickle: bool = False,
                store_options: object = None, **reader_kwargs: object) -> StorageReader:
    """The reader for ``path`` (a local path or a store URI) in ``format`` (auto: from what is
    there). ``store_options``: an ``ObjectStoreOptions`` for a store (default: the process's)."""
    if format not in FORMATS:
        raise MetadataError(f"unknown checkpoint format {format!r} (one of {', '.join(FORMATS)})")
    if is_remote(path):
        return open_object_reader(normalize(check_uri(os.fspath(path))), format, allow_pickle=allow_pickle,
                                  options=store_options, **reader_kwargs)
    return open_local_reader(path, format, allow_pickle=allow_pickle, **reader_kwargs)


def open_writer(path: str | os.PathLike, *, fsync: bool = True, store_options: object = None) -> StorageWriter:
    """The writer of a checkpoint at ``path``: the rename commit on a file system, the commit object
    on a store (``object_checkpoint``)."""
    if is_remote(path):
        return ObjectStoreWriter(normalize(check_uri(os.fspath(path))), options=store_options)  # type: ignore[arg-type]
    return FileSystemWriter(path, fsync=fsync)
