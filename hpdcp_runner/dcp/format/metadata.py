"""Checkpoint metadata: the frozen ``Metadata`` and its versioned JSON form.

``metadata.json`` is the last file written and the only description of a checkpoint. Its records
(chunks, tensors, objects, files) are in ``records``, a format-v2 tensor's chunks in
``indexed_chunks``, and reading it (every field validated before anything is allocated) in
``metadata_parse``; their names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Mapping

from ..core.errors import MetadataError
from . import jsondoc
from .chunk_index import ChunkIndex
from .indexed_chunks import IndexedChunks, chunk_overlaps
from .metadata_parse import file_table, parse_document, validate_index
from .records import (CHECKSUM_ALGORITHM, DEFAULT_MAX_METADATA_BYTES, DTYPES, FORMAT_NAME, FORMAT_VERSION, MAX_FILE_DEPTH,
                      METADATA_FILE, READ_VERSIONS, ChunkMeta, FileMeta, ObjectMeta, ReportedRows, TensorMeta,
                      WriteResult, WrittenRows, check_file_name, check_relative_name, chunk_key, dtype_from_name,
                      dtype_name, element_size)

__all__ = ["CHECKSUM_ALGORITHM", "DEFAULT_MAX_METADATA_BYTES", "DTYPES", "FORMAT_NAME", "FORMAT_VERSION",
           "MAX_FILE_DEPTH", "METADATA_FILE", "READ_VERSIONS", "ChunkMeta", "DeferredMetadata", "FileMeta",
           "IndexedChunks", "Metadata", "MetadataError", "ObjectMeta", "ReportedRows", "TensorMeta", "WriteResult",
           "WrittenRows", "check_file_name", "check_relative_name", "chunk_key", "dtype_from_name", "dtype_name",
           "element_size", "file_table", "chunk_overlaps", "validate_index"]


@dataclass(frozen=True)
class Metadata:
    world_size: int
    tensors: Mapping[str, TensorMeta]
    objects: Mapping[str, ObjectMeta]
    files: Mapping[str, FileMeta]
    format_version: int = 1
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: chunks larger than ``block_bytes`` also carry one digest per block (``ChunkMeta.blocks``),
    #: so a read of part of the chunk verifies the blocks it touches
    block_bytes: int = 0
    #: format v2: the chunk index the tensors' ``IndexedChunks`` read from (None: chunks in memory)
    index: ChunkIndex | None = field(default=None, compare=False, repr=False)

    def keys(self) -> list[str]:
        return sorted({*self.tensors, *self.objects})

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def blocks(self) -> dict[tuple[str, str], str]:
        """{(file, chunk key): block digests} of every chunk that has them (reads every chunk)."""
        return {(c.file, c.key): c.blocks for t in self.tensors.values() for c in t.chunks if c.blocks}

    def as_v1(self) -> "Metadata":
        """The same checkpoint described in format v1 (every chunk in ``metadata.json``): what a
        save with ``format_version=1`` commits, for readers older than the chunk index."""
        if self.index is None:
            return self
        return dataclasses.replace(self, index=None, format_version=1, tensors={
            k: dataclasses.replace(t, chunks=tuple(t.chunks)) for k, t in self.tensors.items()})

    def validate_all(self) -> None:
        """Everything a load checks only in part: every row of the index (``verify``), and that
        no two chunks share bytes. Format v2 is walked in bounded memory (``validate_index``)."""
        if self.index is not None:
            validate_index(self)

    # -- JSON -------------------------------------------------------------------------------
    def _common_doc(self, version: int) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": version,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "files": {n: {"size": f.size, "checksum": f.checksum, "rank": f.rank} for n, f in sorted(self.files.items())},
        }

    def to_json(self) -> str:
        """Format v2 when the chunks are in an index, else v1 (foreign checkpoints described in
        memory, and anything built from chunk tuples)."""
        if self.index is not None:
            doc = self._common_doc(2)
            doc["tensors"] = {k: {"dtype": t.dtype, "shape": list(t.shape), "path": list(t.path)}
                              for k, t in sorted(self.tensors.items())}
            doc["objects"] = {k: {"file": o.file, "checksum": o.checksum, "path": list(o.path)}
                              for k, o in sorted(self.objects.items())}
            doc["extra"] = dict(self.extra)
            doc["index"] = dict(self.index.describe(), block_bytes=self.block_bytes)
            return json.dumps(doc, separators=(",", ":"), allow_nan=False)
        doc = self._common_doc(1)
        doc["tensors"] = {
            k: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "path": list(t.path),
                "chunks": [[list(c.offsets), list(c.sizes), c.file, c.key, c.byte_offset, c.checksum] for c in t.chunks],
            }
            for k, t in sorted(self.tensors.items())
        }
        doc["objects"] = {k: {"file": o.file, "checksum": o.checksum, "path": list(o.path)}
                          for k, o in sorted(self.objects.items())}
        doc["extra"] = dict(self.extra)
        blocks = self.blocks
        if blocks:  # an optional field: readers before it ignored it and verified less
            by_file: dict[str, dict[str, str]] = {}
            for (f, k), hexes in sorted(blocks.items()):
                by_file.setdefault(f, {})[k] = hexes
            doc["block_checksums"] = {"block_bytes": self.block_bytes, "chunks": by_file}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = METADATA_FILE,
                  open_file: Callable[[str], int] | None = None) -> "Metadata":
        """``open_file(name)``: a read-only descriptor of a regular file of the checkpoint (how a
        v2 checkpoint's chunk index is opened; the reader's pinned directory)."""
        return Metadata(**parse_document(jsondoc.parse(text, source), source, open_file))


class DeferredMetadata(Metadata):
    """Committed metadata that is parsed on first use: what ``save`` returns on ranks other than
    the coordinator. Parsing costs every rank ~10 us per chunk of the whole checkpoint (20 s at
    1,024 ranks x 2,000 tensors), which most callers never need."""

    def __init__(self, text: str, source: str = METADATA_FILE,  # noqa: D107
                 open_file: Callable[[str], int] | None = None) -> None:
        object.__setattr__(self, "_deferred", (text, source, open_file))

    def _materialize(self) -> None:
        pending = self.__dict__.pop("_deferred", None)
        if pending is not None:
            md = Metadata.from_json(pending[0], source=pending[1], open_file=pending[2])
            for f in fields(Metadata):
                object.__setattr__(self, f.name, getattr(md, f.name))
            object.__setattr__(self, "__class__", Metadata)  # from now on a plain Metadata

    def __getattribute__(self, name: str) -> Any:
        # fields with defaults (format_version, checksum_algorithm, ...) are class attributes
        # too: without this they would answer the class default instead of the parsed value
        if name in _DEFAULTED and "_deferred" in object.__getattribute__(self, "__dict__"):
            object.__getattribute__(self, "_materialize")()
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        if "_deferred" not in self.__dict__ or name.startswith("__"):
            raise AttributeError(name)
        self._materialize()
        return getattr(self, name)

    def __eq__(self, other: object) -> bool:
        self._materialize()
        return Metadata.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]


_DEFAULTED = frozenset(f.name for f in fields(Metadata) if f.default is not MISSING or f.default_factory is not MISSING)
