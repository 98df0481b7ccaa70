"""Readers of foreign checkpoint formats for the offline transforms, one tensor region at a time.

Every source exposes ``specs`` ({key: (dtype name, shape)}), ``objects()`` (non-tensor leaves),
``read(key, box)`` (the region ``box`` of tensor ``key``, or all of it) and ``close()``, so an
import never needs more memory than one tensor. Sources:

* ``ReaderSource``: what the engine reads in place, on any store: a Hugging Face directory (or
  one ``.safetensors`` file), a ``torch.distributed.checkpoint`` directory (its ``.metadata`` is a
  pickle, so reading it needs ``allow_pickle=True``), ours. The engine's reader of the format.
* ``TorchFileSource``: a ``.pt``/``.bin`` file through ``torch.load(weights_only=True)`` only.
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
from ..format.metadata import Metadata
from ..storage.formats.foreign import HF_INDEX, HF_SINGLE
from ..storage.interfaces import ReadRequest
from ..storage.location import resolve
from ..core.rafile import open_regular, open_regular_file
from ..format.metadata import dtype_from_name, dtype_name
from ..core.utils import flatten_state_dict


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


class ReaderSource(TensorSource):
    """A checkpoint the engine reads in place (Hugging Face safetensors, torch DCP, ours), on any
    location, through the engine's own reader of that format: the offline tools have no second
    implementation of a format. Regions are read with partial reads (a box of a tensor costs
    that box's bytes)."""

    def __init__(self, path: str | os.PathLike, fmt: str, *, allow_pickle: bool = False) -> None:
        from ..protocol import metadata_source
        from ..storage.checkpoint_io import open_reader

        self.path = resolve(path)
        self.allow_pickle = allow_pickle
        self.reader = open_reader(self.path, fmt, allow_pickle=allow_pickle, files_kept=4)
        try:
            self.md = Metadata.from_json(self.reader.read_metadata_text(),
                                         source=metadata_source(self.reader, self.path), open_file=self.reader.open_file)
            self.reader.attach_metadata(self.md)
            self.reader.check_files(sorted(self.md.files))  # every file there, of its recorded size
        except BaseException:
            self.reader.close()
            raise
        self.format_name = self.reader.format_name
        self.specs = {k: (t.dtype, tuple(t.shape)) for k, t in self.md.tensors.items()}

    def objects(self) -> dict[str, Any]:
        if not self.md.objects:
            return {}
        return self.reader.read_objects(self.md.objects, allow_pickle=self.allow_pickle)

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        tm = self.md.tensors[key]
        box = box if box is not None else whole(tm.shape)
        out = torch.empty(box.sizes, dtype=dtype_from_name(tm.dtype))
        requests = []
        for c in tm.chunks:
            inter = intersect(box, Box(tuple(c.offsets), tuple(c.sizes)))
            if inter is None or inter.numel == 0:
                continue
            sub = Box(relative(inter, Box(tuple(c.offsets), tuple(c.sizes))), inter.sizes)
            requests.append(ReadRequest(c, tm.dtype, sub, narrow(out, relative(inter, box), inter.sizes)))
        if requests:
            self.reader.read_tensors(requests)
        return out

    def close(self) -> None:
        self.reader.close()


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
    """A source for ``path`` on any location; ``fmt`` is auto | hf | safetensors | pt | torch_dcp |
    hpdcp | hyper_parallel. Formats the engine reads go through its reader (any store); a torch
    file and a hyper-parallel checkpoint are read from a local path."""
    from ..storage.formats.foreign import detect_format
    from ..storage.location import locate

    kinds = ("auto", "hf", "safetensors", "pt", "torch_dcp", "hpdcp", "hyper_parallel")
    if fmt not in kinds:
        raise ConfigError(f"unknown source format {fmt!r} ({', '.join(kinds)})")
    loc = locate(path)
    if fmt == "auto":
        fmt = detect_format(loc)
        if fmt == "hpdcp" and not loc.is_dir() and not loc.is_file():
            raise CheckpointNotFoundError(f"{loc.url} does not exist")
        if fmt == "hpdcp" and loc.is_dir() and not (set(loc.files()) & {"metadata.json", "hpdcp-commit.json"}):
            raise CheckpointNotFoundError(f"{loc.url}: cannot tell the checkpoint format (no {HF_INDEX}, {HF_SINGLE} "
                                          f"or .metadata)")
    if fmt in ("pt", "hyper_parallel"):
        path = loc.local_dir(f"a {fmt} source is read from a local path (download it first); Hugging Face, torch "
                             f"DCP and our checkpoints are read in place from any store")
        return TorchFileSource(path) if fmt == "pt" else HyperParallelSource(path, allow_pickle=allow_pickle)
    return ReaderSource(loc.url, "hf" if fmt == "safetensors" else fmt, allow_pickle=allow_pickle)
