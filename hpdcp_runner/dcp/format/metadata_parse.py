"""``metadata.json`` read and validated: all of format v1 (its chunk table inline), format v2's
document and chunk index in structure (its rows when used, all of them by ``validate_index``).

Loading validates everything (types, bounds, file names, tiling, no two chunks sharing bytes)
before anything is allocated, so a malformed or hostile file is an error naming the problem, never
a crash or a path escape. The parse returns the fields ``metadata.Metadata`` is built of.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from ..core.errors import MetadataError
from ..core.geometry import tiling_problem
from . import jsondoc
from .chunk_index import BLOCK_COUNT, BLOCK_START, BYTE_OFFSET, FILE, TENSOR, WALK_ROWS, ChunkIndex
from .indexed_chunks import IndexedChunks
from .records import (CHECKSUM_ALGORITHM, DTYPES, FORMAT_NAME, METADATA_FILE, READ_VERSIONS, ChunkMeta, FileMeta,
                      ObjectMeta, TensorMeta, check_file_name, check_relative_name, element_size)

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


def parse_document(doc: Any, source: str, open_file: Callable[[str], int] | None) -> dict[str, Any]:
    """The fields of ``Metadata`` (as keyword arguments) a parsed ``metadata.json`` document gives."""
    if isinstance(doc, dict) and doc.get("format_version") == 2 and doc.get("format") == FORMAT_NAME:
        return _parse_v2(doc, source, open_file)
    return _parse(doc, source)


def _fields(doc: dict, tensors: Mapping[str, TensorMeta], objects: dict, files: dict, version: int,
            block_bytes: int, index: ChunkIndex | None = None) -> dict[str, Any]:
    return {"world_size": doc["world_size"], "tensors": tensors, "objects": objects, "files": files,
            "format_version": version, "checksum_algorithm": doc["checksum_algorithm"], "extra": doc.get("extra", {}),
            "block_bytes": block_bytes, "index": index}


def _parse(doc: Any, source: str) -> dict[str, Any]:
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
    return _fields(doc, tensors, objects, files, 1, block_bytes)


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


def _parse_v2(doc: dict, source: str, open_file: Callable[[str], int] | None) -> dict[str, Any]:
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
    return _fields(doc, tensors, objects, files, 2, ix["block_bytes"], index)


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


def validate_index(md: Any, budget: int = WALK_ROWS) -> None:
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
