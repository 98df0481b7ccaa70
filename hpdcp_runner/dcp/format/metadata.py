"""Checkpoint metadata: frozen dataclasses and their versioned JSON form.

``metadata.json`` is the last file written and the only description of a checkpoint. Loading
validates all of it (types, bounds, file names, tiling) before anything is allocated, so a
malformed or hostile file is an error naming the problem, never a crash or a path escape.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..core.errors import MetadataError
from ..core.geometry import Box, boxes_tile, intersect, relative, tiling_problem
from . import jsondoc
from .chunk_index import (BLOCK_COUNT, BLOCK_START, BYTE_OFFSET, CHECKSUM, FILE, TENSOR, WALK_ROWS, ChunkIndex,
                          hex_to_i64, i64_to_hex)

FORMAT_NAME = "hpdcp"
FORMAT_VERSION = 2  # what saves write: metadata.json + the chunk index (chunk_index.py)
READ_VERSIONS = (1, 2)
METADATA_FILE = "metadata.json"
DEFAULT_MAX_METADATA_BYTES = 256 * 1024 * 1024
CHECKSUM_ALGORITHM = "xxh3_64"

# torch dtype <-> our name <-> safetensors code. File names and keys never come from here.
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[_name] = (getattr(torch, _name), _code)
_DTYPE_NAMES = {dt: name for name, (dt, _) in DTYPES.items()}

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # fullmatch: '$' would admit a trailing newline


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise MetadataError(f"dtype {dtype} is not supported by the checkpoint format") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name][0]
    except KeyError:
        raise MetadataError(f"unknown dtype {name!r}") from None


_ELEMENT_SIZES = {name: torch.empty((), dtype=dt).element_size() for name, (dt, _) in DTYPES.items()}


def element_size(name: str) -> int:
    try:
        return _ELEMENT_SIZES[name]
    except KeyError:
        raise MetadataError(f"unknown dtype {name!r}") from None


def check_file_name(name: Any) -> str:
    """File names are plain names inside the checkpoint directory: no separators, no dot-dot."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise MetadataError(f"file name {name!r} is not a plain file name inside the checkpoint directory")
    return name


MAX_FILE_DEPTH = 4


def check_relative_name(name: Any) -> str:
    """A file of the checkpoint, right inside it or in its subdirectories (a DeepSpeed universal
    checkpoint keeps ``zero/<parameter>/fp32.pt``): ``/``-separated plain names, at most
    ``MAX_FILE_DEPTH`` deep. Only the readers' files (``PinnedDirectory``, which opens each
    directory on the way without following a link, and ``StorePrefix``) open such names; every
    writer, drain and copy still takes plain names only."""
    parts = name.split("/") if isinstance(name, str) else [None]
    if len(parts) > MAX_FILE_DEPTH or any(not isinstance(p, str) or not _FILE_NAME.fullmatch(p) or ".." in p
                                          for p in parts):
        raise MetadataError(f"file name {name!r} is not a plain file name inside the checkpoint directory (nor a "
                            f"path of at most {MAX_FILE_DEPTH} such names)")
    return name


@dataclass(frozen=True)
class ChunkMeta:
    """One stored chunk: its box in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    byte_offset: int
    checksum: str
    #: per-block digests (16 hex digits per ``block_bytes``) of a chunk larger than one block
    blocks: str = ""

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    #: a tuple (format v1, foreign formats) or ``IndexedChunks`` (v2: rows read on demand)
    chunks: Sequence[ChunkMeta]
    path: tuple[str | int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


@dataclass(frozen=True)
class ObjectMeta:
    file: str
    checksum: str
    path: tuple[str | int, ...]


@dataclass(frozen=True)
class FileMeta:
    name: str
    size: int
    checksum: str
    rank: int


@dataclass(frozen=True)
class WriteResult:
    """What one rank wrote: its files, and for each stored key where its bytes are."""

    rank: int
    files: tuple[FileMeta, ...]
    # safetensors key -> (file, byte offset, checksum[, per-block digests])
    chunks: Mapping[str, tuple]
    objects: Mapping[str, tuple[str, str]]  # fqn -> (file, checksum)

    @property
    def bytes_written(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True, eq=False)
class WrittenRows:
    """What one rank wrote, as rows of the chunk index in its write order (``ROW_FIELDS`` then
    offsets and sizes, D of each, padded with 0 and 1), with the rank's own numbering: the
    ``tensor`` column is the index in its key table, ``file`` in ``files``, ``block_start`` in
    ``blocks``. The coordinator receives these rows in place (``Comm.gather_rows``) and renumbers
    them with a few column operations: no Python object per chunk."""

    rank: int
    files: tuple[FileMeta, ...]
    rows: torch.Tensor  # [n, 6 + 2D] int64
    blocks: torch.Tensor  # the chunks' block digests, concatenated in row order
    objects: Mapping[str, tuple[str, str]]

    @classmethod
    def from_result(cls, res: WriteResult, items: Sequence[tuple[int, Box, str]], ndim: int) -> "WrittenRows":
        """``items``: (key index in the rank's table, box, chunk key) of every tensor chunk
        written, in write order; ``res.chunks`` says where each key's bytes are (any order)."""
        fidx = {f.name: i for i, f in enumerate(res.files)}
        width = 6 + 2 * ndim
        flat: list[int] = []
        blocks: list[int] = []
        for key_id, box, key in items:
            entry = res.chunks.get(key)
            if entry is None or entry[0] not in fidx:
                raise MetadataError(f"rank {res.rank}: the storage writer reported no location (or an unlisted file) "
                                    f"for chunk {key!r}")
            file, off, csum, *more = entry
            hexes = more[0] if more else ""
            nd = len(box.offsets)
            flat += (key_id, fidx[file], off, hex_to_i64(csum), len(blocks), len(hexes) // 16)
            flat += box.offsets
            flat += (0,) * (ndim - nd)
            flat += box.sizes
            flat += (1,) * (ndim - nd)
            blocks += [hex_to_i64(hexes[i:i + 16]) for i in range(0, len(hexes), 16)]
        rows = torch.tensor(flat, dtype=torch.int64).view(-1, width)
        return cls(res.rank, tuple(res.files), rows, torch.tensor(blocks, dtype=torch.int64), dict(res.objects))

    def envelope(self) -> dict:
        """The small part of the report (files, objects, counts); the rows follow apart."""
        return {"files": [[f.name, f.size, f.checksum] for f in self.files], "rows": int(self.rows.shape[0]),
                "blocks": int(self.blocks.numel()), "objects": {k: list(v) for k, v in self.objects.items()}}


@dataclass(frozen=True, eq=False)
class ReportedRows:
    """Every rank's ``WrittenRows`` on the coordinator: one rows matrix and one blocks column in
    rank order (filled in place as ranks report), and per rank its files, objects and counts."""

    world_size: int
    rows: torch.Tensor
    row_counts: tuple[int, ...]
    blocks: torch.Tensor
    block_counts: tuple[int, ...]
    files: tuple[tuple[FileMeta, ...], ...]
    objects: tuple[Mapping[str, tuple[str, str]], ...]

    @classmethod
    def envelopes(cls, envs: Sequence[Mapping]) -> tuple[list[int], list[int]]:
        """Each rank's row and block counts from its envelope."""
        return [int(e["rows"]) for e in envs], [int(e["blocks"]) for e in envs]

    @classmethod
    def from_envelopes(cls, envs: Sequence[Mapping], rows: torch.Tensor, blocks: torch.Tensor) -> "ReportedRows":
        rc, bc = cls.envelopes(envs)
        files = tuple(tuple(FileMeta(n, sz, c, r) for n, sz, c in e["files"]) for r, e in enumerate(envs))
        objects = tuple({k: tuple(v) for k, v in e["objects"].items()} for e in envs)
        return cls(len(envs), rows, tuple(rc), blocks.view(-1), tuple(bc), files, objects)

    @classmethod
    def from_written(cls, written: Sequence[WrittenRows], world_size: int, ndim: int) -> "ReportedRows":
        """Concatenated in one process (offline tools, tests)."""
        by_rank = {w.rank: w for w in written}
        ws = [by_rank.get(r) for r in range(world_size)]
        empty = torch.empty((0, 6 + 2 * ndim), dtype=torch.int64)
        rows = torch.cat([w.rows if w is not None and w.rows.numel() else empty for w in ws])
        blocks = torch.cat([w.blocks if w is not None else torch.empty(0, dtype=torch.int64) for w in ws])
        return cls(world_size, rows, tuple(len(w.rows) if w is not None else 0 for w in ws), blocks,
                   tuple(w.blocks.numel() if w is not None else 0 for w in ws),
                   tuple(w.files if w is not None else () for w in ws),
                   tuple(w.objects if w is not None else {} for w in ws))


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    """The safetensors key of a stored chunk; names inside files only, never file names."""
    return f"{fqn}@{','.join(map(str, offsets))}"


_SCAN_ROWS = 16  # tensors with at most this many chunks are scanned whole instead of bisected


class IndexedChunks(Sequence[ChunkMeta]):
    """A format-v2 tensor's chunks: rows of the chunk index read on demand, each checked as it is
    read (its tensor, bounds against the shape and its file, block count, sort key). A rank that
    loads a few shards reads a few rows (``overlapping``); anything that iterates reads them all."""

    def __init__(self, index: ChunkIndex, tid: int, key: str, shape: tuple[int, ...], dtype: str,
                 files: Sequence[FileMeta], block_bytes: int) -> None:
        self.index, self.tid, self.key, self.shape, self.dtype = index, tid, key, shape, dtype
        self.files, self.block_bytes = files, block_bytes
        self.lo, self.hi = index.row_range(tid)
        self.n = self.hi - self.lo
        self._cache: dict[int, ChunkMeta] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        c = self._cache.get(i)
        if c is None:
            self._load(self.lo + i, self.lo + i + 1)
            c = self._cache[i]
        return c

    def __iter__(self) -> Iterator[ChunkMeta]:
        """Every chunk, in order. Rows not already held are read and described but not kept: a
        walk over every tensor of a huge checkpoint (verify in a store, full-tensor digests)
        holds one tensor's chunks at a time, not the whole table."""
        if len(self._cache) == len(self):
            return (self._cache[i] for i in range(len(self)))
        return (self._cache.get(j - self.lo) or self._chunk(j, row)
                for j, row in zip(range(self.lo, self.hi), self.index.rows(self.lo, self.hi)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list, IndexedChunks)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"IndexedChunks({self.key!r}, rows {self.lo}..{self.hi} of {self.index.name})"

    def _bad(self, row: int, what: str) -> MetadataError:
        return MetadataError(f"{self.index.name}: row {row} (tensor {self.key!r}): {what}")

    def _load(self, a: int, b: int) -> None:
        for j, row in enumerate(self.index.rows(a, b)):
            if a + j - self.lo not in self._cache:
                self._cache[a + j - self.lo] = self._chunk(a + j, row)

    def _chunk(self, r: int, row: list[int]) -> ChunkMeta:
        d, nd, shape = self.index.ndim, len(self.shape), self.shape
        offs, sizes = row[6:6 + d], row[6 + d:6 + 2 * d]
        if row[TENSOR] != self.tid:
            raise self._bad(r, f"belongs to tensor id {row[TENSOR]}, not {self.tid} (rows out of order)")
        for k in range(d):
            o, z = offs[k], sizes[k]
            if not (0 <= o and 0 <= z and (o + z <= shape[k] if k < nd else (o == 0 and z == 1))):
                raise self._bad(r, f"chunk offsets={offs[:nd]} sizes={sizes[:nd]} outside shape {list(shape)}")
        dim, span = self.index.tensor_sort[self.tid]
        if sizes[dim] > span or self.index.key(r) != offs[dim]:
            raise self._bad(r, f"its key {self.index.key(r)} / size {sizes[dim]} disagree with its offset "
                               f"{offs[dim]} along sort dimension {dim} (span {span})")
        fid = row[FILE]
        if not 0 <= fid < len(self.files):
            raise self._bad(r, f"file id {fid} is not one of the {len(self.files)} files of metadata.json")
        f = self.files[fid]
        n = math.prod(sizes[:nd]) * element_size(self.dtype)
        boff = row[BYTE_OFFSET]
        if boff < 0 or boff + n > f.size:
            raise self._bad(r, f"chunk bytes [{boff}, {boff + n}) lie beyond the end of {f.name} ({f.size} bytes)")
        bb, start, count = self.block_bytes, row[BLOCK_START], row[BLOCK_COUNT]
        want = -(-n // bb) if bb and n > bb else 0
        if count not in (0, want) or start < 0 or start + count > self.index.nblocks:  # 0: none recorded
            raise self._bad(r, f"block digests [{start}, {start + count}) of {self.index.nblocks}: a "
                               f"{n}-byte chunk has 0 or {want}")
        hexes = "".join(map(i64_to_hex, self.index.blocks(start, count))) if count else ""
        o = tuple(offs[:nd])
        return ChunkMeta(o, tuple(sizes[:nd]), f.name, chunk_key(self.key, o), boff, i64_to_hex(row[CHECKSUM]), hexes)

    def overlapping(self, box: Box) -> list[int]:
        """Indices of the chunks that intersect ``box``: a bisection of the sort keys and the rows
        around it, nothing else of the tensor. Keys out of order around the answer are an error
        naming the row; disorder elsewhere shows as a coverage gap (``check_all`` then names it)."""
        n = self.n
        if not n or not box.numel:
            return []
        if n <= _SCAN_ROWS:  # a few chunks: read and intersect them all (no bisection)
            if len(self._cache) < n:
                self._load(self.lo, self.hi)
                self._check_order(self.lo, self.hi)
            return [i for i in range(n) if intersect(self._cache[i].box, box) is not None]
        dim, span = self.index.tensor_sort[self.tid]
        q_lo = box.offsets[dim] if dim < len(box.offsets) else 0
        q_hi = q_lo + (box.sizes[dim] if dim < len(box.sizes) else 1)
        a, b = self.index.search(self.tid, q_lo - span + 1, q_hi, self.shape[dim] if dim < len(self.shape) else 1)
        self._check_order(max(a - 1, self.lo), min(b + 1, self.hi))
        if any(j - self.lo not in self._cache for j in range(a, b)):
            self._load(a, b)
        return [j - self.lo for j in range(a, b) if intersect(self._cache[j - self.lo].box, box) is not None]

    def _check_order(self, a: int, b: int) -> None:
        """Rows [a, b) have ascending sort keys (what the bisection relies on)."""
        prev = None
        for j in range(a, b):
            k = self.index.key(j)
            if prev is not None and k < prev:
                raise self._bad(j, f"sort key {k} after {prev}: rows out of order")
            prev = k

    def check_disjoint(self, box: Box, found: Sequence[int]) -> None:
        """The chunks a rank uses tile its box: no two overlap inside it (with the volume check
        of the caller, an exact tiling of what this rank reads)."""
        if len(found) > 1:
            parts = []
            for i in found:
                ov = intersect(self[i].box, box)
                parts.append(Box(relative(ov, box), ov.sizes))
            problem = boxes_tile(box.sizes, parts)
            if problem and "overlap" in problem:
                raise MetadataError(f"{self.index.name}: tensor {self.key!r}: {problem} inside the box at offsets "
                                    f"{list(box.offsets)} sizes {list(box.sizes)}")

    def check_all(self) -> None:
        """Every row of the tensor read and checked, keys ascending, and the chunks tiling the
        tensor exactly: what ``verify`` runs, and what explains a coverage gap. Nothing is cached
        (a whole-checkpoint check holds one tensor's rows at a time)."""
        chunks = [self._chunk(self.lo + j, row) for j, row in enumerate(self.index.rows(self.lo, self.hi))]
        keys = [self.index.key(j) for j in range(self.lo, self.hi)]
        for j in range(1, len(keys)):
            if keys[j] < keys[j - 1]:
                raise self._bad(self.lo + j, f"sort key {keys[j]} after {keys[j - 1]}: rows out of order")
        if math.prod(self.shape) or chunks:
            problem = boxes_tile(self.shape, [c.box for c in chunks])
            if problem:
                raise MetadataError(f"{self.index.name}: tensor {self.key!r} (rows {self.lo}..{self.hi}): {problem}")


def overlapping_chunks(chunks: Sequence[ChunkMeta], box: Box, index: Any = None) -> list[int]:
    """Indices of ``chunks`` that intersect ``box`` (``index``: a ``BoxIndex`` over a tuple)."""
    if isinstance(chunks, IndexedChunks):
        return chunks.overlapping(box)
    cand = index.overlapping(box) if index is not None else range(len(chunks))
    return [c for c in cand if intersect(box, chunks[c].box) is not None]


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
        doc = jsondoc.parse(text, source)
        if isinstance(doc, dict) and doc.get("format_version") == 2 and doc.get("format") == FORMAT_NAME:
            return _parse_v2(doc, source, open_file)
        return _parse(doc, source)


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


def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise MetadataError(f"{source}: {what}")


_MAX_INT = 1 << 62  # dims, element counts, sizes and offsets beyond this are hostile (int64 overflow)


def _int_list(v: Any, source: str, what: str) -> tuple[int, ...]:
    _need(isinstance(v, list) and all(type(x) is int and 0 <= x < _MAX_INT for x in v), source,
          f"{what} must be a list of non-negative integers below 2**62, got {v!r:.80}")
    return tuple(v)


def _path(v: Any, source: str, key: str) -> tuple[str | int, ...]:
    _need(isinstance(v, list) and v and all(type(x) in (str, int) for x in v), source, f"{key}: bad path {v!r:.80}")
    return tuple(v)


_TENSOR_FIELDS = {"dtype", "shape", "path", "chunks"}
_TOP_FIELDS = {"format", "format_version", "world_size", "checksum_algorithm", "files", "tensors", "objects", "extra",
               "block_checksums"}
_HEX = re.compile(r"[0-9a-f]*")


def _check_header(doc: Any, source: str, fields: set[str]) -> int:
    """The fields every version shares: kind, version, world size, checksum algorithm."""
    _need(isinstance(doc, dict), source, "top level must be an object")
    _need(doc.get("format") == FORMAT_NAME, source, f"not an hpdcp checkpoint (format={doc.get('format')!r})")
    version = doc.get("format_version")
    _need(version in READ_VERSIONS and type(version) is int, source,
          f"unsupported format version {version!r} (this build reads versions "
          f"{', '.join(map(str, READ_VERSIONS))}; a newer release wrote it)")
    unknown = sorted(set(doc) - fields)
    _need(not unknown, source, f"unknown field(s) {unknown[:5]} (this build reads format version {version} with "
                               f"fields {sorted(fields)}; additions belong in 'extra')")
    ws = doc.get("world_size")
    _need(type(ws) is int and ws >= 1, source, f"world_size must be a positive integer, got {ws!r}")
    algo = doc.get("checksum_algorithm")
    _need(algo == CHECKSUM_ALGORITHM, source, f"unknown checksum_algorithm {algo!r}")
    for section in ("files", "tensors", "objects"):
        _need(isinstance(doc.get(section), dict), source, f"'{section}' must be an object")
    extra = doc.get("extra", {})
    _need(isinstance(extra, dict), source, "'extra' must be an object")
    return version


_RANK_FILE = re.compile(r"rank(\d{5,})\.(?:safetensors|objects\.json)")


def _parse_files(doc: dict, source: str) -> dict[str, FileMeta]:
    """The file table; each file's rank lies inside the world size and agrees with the rank in
    its name (a ``metadata.json`` edited to another world size, or files of another save listed,
    is refused before anything is read)."""
    files: dict[str, FileMeta] = {}
    ws = doc["world_size"]
    extra = doc.get("extra")
    # our saves write every file at the top; only a foreign checkpoint's description (a DeepSpeed
    # universal checkpoint's zero/<param>/fp32.pt) names files in subdirectories
    check = check_relative_name if isinstance(extra, dict) and extra.get("source_format") else check_file_name
    for name, f in doc["files"].items():
        try:
            check(name)
        except MetadataError as e:
            raise MetadataError(f"{source}: {e}") from None
        _need(isinstance(f, dict) and set(f) == {"size", "checksum", "rank"} and type(f.get("size")) is int
              and 0 <= f["size"] < _MAX_INT
              and isinstance(f.get("checksum"), str) and type(f.get("rank")) is int,
              source, f"file {name!r}: bad entry {f!r:.120}")
        rank = f["rank"]
        _need(0 <= rank < ws, source, f"file {name!r}: recorded rank {rank} is outside world_size {ws}")
        m = _RANK_FILE.fullmatch(name)
        _need(m is None or int(m.group(1)) == rank, source,
              f"file {name!r}: recorded rank {rank} differs from the rank in its name")
        files[name] = FileMeta(name, f["size"], f["checksum"], rank)
    return files


def _parse_objects(doc: dict, tensors: Mapping[str, Any], files: Mapping[str, FileMeta], source: str) -> dict:
    objects: dict[str, ObjectMeta] = {}
    for k, o in doc["objects"].items():
        _need(k not in tensors, source, f"key {k!r} is both a tensor and an object")
        _need(isinstance(o, dict) and set(o) <= {"file", "checksum", "path"} and o.get("file") in files
              and isinstance(o.get("checksum"), str),
              source, f"object {k!r}: bad entry or unknown file {o!r:.120}")
        objects[k] = ObjectMeta(o["file"], o["checksum"], _path(o.get("path"), source, k))
    return objects


def _parse(doc: Any, source: str) -> Metadata:
    """Format v1: the chunk table inline, all of it validated (bounds, files, tiling).

    Unknown fields are rejected, not ignored: a reader that skipped a field it does not
    understand could load something other than what was written. Additions go into ``extra``
    (kept and round-tripped) or come with a new format version."""
    version = _check_header(doc, source, _TOP_FIELDS)
    _need(version == 1, source, f"format_version {version} needs its 'index'")
    files = _parse_files(doc, source)
    tensors = {k: _parse_tensor(k, t, files, source) for k, t in doc["tensors"].items()}
    _check_tilings(tensors, source)
    _check_disjoint(tensors, source)
    objects = _parse_objects(doc, tensors, files, source)
    block_bytes, blocks = _parse_blocks(doc.get("block_checksums"), tensors, source)
    if blocks:
        tensors = {k: dataclasses.replace(t, chunks=tuple(
            dataclasses.replace(c, blocks=blocks[(c.file, c.key)]) if (c.file, c.key) in blocks else c
            for c in t.chunks)) for k, t in tensors.items()}
    return Metadata(doc["world_size"], tensors, objects, files, 1, doc["checksum_algorithm"], doc.get("extra", {}),
                    block_bytes)


_V2_FIELDS = {"format", "format_version", "world_size", "checksum_algorithm", "files", "tensors", "objects", "extra",
              "index"}
_V2_TENSOR_FIELDS = {"dtype", "shape", "path"}
_INDEX_FIELDS = {"file", "size", "checksum", "rows", "ndim", "blocks", "block_bytes"}


def file_table(text: str | bytes, source: str = METADATA_FILE) -> tuple[dict[str, "FileMeta"], dict | None]:
    """The files a checkpoint names and, format v2, its chunk index's record, validated as a
    load validates them but without opening the index: what copying a checkpoint's files from
    node to node needs, where the index may not be there yet."""
    doc = jsondoc.parse(text, source)
    v2 = isinstance(doc, dict) and doc.get("format_version") == 2 and doc.get("format") == FORMAT_NAME
    _check_header(doc, source, _V2_FIELDS if v2 else _TOP_FIELDS)
    files = _parse_files(doc, source)
    if not v2:
        return files, None
    ix = doc.get("index")
    _need(isinstance(ix, dict) and set(ix) == _INDEX_FIELDS and type(ix.get("size")) is int and ix["size"] >= 0
          and isinstance(ix.get("checksum"), str), source, f"'index' is malformed: {ix!r:.160}")
    try:
        check_file_name(ix["file"])
    except MetadataError as e:
        raise MetadataError(f"{source}: index: {e}") from None
    _need(ix["file"] not in files, source, f"index file {ix['file']!r} is also listed as a data file")
    return files, ix


def _parse_v2(doc: dict, source: str, open_file: Callable[[str], int] | None) -> Metadata:
    """Format v2: ``metadata.json`` validated whole (it is small: O(tensors + files)), the chunk
    index opened and checked in structure (O(tensors)); its rows are read and checked when used
    (``IndexedChunks``), all of them by ``verify``."""
    _check_header(doc, source, _V2_FIELDS)
    files = _parse_files(doc, source)
    ix = doc.get("index")
    _need(isinstance(ix, dict) and set(ix) == _INDEX_FIELDS
          and all(type(ix[f]) is int and 0 <= ix[f] < _MAX_INT for f in ("size", "rows", "ndim", "blocks", "block_bytes"))
          and isinstance(ix.get("checksum"), str) and ix["ndim"] >= 1,
          source, f"'index' must be {{{', '.join(sorted(_INDEX_FIELDS))}}} with non-negative integer counts, "
                  f"got {ix!r:.160}")
    try:
        check_file_name(ix["file"])
    except MetadataError as e:
        raise MetadataError(f"{source}: index: {e}") from None
    _need(ix["file"] not in files, source, f"index file {ix['file']!r} is also listed as a data file")
    if open_file is None:
        raise MetadataError(f"{source}: format version 2 keeps its chunks in {ix['file']}, and this caller gave no "
                            f"way to open it (read the checkpoint directory, not metadata.json alone)")
    # the index first: its size against the counts is O(1) and refuses a document listing more
    # tensors than the index holds before any per-tensor work
    name = os.path.join(os.path.dirname(source), ix["file"])
    index = ChunkIndex.open(open_file(ix["file"]), name, size=ix["size"], tensors=len(doc["tensors"]),
                            rows=ix["rows"], ndim=ix["ndim"], blocks=ix["blocks"])
    specs = []
    for key in sorted(doc["tensors"]):
        t = doc["tensors"][key]
        if not (isinstance(t, dict) and set(t) == _V2_TENSOR_FIELDS):
            raise MetadataError(f"{source}: tensor {key!r}: entry must be an object with fields "
                                f"{sorted(_V2_TENSOR_FIELDS)}, got {t!r:.100}")
        dtype = t["dtype"]
        _need(dtype in DTYPES, source, f"tensor {key!r}: unknown dtype {dtype!r}")
        shape = _int_list(t["shape"], source, f"tensor {key!r} shape")
        _need(math.prod(shape) < _MAX_INT, source, f"tensor {key!r}: shape {list(shape)} has 2**62 elements or more")
        _need(len(shape) <= ix["ndim"], source, f"tensor {key!r}: {len(shape)} dimensions, more than the index's "
                                                f"ndim {ix['ndim']}")
        specs.append((key, dtype, shape, _path(t["path"], source, key)))
    index.recorded = ix  # what metadata.json says of it (verify checks its checksum)
    file_list = [files[n] for n in sorted(files)]
    tensors = {}
    for tid, (key, dtype, shape, path) in enumerate(specs):
        chunks = IndexedChunks(index, tid, key, shape, dtype, file_list, ix["block_bytes"])
        if not len(chunks) and math.prod(shape):
            raise MetadataError(f"{name}: tensor {key!r} ({math.prod(shape)} elements) has no chunks")
        tensors[key] = TensorMeta(dtype, shape, chunks, path)
    objects = _parse_objects(doc, tensors, files, source)
    return Metadata(doc["world_size"], tensors, objects, files, 2, doc["checksum_algorithm"], doc.get("extra", {}),
                    ix["block_bytes"], index)


def _parse_blocks(raw: Any, tensors: Mapping[str, TensorMeta], source: str) -> tuple[int, dict]:
    """``block_checksums``: every entry names a stored chunk and has one digest per block."""
    if raw is None:
        return 0, {}
    _need(isinstance(raw, dict) and set(raw) == {"block_bytes", "chunks"} and isinstance(raw["chunks"], dict),
          source, "'block_checksums' must be {block_bytes, chunks}")
    bb = raw["block_bytes"]
    _need(type(bb) is int and bb > 0, source, f"block_checksums.block_bytes must be a positive integer, got {bb!r}")
    wanted = {(f, k) for f, ks in raw["chunks"].items() if isinstance(ks, dict) for k in ks}
    nbytes = {}
    for t in tensors.values():
        for c in t.chunks:
            if (c.file, c.key) in wanted:
                nbytes[(c.file, c.key)] = math.prod(c.sizes) * element_size(t.dtype)
    blocks = {}
    for f, ks in raw["chunks"].items():
        _need(isinstance(ks, dict), source, f"block_checksums.chunks[{f!r}] must be an object")
        for k, hexes in ks.items():
            n = nbytes.get((f, k))
            if n is None:
                raise MetadataError(f"{source}: block_checksums: {f}:{k!r} is not a stored chunk")
            if not (isinstance(hexes, str) and len(hexes) == 16 * -(-n // bb) and _HEX.fullmatch(hexes)):
                raise MetadataError(f"{source}: block_checksums: {f}:{k!r} must be {-(-n // bb)} 16-hex-digit digests")
            blocks[(f, k)] = hexes
    return bb, blocks


def _parse_tensor(key: str, t: Any, files: Mapping[str, FileMeta], source: str) -> TensorMeta:
    """One tensor entry, every chunk validated. Messages are built only on failure: formatting
    them eagerly cost ~20 us per chunk, which at 1,000 ranks x 2,000 tensors was 40 s per rank."""
    if not (isinstance(t, dict) and t.keys() <= _TENSOR_FIELDS):
        got = sorted(map(str, t))[:6] if isinstance(t, dict) else t
        raise MetadataError(f"{source}: tensor {key!r}: entry must be an object with fields {sorted(_TENSOR_FIELDS)}, "
                            f"got {got!r:.100}")
    dtype = t.get("dtype")
    _need(dtype in DTYPES, source, f"tensor {key!r}: unknown dtype {dtype!r}")
    shape = _int_list(t.get("shape"), source, f"tensor {key!r} shape")
    _need(math.prod(shape) < _MAX_INT, source, f"tensor {key!r}: shape {list(shape)} has 2**62 elements or more")
    esize = element_size(dtype)
    chunks_raw = t.get("chunks")
    _need(isinstance(chunks_raw, list), source, f"tensor {key!r}: chunks must be a list")
    nd = len(shape)
    chunks = []
    for c in chunks_raw:
        if not (type(c) is list and len(c) == 6):
            raise MetadataError(f"{source}: tensor {key!r}: bad chunk {c!r:.120}")
        offs, sizes, fname, skey, boff, csum = c
        if not (type(offs) is list and type(sizes) is list and len(offs) == nd == len(sizes)):
            if not (isinstance(offs, list) and isinstance(sizes, list)):
                _int_list(offs, source, f"tensor {key!r} chunk offsets")
                _int_list(sizes, source, f"tensor {key!r} chunk sizes")
            raise MetadataError(f"{source}: tensor {key!r}: chunk rank {len(offs)}/{len(sizes)} differs from shape "
                                f"{list(shape)}")
        for o, z, dim in zip(offs, sizes, shape):
            if type(o) is not int or type(z) is not int or o < 0 or z < 0:
                _int_list(offs, source, f"tensor {key!r} chunk offsets")
                _int_list(sizes, source, f"tensor {key!r} chunk sizes")
            if o + z > dim:
                raise MetadataError(f"{source}: tensor {key!r}: chunk offsets={offs} sizes={sizes} outside shape "
                                    f"{list(shape)}")
        f = files.get(fname) if type(fname) is str else None
        if f is None:
            raise MetadataError(f"{source}: tensor {key!r}: chunk names unknown file {fname!r:.80}")
        if type(skey) is not str or type(boff) is not int or boff < 0 or type(csum) is not str:
            raise MetadataError(f"{source}: tensor {key!r}: bad chunk location {c[2:]!r:.120}")
        end = boff + math.prod(sizes) * esize
        if end > f.size:
            raise MetadataError(f"{source}: tensor {key!r}: chunk bytes [{boff}, {end}) lie beyond the end of "
                                f"{fname} ({f.size} bytes)")
        chunks.append(ChunkMeta(tuple(offs), tuple(sizes), fname, skey, boff, csum))
    return TensorMeta(dtype, shape, tuple(chunks), _path(t.get("path"), source, key))


def validate_index(md: "Metadata", budget: int = WALK_ROWS) -> None:
    """Every row of a v2 checkpoint's chunk index checked as a load checks the rows it reads
    (tensor, bounds, sort key, file, bytes inside the file, block digests), every tensor tiled,
    and no two chunks sharing bytes of a file: vectorised over a bounded block of rows at a time
    (whole tensors, about ``budget`` rows; files in groups for the shared bytes), so a checkpoint
    of tens of millions of chunks is checked without holding its chunk table. A row that fails
    is explained by the per-row check of its tensor (``IndexedChunks.check_all``)."""
    index = md.index
    specs = sorted(((t.chunks.tid, k, t) for k, t in md.tensors.items() if isinstance(t.chunks, IndexedChunks)),
                   key=lambda x: x[0])
    if not specs:
        return
    d = index.ndim
    files = specs[0][2].chunks.files
    fsize = torch.tensor([f.size for f in files] or [0], dtype=torch.int64)
    shape = torch.ones((index.tensors, d), dtype=torch.int64)
    nd = torch.zeros(index.tensors, dtype=torch.int64)
    esize = torch.zeros(index.tensors, dtype=torch.int64)
    for tid, _, t in specs:
        if t.shape:
            shape[tid, :len(t.shape)] = torch.tensor(t.shape, dtype=torch.int64)
        nd[tid] = len(t.shape)
        esize[tid] = element_size(t.dtype)
    sort = torch.tensor(index.tensor_sort or [(0, 0)], dtype=torch.int64).view(-1, 2)
    bb = specs[0][2].chunks.block_bytes
    by_tid = {tid: t for tid, _, t in specs}
    for t0, t1, lo, hi in index.tensor_blocks(budget):
        rows = index.rows_tensor(lo, hi)
        keys = index.keys_tensor(lo, hi)
        counts = torch.tensor([index.tensor_rows[t + 1] - index.tensor_rows[t] for t in range(t0, t1)],
                              dtype=torch.int64)
        tid = torch.repeat_interleave(torch.arange(t0, t1), counts)
        off, size = rows[:, 6:6 + d], rows[:, 6 + d:6 + 2 * d]
        shp = shape[tid]
        inside = torch.arange(d)[None, :] < nd[tid][:, None]
        bad = rows[:, TENSOR] != tid
        bad |= ((off < 0) | (size < 0) | torch.where(inside, off + size > shp, (off != 0) | (size != 1))).any(1)
        dim = sort[tid, 0].clamp(0, max(d - 1, 0))
        bad |= (size.gather(1, dim[:, None]).flatten() > sort[tid, 1]) | (keys != off.gather(1, dim[:, None]).flatten())
        same = tid[1:] == tid[:-1]
        bad[1:] |= same & (keys[1:] < keys[:-1])
        fid = rows[:, FILE]
        bad |= (fid < 0) | (fid >= len(files))
        n = torch.where(inside, size, 1).prod(1) * esize[tid]
        boff = rows[:, BYTE_OFFSET]
        bad |= (boff < 0) | (boff + n > fsize[fid.clamp(0, max(len(files) - 1, 0))])
        want = torch.where((n > bb) if bb else torch.zeros_like(n, dtype=torch.bool), -(-n // max(bb, 1)), 0)
        bc, bs = rows[:, BLOCK_COUNT], rows[:, BLOCK_START]
        bad |= ((bc != 0) & (bc != want)) | (bs < 0) | (bs + bc > index.nblocks)
        first = torch.nonzero(bad).flatten()
        if len(first):
            t = int(tid[int(first[0])])
            by_tid[t].chunks.check_all()  # words it
            raise MetadataError(f"{index.name}: row {lo + int(first[0])} (tensor id {t}) fails its checks")
        local = torch.cat([(tid - t0)[:, None], off, size], 1)
        found = tiling_problem([tuple(by_tid[t].shape) for t in range(t0, t1)], local)
        if found is not None:
            key = by_tid[t0 + found[0]].chunks.key
            raise MetadataError(f"{index.name}: tensor {key!r} (rows {index.tensor_rows[t0 + found[0]]}.."
                                f"{index.tensor_rows[t0 + found[0] + 1]}): {found[1]}")
        del rows, keys, tid, off, size, shp, local
    _check_no_shared_bytes(index, files, nd, esize, by_tid, budget)

def _check_no_shared_bytes(index: Any, files: Sequence[Any], nd: torch.Tensor, esize: torch.Tensor,
                           by_tid: dict, budget: int) -> None:
    """No two non-empty chunks of a v2 index share a byte of a file: each file's rows sorted by
    offset, in bounded groups (part of ``validate_index``)."""
    d = index.ndim
    row_tid = index.tensor_rows
    cols = [TENSOR, BYTE_OFFSET] + list(range(6 + d, 6 + 2 * d))  # the columns the check needs
    for f, rows, at in index.rows_by_file(len(files), 2 * budget, cols):
        if len(rows) < 2:
            continue
        tids = rows[:, 0]
        size = rows[:, 2:]
        inside = torch.arange(d)[None, :] < nd[tids][:, None]
        n = torch.where(inside, size, 1).prod(1) * esize[tids]
        keep = n > 0
        start, end, at = rows[keep, 1], rows[keep, 1] + n[keep], at[keep]
        clash = torch.nonzero(start[1:] < end[:-1]).flatten()
        if len(clash):
            j = int(clash[0])
            a, b = int(at[j]), int(at[j + 1])
            ta, tb = bisect.bisect_right(row_tid, a) - 1, bisect.bisect_right(row_tid, b) - 1
            raise MetadataError(f"{index.name}: chunks share bytes of {files[f].name}: {by_tid[ta].chunks.key!r} chunk "
                                f"{a - row_tid[ta]} [{int(start[j])}, {int(end[j])}) and {by_tid[tb].chunks.key!r} "
                                f"chunk {b - row_tid[tb]} [{int(start[j + 1])}, {int(end[j + 1])}) (a damaged or "
                                f"hand-edited chunk table)")


def _check_disjoint(tensors: Mapping[str, TensorMeta], source: str) -> None:
    """No two non-empty chunks share a byte of a file: two chunks naming the same bytes would
    load one tensor region's data into another (caught only later, if at all, by a checksum)."""
    names: dict[str, int] = {}
    flat: list[int] = []
    owners: list[tuple[str, int]] = []
    for k, t in tensors.items():
        esize = element_size(t.dtype)
        for i, c in enumerate(t.chunks):
            n = math.prod(c.sizes) * esize
            if n:
                flat += (names.setdefault(c.file, len(names)), c.byte_offset, c.byte_offset + n)
                owners.append((k, i))
    if len(owners) < 2:
        return
    rows = torch.tensor(flat, dtype=torch.int64).view(-1, 3)
    order = torch.argsort(rows[:, 1], stable=True)
    order = order[torch.argsort(rows[order, 0], stable=True)]  # by file, then by start
    r = rows[order]
    bad = ((r[1:, 0] == r[:-1, 0]) & (r[1:, 1] < r[:-1, 2])).nonzero()
    if len(bad):
        j = int(bad[0])
        (k1, i1), (k2, i2) = owners[int(order[j])], owners[int(order[j + 1])]
        fname = next(n for n, v in names.items() if v == int(r[j, 0]))
        raise MetadataError(f"{source}: chunks share bytes of {fname}: {k1!r} chunk {i1} "
                            f"[{int(r[j, 1])}, {int(r[j, 2])}) and {k2!r} chunk {i2} [{int(r[j + 1, 1])}, "
                            f"{int(r[j + 1, 2])}) (a damaged or hand-edited chunk table)")


def _check_tilings(tensors: Mapping[str, TensorMeta], source: str) -> None:
    """Every tensor's chunks cover it exactly once; one vectorised pass over all chunks."""
    names = list(tensors)
    d = max([len(tensors[k].shape) for k in names] or [1]) or 1
    flat: list[int] = []
    for i, k in enumerate(names):
        tm = tensors[k]
        pad = d - len(tm.shape)
        if len(tm.chunks) == 1 and tm.chunks[0].sizes == tm.shape:
            continue  # one whole chunk: nothing to check
        if not tm.chunks and math.prod(tm.shape):
            raise MetadataError(f"{source}: tensor {k!r}: chunks cover 0 of {math.prod(tm.shape)} elements")
        for c in tm.chunks:
            flat.append(i)
            flat.extend(c.offsets)
            flat.extend((0,) * pad)
            flat.extend(c.sizes)
            flat.extend((1,) * pad)
    if not flat:
        return
    rows = torch.tensor(flat, dtype=torch.int64).view(-1, 1 + 2 * d)
    # tensors skipped above have no rows: give them a None shape so their volume is not checked
    present = set(rows[:, 0].unique().tolist())
    shapes = [tensors[k].shape if i in present else None for i, k in enumerate(names)]
    found = tiling_problem(shapes, rows)
    if found is not None:
        raise MetadataError(f"{source}: tensor {names[found[0]]!r}: {found[1]}")
