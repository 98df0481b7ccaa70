"""Storage interfaces: where checkpoint bytes go and come from.

Planners decide *what* moves; storage only moves bytes. A writer stages every file of a
checkpoint somewhere invisible and makes it visible in one step (``commit``); a reader fills
destination views that the planner already resolved.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..core.errors import MetadataError
from ..core.geometry import Box
from ..core.rafile import RandomAccessFile
from ..format.metadata import ChunkMeta, Metadata, ObjectMeta, WriteResult, element_size

__all__ = ["StorageWriter", "StorageReader", "ReadRequest", "IOCounters", "WriteResult"]


@dataclass(frozen=True)
class ReadRequest:
    """Copy the sub-box ``sub`` (relative to the chunk's origin) of a stored chunk into ``dest``."""

    chunk: ChunkMeta
    dtype: str
    sub: Box
    dest: torch.Tensor


@dataclass
class IOCounters:
    """Per-rank I/O counters, reported in the runner's metrics."""

    bytes_read: int = 0
    reads: int = 0
    files_opened: int = 0
    chunks_verified: int = 0
    bytes_written: int = 0
    files_written: int = 0
    #: what this rank will move in the current save or load (written, or read plus received), set
    #: once the plan says: the total a progress bar shows
    expected_bytes: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    #: what the operation is doing now, in words (a progress bar's hint of what it waits for)
    stage: str = ""

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the named extra counter (broadcasts, bytes_received, ...)."""
        self.extra[name] = self.extra.get(name, 0) + n

    @contextlib.contextmanager
    def staged(self, what: str) -> Iterator[None]:
        """``stage`` is ``what`` while the body runs."""
        before, self.stage = self.stage, what
        try:
            yield
        finally:
            self.stage = before

    def as_dict(self) -> dict[str, int]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("extra", "stage")}
        d.update(self.extra)
        return d


class StorageWriter(ABC):
    """Where one save's bytes go. Call sequence (every rank runs the same protocol)::

        rank 0:     token = begin(overwrite=...)          # check the target, create staging
        every rank: attach(token, rank=r, world_size=n)   # learn the staging area
        every rank: result = write(tensors, objects)      # this rank's share, durable in staging
        rank 0:     commit(metadata)                      # metadata last, then visible atomically
        rank 0, on any failure after begin: abort()       # staging removed, nothing committed

    ``checkpoint_id`` names the checkpoint (logs, errors); ``counters`` are this rank's I/O.
    """

    #: what this writer saves to (a directory path for the filesystem), for logs and errors
    checkpoint_id: str | None = None
    counters: IOCounters

    @property
    def protocol_kind(self) -> str:
        """What every rank's writer must agree on (the storage whose begin/attach/commit the
        save runs); a wrapper that only moves where ``write`` runs reports its inner writer's."""
        return type(self).__name__

    @abstractmethod
    def begin(self, *, overwrite: bool) -> str:
        """Coordinator only: check the target and create the staging area; returns its token."""

    @abstractmethod
    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        """Every rank: learn the staging area chosen by the coordinator."""

    @abstractmethod
    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], objects: Mapping[str, Any]) -> WriteResult:
        """Write this rank's contiguous CPU tensors and encoded objects durably into staging."""

    @abstractmethod
    def commit(self, metadata: Metadata) -> None:
        """Coordinator only: write the metadata last and make the checkpoint visible atomically.
        Format v2 (``metadata.index`` set): first write the chunk index beside it
        (``format.safetensors_io.write_index`` to ``metadata.index.describe()["file"]``), then
        ``metadata.to_json()``; a storage that cannot is saved with ``format_version=1``."""

    @abstractmethod
    def abort(self) -> None:
        """Coordinator only, best effort: remove the staging area; never touches a committed checkpoint."""

    def open_sink(self, name: str, size: int) -> Any:
        """Every rank, after ``attach``: the file ``name`` (``size`` bytes) of staging, written by
        blocks (``write(bytes)``, ``close()`` makes it durable, ``abort()`` drops it): how a
        committed checkpoint's files are copied in unchanged (``drain.copy_checkpoint``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take copied files")

    def commit_copy(self, metadata: Metadata, body: bytes) -> None:
        """Coordinator: ``commit`` for a copied checkpoint, whose chunk index was copied in as a
        file: ``body`` (its ``metadata.json`` as it is) last, then visible atomically."""
        raise NotImplementedError(f"{type(self).__name__} cannot commit copied checkpoints")

    def reopen_args(self) -> dict[str, Any] | None:
        """``open_writer``'s arguments that open this same writer in another process (an async
        save persisted by a process of its own), or None: a writer of the caller's own, which
        only its own process can run."""
        return None

    def committed_opener(self) -> Callable[[str], Any] | None:
        """How every rank opens a file of the committed checkpoint by name (a format-v2 chunk
        index is read lazily, the rows each rank needs); None: the storage cannot."""
        return None

    def discard_own(self) -> None:
        """Every rank of a failed save, best effort: remove what this rank wrote, where the
        coordinator's ``abort`` may not see it (an upload that completed after the abort ran).
        Never touches a committed checkpoint."""


class StorageReader(ABC):
    """Where one load's bytes come from. Call sequence::

        rank 0:     text = read_metadata_text(); p = pin()  # the metadata and what was read
        every rank: attach_metadata(parsed, pin=p)          # validated metadata; same checkpoint?
        every rank: check_reads(names, spans)               # check_files(names), before any byte moves
        every rank: read_tensors(requests); read_objects(wanted, allow_pickle=...)
        every rank: close()

    ``checkpoint_id`` names the checkpoint (logs, errors); ``format_name`` says what the files
    are (``hpdcp``, ``hf``, ``torch_dcp``); ``counters`` are this rank's I/O.
    """

    #: what this reader loads from (a directory path for the filesystem), for logs and errors
    checkpoint_id: str | None = None
    format_name: str = "hpdcp"
    counters: IOCounters
    #: True when reads are expensive (network/shared storage): replica broadcast pays off even on one node.
    slow_storage: bool = False

    @abstractmethod
    def read_metadata_text(self) -> str:
        """The raw metadata document (size-capped)."""

    @abstractmethod
    def attach_metadata(self, metadata: Metadata, pin: Any = None) -> None:
        """Every rank: the validated metadata, used to check files before reading them, and the
        coordinator's ``pin()`` (None: no check), so every rank reads the checkpoint rank 0 read."""

    def attach_pin(self, pin: Any) -> None:
        """Every rank, before it parses the coordinator's metadata: read from the checkpoint
        ``pin`` names from here on, so what parsing opens (a format-v2 chunk index) is that
        checkpoint's, not whatever the name holds by then (and costs no lookup of its own)."""

    def open_file(self, name: str) -> "int | RandomAccessFile":
        """The checkpoint's file ``name`` (a regular file inside the checkpoint) for reads by
        range, a random-access file or a descriptor: how every rank opens a format-v2 chunk
        index to read the rows it needs."""
        raise MetadataError(f"{type(self).__name__} cannot open {name!r}: it reads no format-v2 checkpoints")

    def check_files(self, names: Iterable[str]) -> None:
        """Check these files (exist, readable, recorded size) before any data is read; a storage
        that cannot check cheaply may do nothing."""

    def check_reads(self, names: Iterable[str], spans: Callable[[], Mapping[str, list[tuple[int, int]]]]) -> None:
        """What a load calls before any data is read: ``check_files(names)``. ``spans()`` gives
        the byte ranges of each of those files this rank's plan may read (the whole chunks it
        reads from): a reader that must get a file before it can read it (a node-local restore)
        may get only those ranges."""
        self.check_files(names)

    def pin(self) -> Any:
        """Coordinator, after ``read_metadata_text``: a JSON-able identity of what was read (None:
        the storage cannot tell)."""
        return None

    @abstractmethod
    def read_tensors(self, requests: Sequence[ReadRequest], on_done: Callable[[int], None] | None = None,
                     keep_order: bool = False) -> None:
        """Fill every request's destination; ``on_done(k)`` after request k. The order is the
        reader's choice unless ``keep_order`` asks for the given one (a hint)."""

    @abstractmethod
    def read_objects(self, wanted: Mapping[str, ObjectMeta], *, allow_pickle: bool) -> dict[str, Any]: ...

    def read_bytes(self, chunk: ChunkMeta, dtype: str, sub: Box) -> int:
        """The bytes reading the part ``sub`` (relative to the chunk) of ``chunk`` would fetch: a
        load shares a chunk's read among the ranks that need parts of it when this is well above
        the part's own bytes. A reader that fetches exactly what is asked says so."""
        return sub.numel * element_size(dtype)

    def bytes_moved(self) -> int:
        """Bytes this reader has brought in so far, for progress: what it read, or (a store
        fetching ahead) what has arrived, which leads what was copied out."""
        return self.counters.bytes_read

    def close(self) -> None:
        """Release open files."""
