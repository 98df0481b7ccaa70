"""Copy a committed checkpoint to another store, verified, committed there by that store's own
commit: how a fast tier (a local directory) is drained to a durable one (a bucket, a shared file
system) without staging the state from the device a second time.

Every rank copies the files its rank wrote (``FileMeta.rank``, modulo this world size), reading
each once: the bytes go to the destination as they are read and, in the same pass, every entry's
digest is recomputed, so a file whose checksum differs from the one ``metadata.json`` records is
never completed there. Rank 0 copies the chunk index (verified the same way) and publishes the
destination with ``metadata.json`` last, through the destination writer's commit (a rename, or
the bucket's conditional commit object). A failure on any rank is the same error on every rank and
nothing is published.
"""

from __future__ import annotations

import datetime as _dt
import os
import threading
import time
from typing import Any, Callable

from .saver import AsyncSaveResponse
from ..comm.collectives import Comm, gloo_group
from ..core import faults
from ..core.errors import ConfigError, CorruptCheckpointError, MetadataError
from ..core.rafile import open_regular
from ..core.utils import get_logger
from ..format.metadata import METADATA_FILE, FileMeta, Metadata, check_file_name
from ..format.stream_digest import FileDigest
from ..storage.checkpoint_io import open_reader, open_writer
from ..storage.interfaces import StorageWriter
from ..storage.location import locate

log = get_logger(__name__)

COPY_BLOCK = 8 << 20
Timeout = float | _dt.timedelta | None


def copy_verified(src_dir: str, name: str, size: int, checksum: str, sink: Any, rank: int = 0,
                  as_name: str | None = None) -> int:
    """Stream ``src_dir/name`` into ``sink`` (``write``/``close``/``abort``), recomputing its
    checksum as recorded (a safetensors file: its header and each entry's digest; any other file:
    the digest of its bytes). ``sink.close()`` only when it matches; returns the bytes copied.
    ``as_name``: the checkpoint's name of the file (a file received under a temporary name)."""
    full = os.path.join(src_dir, name)
    faults.point("copy.file", rank=rank, path=full)
    fd = open_regular(full)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptCheckpointError(f"{full}: {actual} bytes, metadata.json records {size}; not copied")
        check = FileDigest(as_name or name, size)
        pos = 0
        try:
            while pos < size:
                block = os.pread(fd, min(COPY_BLOCK, size - pos), pos)
                if not block:
                    raise CorruptCheckpointError(f"{full}: ended at {pos} of {size} bytes while being copied")
                check.update(block)
                sink.write(block)
                pos += len(block)
            got = check.hexdigest()
            if got != checksum:
                raise CorruptCheckpointError(f"{full}: checksum {got} differs from the {checksum} metadata.json "
                                             f"records (changed since it was committed); not copied")
        except BaseException:
            sink.abort()
            raise
        sink.close()
        return size
    finally:
        os.close(fd)


def _check_apart(src: str, dst: str | os.PathLike) -> None:
    """A copy into its own source (``src/copy``) would add files the source's metadata does not
    name, so the source no longer verifies; a source inside its destination would be replaced
    by an overwrite. Both refused before anything is written (links resolved)."""
    if locate(src).overlaps(locate(dst)):
        raise ConfigError(f"copy_checkpoint: the destination {dst} is, lies inside, or holds the source {src}; "
                          f"copy it somewhere outside")


def copy_checkpoint(src: str | os.PathLike, dst: str, *, process_group: Any = None, timeout: Timeout = None,
                    store_options: Any = None, fsync: bool = True, overwrite: bool = False,
                    writer: StorageWriter | None = None) -> Metadata:
    """Copy the committed checkpoint ``src`` (a local directory every rank sees) to ``dst`` (a
    directory or a store URI); every rank of ``process_group`` calls it (one rank works alone).
    Each file is verified against its recorded checksum while it is copied; ``dst`` is committed
    by its storage's commit, so it is either the whole verified checkpoint or not there. Returns
    the copied checkpoint's metadata."""
    src = locate(os.fspath(src)).local_dir("copy_checkpoint reads a local directory", MetadataError)
    _check_apart(src, dst)
    comm = Comm.create(process_group, timeout)
    writer = writer or open_writer(dst, fsync=fsync, store_options=store_options)

    def read_text() -> str:
        reader = open_reader(src, "hpdcp")
        try:
            return reader.read_metadata_text()
        finally:
            reader.close()

    text = comm.agree_root("copy: metadata", read_text)
    md = Metadata.from_json(text, source=os.path.join(src, METADATA_FILE),
                            open_file=lambda name: open_regular(os.path.join(src, check_file_name(name))))
    token = None
    try:
        token = comm.agree_root("copy: begin", lambda: writer.begin(overwrite=overwrite))
        writer.attach(token, rank=comm.rank, world_size=comm.world_size)
        mine: list[FileMeta] = [f for n, f in sorted(md.files.items()) if f.rank % comm.world_size == comm.rank]

        def copy_mine() -> int:
            return sum(copy_verified(src, f.name, f.size, f.checksum, writer.open_sink(f.name, f.size), comm.rank)
                       for f in mine)

        comm.agree("copy: files", copy_mine)

        def commit() -> None:
            if md.index is not None:
                rec = md.index.recorded
                copy_verified(src, rec["file"], rec["size"], rec["checksum"], writer.open_sink(rec["file"], rec["size"]))
            writer.commit_copy(md, text.encode())

        comm.agree_root("copy: commit", commit)
    except BaseException:
        if comm.rank == 0 and token is not None:
            writer.abort()
        writer.discard_own()
        raise
    return md


class SerialWorker:
    """A thread of its own that runs queued items one at a time, in the order they were queued
    (when they are collectives, every rank queues the same items in the same order). ``_put``
    blocks while ``max_waiting`` items already wait; ``close`` runs what is queued, then stops."""

    def __init__(self, name: str, max_waiting: int | None = None) -> None:
        self.max_waiting = max_waiting
        self._queue: list[Any] = []
        self._current: Any = None
        self._cond = threading.Condition()
        self._closed = False
        self._name = name
        self._thread = threading.Thread(target=self._work, name=name, daemon=False)
        self._thread.start()

    def _put(self, item: Any) -> None:
        with self._cond:
            while self.max_waiting is not None and len(self._queue) >= self.max_waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                raise MetadataError(f"{self._name} is closed")
            self._queue.append(item)
            self._cond.notify_all()

    def _pending(self) -> list[Any]:
        """What is queued or running now."""
        with self._cond:
            return list(self._queue) + ([self._current] if self._current is not None else [])

    def _run(self, item: Any) -> None:
        raise NotImplementedError

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                self._current = self._queue.pop(0)
                self._cond.notify_all()
            try:
                self._run(self._current)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Finish every queued item, stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


class Drainer(SerialWorker):
    """Copies committed checkpoints (``copy_checkpoint``) in a background thread, in the order they
    were submitted, on a gloo group of its own: a fast tier drained to a durable one while training
    and its async saves go on. Every rank submits the same copies in the same order (they are
    collectives). Create it in the thread that runs the training collectives (the group is made
    there); ``submit`` may be called from any thread (an async save's callback)."""

    def __init__(self, *, process_group: Any = None, timeout: Timeout = None, max_waiting: int = 1,
                 **copy_kwargs: Any) -> None:
        import torch.distributed as dist

        self.group = None
        if dist.is_available() and dist.is_initialized():
            self.group = gloo_group(process_group or dist.group.WORLD, timeout, "drain")
        self.timeout = None if self.group is not None else timeout
        self.copy_kwargs = copy_kwargs
        self.responses: list[AsyncSaveResponse] = []
        super().__init__("hpdcp-drain", max_waiting)

    def submit(self, src: str, dst: str, callback: Callable[[Metadata], None] | None = None) -> AsyncSaveResponse:
        """Queue the copy of ``src`` to ``dst``; blocks while ``max_waiting`` copies already wait
        (a durable store slower than the saves holds the saves back rather than piling up)."""
        response = AsyncSaveResponse(str(dst), 0.0)
        response.source = os.fspath(src)  # type: ignore[attr-defined]
        response._thread = None
        try:
            self._put((os.fspath(src), dst, callback, response, time.perf_counter()))
        except MetadataError:
            raise MetadataError("the drainer is closed") from None
        self.responses.append(response)
        return response

    def busy(self) -> set[str]:
        """Sources queued or being copied (a fast tier's retention must not delete them)."""
        return {item[0] for item in self._pending()}

    def _run(self, item: tuple) -> None:
        src, dst, callback, response, queued = item
        t0 = time.perf_counter()
        response.staging_seconds = t0 - queued  # (time it waited behind earlier copies)
        try:
            md = copy_checkpoint(src, dst, process_group=self.group, timeout=self.timeout, **self.copy_kwargs)
            response.persist_seconds = time.perf_counter() - t0
            if callback is not None:
                callback(md)
            response._future.set_result(md)
        except BaseException as e:
            response.persist_seconds = time.perf_counter() - t0
            response._future.set_exception(e)
            log.error("copy of %s to %s failed: %s: %s", src, dst, type(e).__name__, e)

    def close(self, timeout: float | None = None) -> list[AsyncSaveResponse]:  # type: ignore[override]
        """Finish every submitted copy (or fail it), stop the thread; returns every copy's handle."""
        super().close(timeout)
        return list(self.responses)
