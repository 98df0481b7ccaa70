"""The records a checkpoint's metadata is made of: chunks, tensors, objects and files (frozen
dataclasses), the dtype names, the file-name rules, and what ranks report of what they wrote.
``metadata.Metadata`` holds them; ``metadata_parse`` reads them from JSON.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..core.errors import MetadataError
from ..core.geometry import Box
from .chunk_index import hex_to_i64

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
