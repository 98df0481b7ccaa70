"""A ``torch.save`` archive read without running it: its pickled structure as plain data, each
tensor located (storage entry, offset, size, stride) where its bytes lie, never loaded.

The readers of other training stacks' checkpoints (DeepSpeed's, Megatron-LM's legacy format) share
this. Their ``data.pkl`` is read by a restricted unpickler that admits torch's tensor rebuild,
storage types, dtypes and ``torch.Size``, plus the few classes each format names (its own
:class:`Archive` subclass's ``ADMITTED``), each turned into a plain :class:`Record` of the
arguments and state it was pickled with: no class of theirs is imported, no function of theirs
called. Any other class is refused with the file and the class named.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import zipfile
from typing import Any, Callable

import torch

from ...core.errors import CorruptCheckpointError, MetadataError, PickleNotAllowedError
from ...core.rafile import RandomAccessFile
from .foreign import _Window, _bounded_read, _entry_data, _row_major, _STORAGE_DTYPES

MAX_PICKLE = 64 << 20  # a data.pkl holds names, shapes and configs: megabytes at most


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor of the archive, located, not loaded: its storage entry, dtype, offset (elements),
    size and stride."""

    storage: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)


class Record:
    """An object of a class the format names, kept as plain data (the arguments it was built
    with and its pickled state); the class itself is never imported."""

    state: Any = None
    args: tuple = ()

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state if self.state is not None else self.args!r})"


class _Dict(dict):
    """A pickled ``OrderedDict``: plain, but it takes the attributes pickle sets (a state dict's
    ``_metadata``)."""


def _tensor(st: tuple, off: int, size: Any, stride: Any, *rest: Any) -> TensorRef:
    return TensorRef(st[1], st[0], int(off), tuple(size), tuple(stride))


#: what every torch.save archive may hold, by (module, name)
_TORCH = {("torch._utils", "_rebuild_tensor_v2"): _tensor,
          ("torch._utils", "_rebuild_parameter"): lambda data, *rest: data,
          ("collections", "OrderedDict"): _Dict,
          # a tensor subclass: the tensor (its new_type is one of the two names below)
          ("torch._tensor", "_rebuild_from_type_v2"): lambda func, new_type, args, state: func(*args),
          ("torch.nn.parameter", "Parameter"): "Parameter", ("torch", "Tensor"): "Tensor",
          ("torch", "Size"): tuple}


class Archive(pickle.Unpickler):
    """Unpickles a ``data.pkl`` into plain data and :class:`TensorRef` (see the module docstring).
    A format's subclass names what else it admits (``ADMITTED``: (module, name) -> what stands
    for it; ``ADMITTED_MODULES``: module -> what stands for any class of it) and says so in
    ``ADMITS`` for the refusal."""

    ADMITTED: dict[tuple[str, str], Any] = {}
    ADMITTED_MODULES: dict[str, Callable[[str], Any]] = {}
    ADMITS = "tensors and plain data"

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TORCH:
            return _TORCH[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ADMITTED:
            return self.ADMITTED[(module, name)]
        if module in self.ADMITTED_MODULES:
            return self.ADMITTED_MODULES[module](name)
        raise PickleNotAllowedError(f"{self.where}: holds an object of class {module}.{name}, which this reader "
                                    f"does not admit (only {self.ADMITS}); nothing of it was run")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        dtype = pid[1] if isinstance(pid[1], torch.dtype) else torch.uint8
        return (dtype, str(pid[2]))


class ArchiveIndex:
    """One ``torch.save`` archive: its pickled structure (tensors as :class:`TensorRef`, read by
    ``unpickler``) and where each storage's bytes start in the file."""

    def __init__(self, fd: RandomAccessFile, where: str, unpickler: type[Archive] = Archive) -> None:
        size = fd.size()
        try:
            with zipfile.ZipFile(io.BufferedReader(_Window(fd, 0, size))) as zf:
                infos = zf.infolist()
                pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
                if len(pkl) != 1:
                    raise CorruptCheckpointError("no data.pkl")
                self.prefix = pkl[0].filename[:-len("data.pkl")]
                self.tree = unpickler(_bounded_read(zf, pkl[0], MAX_PICKLE), where).load()
                align = [i for i in infos if i.filename == f"{self.prefix}.storage_alignment"]
                alignment = int(_bounded_read(zf, align[0], 32)) if align else 1
                self._starts: dict[str, tuple[int, int, int]] = {}  # storage -> (data offset, bytes, CRC-32)
                for info in infos:
                    if info.filename.startswith(f"{self.prefix}data/"):
                        key = info.filename[len(f"{self.prefix}data/"):]
                        self._starts[key] = (_entry_data(fd, 0, size, info, infos, zf.start_dir, alignment),
                                             info.file_size, info.CRC)
        except PickleNotAllowedError:
            raise
        except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, EOFError, TypeError,
                OverflowError, AttributeError, IndexError) as e:
            raise CorruptCheckpointError(f"{where}: not a readable torch.save archive ({type(e).__name__}: "
                                         f"{str(e)[:200]})") from None
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
        self.where = where

    def flat(self, t: Any, what: str) -> tuple[int, int]:
        """(file offset, elements) of a 1-D (or contiguous) tensor ``t`` of this archive."""
        if not isinstance(t, TensorRef):
            raise MetadataError(f"{self.where}: {what} is not a tensor")
        if t.stride != _row_major(t.size) and t.numel > 1:
            raise MetadataError(f"{self.where}: {what} is not contiguous (size {list(t.size)}, stride {list(t.stride)})")
        start, nbytes, _ = self._starts.get(t.storage, (None, 0, 0))
        esize = torch.empty((), dtype=t.dtype).element_size()
        if start is None or t.offset < 0 or (t.offset + t.numel) * esize > nbytes:
            raise CorruptCheckpointError(f"{self.where}: {what} lies outside its storage entry")
        return start + t.offset * esize, t.numel

    def crc_of(self, t: TensorRef) -> str:
        """``crc32:<hex>`` of the zip entry ``t`` fills whole (what a reader checks when it reads
        that chunk whole), else '' (a part of a storage: the CRC covers the entry)."""
        start, nbytes, crc = self._starts.get(t.storage, (None, 0, 0))
        whole = start is not None and t.offset == 0 and t.numel * torch.empty((), dtype=t.dtype).element_size() == nbytes
        return f"crc32:{crc:08x}" if whole else ""


class ArchiveFiles:
    """What a reader of ``torch.save`` archives (a ``_DescribedReader``) shares: ``_archive(name)``
    indexes one of its files with the reader's ``UNPICKLER`` (the classes its format admits)."""

    UNPICKLER: type[Archive] = Archive

    def _archive(self, name: str) -> ArchiveIndex:
        f = self._random_access(name)  # type: ignore[attr-defined]
        try:
            return ArchiveIndex(f, self.full(name), self.UNPICKLER)  # type: ignore[attr-defined]
        finally:
            f.close()
