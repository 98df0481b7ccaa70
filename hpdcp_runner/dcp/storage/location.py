"""Locations: a directory of files on some storage, the one seam every store is a peer behind.

A :class:`Location` is a local directory or a prefix in an object store. It lists its files,
sizes them, reads small ones whole and large ones by ranges, writes and deletes them, and says
what the storage can do (an atomic rename, a conditional write), which decides how a checkpoint
or an offline tool's output is made visible (``commit``). :func:`locate` is the only function that
turns a user's path into one: it asks the store registry (``stores``), so nothing outside
``storage/`` looks at a URI's scheme.

``PosixLocation`` keeps the file system's protections: files are opened inside a pinned directory
descriptor, never through a link. ``ObjectLocation`` is a key prefix of a store, through the
client its registry entry names (``store_client.open_client``: obstore's clouds, an SFTP server).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from ..core.errors import ConfigError
from ..core.rafile import RandomAccessFile
from ..core.utils import get_logger
from .stores import is_remote, kind_of
from .uri import check_uri, join, normalize, split

log = get_logger(__name__)

if TYPE_CHECKING:
    from .catalog import Catalog
    from .checkpoint_files import CheckpointFiles
    from .interfaces import StorageWriter


@dataclass(frozen=True)
class Capabilities:
    """What a storage offers the commit: how a finished directory becomes visible."""

    #: files can be staged under another name and renamed into place in one step (POSIX)
    atomic_rename: bool
    #: a create-if-absent / replace-if-unchanged write (object stores with preconditions)
    conditional_write: bool


def _store_option_names() -> tuple[str, ...]:
    import dataclasses

    from .objects.object_store import ObjectStoreOptions

    return tuple(f.name for f in dataclasses.fields(ObjectStoreOptions))


class Location(ABC):
    """A directory of files: local, or a key prefix in a store."""

    url: str
    capabilities: Capabilities

    @property
    def local_path(self) -> str | None:
        """The POSIX path of a local directory (None in a store): for what only a file system
        does (a tool that writes through torch's own file writer)."""
        return None

    @property
    def name(self) -> str:
        return split(self.url)[1]

    def parent(self) -> "Location":
        return locate(split(self.url)[0])

    def __str__(self) -> str:
        return self.url

    @abstractmethod
    def checkpoint_files(self, *, committed: bool) -> "CheckpointFiles":
        """The files of the checkpoint here, for one load (``checkpoint_files``): ``committed``
        for ours (what the commit made visible), else the directory as it is (a foreign format)."""

    def holds_commit(self) -> bool | None:
        """Whether one small read says a checkpoint of ours is committed here (a store's commit
        object), None where only a listing tells (a local directory: listing it costs nothing)."""
        return None

    @abstractmethod
    def is_dir(self) -> bool:
        """True when something is there as a directory (a store: any object under the prefix)."""

    @abstractmethod
    def is_file(self) -> bool:
        """True when this location is itself one regular file (a store: one object)."""

    @abstractmethod
    def files(self) -> dict[str, int]:
        """The regular files right under this directory: {name: size} (links are not files)."""

    @abstractmethod
    def dirs(self) -> list[str]:
        """The names of the directories right under this one (a store: the common prefixes; a
        link is not a directory): a format that keeps one directory per rank is found by them."""

    @abstractmethod
    def read_small(self, name: str, max_bytes: int) -> bytes | None:
        """The file ``name`` here read whole (None when there is none); over ``max_bytes`` is cut
        (POSIX) or refused (store) before the body is read."""

    @abstractmethod
    def open_range(self, name: str) -> RandomAccessFile:
        """The file ``name`` here for reads by range (``pread``, ``size``, ``close``)."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Write the file ``name`` here whole (not atomic: ``commit`` makes sets of files visible)."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Remove these files (those already gone are not an error)."""

    # -- what callers ask instead of telling local from remote -----------------------------------
    def local_dir(self, needs: str, error: type[Exception] = ConfigError) -> str:
        """This directory's POSIX path, for what only a file system serves (a tool that reads
        with torch's own file reader); a store raises ``error`` saying so (``needs``)."""
        raise error(f"{self.url}: {needs}")

    def overlaps(self, other: "Location") -> bool:
        """Whether this directory and ``other`` are the same or one lies inside the other (a copy
        into its own source, two tiers in one place)."""
        a, b = self.url.rstrip("/") + "/", other.url.rstrip("/") + "/"
        return a.startswith(b) or b.startswith(a)

    def commit_state(self) -> str:
        """'committed', 'uncommitted' (a save that did not finish) or 'missing', from what is
        here: a store's checkpoint is described through its commit object alone."""
        return "committed"

    def file_opener(self) -> Callable[[str], int] | None:
        """``name -> a read-only descriptor`` of a regular file here (how a format-v2 chunk index
        is opened after a save through a writer of the caller's own), None in a store (its
        files are read through its reader)."""
        return None

    def describe(self) -> str:
        """What a person reads this location as ("local directory /x", "s3://b/p")."""
        return self.url

    #: the storage options (``ReaderOptions`` / ``ObjectStoreOptions`` field names) that change
    #: nothing here: an object-store knob on a local directory, a file-system one on a store
    inert_options: tuple[str, ...] = ()

    def claim(self, name: str) -> "Location | None":
        """A new directory ``name`` here for this caller alone, or None when one is there: a
        store has no exclusive create, so it is a prefix nothing is stored under yet."""
        loc = locate(join(self.url, name))
        return None if loc.is_dir() else loc

    def remove_if_empty(self) -> None:
        """Remove this directory if nothing is left in it (a store keeps no empty prefix)."""

    # -- a directory of checkpoints: saves, retention, "latest" -----------------------------------
    @abstractmethod
    def open_writer(self, *, fsync: bool = True) -> "StorageWriter":
        """The writer of a checkpoint here: the rename commit on a file system (``fsync``: its
        durability), the commit object on a store."""

    @abstractmethod
    def catalog(self) -> "Catalog":
        """The committed checkpoints right under this directory, for retention and "latest"."""

    def read_files(self, keep: Callable[[str], bool], max_bytes: int, *, names_only: bool = False) -> dict[str, bytes]:
        """The regular files here whose names ``keep`` admits, each read whole (``names_only``:
        empty); one over ``max_bytes`` is left out, with a warning. The small files that travel
        with a model (config, tokenizer)."""
        out = {}
        for name, size in self.files().items():
            if not keep(name):
                continue
            if size > max_bytes:
                log.warning("not copying %s: over %d bytes", join(self.url, name), max_bytes)
                continue
            got = b"" if names_only else self.read_small(name, max_bytes)
            if got is not None:
                out[name] = got
        return out


class PosixLocation(Location):
    """A local directory."""

    capabilities = Capabilities(atomic_rename=True, conditional_write=False)

    @property
    def inert_options(self) -> tuple[str, ...]:  # type: ignore[override]
        return _store_option_names()

    def __init__(self, path: str | os.PathLike) -> None:
        self.url = os.path.abspath(os.fspath(path))

    @property
    def local_path(self) -> str:
        return self.url

    def checkpoint_files(self, *, committed: bool) -> "CheckpointFiles":
        from .posix.posix_files import PinnedDirectory

        return PinnedDirectory(self.url)  # (the rename commit: what is there is committed)

    def is_dir(self) -> bool:
        return os.path.isdir(self.url)

    def is_file(self) -> bool:
        return os.path.isfile(self.url) and not os.path.islink(self.url)

    def files(self) -> dict[str, int]:
        out = {}
        with os.scandir(self.url) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    def dirs(self) -> list[str]:
        with os.scandir(self.url) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))

    def read_small(self, name: str, max_bytes: int) -> bytes | None:
        from ..core.rafile import open_regular_file

        path = os.path.join(self.url, name)
        if not os.path.isfile(path):
            return None
        with open_regular_file(path, what="file") as f:  # inside its directory, never through a link
            return f.read(max_bytes + 1)[:max_bytes]

    def open_range(self, name: str) -> RandomAccessFile:
        from ..core.rafile import as_random_access, open_regular

        return as_random_access(open_regular(os.path.join(self.url, name)))

    def put(self, name: str, data: bytes) -> None:
        os.makedirs(self.url, exist_ok=True)
        with open(os.path.join(self.url, name), "wb") as f:
            f.write(data)

    def delete(self, names: Iterable[str]) -> None:
        for n in names:
            try:
                os.unlink(os.path.join(self.url, n))
            except FileNotFoundError:
                pass

    def local_dir(self, needs: str, error: type[Exception] = ConfigError) -> str:
        return self.url

    def file_opener(self) -> Callable[[str], int]:
        from ..core.rafile import open_regular

        return lambda name: open_regular(os.path.join(self.url, name))

    def describe(self) -> str:
        return f"local directory {self.url}"

    def claim(self, name: str) -> Location | None:
        os.makedirs(self.url, exist_ok=True)
        try:
            os.mkdir(os.path.join(self.url, name), 0o700)  # exclusive: a folder that was there is not ours
        except FileExistsError:
            return None
        return PosixLocation(os.path.join(self.url, name))

    def remove_if_empty(self) -> None:
        try:
            os.rmdir(self.url)
        except OSError:
            pass

    def overlaps(self, other: Location) -> bool:
        if not isinstance(other, PosixLocation):
            return False
        a, b = os.path.realpath(self.url), os.path.realpath(other.url)  # (links resolved)
        return a == b or b.startswith(a.rstrip(os.sep) + os.sep) or a.startswith(b.rstrip(os.sep) + os.sep)

    def commit_state(self) -> str:
        from ..format.metadata import METADATA_FILE
        from .posix.commit import STAGING_MARK, TRASH_MARK

        if os.path.isfile(os.path.join(self.url, METADATA_FILE)):
            return "committed"
        if os.path.isdir(self.url) or STAGING_MARK in self.name or TRASH_MARK in self.name:
            return "uncommitted"
        return "missing"

    def open_writer(self, *, fsync: bool = True) -> "StorageWriter":
        from .posix.filesystem import FileSystemWriter

        return FileSystemWriter(self.url, fsync=fsync)

    def catalog(self) -> "Catalog":
        from .posix.series import PosixCatalog

        return PosixCatalog(self.url)

    def read_files(self, keep: Callable[[str], bool], max_bytes: int, *, names_only: bool = False) -> dict[str, bytes]:
        """Each file opened inside the directory's own descriptor without following links and
        checked on that descriptor, then read from it: a link swapped in after the listing is
        refused, never followed (what is read is what was checked)."""
        from ..core.errors import HpdcpError
        from ..core.rafile import open_regular_file

        out = {}
        dfd = os.open(self.url, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            for name in sorted(os.listdir(dfd)):
                if not keep(name):
                    continue
                try:
                    f = open_regular_file(os.path.join(self.url, name), dfd, what="side file")
                except (FileNotFoundError, HpdcpError):
                    continue  # a link, a directory, a device, or gone: not read
                with f:
                    if os.fstat(f.fileno()).st_size > max_bytes:
                        log.warning("not copying %s: over %d bytes", os.path.join(self.url, name), max_bytes)
                        continue
                    out[name] = b"" if names_only else f.read(max_bytes + 1)[:max_bytes]
        finally:
            os.close(dfd)
        return out


class ObjectLocation(Location):
    """A key prefix in a store (``s3://``, ``gs://``, ``az://``, ``sftp://``) through its client."""

    capabilities = Capabilities(atomic_rename=False, conditional_write=True)
    inert_options = ("files_kept", "fsync", "shared", "max_read_bytes_per_s", "read_gap_bytes")

    def __init__(self, uri: str, options: object = None) -> None:
        from .store_client import open_client

        self.url = normalize(uri)
        self.bucket = open_client(self.url, options)  # type: ignore[arg-type]
        self._commit: tuple | None = None  # (the commit as holds_commit read it, seconds it took)

    def checkpoint_files(self, *, committed: bool) -> "CheckpointFiles":
        from .objects.object_files import StorePrefix

        seen, self._commit = self._commit, None  # (handed on once: a later reader reads its own)
        return StorePrefix(self.bucket, committed=committed, commit=seen if committed else None)

    def holds_commit(self) -> bool:
        """One GET of the commit object, kept for the reader opened next: a load of ours learns
        its format and its pin from the same round trip (a listing to tell formats apart, then
        the commit, were two)."""
        from .objects.object_checkpoint import read_commit

        if not self.bucket.root:
            return False
        t0 = time.perf_counter()
        got = read_commit(self.bucket, self.bucket.root)
        self._commit = (got, time.perf_counter() - t0)
        return got is not None

    def is_dir(self) -> bool:
        return next(iter(self.bucket.list(self.bucket.root)), None) is not None

    def is_file(self) -> bool:
        return bool(self.bucket.root) and self.bucket.head(self.bucket.root) is not None

    def files(self) -> dict[str, int]:
        return {o["path"].rsplit("/", 1)[-1]: o["size"] for o in self.bucket.list_dir(self.bucket.root)[1]}

    def dirs(self) -> list[str]:
        return sorted(self.bucket.list_dir(self.bucket.root)[0])

    def read_small(self, name: str, max_bytes: int) -> bytes | None:
        got = self.bucket.get(self.bucket.key(name), max_bytes=max_bytes)
        return None if got is None else got[0]

    def open_range(self, name: str) -> RandomAccessFile:
        from .objects.object_store import RemoteFile

        return RemoteFile(self.bucket, self.bucket.key(name), None)

    def put(self, name: str, data: bytes) -> None:
        self.bucket.put(self.bucket.key(name), data)

    def delete(self, names: Iterable[str]) -> None:
        self.bucket.delete([self.bucket.key(n) for n in names])

    def open_writer(self, *, fsync: bool = True) -> "StorageWriter":
        from .objects.object_checkpoint import ObjectStoreWriter

        return ObjectStoreWriter(self.url, options=self.bucket.options)  # (a store's writes are durable when acknowledged)

    def catalog(self) -> "Catalog":
        from .objects.object_checkpoint import StoreCatalog

        return StoreCatalog(self.bucket)


def locate(path: str | os.PathLike | Location, base: str | None = None, *, options: object = None) -> Location:
    """The location ``path`` names: a store URI of a registered scheme (checked: a scheme we do
    not serve, or credentials in it, is a ConfigError naming it; ``options``: its client's
    ``ObjectStoreOptions``, default the process's), or a local path (relative ones from ``base``,
    default the working directory)."""
    if isinstance(path, Location):
        return path
    p = os.fspath(path)
    if is_remote(p):
        check_uri(p)
        return ObjectLocation(p, options)
    return PosixLocation(os.path.join(base, os.path.expanduser(p)) if base else p)


def is_local(path: str | os.PathLike) -> bool:
    """True for a local path; False for a URI (of a scheme we serve or not: never a local path)."""
    return not is_remote(path)


def resolve(path: str | os.PathLike, base: str | None = None) -> str:
    """A user's path made canonical without touching the storage: a URI checked and normalised,
    a local path absolute (relative ones from ``base``)."""
    p = os.fspath(path)
    if is_remote(p):
        return normalize(check_uri(p))
    return os.path.normpath(os.path.join(base, os.path.expanduser(p))) if base else os.path.abspath(p)


def fsspec_package(path: str | os.PathLike) -> str | None:
    """The fsspec file system another tool (torch DCP's fsspec path) reaches ``path``'s store
    with (None for a local path)."""
    kind = kind_of(path)
    return kind.fsspec_package if kind else None


def refused(path: str) -> str | None:
    """Why ``path`` cannot be a location (credentials in it, a scheme no store serves), in one
    line, or None: what the launcher checks on every override before any rank starts."""
    from .uri import credentials_refused

    if not is_remote(path):
        return None
    why = credentials_refused(path)
    if why:
        return why
    try:
        check_uri(path)
    except Exception as e:  # ConfigError: the scheme
        return str(e)
    return None


def spelled(path: str | os.PathLike) -> str:
    """``path`` as logs and errors name it: a URI checked and normalised, a local path as given."""
    p = os.fspath(path)
    return normalize(check_uri(p)) if is_remote(p) else p

