"""Readers of foreign checkpoint formats for the offline transforms, one tensor region at a time.

Every source exposes ``specs`` ({key: (dtype name, shape)}), ``objects()`` (non-tensor leaves),
``read(key, box)`` (the region ``box`` of tensor ``key``, or all of it) and ``close()``, so an
import never needs more memory than one tensor. Sources:

* ``SafetensorsSource``: a Hugging Face directory (``model.safetensors.index.json`` or
  ``model.safetensors``) or one ``.safetensors`` file; boxes are read with safetensors' slices.
* ``TorchFileSource``: a ``.pt``/``.bin`` file through ``torch.load(weights_only=True)`` only.
* ``TorchDcpSource``: a ``torch.distributed.checkpoint`` directory. Its ``.metadata`` is a
  pickle, so reading it needs ``allow_pickle=True``.
* ``HyperParallelSource``: a hyper-parallel checkpoint (``_rank{N}_.safetensors`` + pickled
  ``.metadata``). The metadata goes through a restricted unpickler that admits only their
  metadata classes (mapped to plain records); anything else in the pickle is refused. Behind
  ``allow_pickle=True`` too, since it is still a pickle from the checkpoint's author.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from ..core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, MetadataError, PickleNotAllowedError
from ..core.geometry import Box, intersect, narrow, relative, whole
from ..format import jsondoc
from ..core.rafile import open_regular, open_regular_file
from ..format.metadata import dtype_from_name, dtype_name
from ..core.utils import flatten_state_dict

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
# Real shards hold at most a few thousand tensors; a hostile header of 300k entries took ~55 s and
# 1 GiB to import. Raise it here for a genuinely larger file.
MAX_IMPORT_ENTRIES = 65536


class TensorSource:
    """Base: a map of tensor specs plus region reads."""

    path: str
    specs: dict[str, tuple[str, tuple[int, ...]]]

    def objects(self) -> dict[str, Any]:
        return {}

    def paths(self) -> dict[str, tuple]:
        """Nested path of each key (for rebuilding nesting); flat dotted keys by default."""
        return {k: tuple(k.split(".")) for k in self.specs}

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    def __init__(self, path: str | os.PathLike) -> None:

        self.path = os.path.abspath(os.fspath(path))
        self._open = safe_open_pinned
        self.files: dict[str, str] = {}  # key -> file path
        if os.path.isdir(self.path):
            index = os.path.join(self.path, HF_INDEX)
            single = os.path.join(self.path, HF_SINGLE)
            if os.path.isfile(index):
                self._from_index(index)
            elif os.path.isfile(single):
                self._scan([single])
            else:
                raise CheckpointNotFoundError(f"{self.path}: neither {HF_INDEX} nor {HF_SINGLE} (not a Hugging Face "
                                              f"model directory)")
        elif os.path.isfile(self.path):
            self._scan([self.path])
        else:
            raise CheckpointNotFoundError(f"{self.path} does not exist")
        self._handles: dict[str, Any] = {}

    def _from_index(self, index: str) -> None:
        if os.path.getsize(index) > MAX_INDEX_BYTES:
            raise MetadataError(f"{index} is larger than {MAX_INDEX_BYTES} bytes")
        with open_regular_file(index, what="index file") as f:
            doc = jsondoc.parse(f.read(), index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise MetadataError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
        names = sorted(set(wm.values()))
        for n in names:
            if os.path.basename(n) != n or n.startswith("."):
                raise MetadataError(f"{index}: file name {n!r} must be a plain name inside the directory")
        self._scan([os.path.join(self.path, n) for n in names], claimed=wm)

    def _scan(self, files: list[str], claimed: dict[str, str] | None = None) -> None:
        from ..format.safetensors_io import read_header

        self.specs = {}
        for fp in files:
            if not os.path.isfile(fp):
                raise CheckpointNotFoundError(f"{fp} is listed in {HF_INDEX} but missing")
            _, entries = read_header(fp, max_entries=MAX_IMPORT_ENTRIES)
            for e in entries:
                if e.key in self.files:
                    raise MetadataError(f"tensor {e.key!r} appears in both {self.files[e.key]} and {fp}")
                self.files[e.key] = fp
                self.specs[e.key] = (e.dtype, e.shape)
        if claimed is not None:
            for key, name in claimed.items():
                where = self.files.get(key)
                if where is None or os.path.basename(where) != name:
                    raise MetadataError(f"{HF_INDEX} maps {key!r} to {name} but "
                                        f"{'no file holds it' if where is None else 'it is in ' + where}")
            extra = sorted(set(self.files) - set(claimed))
            if extra:
                raise MetadataError(f"{HF_INDEX} does not list {len(extra)} tensor(s) found in the shards: {extra[:5]}")

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        fp = self.files[key]
        try:
            h = self._handles.get(fp)
            if h is None:
                h = self._handles[fp] = self._open(fp, framework="pt")
            if box is None or box == whole(self.specs[key][1]) or not box.sizes:
                return h.get_tensor(key)
            sl = h.get_slice(key)
            return sl[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].contiguous()
        except Exception as e:  # safetensors' own errors carry no file name
            raise CorruptCheckpointError(f"{fp}: cannot read tensor {key!r} ({type(e).__name__}: "
                                         f"{str(e)[:200]})") from None

    def close(self) -> None:
        self._handles.clear()


class TorchFileSource(TensorSource):
    """A ``torch.save`` file, loaded with ``weights_only=True`` (no arbitrary code) and mmap."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(self.path):
            raise CheckpointNotFoundError(f"{self.path} does not exist")
        try:
            try:
                sd = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # a legacy (non-zip) torch.save file cannot be mmapped
                if "mmap" not in str(e):
                    raise
                sd = torch.load(self.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise PickleNotAllowedError(f"{self.path}: refused by torch.load(weights_only=True): it holds objects "
                                        f"other than tensors and plain data ({str(e).splitlines()[0]})") from None
        except Exception as e:  # any other parse failure of a file that is not a torch.save archive
            raise CorruptCheckpointError(f"{self.path}: not a readable torch.save file "
                                         f"({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(sd, dict):
            raise MetadataError(f"{self.path}: holds a {type(sd).__name__}, expected a state dict")
        flat, self._paths = flatten_state_dict(sd)
        self._tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        self._objects = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        self.specs = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in self._tensors.items()}

    def paths(self) -> dict[str, tuple]:
        return dict(self._paths)

    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        t = self._tensors[key]
        return (t if box is None else narrow(t, box.offsets, box.sizes)).contiguous()

    def close(self) -> None:
        self._tensors.clear()


def safe_open_pinned(path: str, framework: str = "pt") -> Any:
    """``safetensors.safe_open`` of the regular file at ``path``, never of a link swapped in after
    its header was checked: the file is opened without following links and the library opens
    that descriptor (``/proc/self/fd``) where the platform has it."""
    from safetensors import safe_open

    fd = open_regular(path)
    try:
        via = f"/proc/self/fd/{fd}"
        return safe_open(via if os.path.exists(via) else path, framework=framework)
    finally:
        os.close(fd)


def _require_pickle(path: str, allow_pickle: bool, what: str) -> None:
    if not allow_pickle:
        raise PickleNotAllowedError(f"{path}: {what} stores its metadata as a pickle, and unpickling runs code chosen "
                                    f"by whoever wrote the file; pass allow_pickle=true (transform.allow_pickle) "
                                    f"only for a checkpoint you trust")


class TorchDcpSource(TensorSource):
    """A torch.distributed.checkpoint directory, read with torch's own reader (no process group)."""

    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        import torch.distributed.checkpoint as tdcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(os.path.join(self.path, ".metadata")):
            raise CheckpointNotFoundError(f"{self.path}: no .metadata (not a torch.distributed.checkpoint directory)")
        _require_pickle(os.path.join(self.path, ".metadata"), allow_pickle, "torch.distributed.checkpoint")
        self._tdcp = tdcp
        self.md = tdcp.FileSystemReader(self.path).read_metadata()
        self.specs, self._bytes = {}, []
        for key, m in self.md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                self.specs[key] = (dtype_name(m.properties.dtype), tuple(m.size))
            else:
                self._bytes.append(key)
        self._cache: tuple[str, torch.Tensor] | None = None

    def objects(self) -> dict[str, Any]:
        if not self._bytes:
            return {}
        out: dict[str, Any] = {k: None for k in self._bytes}
        self._tdcp.load(out, storage_reader=self._tdcp.FileSystemReader(self.path), no_dist=True)
        return out

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        if self._cache is None or self._cache[0] != key:
            dtype, shape = self.specs[key]
            self._cache = None
            full = {key: torch.empty(shape, dtype=dtype_from_name(dtype))}
            self._tdcp.load(full, storage_reader=self._tdcp.FileSystemReader(self.path), no_dist=True)
            self._cache = (key, full[key])
        t = self._cache[1]
        return t if box is None else narrow(t, box.offsets, box.sizes).contiguous()

    def close(self) -> None:
        self._cache = None


# -- hyper-parallel ------------------------------------------------------------------------------

_HP_MODULES = ("hyper_parallel.core.distributed_checkpoint.metadata", "hyper_parallel.core.distributed_checkpoint.storage",
               "hyper_parallel.core.distributed_checkpoint.filesystem_storage")
_HP_CLASSES = ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
               "BytesStorageMetadata", "StorageInfo", "_StorageInfo", "ChunkInfo")


class _Record:
    """A plain stand-in for one of their metadata classes: attributes only, no behaviour."""

    kind = "?"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {self.kind}")
        self.__dict__.update(state)

    def __hash__(self) -> int:  # MetadataIndex is a dict key; identity is (fqn, offset)
        return hash((self.kind, getattr(self, "fqn", None), tuple(getattr(self, "offset", ()) or ())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Record) and hash(self) == hash(other)


_RECORDS = {name: type(name, (_Record,), {"kind": name}) for name in _HP_CLASSES}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits their metadata classes (as records) and nothing else: no callables, no modules."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _HP_MODULES and name in _RECORDS:
            return _RECORDS[name]
        if (module, name) == ("copyreg", "__newobj__") or (module, name) == ("copyreg", "_reconstructor"):
            raise pickle.UnpicklingError(f"{module}.{name} is not admitted")
        raise pickle.UnpicklingError(f"global {module}.{name} is not one of the hyper-parallel metadata classes")


def read_hyper_parallel_metadata(path: str, max_bytes: int = 256 << 20) -> Any:
    with open_regular_file(path, what="metadata file") as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            raise MetadataError(f"{path} is larger than {max_bytes} bytes")
        data = f.read()
    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise MetadataError(f"{path}: not hyper-parallel metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, _RECORDS["Metadata"]) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise MetadataError(f"{path}: the pickle does not hold a hyper-parallel Metadata")
    return md


class HyperParallelSource(TensorSource):
    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False) -> None:

        self.path = os.path.abspath(os.fspath(path))
        mpath = os.path.join(self.path, ".metadata")
        if not os.path.isfile(mpath):
            raise CheckpointNotFoundError(f"{self.path}: no .metadata (not a hyper-parallel checkpoint)")
        _require_pickle(mpath, allow_pickle, "a hyper-parallel checkpoint")
        md = read_hyper_parallel_metadata(mpath)
        self._open = safe_open_pinned
        self._handles: dict[str, Any] = {}
        self.specs, self.chunks, self._paths, self._bytes = {}, {}, {}, {}
        storage = {(getattr(k, "fqn", None), tuple(getattr(k, "offset", ()) or ())): v
                   for k, v in (getattr(md, "storage_data", None) or {}).items()}
        planner = getattr(md, "planner_data", None) or {}
        try:
            for fqn, m in md.state_dict_metadata.items():
                if m.kind == "BytesStorageMetadata":
                    self._bytes[fqn] = self._file_of(storage[(fqn, ())])
                    continue
                dtype = str(m.properties.dtype).removeprefix("torch.")
                dtype_from_name(dtype)
                shape = tuple(int(x) for x in m.size)
                self.specs[fqn] = (dtype, shape)
                self.chunks[fqn] = []
                for c in m.chunks:
                    box = Box(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes))
                    if not box.within(shape):
                        raise MetadataError(f"{mpath}: chunk {box} of {fqn!r} lies outside shape {list(shape)}")
                    info = storage[(fqn, box.offsets)]
                    self.chunks[fqn].append((box, self._file_of(info), getattr(info, "tensor_key", None) or fqn))
                if isinstance(planner.get(fqn), tuple):
                    self._paths[fqn] = planner[fqn]
        except KeyError as e:
            raise MetadataError(f"{mpath}: no storage entry for {e.args[0]!r}") from None
        except (AttributeError, TypeError, ValueError) as e:
            raise MetadataError(f"{mpath}: malformed metadata ({e})") from None

    def _file_of(self, info: Any) -> tuple[str, int, int]:
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
            raise MetadataError(f"{self.path}/.metadata: storage file {name!r} must be a plain name in the directory")
        return os.path.join(self.path, name), int(getattr(info, "offset", 0) or 0), int(getattr(info, "length", -1))

    def paths(self) -> dict[str, tuple]:
        return {k: self._paths.get(k, tuple(k.split("."))) for k in self.specs}

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        dtype, shape = self.specs[key]
        box = box or whole(shape)
        out = torch.empty(box.sizes, dtype=dtype_from_name(dtype))
        covered = 0
        for cbox, (fp, _, _), tkey in self.chunks[key]:
            ov = intersect(box, cbox)
            if ov is None:
                continue
            h = self._handles.get(fp)
            if h is None:
                if not os.path.isfile(fp):
                    raise CheckpointNotFoundError(f"{fp} is named in {self.path}/.metadata but missing")
                h = self._handles[fp] = self._open(fp, framework="pt")
            src_rel = relative(ov, cbox)
            sl = h.get_slice(tkey)
            part = sl[tuple(slice(o, o + s) for o, s in zip(src_rel, ov.sizes))] if ov.sizes else sl[:]
            narrow(out, relative(ov, box), ov.sizes).copy_(part)
            covered += ov.numel
        if covered != box.numel:
            raise CorruptCheckpointError(f"{self.path}: chunks cover {covered} of {box.numel} elements of {key!r}")
        return out

    def objects(self) -> dict[str, Any]:
        out = {}
        for fqn, (fp, off, length) in self._bytes.items():
            with open_regular_file(fp) as f:
                f.seek(off)
                data = f.read(length if length >= 0 else -1)
            out[fqn] = pickle.loads(data)  # allow_pickle was required to get here
        return out

    def close(self) -> None:
        self._handles.clear()


def open_source(path: str | os.PathLike, fmt: str = "auto", *, allow_pickle: bool = False) -> TensorSource:
    """A source for ``path``; ``fmt`` is auto | hf | safetensors | pt | torch_dcp | hyper_parallel."""
    p = os.fspath(path)
    if fmt == "auto":
        if os.path.isdir(p):
            names = set(os.listdir(p))
            if HF_INDEX in names or HF_SINGLE in names:
                fmt = "hf"
            elif ".metadata" in names and any(n.startswith("_rank") and n.endswith("_.safetensors") for n in names):
                fmt = "hyper_parallel"
            elif ".metadata" in names:
                fmt = "torch_dcp"
            else:
                raise CheckpointNotFoundError(f"{p}: cannot tell the checkpoint format (no {HF_INDEX}, {HF_SINGLE} "
                                              f"or .metadata)")
        else:
            fmt = "safetensors" if p.endswith(".safetensors") else "pt"
    if fmt in ("hf", "safetensors"):
        return SafetensorsSource(p)
    if fmt == "pt":
        return TorchFileSource(p)
    if fmt == "torch_dcp":
        return TorchDcpSource(p, allow_pickle=allow_pickle)
    if fmt == "hyper_parallel":
        return HyperParallelSource(p, allow_pickle=allow_pickle)
    raise ConfigError(f"unknown source format {fmt!r} (auto, hf, safetensors, pt, torch_dcp, hyper_parallel)")

