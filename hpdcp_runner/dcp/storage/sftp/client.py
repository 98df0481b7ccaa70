"""The SFTP client of the store protocol: ``sftp://host[:port]/absolute/path`` on any SSH server
(OpenSSH's ``internal-sftp`` or ``sftp-server``; a cluster's login or storage node).

A checkpoint there is the store protocol's (``object_checkpoint``): every save under a prefix of
its own, published by one conditional write of the commit object. What each call rests on, and so
what a commit can guarantee:

* **a whole object**, visible at once: written to a temporary name beside it
  (``.NAME.put-<id>``) and renamed into place with ``posix-rename@openssh.com`` (an atomic
  replace, ``rename(2)`` on the server);
* **create if absent** (a new checkpoint): the same temporary file renamed with the protocol's
  own ``SSH_FXP_RENAME``, which never replaces an existing file (OpenSSH links the new name,
  which fails when it exists): of two saves of one name exactly one commits;
* **replace if unchanged** (an overwrite): under a lock file made by that same exclusive
  rename, the commit object is read back and compared with the one the save read at its start
  (its SHA-256: SFTP has no ETag), then replaced atomically. The lock holds among hpdcp writers
  (every one takes it); one left by a killed writer is taken over once it is ``_STALE_LOCK_S``
  old on the server's clock;
* **durability**: every file is flushed with ``fsync@openssh.com`` before it is renamed into
  place; a server without that extension is said once in the log (the checkpoint is then as
  durable as the server's file system makes renamed files).

Both conditions are probed on the server before the first save (``check_conditional_writes``):
a server whose rename replaces existing files (rclone's ``serve sftp`` does) is refused in one
line, since two saves of one name could both report success; ``dcp.storage.unconditional_ok``
runs there anyway, one saver per name.

Credentials come from the environment, never the URI: ``SFTP_USER`` (default: this user), then
``SFTP_KEY_FILE`` (a private key), ``SFTP_PASSWORD``, the ssh-agent and ``~/.ssh``'s keys. The
server must be known: its host key in ``SFTP_KNOWN_HOSTS`` or ``~/.ssh/known_hosts`` (an unknown
host is refused, never trusted on first use). Paths are absolute on the server. Each process keeps
one SSH connection per server and user, with up to ``concurrency`` SFTP channels (OpenSSH allows
10 sessions a connection by default), each with ``request_timeout_s`` on every reply.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import getpass
import hashlib
import logging
import os
import posixpath
import queue
import socket
import stat
import threading
import time
import uuid
from typing import Any, Iterator, Sequence

from ...core.errors import CheckpointNotFoundError, ConfigError, StorageAccessError
from ...core.utils import get_logger
from ..store_client import StoreClient

log = get_logger(__name__)

INSTALL_HINT = 'pip install "hpdcp_runner[sftp]" (paramiko)'
_TMP = ".put-"  # a whole object's temporary name: .NAME.put-<id>, beside it
_LOCK = ".lock"  # the lock of a replace-if-unchanged: NAME.lock
_STALE_LOCK_S = 60.0  # a lock this old on the server's clock was left by a killed writer
_LOCK_WAIT_S = 30.0  # how long a replace waits for another writer's lock
_ETAG_BYTES = 1 << 20  # objects up to this size carry their SHA-256 as their e_tag (commit objects)
_BLOCK = 4 << 20  # bytes per write call (paramiko splits them into pipelined requests)


def _paramiko() -> Any:
    try:
        import paramiko
    except ImportError:
        raise ConfigError(f"checkpoints on an SFTP server (sftp://) need paramiko: {INSTALL_HINT}") from None
    quiet = logging.getLogger("paramiko")
    if quiet.level == logging.NOTSET:  # (one INFO line per channel opened, unless the user asked for them)
        quiet.setLevel(logging.WARNING)
    return paramiko


def _read(f: Any, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of an open file, every request sent before the first reply is
    awaited (paramiko's prefetch), taken in request-sized pieces: one ``read`` of many MiB joins
    its pieces one by one (quadratic: 6x slower than the wire for 64 MiB, measured)."""
    step = f.MAX_REQUEST_SIZE
    out = bytearray()
    for piece in f.readv([(o, min(step, stop - o)) for o in range(start, stop, step)]):
        out += piece
    return bytes(out)


def _temp_name(path: str) -> str:
    """A fresh temporary name beside ``path`` (``.NAME.put-<id>``), renamed onto it when whole."""
    return posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}{_TMP}{uuid.uuid4().hex[:12]}")


def _etag(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


class _Server:
    """One SSH connection to a server as one user, and a pool of SFTP channels on it."""

    def __init__(self, host: str, port: int, timeout: float, channels: int) -> None:
        pm = _paramiko()
        self.host, self.port, self.timeout = host, port, timeout
        self.user = _user()
        self.ssh = pm.SSHClient()
        self.ssh.load_system_host_keys()
        known = os.environ.get("SFTP_KNOWN_HOSTS")
        if known:
            self.ssh.load_host_keys(os.path.expanduser(known))
        self.ssh.set_missing_host_key_policy(pm.RejectPolicy())  # never trusted on first use
        key = os.environ.get("SFTP_KEY_FILE")
        self.ssh.connect(host, port, username=self.user, password=os.environ.get("SFTP_PASSWORD") or None,
                         key_filename=os.path.expanduser(key) if key else None, timeout=timeout,
                         banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout)
        self.pool: queue.LifoQueue = queue.LifoQueue()
        self.slots = threading.Semaphore(channels)
        self.fsync_ok: bool | None = None  # whether the server offers fsync@openssh.com (None: not asked)
        # ranged reads one at a time on this connection, each with every request in flight: two
        # channels prefetching at once stalled for 3-8 s at random (measured, 256 MiB on loopback:
        # loads of 2-12 s with 2-8 readers, 2.6 s every time with one)
        self.reads = threading.Lock()

    def alive(self) -> bool:
        t = self.ssh.get_transport()
        return t is not None and t.is_active()

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        """An SFTP channel of this connection for one call (at most ``channels`` at once)."""
        if not self.slots.acquire(timeout=self.timeout):
            raise TimeoutError(f"no SFTP channel to {self.host}:{self.port} came free in {self.timeout:g} s")
        try:
            try:
                s = self.pool.get_nowait()
            except queue.Empty:
                s = self.ssh.open_sftp()
                s.get_channel().settimeout(self.timeout)  # every reply within the timeout: no hang
            ok = False
            try:
                yield s
                ok = True
            finally:
                if ok:
                    self.pool.put(s)
                else:
                    s.close()  # (a call that failed may leave replies in flight on it)
        finally:
            self.slots.release()


_SERVERS: dict[tuple, _Server] = {}
_SERVERS_LOCK = threading.Lock()


def _server(host: str, port: int, options: Any) -> _Server:
    ident = (os.getpid(), host, port, os.environ.get("SFTP_USER"), os.environ.get("SFTP_KEY_FILE"),
             os.environ.get("SFTP_KNOWN_HOSTS"))  # (a forked process makes its own connection)
    with _SERVERS_LOCK:
        got = _SERVERS.get(ident)
        if got is None or not got.alive():
            got = _SERVERS[ident] = _Server(host, port, options.request_timeout_s, min(options.concurrency, 8))
        return got


def _user() -> str:
    return os.environ.get("SFTP_USER") or getpass.getuser()


def _is_missing(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == 2


class SftpBucket(StoreClient):
    """The objects under one ``sftp://host[:port]/path``: keys are paths below ``/`` on the
    server, the directories made as objects are written and removed when they empty."""

    def __init__(self, uri: str, options: Any = None) -> None:
        from ..objects.object_store import default_options

        self.options = options or default_options()
        self._parse(uri)
        host, _, port = self.bucket.partition(":")
        self.host, self.port = host, int(port or 22)
        if not 0 < self.port < 65536:
            raise ConfigError(f"{uri}: {self.port} is not a TCP port")
        self._conn: _Server | None = None

    # -- connection and errors --------------------------------------------------------------
    @contextlib.contextmanager
    def _sftp(self, what: str, key: str, *, read: bool = False) -> Iterator[Any]:
        """An SFTP channel for one call (``read``: a ranged read, which waits for the
        connection's other ranged reads first); any failure is one line naming ``what`` and ``key``."""
        from ...core.errors import HpdcpError

        try:
            if self._conn is None or not self._conn.alive():
                self._conn = _server(self.host, self.port, self.options)
            with self._conn.reads if read else contextlib.nullcontext(), self._conn.channel() as s:
                yield s
        except (HpdcpError, FileExistsError):
            raise
        except Exception as e:
            raise self.error(e, what, key) from None

    def error(self, e: BaseException, what: str, key: str) -> Exception:
        pm = _paramiko()
        where, server = self.url(key), f"{self.host}:{self.port}"
        if _is_missing(e):
            return CheckpointNotFoundError(f"{what}: {where} does not exist")
        if isinstance(e, pm.AuthenticationException):
            return StorageAccessError(f"{what}: the SFTP server {server} refused user {_user()!r} ({e}); "
                                      f"check {self.kind.credentials}")
        if isinstance(e, pm.SSHException) and "known_hosts" in str(e):
            return StorageAccessError(f"{what}: the host key of {server} is not known, so the server is not trusted; "
                                      f"add it to SFTP_KNOWN_HOSTS or ~/.ssh/known_hosts (ssh-keyscan -p {self.port} "
                                      f"{self.host}) after checking its fingerprint")
        if isinstance(e, pm.BadHostKeyException):
            return StorageAccessError(f"{what}: the host key of {server} differs from the known one: refused ({e})")
        if isinstance(e, (pm.ssh_exception.NoValidConnectionsError, ConnectionError, socket.gaierror)):
            return StorageAccessError(f"{what}: cannot reach the SFTP server {server} for {where} ({e})")
        if isinstance(e, (socket.timeout, TimeoutError)):
            return StorageAccessError(f"{what}: the SFTP server {server} did not answer within "
                                      f"{self.options.request_timeout_s:g} s for {where} (dcp.storage.request_timeout_s)")
        if isinstance(e, PermissionError) or getattr(e, "errno", None) == 13:
            return StorageAccessError(f"{what}: access to {where} was refused by the server (permissions)")
        return StorageAccessError(f"{what}: {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    @staticmethod
    def _path(key: str) -> str:
        return "/" + key.strip("/")

    def _meta(self, key: str, attr: Any, body: bytes | None = None) -> dict:
        return {"path": key, "size": attr.st_size, "e_tag": _etag(body) if body is not None else None,
                "last_modified": _dt.datetime.fromtimestamp(attr.st_mtime or 0, _dt.timezone.utc)}

    # -- reads --------------------------------------------------------------------------------
    def _object(self, s: Any, key: str) -> Any:
        """The attributes of the regular file at ``key``, or None (missing; a directory or a link
        is no object)."""
        try:
            attr = s.lstat(self._path(key))
        except OSError as e:
            if _is_missing(e):
                return None
            raise
        return attr if stat.S_ISREG(attr.st_mode or 0) else None

    def head(self, key: str) -> dict | None:
        with self._sftp("reading", key) as s:
            attr = self._object(s, key)
            if attr is None:
                return None
            body = None
            if attr.st_size <= _ETAG_BYTES:  # small: its digest is the version a replace names
                with s.open(self._path(key), "rb") as f:
                    body = f.read()
            return self._meta(key, attr, body)

    def get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, dict] | None:
        with self._sftp("reading", key) as s:
            attr = self._object(s, key)
            if attr is None:
                return None
            if max_bytes is not None and attr.st_size > max_bytes:
                raise StorageAccessError(f"{self.url(key)} is {attr.st_size} bytes, over the {max_bytes}-byte limit")
            with s.open(self._path(key), "rb") as f:
                body = _read(f, 0, attr.st_size)
            return body, self._meta(key, attr, body if len(body) <= _ETAG_BYTES else None)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._sftp(f"reading bytes {start}..{end}", key, read=True) as s:
            with s.open(self._path(key), "rb") as f:
                size = f.stat().st_size
                stop = min(end, size)
                return _read(f, start, stop) if stop > start else b""

    # -- writes -------------------------------------------------------------------------------
    def _mkdirs(self, s: Any, directory: str) -> None:
        """``directory`` and its parents, as a store makes prefixes on the first write."""
        missing = []
        d = directory
        while d not in ("", "/"):
            try:
                if stat.S_ISDIR(s.stat(d).st_mode or 0):
                    break
                raise StorageAccessError(f"{self.url(d.lstrip('/'))} is a file, not a directory")
            except OSError as e:
                if not _is_missing(e):
                    raise
            missing.append(d)
            d = posixpath.dirname(d)
        for d in reversed(missing):
            try:
                s.mkdir(d)
            except OSError:
                if not stat.S_ISDIR(s.stat(d).st_mode or 0):  # (made by another writer meanwhile: fine)
                    raise

    def _fsync(self, s: Any, f: Any) -> None:
        """The file's bytes on the server's disk (``fsync@openssh.com``), where it offers that."""
        conn = self._conn
        if conn is None or conn.fsync_ok is False:
            return
        from paramiko.sftp import CMD_EXTENDED

        f.flush()  # (a failed write is that write's error, not an unsupported fsync)
        try:
            s._request(CMD_EXTENDED, "fsync@openssh.com", f.handle)  # (paramiko has no public call for it)
            if conn.fsync_ok is None:
                conn.fsync_ok = True
        except OSError as e:
            if conn.fsync_ok is True:
                raise  # the server fsyncs, so this file's failed: never a durable-looking save
            with _SERVERS_LOCK:  # (channels ask at once: one warning)
                first, conn.fsync_ok = conn.fsync_ok is None, False
            if first:
                log.warning("the SFTP server %s:%s offers no fsync@openssh.com (%s): checkpoints there are as durable "
                            "as its file system makes renamed files", self.host, self.port, e)

    def _write_temp(self, s: Any, path: str, data: Any) -> str:
        """``data`` in a new file beside ``path``, flushed; returns its name."""
        tmp = _temp_name(path)
        self._mkdirs(s, posixpath.dirname(path))
        with s.open(tmp, "wb") as f:
            f.set_pipelined(True)
            view = memoryview(data).cast("B")
            for i in range(0, len(view), _BLOCK):
                f.write(view[i:i + _BLOCK].tobytes())
            self._fsync(s, f)
        return tmp

    def _remove_quietly(self, s: Any, path: str) -> None:
        try:
            s.remove(path)
        except OSError:
            pass

    def _rename_new(self, s: Any, tmp: str, path: str) -> bool:
        """``tmp`` renamed to ``path`` only if nothing is there (the protocol's own rename, which
        never replaces): False when something is."""
        try:
            s.rename(tmp, path)
            return True
        except OSError as e:
            try:
                s.lstat(path)
            except OSError:
                raise e from None  # not there, so the rename failed for another reason
            self._remove_quietly(s, tmp)
            return False

    def put(self, key: str, data: bytes | memoryview, *, mode: Any = None) -> dict:
        path = self._path(key)
        with self._sftp("writing", key) as s:
            if mode is not None and mode != "create":
                self._replace_if_unchanged(s, key, data, mode.get("e_tag"))
            else:
                tmp = self._write_temp(s, path, data)
                if mode == "create":
                    if not self._rename_new(s, tmp, path):
                        raise FileExistsError(f"{self.url(key)} exists (conditional write refused)")
                else:
                    s.posix_rename(tmp, path)
            return self._meta(key, s.lstat(path), bytes(data) if len(data) <= _ETAG_BYTES else None)

    def _replace_if_unchanged(self, s: Any, key: str, data: Any, e_tag: str | None) -> None:
        """Under the lock: the object is still the one ``e_tag`` names, then replaced atomically;
        else FileExistsError (the caller's compare-and-swap lost)."""
        path = self._path(key)
        lock = self._lock(s, path)
        try:
            try:
                with s.open(path, "rb") as f:
                    current = _etag(f.read(_ETAG_BYTES + 1))
            except OSError as e:
                if not _is_missing(e):
                    raise
                current = None
            if e_tag is None or current != e_tag:
                raise FileExistsError(f"{self.url(key)} changed (conditional write refused)")
            s.posix_rename(self._write_temp(s, path, data), path)
        finally:
            self._remove_quietly(s, lock)

    def _lock(self, s: Any, path: str) -> str:
        """Take ``path``'s lock file (the exclusive rename), waiting for another writer's; one
        ``_STALE_LOCK_S`` old on the server's clock is a killed writer's, taken over."""
        lock, deadline = path + _LOCK, time.monotonic() + _LOCK_WAIT_S
        while True:
            tmp = self._write_temp(s, lock, f"{socket.gethostname()} {os.getpid()}".encode())
            now = s.lstat(tmp).st_mtime or 0  # the server's clock
            if self._rename_new(s, tmp, lock):
                return lock
            try:
                held_since = s.lstat(lock).st_mtime or 0
            except OSError:
                continue  # released meanwhile
            if now - held_since > _STALE_LOCK_S:
                log.warning("taking over %s: its lock is %.0f s old (a writer killed while replacing it)",
                            self.url(lock.lstrip('/')), now - held_since)
                self._remove_quietly(s, lock)
                continue
            if time.monotonic() > deadline:
                raise StorageAccessError(f"{self.url(lock.lstrip('/'))} is held by another writer for over "
                                         f"{_LOCK_WAIT_S:g} s")
            time.sleep(0.05)

    def writer(self, key: str, size_hint: int | None = None) -> "_Upload":
        return _Upload(self, key)

    # -- listings and deletes -----------------------------------------------------------------
    def _listdir(self, s: Any, key: str) -> list:
        try:
            return s.listdir_attr(self._path(key))
        except OSError as e:
            if _is_missing(e) or getattr(e, "errno", None) == 20:  # (a file: nothing under it)
                return []
            raise

    def list(self, prefix: str) -> Iterator[dict]:
        out, todo = [], [prefix.strip("/")]
        with self._sftp("listing", prefix) as s:
            while todo:
                d = todo.pop()
                for a in self._listdir(s, d):
                    k = f"{d}/{a.filename}" if d else a.filename
                    if stat.S_ISDIR(a.st_mode or 0):
                        todo.append(k)
                    elif stat.S_ISREG(a.st_mode or 0):  # (links are not objects)
                        out.append(self._meta(k, a))
        yield from sorted(out, key=lambda o: o["path"])

    def list_dir(self, prefix: str) -> tuple[list[str], list[dict]]:
        d = prefix.strip("/")
        with self._sftp("listing", prefix) as s:
            attrs = self._listdir(s, d)
        dirs = sorted(a.filename for a in attrs if stat.S_ISDIR(a.st_mode or 0))
        objs = [self._meta(f"{d}/{a.filename}" if d else a.filename, a) for a in attrs if stat.S_ISREG(a.st_mode or 0)]
        return dirs, sorted(objs, key=lambda o: o["path"])

    def delete(self, keys: Sequence[str]) -> None:
        """The objects, then the directories they leave empty up to this location's own (a
        store keeps no empty prefix)."""
        if not keys:
            return
        with self._sftp("deleting", keys[0]) as s:
            parents = set()
            for k in keys:
                try:
                    s.remove(self._path(k))
                except OSError as e:
                    if not _is_missing(e):
                        raise
                parents.add(posixpath.dirname(k.strip("/")))
            root = self.root.strip("/")
            for d in sorted(parents, key=lambda p: -p.count("/")):
                while root and d.startswith(root + "/"):  # (never above the location: sftp://host alone prunes none)
                    try:
                        s.rmdir(self._path(d))
                    except OSError:
                        break  # not empty (or gone): its parent is not either
                    d = posixpath.dirname(d)


class _Upload:
    """One object streamed (a rank file, a copied file): into a temporary name beside it,
    renamed into place by ``close``, so an upload never completed is never the object."""

    def __init__(self, bucket: SftpBucket, key: str) -> None:
        self.bucket, self.key = bucket, key
        self._cm = bucket._sftp("writing", key)
        self._s = self._cm.__enter__()
        try:
            path = bucket._path(key)
            bucket._mkdirs(self._s, posixpath.dirname(path))
            self.tmp = _temp_name(path)
            self._f = self._s.open(self.tmp, "wb")
            self._f.set_pipelined(True)
        except BaseException as e:
            self._cm.__exit__(type(e), e, e.__traceback__)
            raise

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        try:
            for i in range(0, len(view), _BLOCK):
                self._f.write(view[i:i + _BLOCK].tobytes())
        except Exception as e:
            self.abort()
            raise self.bucket.error(e, "writing", self.key) from None

    def close(self) -> None:
        try:
            self.bucket._fsync(self._s, self._f)
            self._f.close()
            self._s.posix_rename(self.tmp, self.bucket._path(self.key))
        except Exception as e:
            self.abort()
            raise self.bucket.error(e, "writing", self.key) from None
        self._s = None
        self._cm.__exit__(None, None, None)

    def abort(self) -> None:
        """Drop the temporary file and the channel (best effort: a save's clean-up takes what is
        left)."""
        if self._s is None:
            return
        try:
            self._f.close()
            self.bucket._remove_quietly(self._s, self.tmp)
        except Exception:
            pass
        self._s = None
        try:
            err = ConnectionAbortedError("upload aborted")
            self._cm.__exit__(type(err), err, None)  # (the channel is closed, not reused)
        except Exception:
            pass
