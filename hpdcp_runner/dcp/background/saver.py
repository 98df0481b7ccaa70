"""async_save: copy the state to the host (``host_copies``), then persist it in the background.

The save's protocol (planning, the commit) runs in a background thread of this process, on a
dedicated gloo group (created once per set of ranks), never on the training group, so its
collectives cannot interleave with the training loop's and deadlock. Who writes the rank's files
is the mode: ``thread`` (the default) writes them in that thread too (file writes and fsync
release the GIL; no pickling, no second CUDA context); ``process`` hands them to a persisting
process of the rank's own (``process``), so serialising, hashing and uploads never take this
process's GIL either.

Rules a caller can rely on:

* ``async_save`` returns once the state is copied: tensors mutated afterwards do not change the
  checkpoint. With ``staging="background"`` it returns at once and the copy runs in the
  background thread: the caller must not change the state's tensors until
  ``response.wait_staged()`` returned (a training loop calls it just before its optimizer step,
  so the copy overlaps the forward and backward passes). Staging buffers are reused between
  saves (pinned host memory for CUDA sources), so steady-state extra memory is one copy of the
  rank's local shards (``release_staging_buffers`` frees it).
* At most one async save is in flight per process: a second ``async_save`` first waits for the
  previous one to finish (its outcome stays with its own response). Every rank must issue the
  same sequence of async saves, as with ``save``.
* The checkpoint commits only after every rank wrote; a failure anywhere commits nothing and is
  raised by ``response.result()`` on every rank (naming rank and file). A failure nobody
  retrieves is also logged.
* The background thread is not a daemon: interpreter exit waits for an in-flight checkpoint.
  Call ``wait_for_async_saves()`` before destroying the process group.
"""

from __future__ import annotations

import copy
import datetime as _dt
import threading
import time
from concurrent.futures import Future, wait as futures_wait
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..comm.collectives import gloo_group
from ..core import faults
from ..core.errors import CollectiveTimeoutError, ConfigError, StateDictError
from ..format.metadata import Metadata
from ..core.ragged import FlatShard, FusedShard, LocalShard, ShardPieces
from ..planning.interfaces import SavePlanner
from ..planning.standard import StandardSavePlanner, local_pieces
from .host_copies import DeferredCopies, HostCopies
from ..state_dict import stateful_to_state_dict
from ..core.utils import TENSOR_LEAVES, gc_paused, get_logger, is_dtensor, rank_of_env

log = get_logger(__name__)

_LOCK = threading.Lock()
_IN_FLIGHT: "AsyncSaveResponse | None" = None


_BUFFERS = HostCopies()


def _stage_leaf(v: Any, key: tuple, bufs: HostCopies) -> Any:
    """A host copy of one tensor leaf, in a form the save planner understands without a mesh."""
    if isinstance(v, FlatShard):
        return FlatShard(bufs.copy(key, v.local), v.global_shape, v.start)
    if isinstance(v, FusedShard):
        return FusedShard(bufs.copy(key, v.local), v.global_shape, v.boxes, v.dim)
    if isinstance(v, ShardPieces):
        return ShardPieces(v.global_shape, [(b, bufs.copy(key + (i,), t)) for i, (b, t) in enumerate(v.pieces)])
    if is_dtensor(v) or isinstance(v, LocalShard):
        pieces = local_pieces(v)
        shape = tuple(int(d) for d in (v.global_shape if isinstance(v, LocalShard) else v.shape))
        if not pieces:  # this rank holds nothing of it (e.g. outside the mesh): an empty flat shard
            return FlatShard(torch.empty(0, dtype=v.dtype), shape, 0)
        box, t = pieces[0]
        return LocalShard(bufs.copy(key, t), box.offsets, shape)
    return bufs.copy(key, v)


def stage_state_dict(state_dict: Any, bufs: HostCopies | None = None, _path: tuple = ()) -> Any:
    """Copy every tensor leaf into host staging buffers and every other leaf by ``deepcopy``,
    keeping the nesting (so keys and paths in the checkpoint are the same as a direct save)."""
    bufs = _BUFFERS if bufs is None else bufs
    if isinstance(state_dict, Mapping):
        return {k: stage_state_dict(v, bufs, _path + (k,)) for k, v in state_dict.items()}
    if isinstance(state_dict, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple, *TENSOR_LEAVES))
                                                     for x in state_dict):
        out = [stage_state_dict(v, bufs, _path + (i,)) for i, v in enumerate(state_dict)]
        return out if isinstance(state_dict, list) else tuple(out)
    if isinstance(state_dict, TENSOR_LEAVES):
        return _stage_leaf(state_dict, _path, bufs)
    return copy.deepcopy(state_dict)


def release_staging_buffers() -> None:
    """Free the reused staging buffers (after waiting for any in-flight save) and stop a
    process-mode save's persisting process."""
    wait_for_async_saves()
    _BUFFERS.clear()
    from . import process as persister

    persister.shutdown()


class AsyncSaveResponse:
    """The handle ``async_save`` returns: ``result()`` gives the committed metadata or raises."""

    def __init__(self, checkpoint_id: str | None, staging_seconds: float) -> None:
        self.checkpoint_id = checkpoint_id
        #: what ``async_save`` held the caller for (with background staging: not the copy)
        self.staging_seconds = staging_seconds
        #: background staging: the copy's own seconds, in the background thread (None: staged
        #: before ``async_save`` returned)
        self.copy_seconds: float | None = None
        self._staged: Future = Future()
        self.persist_seconds: float | None = None
        #: what writes the files: "thread", or "process" (a process-mode save made while the
        #: persisting process was still starting is written by a thread instead)
        self.mode = "thread"
        self._future: Future = Future()
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._future.done()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the state is copied (at once unless ``staging="background"``): from then
        on the caller may change its tensors. Never raises (a failed copy fails the save, which
        ``result()`` raises); True when the copy is over."""
        futures_wait([self._staged], timeout)
        return self._staged.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until persisted (or failed) without raising; True when finished. Waits on the
        outcome, not on ``Thread.join``: a signal (Ctrl-C) that interrupts a join can leave the
        thread marked stopped while it still writes, and interpreter exit would then not wait
        for the checkpoint (seen on CPython 3.11)."""
        futures_wait([self._future], timeout)
        if self._future.done() and self._thread is not None:
            self._thread.join()  # it is past the outcome: only its return is left
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        """The committed checkpoint's metadata; raises the save's failure (an ``HpdcpError``
        naming the failing rank and file) or ``CollectiveTimeoutError`` after ``timeout`` s."""
        if not self.wait(timeout):
            raise CollectiveTimeoutError(f"async save of {self.checkpoint_id} still running after {timeout} s")
        return self._future.result()

    def exception(self) -> BaseException | None:
        self.wait()
        return self._future.exception()


class _FailedCopy(SavePlanner):
    """The planner of a save whose background copy failed on this rank: it plans as the real one
    (the other ranks are already in the save's collectives), and raises the copy's failure where
    this rank's data would be written, an agreed step, so every rank fails the save and nothing
    commits. (A rank that writes none of its chunks loses nothing: what it held is written by
    the ranks that hold it too.)"""

    def __init__(self, inner: SavePlanner, error: BaseException) -> None:
        self.inner, self.error = inner, error

    def configure(self, state_dict: Mapping[str, Any], **kwargs: Any) -> None:
        self.inner.configure(state_dict, **kwargs)

    def create_local_plan(self) -> Any:
        return self.inner.create_local_plan()

    def create_global_plan(self, layouts: Any) -> Any:
        return self.inner.create_global_plan(layouts)

    def resolve_data(self, item: Any) -> Any:
        raise StateDictError(f"the background copy of the state (async_save staging='background') failed on "
                             f"this rank: {type(self.error).__name__}: {self.error}") from self.error


def _persist_group(process_group: Any, timeout: float | _dt.timedelta | None) -> Any:
    """The dedicated gloo group for background saves over the same ranks (created once)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return gloo_group(process_group or dist.group.WORLD, timeout, "async")


def _seconds(timeout: float | _dt.timedelta | None) -> float | None:
    """The save's timeout in seconds (None: the persister's default bound)."""
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, _dt.timedelta) else float(timeout)


def save_in_flight() -> bool:
    """Whether this process has an async save still persisting."""
    with _LOCK:
        return _IN_FLIGHT is not None and not _IN_FLIGHT.done()


def wait_for_async_saves(timeout: float | None = None) -> None:
    """Block until this process's in-flight async save (if any) finished; never raises its error."""
    with _LOCK:
        pending = _IN_FLIGHT
    if pending is not None:
        pending.wait(timeout)


MODES = ("thread", "process")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"async_save mode must be one of {', '.join(MODES)}, got {mode!r}")


def start_async_persist(mode: str, wait_s: float = 0.0, nice: int | None = None) -> bool:
    """Start what ``async_save(mode=...)`` persists with ahead of the first save (``process``: the
    persisting process, which takes seconds to import torch). ``wait_s``: how long to wait for it
    to finish starting; a process-mode save made before then is written by a thread of this
    process instead (its start-up never lands on the caller's loop). ``nice``: how much lower the
    persisting process's scheduling priority is than this process's (0-19; default 10, so the
    steps get the cores first; a process already started keeps its own). Returns whether it is ready."""
    _check_mode(mode)
    if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19):
        raise ConfigError(f"start_async_persist: nice must be an integer from 0 to 19, got {nice!r}")
    if mode != "process":
        return True
    from . import process as persister

    if nice is not None:
        persister.persister().nice = nice
    persister.prepare()
    return persister.persister().wait_ready(wait_s) if wait_s > 0 else persister.persister().ready()


STAGING = ("now", "background")


def _process_writer(mode: str, checkpoint_id: Any, timeout: Any, save_kwargs: dict) -> tuple[str, Any]:
    """Process mode: the shared staging, with the save's writer wrapped to write from the
    persisting process (in ``save_kwargs``); a process still starting turns the save into a
    thread-mode one. Returns the mode that writes and its staging buffers (None: this process's)."""
    if mode != "process":
        return mode, None
    from . import process as persister

    bufs = persister.prepare()
    if not persister.persister().ready():  # still starting: its start-up must not land on this loop
        log.info("async save of %s: the persisting process is still starting; this save is written by a "
                 "thread of this process", checkpoint_id)
        return "thread", None
    from ..storage.checkpoint_io import open_writer

    writer = save_kwargs.get("storage_writer")
    if writer is None:
        if checkpoint_id is None:
            raise ConfigError("give checkpoint_id (a directory or URI) or a storage writer")
        writer = open_writer(str(checkpoint_id))
    save_kwargs["storage_writer"] = persister.ProcessWriter(writer, bufs, silence_s=_seconds(timeout))
    return mode, bufs


def async_save(state_dict: Mapping[str, Any], *, checkpoint_id: Any = None, process_group: Any = None,
               timeout: float | _dt.timedelta | None = None,
               callback: Callable[[Metadata], None] | None = None, mode: str = "thread",
               staging: str = "now", **save_kwargs: Any) -> AsyncSaveResponse:
    """Stage ``state_dict`` to host memory now, save it in the background; every rank calls it.

    Takes the same keyword arguments as ``save`` (storage_writer, planner, overwrite,
    allow_pickle, verify_replicas, extra). ``callback(metadata)`` runs in the background thread
    after the commit. ``mode``: ``thread`` writes the files in a thread of this process;
    ``process`` stages into shared memory and writes them in a persisting process of this rank
    (``persister.py``), so serialising, hashing and uploads never hold this process's GIL; a
    rank whose persisting process is still starting writes that save by a thread instead (its
    start-up never lands on the caller; ``response.mode`` says which, and the ranks need not
    agree). ``staging``: ``now`` copies the state before returning; ``background`` returns
    once its host buffers are found (the structure and non-tensor values copied) and copies the
    tensors in the background thread, before the save: the caller keeps its tensors unchanged
    until ``response.wait_staged()`` (forward passes that update buffers, like BatchNorm's running
    statistics, count as changes). Returns an ``AsyncSaveResponse``.
    """
    global _IN_FLIGHT
    from ..api import _check_extra, save  # api imports this module's names lazily; avoid a cycle at import time

    if "timer" in save_kwargs:
        raise ConfigError("async_save takes no timer (the save runs in another thread)")
    _check_mode(mode)
    if staging not in STAGING:
        raise ConfigError(f"async_save staging must be one of {', '.join(STAGING)}, got {staging!r}")
    _check_extra(save_kwargs.get("extra"))  # refused now, in the caller's thread, not in the background
    wait_for_async_saves()  # one in flight at a time: the staging buffers are reused
    t0 = time.perf_counter()
    group = _persist_group(process_group, timeout)
    mode, bufs = _process_writer(mode, checkpoint_id, timeout, save_kwargs)
    copies = DeferredCopies(_BUFFERS if bufs is None else bufs) if staging == "background" else None
    with gc_paused(threading.current_thread() is threading.main_thread()):  # see utils.gc_paused
        staged = stage_state_dict(stateful_to_state_dict(state_dict)[0], bufs if copies is None else copies)
    if copies is not None:
        copies.mark()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # non-blocking device-to-pinned copies done before we return
    path = None if checkpoint_id is None else str(checkpoint_id)
    response = AsyncSaveResponse(path, time.perf_counter() - t0)
    response.mode = mode
    if copies is None:
        response._staged.set_result(None)

    def persist() -> None:
        t1 = time.perf_counter()
        try:
            if copies is not None:
                try:
                    faults.point("stage.copy", rank=rank_of_env())
                    copies.run()
                except BaseException as e:  # noqa: BLE001 - the save still runs, to fail on every rank
                    save_kwargs["planner"] = _FailedCopy(save_kwargs.get("planner") or StandardSavePlanner(), e)
                finally:
                    response.copy_seconds = time.perf_counter() - t1
                    response._staged.set_result(None)
            # The group carries the timeout; passing it again would make save create yet another
            # group from this thread, racing the training thread's group creation.
            md = save(staged, checkpoint_id=checkpoint_id, process_group=group,
                      timeout=None if group is not None else timeout, **save_kwargs)
            response.persist_seconds = time.perf_counter() - t1
            if callback is not None:
                callback(md)
            response._future.set_result(md)
        except BaseException as e:  # delivered to result(); logged in case nobody asks
            response.persist_seconds = time.perf_counter() - t1
            response._future.set_exception(e)
            log.error("async save of %s failed: %s: %s (response.result() raises it)", path, type(e).__name__, e)

    thread = threading.Thread(target=persist, name="hpdcp-async-save", daemon=False)
    response._thread = thread
    with _LOCK:
        _IN_FLIGHT = response
    thread.start()
    return response
