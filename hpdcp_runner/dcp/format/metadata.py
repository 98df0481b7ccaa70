"""Checkpoint metadata: frozen dataclasses and their versioned JSON form.

``metadata.json`` is the last file written and the only description of a checkpoint. Loading
validates all of it (types, bounds, file names, tiling) before anything is allocated, so a
malformed or hostile file is an error naming the problem, never a crash or a path escape.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

import torch

from ..core.errors import MetadataError
from ..core.geometry import Box, tiling_problem

FORMAT_NAME = "hpdcp"
FORMAT_VERSION = 1
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


@dataclass(frozen=True)
class ChunkMeta:
    """One stored chunk: its box in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    byte_offset: int
    checksum: str

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]
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

    def to_wire(self) -> dict:
        return {"rank": self.rank, "files": [[f.name, f.size, f.checksum] for f in self.files],
                "chunks": {k: list(v) for k, v in self.chunks.items()},
                "objects": {k: list(v) for k, v in self.objects.items()}}

    @classmethod
    def from_wire(cls, w: dict) -> "WriteResult":
        return cls(w["rank"], tuple(FileMeta(n, s, c, w["rank"]) for n, s, c in w["files"]),
                   {k: tuple(v) for k, v in w["chunks"].items()}, {k: tuple(v) for k, v in w["objects"].items()})


@dataclass(frozen=True)
class Metadata:
    world_size: int
    tensors: Mapping[str, TensorMeta]
    objects: Mapping[str, ObjectMeta]
    files: Mapping[str, FileMeta]
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: chunks larger than ``block_bytes`` also carry one digest per block, so a read of part of
    #: the chunk verifies the blocks it touches: (file, chunk key) -> concatenated 16-hex digests
    block_bytes: int = 0
    blocks: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def keys(self) -> list[str]:
        return sorted({*self.tensors, *self.objects})

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "files": {n: {"size": f.size, "checksum": f.checksum, "rank": f.rank} for n, f in sorted(self.files.items())},
            "tensors": {
                k: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "path": list(t.path),
                    "chunks": [[list(c.offsets), list(c.sizes), c.file, c.key, c.byte_offset, c.checksum] for c in t.chunks],
                }
                for k, t in sorted(self.tensors.items())
            },
            "objects": {k: {"file": o.file, "checksum": o.checksum, "path": list(o.path)} for k, o in sorted(self.objects.items())},
            "extra": dict(self.extra),
        }
        if self.blocks:  # an optional field: readers before it ignored it and verified less
            by_file: dict[str, dict[str, str]] = {}
            for (f, k), hexes in sorted(self.blocks.items()):
                by_file.setdefault(f, {})[k] = hexes
            doc["block_checksums"] = {"block_bytes": self.block_bytes, "chunks": by_file}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = METADATA_FILE) -> "Metadata":
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise MetadataError(f"{source}: not valid JSON ({e})") from None
        return _parse(doc, source)


class DeferredMetadata(Metadata):
    """Committed metadata that is parsed on first use: what ``save`` returns on ranks other than
    the coordinator. Parsing costs every rank ~10 us per chunk of the whole checkpoint (20 s at
    1,024 ranks x 2,000 tensors), which most callers never need."""

    def __init__(self, text: str, source: str = METADATA_FILE) -> None:  # noqa: D107
        object.__setattr__(self, "_deferred", (text, source))

    def _materialize(self) -> None:
        pending = self.__dict__.pop("_deferred", None)
        if pending is not None:
            md = Metadata.from_json(pending[0], source=pending[1])
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


def _parse(doc: Any, source: str) -> Metadata:
    """Unknown fields are rejected, not ignored: a reader that skipped a field it does not
    understand could load something other than what was written. Additions go into ``extra``
    (kept and round-tripped) or come with a new format version."""
    _need(isinstance(doc, dict), source, "top level must be an object")
    unknown = sorted(set(doc) - _TOP_FIELDS)
    _need(not unknown, source, f"unknown field(s) {unknown[:5]} (this build reads format version {FORMAT_VERSION}; "
                               f"additions belong in 'extra')")
    _need(doc.get("format") == FORMAT_NAME, source, f"not an hpdcp checkpoint (format={doc.get('format')!r})")
    version = doc.get("format_version")
    _need(version == FORMAT_VERSION, source,
          f"format_version {version!r} is not supported (this build reads version {FORMAT_VERSION})")
    ws = doc.get("world_size")
    _need(type(ws) is int and ws >= 1, source, f"world_size must be a positive integer, got {ws!r}")
    algo = doc.get("checksum_algorithm")
    _need(algo == CHECKSUM_ALGORITHM, source, f"unknown checksum_algorithm {algo!r}")
    for section in ("files", "tensors", "objects"):
        _need(isinstance(doc.get(section), dict), source, f"'{section}' must be an object")
    files: dict[str, FileMeta] = {}
    for name, f in doc["files"].items():
        try:
            check_file_name(name)
        except MetadataError as e:
            raise MetadataError(f"{source}: {e}") from None
        _need(isinstance(f, dict) and set(f) == {"size", "checksum", "rank"} and type(f.get("size")) is int
              and 0 <= f["size"] < _MAX_INT
              and isinstance(f.get("checksum"), str) and type(f.get("rank")) is int,
              source, f"file {name!r}: bad entry {f!r:.120}")
        files[name] = FileMeta(name, f["size"], f["checksum"], f["rank"])
    tensors = {k: _parse_tensor(k, t, files, source) for k, t in doc["tensors"].items()}
    _check_tilings(tensors, source)
    objects: dict[str, ObjectMeta] = {}
    for k, o in doc["objects"].items():
        _need(k not in tensors, source, f"key {k!r} is both a tensor and an object")
        _need(isinstance(o, dict) and set(o) <= {"file", "checksum", "path"} and o.get("file") in files
              and isinstance(o.get("checksum"), str),
              source, f"object {k!r}: bad entry or unknown file {o!r:.120}")
        objects[k] = ObjectMeta(o["file"], o["checksum"], _path(o.get("path"), source, k))
    extra = doc.get("extra", {})
    _need(isinstance(extra, dict), source, "'extra' must be an object")
    block_bytes, blocks = _parse_blocks(doc.get("block_checksums"), tensors, source)
    return Metadata(ws, tensors, objects, files, version, algo, extra, block_bytes, blocks)


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
