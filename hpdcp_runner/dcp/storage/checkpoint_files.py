"""The files of one checkpoint as a load sees them: what the reader takes by composition.

A :class:`CheckpointFiles` is a location's checkpoint pinned for one load. The reader
(``reader.CheckpointReader``) plans, verifies and copies; this says where the bytes come from
and what "the same checkpoint" means on that storage:

* ``posix_files.PinnedDirectory``: a local directory held open by a descriptor, every file
  opened inside it, never through a link; the pin is the directory's inode.
* ``object_files.StorePrefix``: a key prefix in a bucket; ours is the save its commit object
  names (the pin), a foreign one the prefix as it is. Ranges are fetched ahead concurrently,
  round by round, and later reads are served from them.

Adding a store adds a client (``store_client``), whose files ``StorePrefix`` reads; a storage whose
files are reached in another way than a store's adds one of these, and every format's reader (ours, Hugging Face, torch DCP) reads from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

from ..core.errors import CheckpointChangedError, HpdcpError, MetadataError
from ..core.rafile import RandomAccessFile
from ..format.metadata import MAX_FILE_DEPTH
from .interfaces import IOCounters


def plain_name(name: str, where: str) -> str:
    """A file name inside the checkpoint: a plain name (no separator, no dot-dot), or a path of
    such names into its subdirectories (at most ``MAX_FILE_DEPTH`` deep): what a description's own file
    names (``.metadata``, an index's shard names, a universal checkpoint's ``zero/<param>/fp32.pt``,
    already checked) must still be."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or len(parts) > MAX_FILE_DEPTH or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise MetadataError(f"{where}: {name!r} is not a plain file name inside the checkpoint")
    return name


class CheckpointFiles(ABC):
    """One checkpoint's files on some storage, pinned for one load."""

    #: the checkpoint as errors and logs name it (a path or a URI)
    url: str
    #: reads are slow (network or shared storage): a replica broadcast pays off even on one node
    shared: bool = False
    #: bytes fetched per round (``fetch`` then reads served from memory); None: read on demand
    round_bytes: int | None = None
    #: the reader's counters (set by the reader that owns these files)
    counters: IOCounters

    # -- our format: the metadata, and which checkpoint this load reads --------------------
    @abstractmethod
    def metadata_text(self, name: str, max_bytes: int) -> str:
        """Our ``metadata.json`` (``name``) as text, capped, from the committed checkpoint,
        which this pins; a checkpoint not there is ``not_found()``."""

    @abstractmethod
    def pin_directory(self) -> None:
        """Fix which directory (or save) the files below come from, if not yet fixed."""

    @abstractmethod
    def pin(self) -> Any:
        """A JSON-able identity of the pinned checkpoint (rank 0's, sent to the other ranks)."""

    @abstractmethod
    def attach(self, pin: Any) -> None:
        """Pin to the coordinator's ``pin`` (None: pin now); a different one is ``changed``."""

    @abstractmethod
    def not_found(self) -> HpdcpError:
        """No committed checkpoint here, with a hint of what is there instead."""

    def changed(self, how: str) -> CheckpointChangedError:
        return CheckpointChangedError(f"checkpoint {self.url} changed during the load ({how}: overwritten, moved or "
                                      f"deleted by another process); nothing loaded from it can be trusted")

    @abstractmethod
    def missing(self, name: str) -> HpdcpError:
        """The file ``name`` the metadata lists is not there: the checkpoint changed under this
        load, or the file is really missing."""

    # -- files --------------------------------------------------------------------------------
    @abstractmethod
    def require_directory(self) -> None:
        """Something is there to describe (a foreign checkpoint), else CheckpointNotFoundError."""

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size_of(self, name: str) -> int:
        """The size of the regular file ``name`` (missing: CheckpointNotFoundError; a link or a
        directory: CorruptCheckpointError)."""

    @abstractmethod
    def read_small(self, name: str, max_bytes: int) -> bytes:
        """The file ``name`` whole (a description's index, a pickle): missing is not found."""

    @abstractmethod
    def open_random(self, name: str) -> RandomAccessFile:
        """The file ``name`` for reads by range (owned by the caller: close it)."""

    @abstractmethod
    def check_sizes(self, names: Iterable[str], expected: dict[str, int]) -> None:
        """Each file is there, a regular file, of its ``expected`` size where one is given."""

    @abstractmethod
    def open_handle(self, name: str, expected: int | None) -> Any:
        """A handle for :meth:`pread_into` (checked against the ``expected`` size)."""

    def close_handle(self, handle: Any) -> None:
        """Release a handle the reader's open-file cache let go of."""

    def handles_kept(self, files_kept: int) -> int:
        """How many handles the reader keeps open: ``files_kept`` where a handle holds a resource."""
        return files_kept

    @abstractmethod
    def size(self, handle: Any) -> int: ...

    @abstractmethod
    def pread_into(self, handle: Any, offset: int, view: memoryview, name: str) -> None:
        """Fill ``view`` from the file at ``offset`` (a short read is CorruptCheckpointError)."""

    def vectored_fd(self, handle: Any) -> int | None:
        """An OS descriptor for vectored reads straight into destinations, or None (then slabs)."""
        return None

    # -- fetching ahead (stores) ---------------------------------------------------------------
    def fetch(self, ranges: Sequence[tuple[str, int, int]], handles: dict[str, Any]) -> None:
        """Bring in these (file, start, stop) ranges before a round's reads (default: nothing)."""

    def release(self) -> None:
        """Drop what ``fetch`` brought in (a round is done)."""

    def bytes_arrived(self) -> int:
        """Bytes fetched so far (progress leads the copies out); 0 where nothing is fetched ahead."""
        return 0

    # -- the storage's own digests (foreign files, which record none) -----------------------------
    def check_store_digests(self) -> None:
        """Check every file read whole against the digest the storage keeps of it, where it keeps
        one (object stores: ``store_digests``); a file system keeps none (default: nothing)."""

    def store_digest_states(self) -> dict[str, str]:
        """{file: matched | skipped | unusable | failed | open} of the files with such a digest."""
        return {}

    def close(self) -> None:
        """Release the pin and anything held."""
