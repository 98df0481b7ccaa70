"""Single-process checkpoint tools: describe, verify, and full-tensor digests.

They need no process group and read one tensor at a time, so memory stays at the largest
tensor whatever the checkpoint size.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..format.checksums import block_digests, digest, digest_pieces, file_checksum
from ..format.safetensors_io import parse_header
from ..core.rafile import open_regular_file
from ..format import jsondoc
from ..format import objects as objcodec
from ..core.errors import CheckpointNotFoundError, HpdcpError, MetadataError, PickleNotAllowedError, StorageAccessError
from ..storage.posix.filesystem import FileSystemReader
from ..core.geometry import Box, narrow
from ..format.metadata import METADATA_FILE, Metadata, dtype_from_name, element_size
from ..storage.interfaces import ReadRequest, StorageReader
from ..storage.checkpoint_io import open_reader
from ..storage.location import locate, resolve
from ..storage.uri import join


def commit_state(path: str | os.PathLike) -> str:
    """'committed', 'uncommitted' (a staging dir or a dir without metadata) or 'missing'."""
    return locate(path).commit_state()


def describe(path: str | os.PathLike, reader: StorageReader | None = None, md: Metadata | None = None) -> dict:
    """A JSON-able summary: format, world size, files, and per tensor dtype/shape/chunks/bytes.
    ``reader``/``md``: a foreign checkpoint (Hugging Face, torch DCP) as its reader describes it."""
    reader = reader or open_reader(path, "hpdcp")
    if md is None:
        try:
            md = Metadata.from_json(reader.read_metadata_text(), source=join(reader.path, METADATA_FILE),
                                    open_file=reader.open_file)
        finally:
            reader.close()
    files_of = tensor_files(md)
    tensors = {k: {"dtype": t.dtype, "shape": list(t.shape), "chunks": len(t.chunks), "bytes": t.nbytes,
                   **files_of[k]} for k, t in md.tensors.items()}
    fmt = getattr(reader, "format_name", "hpdcp")
    extra = md.extra if isinstance(md.extra, dict) else {}
    series = {}
    if isinstance(extra.get("series"), str):
        from ..storage.retention import why_not_member
        from ..storage.uri import split

        why = why_not_member(split(os.fspath(path))[1], os.fspath(path), extra["series"], extra)
        series = {"series": {"series": extra["series"], "step": extra.get("step"), "member": why is None,
                             "why": why}}
    return {**series, "path": reader.path, "format": fmt, "state": commit_state(path) if fmt == "hpdcp" else "committed",
            "format_version": md.format_version,
            "world_size": md.world_size, "tensor_bytes": md.total_tensor_bytes,
            "files": {n: {"size": f.size, "rank": f.rank} for n, f in sorted(md.files.items())},
            "tensors": tensors, "objects": sorted(md.objects)}


FILES_LISTED = 64  # per tensor in ``describe``: more are counted (8,192 ranks' files per tensor help no one)


def tensor_files(md: Metadata) -> dict[str, dict]:
    """Per tensor ``{"files": the first FILES_LISTED file names, "file_count": n}``; for format
    v2 from the chunk index a bounded block of rows at a time, never every chunk's description."""
    out: dict[str, dict] = {}
    if md.index is None:
        for k, t in md.tensors.items():
            names = sorted({c.file for c in t.chunks})
            out[k] = {"files": names[:FILES_LISTED], "file_count": len(names)}
        return out
    from ..format.chunk_index import FILE, TENSOR
    from ..format.metadata import IndexedChunks

    index = md.index
    names = sorted(md.files)
    by_tid = {t.chunks.tid: k for k, t in md.tensors.items() if isinstance(t.chunks, IndexedChunks)}
    nf = max(len(names), 1)
    for t0, t1, lo, hi in index.tensor_blocks():
        rows = index.rows_tensor(lo, hi)
        pairs = torch.unique(rows[:, TENSOR] * nf + rows[:, FILE].clamp(0, nf - 1))  # sorted: by tensor, then file
        tids, fids = (pairs // nf).tolist(), (pairs % nf).tolist()
        for t in range(t0, t1):
            if t in by_tid:
                out[by_tid[t]] = {"files": [], "file_count": 0}
        for t, f in zip(tids, fids):
            entry = out.get(by_tid.get(t))
            if entry is not None:
                entry["file_count"] += 1
                if len(entry["files"]) < FILES_LISTED:
                    entry["files"].append(names[f])
    return out


def files_of(md: Metadata, keys: Iterable[str]) -> list[str]:
    """The files holding chunks of ``keys``; format v2 from the index a bounded block at a time."""
    keys = set(keys)
    if md.index is None:
        return sorted({c.file for k in keys for c in md.tensors[k].chunks})
    from ..format.chunk_index import FILE, TENSOR
    from ..format.metadata import IndexedChunks

    names = sorted(md.files)
    tids = torch.tensor(sorted(t.chunks.tid for k, t in md.tensors.items()
                               if k in keys and isinstance(t.chunks, IndexedChunks)) or [-1], dtype=torch.int64)
    used = torch.zeros(max(len(names), 1), dtype=torch.bool)
    for _, _, lo, hi in md.index.tensor_blocks():
        rows = md.index.rows_tensor(lo, hi)
        f = rows[torch.isin(rows[:, TENSOR], tids), FILE]
        used[f[(f >= 0) & (f < len(names))]] = True
    return [names[i] for i in torch.nonzero(used).flatten().tolist()]


BATCH_BYTES = 64 << 20  # what verify and digests read together (a store fetches their ranges concurrently)


def iter_full_tensors(path: str | os.PathLike, keys: list[str] | None = None, *,
                      reuse_buffer: bool = False, reader: StorageReader | None = None,
                      keep: Callable[[str], bool] | None = None,
                      on_bytes: Callable[[int, int], None] | None = None,
                      batch_bytes: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` assembled from every chunk, in key order; ``on_bytes(done,
    total)`` hears the tensor bytes read so far of all it will read (progress).

    With ``batch_bytes``, consecutive tensors are read together, up to that many bytes (or one
    tensor, if larger), in one reader call: a store fetches all their ranges concurrently instead
    of one tensor's at a time (a round trip per small tensor); 0 reads one tensor at a time (what
    bounds a merge's memory by the largest tensor). With ``reuse_buffer`` the tensors are views of one
    buffer sized for the largest batch (valid only until the next batch is read): memory stays
    at that size however the allocator behaves (freed multi-MiB blocks otherwise fragment the heap
    and RSS creeps up).
    """
    reader = reader or open_reader(path, "hpdcp", files_kept=4)
    md = Metadata.from_json(reader.read_metadata_text(), source=join(os.fspath(path), METADATA_FILE),
                            open_file=reader.open_file)
    reader.attach_metadata(md)
    keys = list(keys) if keys is not None else sorted(k for k in md.tensors if keep is None or keep(k))
    reader.check_files(files_of(md, keys))  # sizes real before allocating

    def aligned(k: str) -> int:  # each tensor's view starts at a multiple of 64 bytes (any dtype)
        return -(-md.tensors[k].nbytes // 64) * 64

    batches = _batches(keys, aligned, batch_bytes)
    scratch = torch.empty(max((sum(aligned(k) for k in b) for b in batches), default=0) if reuse_buffer else 0,
                          dtype=torch.uint8)
    total, done = sum(md.tensors[k].nbytes for k in keys), 0
    if on_bytes is not None:
        on_bytes(0, total)
    try:
        for batch in batches:
            fulls, reqs, at = [], [], 0
            for key in batch:
                tm = md.tensors[key]
                dt = dtype_from_name(tm.dtype)
                full = scratch[at:at + tm.nbytes].view(dt).view(tm.shape) if reuse_buffer else \
                    torch.empty(tm.shape, dtype=dt)
                at += aligned(key)
                fulls.append(full)
                reqs += [ReadRequest(c, tm.dtype, Box(tuple(0 for _ in c.sizes), c.sizes),
                                     narrow(full, c.offsets, c.sizes)) for c in tm.chunks]
            req_bytes = [r.chunk.box.numel * element_size(r.dtype) for r in reqs]
            moved = [done]

            def read(k: int) -> None:  # progress request by request inside a batch
                moved[0] += req_bytes[k]
                on_bytes(moved[0], total)

            reader.read_tensors(reqs, read if on_bytes is not None else None)
            for key, full in zip(batch, fulls):
                done += md.tensors[key].nbytes
                yield key, full
            del fulls, reqs, full  # before the next batch: one batch alive at a time
    finally:
        reader.close()


def _batches(keys: list[str], size: Callable[[str], int], limit: int) -> list[list[str]]:
    """Consecutive keys in groups of at most ``limit`` bytes (a larger key alone)."""
    out: list[list[str]] = []
    room = 0
    for k in keys:
        n = size(k)
        if not out or n > room:
            out.append([])
            room = limit
        out[-1].append(k)
        room -= n
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's dtype, shape and row-major bytes (layout independent)."""
    from ..core.utils import byte_view

    c = t.detach().to("cpu").contiguous()
    # streamed over the tensor's own bytes: the one-shot digest of header + a bytes() copy cost two
    # copies of every tensor (1.8 s of a 2.2 s verify of 1.25 GiB; the hash itself 0.05 s)
    return digest_pieces((f"{c.dtype}{list(c.shape)}".encode(), byte_view(c)))


def full_tensor_digests(path: str | os.PathLike, reader: StorageReader | None = None, *,
                        keep: Callable[[str], bool] | None = None, cast: torch.dtype | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        split: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """{key: digest of the full tensor}, tensors read in batches of up to ``BATCH_BYTES`` (a
    store fetches a batch's ranges concurrently; ``reader``: a foreign one). ``keep``: only the keys it admits (the others are never read); ``cast``: floating
    tensors digested as cast to it (what an export with that dtype wrote); ``progress(done, total)``
    hears the bytes read so far (a progress bar); ``split``: a key stacked along
    dim 0 digested slice by slice under the names given (to compare with unstacked tensors)."""
    out = {}
    for k, t in iter_full_tensors(path, reader=reader, reuse_buffer=True, keep=keep, on_bytes=progress,
                                  batch_bytes=BATCH_BYTES):
        t = t.to(cast) if cast is not None and t.is_floating_point() else t
        names = (split or {}).get(k)
        if names is None:
            out[k] = tensor_digest(t)
            continue
        if t.dim() == 0 or t.shape[0] != len(names):
            raise MetadataError(f"{path}: {k!r} has shape {list(t.shape)}, not {len(names)} stacked tensors")
        for name, piece in zip(names, t.unbind(0)):
            out[name] = tensor_digest(piece)
    return out


@dataclass(frozen=True)
class VerifyReport:
    path: str
    problems: tuple[str, ...]
    files_checked: int
    bytes_checked: int

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | os.PathLike, on_file: Callable[[str, int], None] | None = None,
           on_bytes: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Recompute every checksum and cross-check files against the metadata; collect all problems.
    ``on_file(name, size)`` is called after each file; ``on_bytes(done, total)`` as bytes are
    checked (progress)."""
    if not locate(path).capabilities.atomic_rename:  # committed by its commit object (a store): every
        return _verify_in_store(resolve(path), on_file, on_bytes)  # byte through the verifying reader
    # renamed into place whole (a file system): file by file, and nothing there the metadata does not name
    problems: list[str] = []
    abspath = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(abspath, METADATA_FILE)):
        FileSystemReader(path).read_metadata_text()  # nothing there: not found (with its hints), not damaged
    try:
        md = FileSystemReader(path).read_metadata_once()
        md.validate_all()  # format v2: every row of the chunk index (a load checks the rows it uses)
    except HpdcpError as e:
        return VerifyReport(abspath, (str(e),), 0, 0)
    if md.index is not None:
        problems += _verify_index(os.path.join(abspath, md.index.recorded["file"]), md.index.recorded["checksum"])
    per_file = _chunks_by_file(md)  # one file's chunks at a time, in name order
    objects_by_file: dict[str, list[str]] = {}
    for k, o in md.objects.items():
        objects_by_file.setdefault(o.file, []).append(k)
    problems += _rank_problems(md)
    checked = nbytes = 0
    total, done = sum(fm.size for fm in md.files.values()), 0
    if on_bytes is not None:
        on_bytes(0, total)
    dfd = os.open(abspath, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:  # every file opened inside this directory, never through a link (no check-then-open window)
        for name, fm in sorted(md.files.items()):
            if on_bytes is not None:
                on_bytes(done, total)  # the files before this one
            done += fm.size
            file_chunks, file_blocks = next(per_file)
            full = os.path.join(abspath, name)
            try:
                f = open_regular_file(full, dfd)
            except FileNotFoundError:
                problems.append(f"{name}: missing")
                continue
            except HpdcpError as e:
                kind = "a symbolic link" if "symbolic link" in str(e) else "special"
                problems.append(f"{name}: not a regular file ({kind}); load refuses it")
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if size != fm.size:
                    problems.append(f"{name}: {size} bytes, metadata records {fm.size}")
                    continue
                checked += 1
                nbytes += size
                if name.endswith(".safetensors"):
                    problems += _verify_tensor_file(f, name, fm.checksum, file_chunks, file_blocks, md.block_bytes)
                else:
                    body = f.read()
                    if digest(body) != fm.checksum:
                        problems.append(f"{name}: checksum mismatch")
                    problems += _object_file_problems(name, body, objects_by_file.get(name, []), md)
            if on_file is not None:
                on_file(name, size)
        if on_bytes is not None:
            on_bytes(total, total)
        extra = sorted(set(os.listdir(dfd)) - set(md.files) - {METADATA_FILE}
                       - ({md.index.recorded["file"]} if md.index is not None else set()))
    finally:
        os.close(dfd)
    problems += [f"{n}: not listed in {METADATA_FILE}" for n in extra]
    return VerifyReport(abspath, tuple(problems), checked, nbytes)


def _chunks_by_file(md: Metadata) -> Iterator[tuple[dict[str, tuple], dict[str, str]]]:
    """For each file in name order: {chunk key: (chunk, dtype, tensor key)} and {chunk key: block
    digests}. Format v2 reads the index by groups of files (``ChunkIndex.rows_by_file``), so
    only one group's rows are held, never every chunk's description."""
    names = sorted(md.files)
    if md.index is None:
        by_file: dict[str, dict[str, tuple]] = {}
        for k, t in md.tensors.items():
            for c in t.chunks:
                by_file.setdefault(c.file, {})[c.key] = (c, t.dtype, k)
        blocks_by_file: dict[str, dict[str, str]] = {}
        for (f, k), hexes in md.blocks.items():
            blocks_by_file.setdefault(f, {})[k] = hexes
        for n in names:
            yield by_file.get(n, {}), blocks_by_file.get(n, {})
        return
    from ..format.metadata import IndexedChunks

    index = md.index
    tensors = {t.chunks.tid: (k, t) for k, t in md.tensors.items() if isinstance(t.chunks, IndexedChunks)}
    for _, rows, at in index.rows_by_file(len(names)):
        chunks: dict[str, tuple] = {}
        blocks: dict[str, str] = {}
        for r, row in zip(at.tolist(), rows.tolist()):
            tid = row[0]
            k, t = tensors[tid]
            c = t.chunks._chunk(r, row)  # the row checked and described as a load would
            chunks[c.key] = (c, t.dtype, k)
            if c.blocks:
                blocks[c.key] = c.blocks
        yield chunks, blocks


def _rank_problems(md: Metadata) -> list[str]:
    """Each file's recorded rank is inside the world size and matches its rank file name."""
    out = []
    for name, fm in sorted(md.files.items()):
        m = re.fullmatch(r"rank(\d{5,})\.(safetensors|objects\.json)", name)
        if not 0 <= fm.rank < md.world_size:
            out.append(f"{name}: recorded rank {fm.rank} is outside world_size {md.world_size}")
        elif m and int(m.group(1)) != fm.rank:
            out.append(f"{name}: recorded rank {fm.rank} differs from the rank in its name")
    return out


def _object_file_problems(name: str, body: bytes, keys: list[str], md: Metadata) -> list[str]:
    """The objects file is JSON holding every key listed for it, each a well-formed encoding with
    its recorded checksum (pickled values are checked for form only: never unpickled here)."""
    try:
        doc = jsondoc.parse(body, name)
    except HpdcpError as e:
        return [str(e)]
    if not isinstance(doc, dict):
        return [f"{name}: not a JSON object"]
    out = []
    for k in sorted(keys):
        if k not in doc:
            out.append(f"{name}: object {k!r} listed in the metadata is not in the file")
            continue
        text = json.dumps(doc[k], separators=(",", ":")).encode()
        if digest(text) != md.objects[k].checksum:
            out.append(f"{name}: object {k!r} fails its checksum")
        try:
            objcodec.decode(doc[k], key=k, source=name, allow_pickle=False)
        except PickleNotAllowedError:
            pass
        except HpdcpError as e:
            out.append(str(e))
    return out


def _verify_index(full: str, checksum: str) -> list[str]:
    """The chunk index's own checksum (as a rank file's: header, then each entry's digest)."""
    name = os.path.basename(full)
    try:
        with open_regular_file(full) as f:
            raw, entries = parse_header(name, os.fstat(f.fileno()).st_size, lambda n, off: os.pread(f.fileno(), n, off))
            digests = []
            for e in entries:  # streamed: the rows entry of a huge index is gigabytes
                f.seek(e.byte_offset)
                digests.append(digest_pieces(_pieces(f, e.nbytes, e.key)))
    except (HpdcpError, OSError) as e:
        return [f"{name}: {e}"]
    return [] if file_checksum(raw, digests) == checksum else [f"{name}: checksum mismatch (recorded in metadata.json)"]


def _pieces(f: BinaryIO, n: int, what: str, piece: int = 16 << 20) -> Iterator[bytes]:
    while n:
        data = f.read(min(n, piece))
        if not data:
            raise OSError(f"short read of {what}")
        n -= len(data)
        yield data


def _verify_tensor_file(f: BinaryIO, name: str, checksum: str, chunks: dict, blocks: dict[str, str],
                        block_bytes: int) -> list[str]:
    """One rank file, read through ``f`` (opened once, not followed through a link)."""
    problems = []
    try:
        header, entries = parse_header(name, os.fstat(f.fileno()).st_size,
                                       lambda n, off: os.pread(f.fileno(), n, off))
    except HpdcpError as e:
        return [str(e)]
    digests = []
    for e in entries:
        f.seek(e.byte_offset)
        data = f.read(e.nbytes)
        d = digest(data)
        digests.append(d)
        found = chunks.get(e.key)
        if found is None:
            problems.append(f"{name}: key {e.key!r} is not in the metadata")
            continue
        c, dtype, tensor = found
        if e.dtype != dtype or e.shape != c.sizes or e.nbytes != math.prod(c.sizes) * element_size(dtype):
            problems.append(f"{name}: key {e.key!r} is {e.dtype} {list(e.shape)} ({e.nbytes} bytes) in the file "
                            f"but {METADATA_FILE} records tensor {tensor!r} as {dtype} chunk {list(c.sizes)}")
        elif c.checksum != d or c.byte_offset != e.byte_offset:
            problems.append(f"{name}: key {e.key!r} fails its checksum")
        elif e.key in blocks and block_digests(memoryview(data), block_bytes) != blocks[e.key]:
            problems.append(f"{name}: key {e.key!r}: its block checksums do not match its bytes")
    missing = sorted(set(chunks) - {e.key for e in entries})
    problems += [f"{name}: key {k!r} listed in the metadata is not in the file" for k in missing]
    if file_checksum(header, digests) != checksum:
        problems.append(f"{name}: file checksum mismatch")
    return problems


def _verify_in_store(uri: str, on_file: Callable[[str, int], None] | None,
                     on_bytes: Callable[[int, int], None] | None = None) -> VerifyReport:
    """verify() of a checkpoint in an object store: the commit, the metadata and every row of the
    index checked, every file listed and of its recorded size, then every tensor read whole
    through the verifying reader (each chunk's checksum) and every object file's checksum: every
    stored byte is checked once, one tensor in memory at a time."""
    problems: list[str] = []
    reader = open_reader(uri, "hpdcp")
    md = None
    try:
        md = Metadata.from_json(reader.read_metadata_text(), source=join(uri, METADATA_FILE),
                                open_file=reader.open_file)
        md.validate_all()
        reader.attach_metadata(md)
        reader.check_files(sorted(md.files))
    except (CheckpointNotFoundError, StorageAccessError) as e:
        reader.close()
        if md is None:  # nothing there (or no access): not a damaged checkpoint
            raise
        return VerifyReport(uri, (str(e),), 0, 0)  # a file the metadata names is missing
    except HpdcpError as e:
        reader.close()
        return VerifyReport(uri, (str(e),), 0, 0)
    problems += _rank_problems(md)
    checked = nbytes = 0
    try:
        for key, _ in iter_full_tensors(uri, reader=reader, reuse_buffer=True, on_bytes=on_bytes,
                                        batch_bytes=BATCH_BYTES):
            pass
        objects = reader.read_objects(md.objects, allow_pickle=False) if md.objects else {}
        del objects
    except PickleNotAllowedError:
        pass  # a pickled object's bytes were checked before it was refused
    except HpdcpError as e:
        problems.append(str(e))
    finally:
        reader.close()
    for name, fm in sorted(md.files.items()):
        checked += 1
        nbytes += fm.size
        if on_file is not None:
            on_file(name, fm.size)
    return VerifyReport(uri, tuple(problems), checked, nbytes)
