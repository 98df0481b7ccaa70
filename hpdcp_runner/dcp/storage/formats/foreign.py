"""Foreign checkpoints read in place by the distributed load: Hugging Face safetensors and
torch.distributed.checkpoint directories, no offline import step.

Each reader describes the foreign files as our own metadata (one chunk per stored tensor or
torch DCP chunk, located by file and byte offset), so planning, replica broadcast, batching and
partial reads are exactly those of our format: a rank reads only the byte ranges of the slices it
keeps. The coordinator builds the description once and every rank validates it as it would our
``metadata.json`` (bounds, tiling). Hugging Face files record no checksums: loads check
headers, sizes and bounds, not the bytes. A torch DCP record carries its zip's CRC-32, checked
whenever a chunk that is a whole record is read whole (docs/threat_model.md has the table).

* ``HfReader``: a directory with ``model.safetensors.index.json`` (shards) or
  ``model.safetensors``, or one ``.safetensors`` file. Keys stay flat (``model.layers.0...``).
* ``TorchDcpReader``: a torch DCP directory (``.metadata`` + ``*.distcp``). ``.metadata`` is a
  pickle: reading it needs ``allow_pickle``. Each tensor record is a ``torch.save`` zip inside a
  ``.distcp`` file; the reader finds the stored (uncompressed) data entry of each record and its
  exact layout (a restricted unpickler that admits only torch's tensor-rebuild calls), so reads
  go straight to the bytes. Non-tensor values are ``torch.load(weights_only=True)``-ed.
"""

from __future__ import annotations

import dataclasses
import io
import re
import os
import pickle
import zipfile
import zlib
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ...core.rafile import RandomAccessFile
from ...format import jsondoc
from ...format.safetensors_io import parse_header
from ...core.errors import CheckpointNotFoundError, CorruptCheckpointError, MetadataError, PickleNotAllowedError
from ..checkpoint_files import CheckpointFiles
from ..posix.posix_files import PinnedDirectory
from ..reader import CheckpointReader
from ...format.metadata import METADATA_FILE, ChunkMeta, FileMeta, Metadata, ObjectMeta, TensorMeta, check_file_name, dtype_name
from ...core.utils import byte_view
from ..interfaces import ReadRequest

if TYPE_CHECKING:
    from ..location import Location

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
DCP_METADATA = ".metadata"
MAX_INDEX_BYTES = 64 << 20
MAX_ENTRIES_PER_FILE = 65536
FORMATS = ("auto", "hpdcp", "hf", "torch_dcp", "deepspeed", "megatron")
_DCP_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def detect_format(path: "str | os.PathLike | Location") -> str:
    """``hpdcp`` | ``hf`` | ``torch_dcp`` | ``deepspeed`` | ``megatron`` | ``hyper_parallel`` | ``pt`` from what is there, on any
    location (one listing of a store's prefix): the one format detector of the engine and the
    offline tools."""
    from ..location import locate
    from ..objects.object_checkpoint import COMMIT_OBJECT

    loc = locate(path)
    if loc.url.endswith(".safetensors") and (loc.local_path is None or loc.is_file()):
        return "hf"
    if loc.local_path is not None and not loc.is_dir():
        # a torch file is read by the import alone; our reader names any other problem (missing,
        # a file, a displaced overwrite)
        return "pt" if loc.url.endswith((".pt", ".pth", ".bin")) else "hpdcp"
    if loc.holds_commit():  # (a store: ours is known from its commit object, no listing)
        return "hpdcp"
    names = set(loc.files())
    from .format_marks import (backend_of, is_deepspeed_run, is_deepspeed_step, is_deepspeed_universal, is_megatron_run,
                               megatron_rank_dirs)

    if backend_of(loc, names) is not None or (is_megatron_run(names) and METADATA_FILE not in names):
        return "megatron"  # (its metadata.json names a sharded backend: not ours)
    if METADATA_FILE in names or COMMIT_OBJECT in names:
        return "hpdcp"
    if HF_INDEX in names or HF_SINGLE in names:
        return "hf"
    if is_deepspeed_step(names) or is_deepspeed_run(names) or is_deepspeed_universal(names):
        return "deepspeed"
    if DCP_METADATA in names:
        if any(n.startswith("_rank") and n.endswith("_.safetensors") for n in names):
            return "hyper_parallel"
        return "torch_dcp"
    if not names and megatron_rank_dirs(loc.dirs()):  # (an iteration directory of Megatron-LM's legacy format)
        return "megatron"
    return "hpdcp"


def engine_format(path: "str | os.PathLike | Location", format: str) -> str:
    """The format the engine reads ``path`` as (``format``, or detected): one it reads in place."""
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "hyper_parallel":
        raise CheckpointNotFoundError(f"{path} is a hyper-parallel checkpoint; convert it first with "
                                      f"transform=import_hyper_parallel")
    if fmt not in FORMATS or fmt == "auto":
        raise MetadataError(f"{path}: a {fmt!r} checkpoint is read by the import only (transform=import), "
                            f"not in place" if fmt == "pt" else f"unknown checkpoint format {format!r} "
                            f"(one of {', '.join(FORMATS)})")
    return fmt


class _DescribedReader(CheckpointReader):
    """The engine's reader over a foreign checkpoint's files (any storage: ``files``, or a local
    directory path), its metadata built from those files (:meth:`describe`) instead of read."""

    format_name = "?"

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", **kwargs: Any) -> None:
        # our block checksums do not exist here; what the format does record (torch DCP's zip
        # CRC-32 of each record) is checked by the reader itself, if the caller asked for checks
        self.check_crc = kwargs.get("verify_checksums", True)
        kwargs["verify_checksums"] = False
        super().__init__(files if isinstance(files, CheckpointFiles) else PinnedDirectory(files), **kwargs)
        self._described: str | None = None
        if self.check_crc:  # the format's own checksums are few or none: the storage's, where it keeps them
            self.files.check_store_digests()

    def _read_one(self, name: str, offset: int, nbytes: int, r: ReadRequest, dt: torch.dtype) -> None:
        """A chunk that is a zip entry's whole data (a torch DCP record; a tensor of a
        ``torch.save`` archive that fills its storage), read whole, is checked against the zip's
        CRC-32 (what torch.save recorded); a part of one cannot be (the CRC covers the entry)."""
        crc = r.chunk.checksum
        if not (self.check_crc and crc.startswith("crc32:") and r.sub.sizes == r.chunk.sizes):
            super()._read_one(name, offset, nbytes, r, dt)
            return
        fd = self._fd(name)
        dest = r.dest
        direct = dest.device.type == "cpu" and dest.dtype == dt and dest.is_contiguous()
        buf = dest if direct else self.copier.scratch_view(nbytes)
        view = byte_view(buf)
        self.copier.check_bounds(fd, name, r, offset, nbytes)
        self.copier.pread(fd, offset, view, name=name)
        self.copier.count(nbytes, 1)
        if f"crc32:{zlib.crc32(view):08x}" != crc:
            raise CorruptCheckpointError(f"{self.full(name)}: the record of {r.chunk.key!r} at offset "
                                         f"{offset} fails its zip CRC-32 (corrupted data)")
        self.counters.chunks_verified += 1
        if not direct:
            dest.copy_(buf.view(dt).view(r.chunk.sizes))

    def _checked_name(self, name: Any, where: str) -> str:
        try:
            return check_file_name(name)
        except MetadataError:
            raise MetadataError(f"{where}: file name {name!r} must be a plain file name inside {self.path}") from None

    def read_metadata_text(self) -> str:
        """The description, built once per reader: a reader reused for several loads of the
        same checkpoint (the Hugging Face export's rounds) parses the foreign files once."""
        self.files.require_directory()
        if self._described is None:
            self._described = self.describe().to_json()
        return self._described

    # what describe() needs of the files
    def _exists(self, name: str) -> bool:
        return self.files.exists(name)

    def _size_of(self, name: str) -> int:
        return self.files.size_of(name)

    def _read_small(self, name: str) -> bytes:
        return self.files.read_small(name, MAX_INDEX_BYTES)

    def _random_access(self, name: str) -> RandomAccessFile:
        return self.files.open_random(name)

    def _header_of(self, name: str) -> list:
        f = self._random_access(name)
        try:
            return parse_header(self.full(name), f.size(), f.pread, MAX_ENTRIES_PER_FILE)[1]
        finally:
            f.close()

    def describe(self) -> Metadata:
        raise NotImplementedError


class HfReader(_DescribedReader):
    """Hugging Face safetensors, one file or an index of shards."""

    format_name = "hf"

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", *, only: str | None = None, **kwargs: Any) -> None:
        """``only``: the one ``.safetensors`` file of the directory to read (a local path to
        such a file sets it too)."""
        if not isinstance(files, CheckpointFiles) and os.path.isfile(files):
            files, only = os.path.split(os.path.abspath(os.fspath(files)))
        self.only = only
        super().__init__(files, **kwargs)

    def _index(self) -> dict[str, str] | None:
        index = self.full(HF_INDEX)
        if self.only is not None or not self._exists(HF_INDEX):
            return None
        size = self._size_of(HF_INDEX)
        if size > MAX_INDEX_BYTES:
            raise MetadataError(f"{index} is {size} bytes, over the {MAX_INDEX_BYTES}-byte limit")
        doc = jsondoc.parse(self._read_small(HF_INDEX), index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str)
                                                          for k, v in wm.items()):
            raise MetadataError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
        for v in set(wm.values()):
            self._checked_name(v, index)
        return wm

    def describe(self) -> Metadata:
        wm = self._index()
        if wm is not None:
            names = sorted(set(wm.values()))
        elif self.only is not None:
            names = [self._checked_name(self.only, self.path)]
        elif self._exists(HF_SINGLE):
            names = [HF_SINGLE]
        else:
            raise CheckpointNotFoundError(f"{self.path}: neither {HF_INDEX} nor {HF_SINGLE} (not a Hugging Face "
                                          f"model directory)")
        files: dict[str, FileMeta] = {}
        tensors: dict[str, TensorMeta] = {}
        where: dict[str, str] = {}
        for name in names:
            full = self.full(name)
            if wm is not None and not self._exists(name):
                raise CheckpointNotFoundError(f"{full} is listed in {self.full(HF_INDEX)} but missing")
            size = self._size_of(name)
            entries = self._header_of(name)
            files[name] = FileMeta(name, size, "", 0)
            for e in entries:
                if e.key in where:
                    raise MetadataError(f"tensor {e.key!r} is stored twice: in {where[e.key]} and {full}")
                where[e.key] = full
                tensors[e.key] = TensorMeta(e.dtype, e.shape, (ChunkMeta((0,) * len(e.shape), e.shape, name, e.key,
                                                                         e.byte_offset, ""),), (e.key,))
        if wm is not None:
            index = self.full(HF_INDEX)
            wrong = sorted(k for k, n in wm.items() if k not in where or os.path.basename(where[k]) != n)
            if wrong:
                k = wrong[0]
                raise MetadataError(f"{index} maps {len(wrong)} tensor(s) to files that do not hold them, e.g. "
                                    f"{k!r} -> {wm[k]} ({'no shard holds it' if k not in where else 'it is in ' + where[k]})")
            unlisted = sorted(set(where) - set(wm))
            if unlisted:
                raise MetadataError(f"{index} does not list {len(unlisted)} tensor(s) found in the shards: "
                                    f"{unlisted[:5]}")
        return Metadata(1, tensors, {}, files, extra={"source_format": "hf"})


# -- torch.distributed.checkpoint ----------------------------------------------------------------

def _require_pickle(path: str, allow_pickle: bool) -> None:
    if not allow_pickle:
        raise PickleNotAllowedError(f"{path}: a torch.distributed.checkpoint stores its metadata as a pickle, and "
                                    f"unpickling runs code chosen by whoever wrote it; set dcp.allow_pickle=true "
                                    f"(allow_pickle=True) only for a checkpoint you trust")


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start+length) of an open file, for ``zipfile``."""

    def __init__(self, f: RandomAccessFile, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + off))
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        data = self.f.pread(n, self.start + self.pos)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _TensorRecord(pickle.Unpickler):
    """Reads the ``data.pkl`` of one ``torch.save``-d tensor: admits only torch's tensor rebuild
    and storage types, and records (storage key, dtype, offset, size, stride) instead of building."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, offset, size, stride, *rest: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        return ("storage", pid[1], str(pid[2]))


_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


def _row_major(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


class TorchDcpReader(_DescribedReader):
    """A torch.distributed.checkpoint directory, read by recorded offsets."""

    format_name = "torch_dcp"

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", *, allow_pickle: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(files, **kwargs)
        self.allow_pickle = allow_pickle

    def describe(self) -> Metadata:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        mpath = self.full(DCP_METADATA)
        if not self._exists(DCP_METADATA):
            raise CheckpointNotFoundError(f"{self.path}: no {DCP_METADATA} (not a torch.distributed.checkpoint "
                                          f"directory)")
        _require_pickle(mpath, self.allow_pickle)
        if self._size_of(DCP_METADATA) > MAX_INDEX_BYTES:
            raise MetadataError(f"{mpath} is over the {MAX_INDEX_BYTES}-byte limit")
        body = self._read_small(DCP_METADATA)
        try:
            tmd = pickle.loads(body)  # allowed above: the user trusts this checkpoint
        except Exception as e:
            raise MetadataError(f"{mpath}: not torch.distributed.checkpoint metadata "
                                f"({type(e).__name__}: {e})") from None
        sdm = getattr(tmd, "state_dict_metadata", None)
        storage = getattr(tmd, "storage_data", None)
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise MetadataError(f"{mpath}: no state_dict_metadata/storage_data (not torch DCP metadata)")
        where = {(k.fqn, tuple(k.offset or ())): v for k, v in storage.items()}
        paths = getattr(tmd, "planner_data", None) or {}
        files: dict[str, FileMeta] = {}
        fds: dict[str, RandomAccessFile] = {}
        tensors: dict[str, TensorMeta] = {}
        objects: dict[str, ObjectMeta] = {}
        locations: dict[str, list] = {}
        try:
            for fqn, m in sorted(sdm.items()):
                path = _path_of(fqn, paths.get(fqn))
                if isinstance(m, BytesStorageMetadata):
                    info = where.get((fqn, ()))
                    if info is None:
                        raise MetadataError(f"{mpath}: no storage entry for object {fqn!r}")
                    name = self._file(info.relative_path, files, fds, mpath)
                    objects[fqn] = ObjectMeta(name, "", path)
                    locations[fqn] = [int(info.offset), int(info.length)]
                    continue
                if not isinstance(m, TensorStorageMetadata):
                    raise MetadataError(f"{mpath}: {fqn!r} has unknown metadata {type(m).__name__}")
                dtype = dtype_name(m.properties.dtype)
                chunks = []
                for c in m.chunks:
                    offs, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
                    info = where.get((fqn, offs))
                    if info is None:
                        raise MetadataError(f"{mpath}: no storage entry for {fqn!r} chunk at {list(offs)}")
                    if getattr(info, "transform_descriptors", None):
                        raise MetadataError(f"{mpath}: {fqn!r} is stored through transforms "
                                            f"{info.transform_descriptors} (e.g. compression), which this reader "
                                            f"does not decode")
                    name = self._file(info.relative_path, files, fds, mpath)
                    start, crc = self._data_offset(fds[name], name, int(info.offset), int(info.length), fqn, sizes,
                                                   m.properties.dtype)
                    chunks.append(ChunkMeta(offs, sizes, name, fqn, start, crc))
                tensors[fqn] = TensorMeta(dtype, tuple(int(x) for x in m.size), tuple(chunks), path)
        finally:
            for f in fds.values():
                f.close()
        # torch DCP records no world size; its files are named __<rank>_<n>.distcp by the rank
        # that wrote them, so the highest such rank bounds it from below (what inspect reports)
        ranks = {n: int(m.group(1)) for n in files if (m := _DCP_FILE.fullmatch(n))}
        world = max(ranks.values(), default=0) + 1
        files = {n: dataclasses.replace(f, rank=ranks.get(n, 0)) for n, f in files.items()}
        return Metadata(world, tensors, objects, files, extra={"source_format": "torch_dcp",
                                                               "torch_dcp_objects": locations})


    def _file(self, rel: Any, files: dict, fds: dict, mpath: str) -> str:
        name = self._checked_name(rel, mpath)
        if name not in files:
            files[name] = FileMeta(name, self._size_of(name), "", 0)
            fds[name] = self._random_access(name)
        return name

    def _data_offset(self, fd: RandomAccessFile, name: str, offset: int, length: int, fqn: str,
                     sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[int, str]:
        """(file offset of the chunk's raw bytes inside its ``torch.save`` record, its checksum:
        ``crc32:<hex>`` when the chunk is the record's whole data entry, else ''), after checking
        that the record stores exactly this chunk, uncompressed and row-major, and that the zip
        structure locating it is consistent (see :func:`_entry_data`)."""
        full = self.full(name)
        size = fd.size()
        nbytes = torch.Size(sizes).numel() * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptCheckpointError(f"{full}: record of {fqn!r} at [{offset}, {offset + length}) lies outside "
                                         f"the file ({size} bytes)")
        if fd.pread(4, offset) != b"PK\x03\x04":
            if length == nbytes:  # raw bytes (torch DCP's safetensors serialization)
                return offset, ""
            raise CorruptCheckpointError(f"{full}: record of {fqn!r} at offset {offset} is neither a torch.save archive "
                                         f"nor {nbytes} raw bytes")
        problem = None
        try:
            with zipfile.ZipFile(io.BufferedReader(_Window(fd, offset, length))) as zf:
                infos = zf.infolist()
                pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
                if len(pkl) != 1:
                    raise CorruptCheckpointError("no data.pkl")
                prefix = pkl[0].filename[:-len("data.pkl")]
                rec = _TensorRecord(io.BytesIO(_bounded_read(zf, pkl[0]))).load()
                if not (isinstance(rec, tuple) and rec[0] == "tensor" and isinstance(rec[1], tuple)):
                    raise CorruptCheckpointError("the record is not one tensor")
                _, (_, storage_type, key), st_off, rsize, rstride = rec
                esize = torch.empty((), dtype=dtype).element_size()
                if _STORAGE_DTYPES.get(storage_type, dtype) != dtype and storage_type != "UntypedStorage":
                    problem = f"stores {storage_type}, the metadata says {dtype}"
                elif rsize != sizes or (rstride != _row_major(sizes) and torch.Size(sizes).numel() > 1):
                    problem = f"stores size {list(rsize)} stride {list(rstride)}, not a row-major {list(sizes)}"
                elif type(st_off) is not int or st_off < 0:
                    problem = f"has storage offset {st_off!r} (must be a non-negative integer)"
                else:
                    info = zf.getinfo(f"{prefix}data/{key}")
                    align = [i for i in infos if i.filename == f"{prefix}.storage_alignment"]
                    data_at = _entry_data(fd, offset, length, info, infos, zf.start_dir,
                                          int(_bounded_read(zf, align[0], 32)) if align else 1)
                    skip = st_off * esize
                    if skip + nbytes > info.file_size:
                        problem = (f"its data entry is {info.file_size} bytes, too short for {nbytes} at storage "
                                   f"offset {st_off}")
                    else:
                        whole = skip == 0 and nbytes == info.file_size
                        return offset + data_at + skip, (f"crc32:{info.CRC:08x}" if whole else "")
        except (zipfile.BadZipFile, pickle.UnpicklingError, CorruptCheckpointError, KeyError, ValueError,
                EOFError, TypeError, OverflowError) as e:
            problem = f"is not a readable torch.save record ({type(e).__name__}: {e})"
        raise CorruptCheckpointError(f"{full}: record of {fqn!r} at offset {offset} {problem}")

    def read_objects(self, wanted: Mapping[str, ObjectMeta], *, allow_pickle: bool) -> dict[str, Any]:
        locations = (self.metadata.extra.get("torch_dcp_objects") if self.metadata else None) or {}
        out: dict[str, Any] = {}
        for fqn, om in sorted(wanted.items()):
            loc = locations.get(fqn)
            if not (isinstance(loc, list) and len(loc) == 2 and all(type(x) is int and x >= 0 for x in loc)):
                raise MetadataError(f"{self.path}: no location recorded for object {fqn!r}")
            fd = self._fd(om.file)
            if loc[0] + loc[1] > self.copier.file_size(fd):
                raise CorruptCheckpointError(f"{self.full(om.file)}: object {fqn!r} is truncated")
            data = bytearray(loc[1])
            self.copier.pread(fd, loc[0], memoryview(data), name=om.file)
            self.counters.bytes_read += len(data)
            try:  # weights_only: plain containers, numbers, strings and tensors, never code
                _check_stored(data)
                out[fqn] = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:
                raise CorruptCheckpointError(f"{self.full(om.file)}: object {fqn!r} cannot be read "
                                             f"safely ({type(e).__name__}: {str(e)[:200]})") from None
        return out


MAX_RECORD_PICKLE = 1 << 20  # a tensor record's data.pkl is ~200 bytes; anything near this is hostile


def _bounded_read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int = MAX_RECORD_PICKLE) -> bytes:
    """An entry's bytes, refusing one over ``limit`` before inflating it: a stored size can lie
    and a compressed entry can inflate a thousandfold, so the read itself stops at the limit."""
    if info.file_size > limit:
        raise CorruptCheckpointError(f"{info.filename} declares {info.file_size} bytes, over the {limit}-byte limit")
    with zf.open(info) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{info.filename} inflates past the {limit}-byte limit")
    return data


def _entry_data(fd: RandomAccessFile, base: int, length: int, info: zipfile.ZipInfo, infos: list,
                start_dir: int, align: int = 1) -> int:
    """Where ``info``'s data starts inside the record at ``base``, after checking the zip
    structure both ways: the local header agrees with the central directory (name, method, and
    sizes and CRC, or the data descriptor right after the data when the header defers them), its
    extra field is whole records, the data starts at the record's declared alignment
    (``.storage_alignment``, which torch.save pads to) and ends before the next entry and the
    central directory. A flipped byte in a length field therefore fails here instead of shifting
    the data read."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{info.filename}: its data is compressed")
    local = fd.pread(30, base + info.header_offset)
    if info.header_offset < 0 or len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{info.filename}: no local header at {info.header_offset}")
    flags, method = int.from_bytes(local[6:8], "little"), int.from_bytes(local[8:10], "little")
    crc, csize, usize = (int.from_bytes(local[i:i + 4], "little") for i in (14, 18, 22))
    nlen, xlen = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    encoded = info.filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    if nlen != len(encoded) or fd.pread(nlen, base + info.header_offset + 30) != encoded:
        raise CorruptCheckpointError(f"{info.filename}: its local header names another file")
    if method != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{info.filename}: local header says compressed")
    extra, i = fd.pread(xlen, base + info.header_offset + 30 + nlen), 0
    while i + 4 <= len(extra):
        i += 4 + int.from_bytes(extra[i + 2:i + 4], "little")
    if i != xlen or len(extra) != xlen:
        raise CorruptCheckpointError(f"{info.filename}: its local header's extra field ({xlen} bytes) is not whole "
                                     f"records")
    start = info.header_offset + 30 + nlen + xlen
    if align < 1 or start % align:
        raise CorruptCheckpointError(f"{info.filename}: data at {start} is not at the record's {align}-byte alignment")
    end = start + info.compress_size
    later = [i.header_offset for i in infos if i.header_offset > info.header_offset]
    limit = min(later + [start_dir, length])
    if end > limit:
        raise CorruptCheckpointError(f"{info.filename}: data [{start}, {end}) runs into the next zip structure at "
                                     f"{limit}")
    if flags & 0x8:  # sizes and CRC follow the data, in a data descriptor (how torch.save writes)
        tail = fd.pread(24, base + end)
        if tail[:4] == b"PK\x07\x08":
            tail = tail[4:]
        wide = (int.from_bytes(tail[4:12], "little"), int.from_bytes(tail[12:20], "little"))
        narrow = (int.from_bytes(tail[4:8], "little"), int.from_bytes(tail[8:12], "little"))
        if int.from_bytes(tail[:4], "little") != info.CRC or (info.compress_size, info.file_size) not in (wide, narrow):
            raise CorruptCheckpointError(f"{info.filename}: the data descriptor after its data disagrees with the "
                                         f"central directory (shifted or damaged structure)")
    elif (crc, csize, usize) != (info.CRC, info.compress_size, info.file_size) and csize != 0xFFFFFFFF:
        raise CorruptCheckpointError(f"{info.filename}: local header and central directory disagree")
    return start


def _check_stored(data: bytes) -> None:
    """A ``torch.save`` archive whose entries are all stored (torch never compresses): what
    ``torch.load`` then inflates is bounded by the record's own size."""
    if data[:4] != b"PK\x03\x04":
        return  # the legacy (non-zip) format: torch.load reads it in place
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                raise CorruptCheckpointError(f"entry {info.filename} is compressed or larger than its record")


def _path_of(fqn: str, recorded: Any) -> tuple:
    """torch DCP's ``planner_data`` records each flattened key's original nesting."""
    if isinstance(recorded, (list, tuple)) and recorded and all(type(x) in (str, int) for x in recorded) \
            and ".".join(map(str, recorded)) == fqn:
        return tuple(recorded)
    return (fqn,)
