"""Process-based persist for ``async_save(mode="process")``: a rank's files are written by a
persisting process of its own, so serialising, hashing and uploading never take the training
process's GIL.

Division of work. The training process stages the state into shared memory (``SharedHostCopies``:
segments of a file on ``/dev/shm``, reused between saves) and runs the save protocol's small
steps (planning, the commit) in its background thread, as the thread mode does. Only the writer's
``write`` crosses over (``ProcessWriter``): the persisting process receives the segments once
(their names; it maps them), then per save a list of (segment, offset, dtype, shape) for each
tensor, never tensor bytes through a pipe. It opens the same storage writer (the path and
options, rebuilt there), writes the rank's files and returns what it wrote.

The persisting process is started at the first process-mode save (without waiting for it) and
kept between saves. One that dies (killed, out of memory) makes that rank's write fail with
``PersistProcessError``; the protocol turns it into the same failure on every rank, rank 0
aborts and nothing is published. The training process hears it from ``response.result()`` at
its next save or wait, and the next save starts a fresh persisting process on fresh host copies.
Segment files are unlinked as soon as the persisting process has mapped them, so a killed job
leaves at most the segments of one save not yet handed over (removed by the next start).
"""

from __future__ import annotations

import atexit
import glob
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Mapping, Sequence

import torch

from ..core import faults
from ..core.errors import ConfigError, HpdcpError, InsufficientMemoryError, PersistProcessError
from ..core.utils import get_logger
from ..format.metadata import WriteResult, dtype_from_name, dtype_name
from .host_copies import HostCopies
from ..storage.posix.commit import pid_alive
from ..storage.interfaces import StorageWriter

log = get_logger(__name__)

ALIGN = 64
SEGMENT_BYTES = 256 << 20  # host-copy space is taken from segments of at least this size
_PREFIX = "hpdcp-stage-"


def shm_dir() -> str:
    """Where host-copy segments live: ``HPDCP_SHM_DIR``, else ``/dev/shm`` (memory), else the temp dir.
    A ``HPDCP_SHM_DIR`` that is not a writable directory is one line naming the variable."""
    d = os.environ.get("HPDCP_SHM_DIR")
    if d:
        if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
            what = "does not exist" if not os.path.exists(d) else "is not a directory" if not os.path.isdir(d) \
                else "is not writable by this user"
            raise ConfigError(f"HPDCP_SHM_DIR={d} {what}: point it at a writable directory (a tmpfs such as "
                              f"/dev/shm) or unset it")
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def create_segment(nbytes: int, what: str = "") -> tuple[str, int]:
    """A new host-copy file of ``nbytes``, (path, open descriptor): created exclusively, readable by
    this user only (0600; staged weights are nobody else's), under a name nobody can guess (a
    file planted at a predictable name can neither block nor receive a save), its space reserved
    now: a host-copy directory too small for the state is an error here, not a SIGBUS when a
    tensor is copied in. ``what``: a tag in the name (scratch segments)."""
    directory = shm_dir()
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(8):
        path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{what}{secrets.token_hex(8)}")
        try:
            fd = os.open(path, flags, 0o600)
            break
        except FileExistsError:
            continue  # (a name taken: drawn again)
        except OSError as e:
            raise PersistProcessError(f"cannot create a host-copy file in {directory} ({e.strerror}); set "
                                      f"HPDCP_SHM_DIR to a writable directory") from None
    else:
        raise PersistProcessError(f"{directory}: 8 fresh host-copy names were all taken")
    try:
        _reserve(fd, nbytes, directory)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return path, fd


def _reserve(fd: int, nbytes: int, directory: str) -> None:
    """Allocate the file's blocks (a tmpfs hands out its pages now, or says it has none)."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # (no fallocate, e.g. macOS: sized only, its pages taken as they are written)
            os.ftruncate(fd, nbytes)
    except OSError as e:
        import errno

        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise InsufficientMemoryError(
                f"copying {nbytes / 2**20:.1f} MiB to the host for a process-mode save: {directory} has no room for it "
                f"({e.strerror}); give it more space, set HPDCP_SHM_DIR to a larger directory, or save with "
                f"dcp.async_mode=thread") from None
        raise PersistProcessError(f"cannot size a host-copy file in {directory} ({e.strerror})") from None


def clear_stale_segments(directory: str | None = None) -> list[str]:
    """Remove segment files whose training process is gone (killed before handing them over)."""
    removed = []
    for path in glob.glob(os.path.join(directory or shm_dir(), f"{_PREFIX}*")):
        try:
            pid = int(os.path.basename(path)[len(_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def _map(path: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole file, mapped shared (writes are seen by every mapper)."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass
class _Segment:
    path: str
    nbytes: int
    base: torch.Tensor
    used: int = 0
    handed: bool = False  # mapped by the persisting process and unlinked

    @property
    def ptr(self) -> int:
        return self.base.untyped_storage().data_ptr()


class SharedHostCopies(HostCopies):
    """``HostCopies`` in shared-memory segments another process maps: same reuse rule (one
    buffer per leaf path, kept while its shape and dtype stay), bump-allocated, 64-byte aligned."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[_Segment] = []
        self._allocated = 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.nbytes - seg.used < need:
            size = max(SEGMENT_BYTES, need)
            path, fd = create_segment(size)
            try:
                seg = _Segment(path, size, _map(path, size))
            finally:
                os.close(fd)
            self.segments.append(seg)
        view = seg.base[seg.used: seg.used + nbytes]
        seg.used += need
        self._allocated += need
        return view

    def buffer(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            if buf is not None:
                self.nbytes -= buf.numel() * buf.element_size()
            raw = self._alloc(src.numel() * src.element_size())
            buf = raw.view(src.dtype).view(src.shape) if src.dim() else raw.view(src.dtype).view(())
            self._bufs[key] = buf
            self.nbytes += buf.numel() * buf.element_size()
        return buf

    def copy(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self.buffer(key, src)
        buf.copy_(src.detach())
        return buf

    def wasteful(self) -> bool:
        """More than half the allocated space is held by buffers no leaf uses any more."""
        return self._allocated > 2 * max(self.nbytes, 1) + SEGMENT_BYTES

    def locate(self, t: torch.Tensor) -> tuple[_Segment, int] | None:
        """The segment holding contiguous ``t`` and its byte offset there, or None."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        ptr = t.untyped_storage().data_ptr()
        for seg in self.segments:
            if seg.ptr == ptr:
                return seg, t.storage_offset() * t.element_size()
        return None

    def clear(self) -> None:
        super().clear()
        for seg in self.segments:
            if not seg.handed:
                _unlink(seg.path)
        self.segments.clear()
        self._allocated = 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class WriterSpec:
    """How the persisting process opens the same storage writer: ``open_writer``'s arguments."""

    path: str
    fsync: bool = True
    store_options: Any = None

    @classmethod
    def of(cls, writer: StorageWriter) -> "WriterSpec":
        args = writer.reopen_args()
        if args is not None:
            return cls(**args)
        raise ConfigError(f"async_save mode=process rebuilds the storage writer in the persisting process and knows "
                          f"FileSystemWriter and ObjectStoreWriter (from a path or URI); got {type(writer).__name__}: "
                          f"use mode='thread' for a writer of your own")


#: the persisting process's first lines: its import path loses the working directory (``python
#: -m`` and ``-c`` put it first, so a module planted there would run inside it, shadowing an
#: installed one such as xxhash); this package's own location goes last (found even when it is
#: not installed, never before the installed modules)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_CHILD = ("import os, sys; here = os.getcwd(); "
          "sys.path[:] = [p for p in sys.path if p not in ('', '.', here)]; "
          f"sys.path.append({_PACKAGE_PARENT!r}); "
          "from hpdcp_runner.dcp.background.process import main; main(sys.argv[1:])")
#: how often a persisting process that is writing says it is alive, and how long the training
#: process waits on one that says nothing before it calls it hung (SIGSTOP, a wedged mount)
HEARTBEAT_S = 1.0
DEFAULT_SILENCE_S = 120.0
#: the persisting process's niceness: on a host whose cores the training uses, its writes and
#: checksums yield to the steps (measured: steps beside a persist 2.1x -> 1.2-1.7x slower than
#: without, with two ranks on two cores; the persist takes longer instead)
DEFAULT_NICE = 10


class Persister:
    """This rank's persisting process: started once, kept between saves, restarted after a death."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.nice = DEFAULT_NICE  # what the next process started lowers its priority by
        self.dead: str | None = None  # why the last one is gone (until a new one starts)
        self._ready = False  # it said it finished starting (imports done): a save may wait on it
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.dead is None

    def ready(self) -> bool:
        """True once the process has finished starting (it imports torch: seconds, on a busy
        host more). Never waits: a save that finds it still starting is written another way
        rather than putting the start-up on the training loop."""
        if self._ready or not self.alive():
            return self._ready
        if not self._lock.acquire(blocking=False):  # a request is being served: it started long ago
            return True
        try:
            while self.conn.poll(0):
                if self.conn.recv()[0] == "ready":
                    self._ready = True
        except (EOFError, OSError):
            return False
        finally:
            self._lock.release()
        return self._ready

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`ready` (tests, benchmarks, a job's start)."""
        deadline = time.monotonic() + timeout
        while not self.ready() and self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._ready

    def start(self) -> None:
        """Start the process if none runs (returns at once; it imports torch in the background)."""
        if self.alive():
            return
        self.stop()
        clear_stale_segments()
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno()), str(os.getpid()),
                                          str(self.nice)],
                                         pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except OSError as e:
            parent.close()
            raise PersistProcessError(f"cannot start the persisting process ({e})") from None
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.dead, self._ready = None, False
        log.info("persisting process started (pid %d)", self.proc.pid)

    def _died(self, doing: str) -> PersistProcessError:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        pid = self.proc.pid if self.proc is not None else None
        self.dead = f"the persisting process (pid {pid}) died ({how}) while {doing}"
        return PersistProcessError(self.dead)

    def call(self, msg: tuple, doing: str, on_mapped: Callable[[], None] | None = None,
             silence_s: float | None = None) -> Any:
        """Send ``msg`` and wait for its answer (``("mapped",)`` first calls ``on_mapped``). While it
        works the process says it is alive every :data:`HEARTBEAT_S`; silent for ``silence_s``
        (default :data:`DEFAULT_SILENCE_S`), it is taken for hung, killed, and the call fails."""
        silence = silence_s or DEFAULT_SILENCE_S
        with self._lock:
            if not self.alive():
                raise PersistProcessError(self.dead or "no persisting process runs")
            try:
                self.conn.send(msg)
                while True:
                    if not self.conn.poll(silence):
                        raise self._hung(doing, silence)
                    reply = self.conn.recv()
                    if reply[0] == "alive":
                        continue
                    if reply[0] == "ready":  # its start-up finished (nobody polled for it)
                        self._ready = True
                        continue
                    if reply[0] == "mapped":
                        if on_mapped is not None:
                            on_mapped()
                        continue
                    break
            except (EOFError, OSError):
                raise self._died(doing) from None
        if reply[0] == "error":
            raise _error_from(reply[1], reply[2])
        return reply[1:]

    def _hung(self, doing: str, silence: float) -> PersistProcessError:
        pid = self.proc.pid if self.proc is not None else None
        if self.proc is not None:
            self.proc.kill()  # (a stopped process dies of SIGKILL too)
            self.proc.wait()
        self.dead = (f"the persisting process (pid {pid}) said nothing for {silence:g} s while {doing} (stopped or "
                     f"hung); it was killed and the next save starts a fresh one")
        return PersistProcessError(self.dead)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the process to exit (after the write it may be doing) and reap it."""
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is None:
            return
        try:
            if proc.poll() is None and conn is not None:
                conn.send(("exit",))
            proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if conn is not None:
                conn.close()


def _error_from(kind: str, text: str) -> BaseException:
    """The persisting process's failure, as the same ``HpdcpError`` class where one takes a
    message (rebuilt from its name and text: nothing is unpickled), else one naming it."""
    from ..core import errors

    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.HpdcpError):
        try:
            return cls(text)
        except TypeError:  # a class with more to say than a message (DistributedError)
            pass
    return PersistProcessError(f"the persisting process failed: {kind}: {text}")


_PERSISTER = Persister()
_HOST_COPIES = SharedHostCopies()


def persister() -> Persister:
    return _PERSISTER


def shared_host_copies() -> SharedHostCopies:
    return _HOST_COPIES


def prepare() -> SharedHostCopies:
    """Before copying a process-mode save to the host: a dead persisting process's host copies are dropped (its
    segments were handed to it and unlinked) and a fresh process is started."""
    if not _PERSISTER.alive():
        if _PERSISTER.proc is not None or _PERSISTER.dead:
            _HOST_COPIES.clear()
        _PERSISTER.start()
    elif _HOST_COPIES.wasteful():
        _HOST_COPIES.clear()
        _PERSISTER.call(("forget",), "dropping old host-copy segments")
    return _HOST_COPIES


def shutdown() -> None:
    """Stop the persisting process and free the shared host copies (after any in-flight save)."""
    _PERSISTER.stop()
    _HOST_COPIES.clear()


atexit.register(shutdown)


class ProcessWriter(StorageWriter):
    """A storage writer whose ``write`` runs in the persisting process; everything else (begin,
    attach, commit, abort) runs here on the wrapped writer, which the protocol calls as usual."""

    def __init__(self, inner: StorageWriter, copies: SharedHostCopies | None = None,
                 process: Persister | None = None, silence_s: float | None = None) -> None:
        """``silence_s``: how long a write waits on a persisting process that says nothing (the
        save's timeout; default :data:`DEFAULT_SILENCE_S`)."""
        self.inner = inner
        self.silence_s = silence_s
        self.spec = WriterSpec.of(inner)
        self.copies = copies or _HOST_COPIES
        self.process = process or _PERSISTER
        self.counters = inner.counters
        self._attached: tuple[str, int, int] | None = None

    @property
    def protocol_kind(self) -> str:  # the wrapped writer's: a rank writing by thread saves with it
        return self.inner.protocol_kind

    @property
    def checkpoint_id(self) -> str | None:  # type: ignore[override]
        return self.inner.checkpoint_id

    def begin(self, *, overwrite: bool) -> str:
        return self.inner.begin(overwrite=overwrite)

    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        self.inner.attach(token, rank=rank, world_size=world_size)
        self._attached = (token, rank, world_size)

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], objects: Mapping[str, Any]) -> WriteResult:
        token, rank, world_size = self._attached
        scratch: list[_Segment] = []
        descs = []
        for key, t in tensors:
            where = self.copies.locate(t)
            if where is None:  # not a staged buffer (a planner's copy): into a scratch segment
                where = self._scratch(t, scratch)
            seg, off = where
            descs.append((key, seg.path, off, dtype_name(t.dtype), tuple(t.shape)))
        fresh = [s for s in self.copies.segments + scratch if not s.handed]
        new = [(s.path, s.nbytes) for s in fresh]

        def mapped() -> None:  # the persisting process holds them: their names can go
            for s in fresh:
                s.handed = True
                _unlink(s.path)

        try:
            result, counts = self.process.call(("write", self.spec, token, rank, world_size, new,
                                                 [s.path for s in scratch], descs, dict(objects)),
                                                f"writing rank {rank}'s files of {self.checkpoint_id}", mapped,
                                                self.silence_s)
        finally:
            for s in scratch:
                if not s.handed:
                    _unlink(s.path)
        for k in ("bytes_written", "files_written"):
            setattr(self.counters, k, getattr(self.counters, k) + counts.get(k, 0))
        return result

    def _scratch(self, t: torch.Tensor, scratch: list[_Segment]) -> tuple[_Segment, int]:
        nbytes = t.numel() * t.element_size()
        path, fd = create_segment(max(nbytes, 1), "scratch-")
        try:
            seg = _Segment(path, max(nbytes, 1), _map(path, max(nbytes, 1)))
        finally:
            os.close(fd)
        seg.base[:nbytes].view(t.dtype).view(t.shape).copy_(t.contiguous()) if nbytes else None
        scratch.append(seg)
        return seg, 0

    def commit(self, metadata: Any) -> None:
        self.inner.commit(metadata)

    def open_sink(self, name: str, size: int) -> Any:
        return self.inner.open_sink(name, size)

    def commit_copy(self, metadata: Any, body: bytes) -> None:
        self.inner.commit_copy(metadata, body)

    def abort(self) -> None:
        self.inner.abort()

    def committed_opener(self) -> Callable[[str], Any] | None:
        return self.inner.committed_opener()

    def discard_own(self) -> None:
        if self.process.alive():
            try:
                self.process.call(("discard",), "discarding this rank's files")
            except HpdcpError as e:
                log.warning("could not discard this rank's files of %s: %s", self.checkpoint_id, e)
        self.inner.discard_own()


# -- the persisting process ------------------------------------------------------------------------

def _tensor(segments: Mapping[str, torch.Tensor], path: str, off: int, dtype: str, shape: tuple) -> torch.Tensor:
    dt = dtype_from_name(dtype)
    n = 1
    for d in shape:
        n *= d
    raw = segments[path][off: off + n * torch.empty((), dtype=dt).element_size()]
    return raw.view(dt).view(shape)


def _serve(conn: Connection) -> None:
    from ..storage.checkpoint_io import open_writer

    segments: dict[str, torch.Tensor] = {}
    writer: StorageWriter | None = None
    lock, busy = threading.Lock(), threading.Event()
    real_send = conn.send

    def send(msg: tuple) -> None:
        with lock:
            real_send(msg)

    def beat() -> None:  # while a request is served: "alive" (a stopped process says nothing)
        while True:
            time.sleep(HEARTBEAT_S)
            if busy.is_set():
                try:
                    send(("alive",))
                except OSError:
                    return

    conn.send = send  # type: ignore[method-assign]
    threading.Thread(target=beat, name="hpdcp-persist-heartbeat", daemon=True).start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the training process is gone
            return
        op = msg[0]
        busy.set()
        try:
            if op == "exit":
                return
            if op == "forget":
                segments.clear()
                conn.send(("ok",))
            elif op == "discard":
                if writer is not None:
                    writer.discard_own()
                conn.send(("ok",))
            elif op == "write":
                _, spec, token, rank, world_size, new, scratch, descs, objects = msg
                for path, nbytes in new:
                    segments[path] = _map(path, nbytes)
                conn.send(("mapped",))
                faults.point("persist.write", rank=rank, path=spec.path)
                writer = open_writer(spec.path, fsync=spec.fsync, store_options=spec.store_options)
                writer.attach(token, rank=rank, world_size=world_size)
                tensors = [(key, _tensor(segments, p, off, dt, shape)) for key, p, off, dt, shape in descs]
                try:
                    result = writer.write(tensors, objects)
                finally:
                    del tensors
                    for p in scratch:
                        segments.pop(p, None)
                conn.send(("ok", result, writer.counters.as_dict()))
            else:
                conn.send(("error", "PersistProcessError", f"unknown request {op!r}"))
        except BaseException as e:  # the training process raises it
            log.debug("persisting process: %s: %s\n%s", type(e).__name__, e, traceback.format_exc())
            try:
                conn.send(("error", type(e).__name__, str(e)))
            except OSError:
                return
        finally:
            busy.clear()


def main(argv: Sequence[str]) -> None:
    import logging

    fd, parent = int(argv[0]), int(argv[1])
    logging.basicConfig(level=logging.WARNING, format=f"[%(asctime)s][persister of pid {parent}][%(levelname)s] "
                                                       f"%(message)s")
    torch.set_num_threads(1)
    if len(argv) > 2 and int(argv[2]) > 0:  # a lower priority than training's: steps come first
        os.nice(int(argv[2]))
    from ..storage import checkpoint_io  # noqa: F401  (what the first write needs, imported before "ready")
    from ..storage.objects import object_checkpoint  # noqa: F401
    from ..storage.posix import filesystem  # noqa: F401

    conn = Connection(fd)
    conn.send(("ready",))
    _serve(conn)


if __name__ == "__main__":
    main(sys.argv[1:])
