"""The commit step, shared by checkpoints and every offline output: a directory is built under
a hidden staging name beside its final name and appears under that name in one rename (an
overwrite swaps the two atomically where the kernel can, so the old one stays loadable until the
new one is in place). Also what cleanup needs: trash deletion, abandoned-staging detection
(flock), recovery of an overwrite interrupted between its two renames.

Names beside ``parent/NAME``: ``.NAME.tmp-<id>`` staging (``.lock`` beside it while a live
process writes it), ``.NAME.trash-<id>`` being deleted, ``.NAME.old-<id>`` displaced by an
interrupted non-atomic overwrite.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import socket
import time
import uuid

from ...core import faults
from ...core.errors import CheckpointExistsError, CommitDurabilityError, HpdcpError, StorageAccessError
from ...core.utils import get_logger
from ...format.metadata import METADATA_FILE

log = get_logger(__name__)
STAGING_MARK = ".tmp-"
STAGING_LOCK = ".lock"  # suffix of the lock file beside a staging directory
TRASH_MARK = ".trash-"
DISPLACED_MARK = ".old-"  # an overwritten checkpoint between the two renames of a non-atomic swap


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directories (Linux renameat2). False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if fn(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def remove_tree_safely(path: str) -> None:
    """Rename to a trash name first, then delete: a crash never leaves half a checkpoint under a real name."""
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name.lstrip('.')}{TRASH_MARK}{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    faults.point("retention.delete", path=trash)
    if os.path.islink(trash):  # rmtree refuses links; a link is removed, never followed
        os.unlink(trash)
    else:
        shutil.rmtree(trash, ignore_errors=True)


def hold_staging_lock(staging: str) -> int:
    """The coordinator holds an exclusive flock on ``<staging>.lock`` (beside the staging
    directory, so it is never part of the checkpoint) from begin until after the commit; the
    kernel drops it when the process dies, which is how cleanup tells a dead save's staging
    directory from one in progress."""
    fd = os.open(staging + STAGING_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # who holds it: where flock is local to a host (some cluster file systems), a lock taken on
    # another host looks free here, so the holder's host and pid say more than the lock alone
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with ``pid`` still runs (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, someone else's
    return True


def staging_is_abandoned(staging: str, *, unlocked_age_s: float = 3600.0) -> bool:
    """True when no live process saves into ``staging``: its lock is free and its holder (host,
    pid, written in the lock) is a process of this host that is gone, or a process of another
    host that has not touched it for ``unlocked_age_s``; or it has no lock (an early crash, or a
    version without one) and was last touched over ``unlocked_age_s`` ago."""
    lock = staging + STAGING_LOCK
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        try:
            return time.time() - os.stat(staging).st_mtime > unlocked_age_s
        except OSError:
            return False
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        holder = os.pread(fd, 256, 0).decode(errors="replace").split()
        if len(holder) != 2 or not holder[1].isdigit():
            return True  # free, holder unknown (a lock from before holders were recorded)
        if holder[0] == socket.gethostname():
            return not pid_alive(int(holder[1])) or time.time() - os.fstat(fd).st_mtime > unlocked_age_s
        return time.time() - max(os.fstat(fd).st_mtime, _newest_mtime(staging)) > unlocked_age_s
    finally:
        os.close(fd)


def _newest_mtime(directory: str) -> float:
    """The latest modification time in ``directory`` (its files grow while a save writes them)."""
    newest = 0.0
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for e in it:
            with contextlib.suppress(OSError):
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def clear_abandoned(directory: str) -> list[str]:
    """Delete what dead writers left in ``directory``: trash of a deletion or overwrite that
    crashed half-way, and staging directories (with their locks) whose save is no longer running
    (:func:`staging_is_abandoned`); saves in progress keep theirs. Swaps a crash interrupted are
    finished first (their staging says which displaced copy is the committed checkpoint). Returns
    the staging names removed. Every save's coordinator calls it, so an interrupted or killed
    save's bytes do not stay behind whatever retention is set to."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for n in names:
        if n.startswith(".") and DISPLACED_MARK in n and TRASH_MARK not in n:
            recover_displaced(os.path.join(directory, n[1:n.rindex(DISPLACED_MARK)]))
    for n in names:
        if n.startswith(".") and TRASH_MARK in n:
            shutil.rmtree(os.path.join(directory, n), ignore_errors=True)
        elif n.startswith(".") and STAGING_MARK in n and not n.endswith(STAGING_LOCK):
            staging = os.path.join(directory, n)
            if os.path.isdir(staging) and not os.path.islink(staging) and staging_is_abandoned(staging):
                log.info("removing %s: the save that staged it is no longer running", staging)
                shutil.rmtree(staging, ignore_errors=True)  # never a checkpoint: no trash step needed
                with contextlib.suppress(OSError):
                    os.unlink(staging + STAGING_LOCK)
                removed.append(n)
    return removed


NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
USER_FIXES = NO_SPACE + (errno.EROFS, errno.EACCES, errno.EPERM)  # what a user fixes, not a bug


def storage_access_error(e: OSError, what: str) -> StorageAccessError:
    """``what`` failed for a reason the user fixes (permissions, a file in the way, no space)."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in NO_SPACE:
        place = os.path.dirname(os.path.dirname(e.filename)) if e.filename and STAGING_MARK in e.filename \
            else os.path.dirname(e.filename) if e.filename else "the device"
        quota = " (over the quota)" if e.errno != errno.ENOSPC else ""
        return StorageAccessError(f"{what}: no space left on {place}{quota}: {e.strerror or e}{where}; free space "
                                  f"there or write elsewhere")
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return StorageAccessError(f"{what}: a file is in the way where a directory should be{where}")
    return StorageAccessError(f"{what}: {e.strerror or e}{where}")


def publish_dir(staging: str, path: str, *, overwrite: bool, fsync: bool = True) -> None:
    """Make a complete staging directory visible as ``path`` in one step (the commit).

    Without ``overwrite`` an existing ``path`` is never replaced, also one that another writer
    committed while this one was staging (rename() onto a non-empty directory fails, so there is
    no window). With it, the two are swapped atomically where the kernel can (renameat2), so the
    old one stays loadable until the new one is in place, then the old one goes to trash. Where
    it cannot (some FUSE and network file systems), see :func:`_swap_by_renames`.
    """
    parent, name = os.path.split(path)
    faults.point("commit.rename", path=path)
    if not overwrite:
        try:
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            os.rename(staging, path)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
            raise CheckpointExistsError(f"{path} appeared while this save was in progress (another save committed "
                                        f"it first); nothing was committed") from None
    elif os.path.lexists(path):
        if not _exchange(staging, path):
            _swap_by_renames(staging, path)
        else:
            remove_tree_safely(staging)  # the staging name now holds the old one
    else:
        os.rename(staging, path)
    if fsync:
        try:
            faults.point("commit.dir_fsync", path=parent)
            fsync_dir(parent)
        except OSError as e:
            raise CommitDurabilityError(
                f"checkpoint {path} IS committed (complete and loadable under its name), but syncing its directory "
                f"{parent} failed ({e.strerror or e}): the commit may not survive a crash of the machine; check the "
                f"storage. Saving it again needs overwrite.") from None


def _swap_by_renames(staging: str, path: str) -> None:
    """Overwrite without an atomic exchange: the old checkpoint is first renamed to a *displaced*
    name ``.NAME.old-<id>``, ``<id>`` being the staging directory's (``.NAME.tmp-<id>``), never to
    trash, then staging becomes ``NAME``. If the second rename fails, the old one is put back at
    once. While both exist (between the renames, or after a crash there) readers read the
    displaced copy in place (:func:`interrupted_swap`); the next writer of the name restores it
    once the swap's staging lock is free (:func:`recover_displaced`). Trash cleanup never touches
    displaced directories."""
    parent, name = os.path.split(path)
    displaced = os.path.join(parent, f".{name}{DISPLACED_MARK}{staging.rsplit(STAGING_MARK, 1)[-1]}")
    os.rename(path, displaced)
    try:
        faults.point("commit.displaced", path=path)
        os.rename(staging, path)
    except OSError as e:
        try:
            os.rename(displaced, path)
        except OSError:
            pass  # the next writer of the name restores it; readers read it in place until then
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise CheckpointExistsError(f"{path} was put back by another process while this overwrite was between "
                                        f"its two renames; nothing was committed") from None
        raise
    except BaseException:
        try:
            os.rename(displaced, path)
        except OSError:
            pass
        raise
    try:
        remove_tree_safely(displaced)
    except FileNotFoundError:
        pass  # a concurrent recovery already cleared it: the commit stands


def _displaced(path: str) -> list[tuple[str, str]]:
    """(displaced directory, the staging directory of the swap that displaced it) beside ``path``."""
    parent, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}{DISPLACED_MARK}"
    try:
        # (a displaced directory being deleted was renamed to trash: never a candidate)
        found = sorted(n for n in os.listdir(parent) if n.startswith(prefix) and TRASH_MARK not in n)
    except OSError:
        return []
    return [(os.path.join(parent, n), os.path.join(parent, f".{name}{STAGING_MARK}{n[len(prefix):]}"))
            for n in found]


def interrupted_swap(path: str) -> str | None:
    """Read only (what readers call): the complete checkpoint an overwrite displaced from the
    missing ``path`` and has not yet replaced, i.e. a displaced copy whose swap's staging
    directory still exists (between the two renames, or after a crash there). A displaced copy
    whose staging is gone belongs to a swap that completed: the name was deleted after it, on
    purpose, and stays deleted."""
    if os.path.lexists(path):
        return None
    live = [d for d, staging in _displaced(path)
            if os.path.isdir(staging) and os.path.isfile(os.path.join(d, METADATA_FILE))]
    return max(live, key=lambda d: os.stat(os.path.join(d, METADATA_FILE)).st_mtime_ns) if live else None


def recover_displaced(path: str) -> bool:
    """Writers only (a save of ``path``, retention): finish what a crashed rename-swap left, never
    one in progress (its staging lock is held). A missing ``path`` gets its displaced checkpoint
    back when the swap's staging is abandoned (the staging is then removed); displaced copies of
    swaps that completed are deleted. Returns whether ``path`` was restored."""
    restored = False
    for displaced, staging in _displaced(path):
        if os.path.isdir(staging) and not staging_is_abandoned(staging):
            continue  # an overwrite in progress: its writer finishes it
        complete = os.path.isfile(os.path.join(displaced, METADATA_FILE))
        legacy = len(displaced.rsplit(DISPLACED_MARK, 1)[-1]) == 8  # before ids were the staging's: no link
        if not os.path.lexists(path) and complete and (os.path.isdir(staging) or legacy):
            try:
                os.rename(displaced, path)
                restored = True
                log.warning("restored %s from %s: an overwrite had been interrupted between its renames", path,
                            displaced)
            except OSError:
                return False
        else:
            try:
                remove_tree_safely(displaced)
            except OSError:
                pass
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)  # never a checkpoint: no trash step needed
            with contextlib.suppress(OSError):
                os.unlink(staging + STAGING_LOCK)
    return restored


class RenameCommit:
    """The file system's commit strategy, for the engine's checkpoints and the offline tools'
    outputs alike: files are written into a hidden staging directory beside the target (its
    coordinator holding the staging lock, so cleanup can tell a live save from a dead one's
    leftovers), then published by one rename (``publish_dir``: an existing target stays in place
    until the new one is complete, swapped atomically where the kernel can). Beginning repairs an
    overwrite a crash interrupted and clears what dead writers left beside the target."""

    def __init__(self, dst: str, staging: str, overwrite: bool, lock_fd: int | None = None) -> None:
        self.dst, self.staging, self.overwrite, self._lock_fd = dst, staging, overwrite, lock_fd

    @classmethod
    def begin(cls, dst: str | os.PathLike, overwrite: bool, *, exists: str, what: str = "the output") -> "RenameCommit":
        """Coordinator: refuse an existing ``dst`` without ``overwrite`` (``exists``: the error,
        ``{path}`` in it replaced), make and lock the staging directory (``what``: the target in
        errors)."""
        path = os.path.abspath(os.fspath(dst))
        recover_displaced(path)
        if os.path.lexists(path) and not overwrite:
            raise CheckpointExistsError(exists.replace("{path}", path))
        parent, name = os.path.split(path)
        staging = os.path.join(parent, f".{name}{STAGING_MARK}{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(parent, exist_ok=True)
            os.mkdir(staging)
        except OSError as e:
            raise storage_access_error(e, f"cannot create {what} {path}") from None
        out = cls(path, staging, overwrite, hold_staging_lock(staging))
        try:  # what interrupted or killed writers left here goes now
            clear_abandoned(parent)
        except OSError as e:  # best effort: never the reason a save fails
            log.warning("could not clear abandoned staging in %s: %s", parent, e)
        return out

    @property
    def token(self) -> str:
        """What the other ranks ``adopt``: the staging directory's name."""
        return os.path.basename(self.staging)

    @classmethod
    def adopt(cls, dst: str | os.PathLike, token: str, overwrite: bool) -> "RenameCommit":
        """Another rank: the coordinator's staging directory (``token``, a name beside ``dst``)."""
        path = os.path.abspath(os.fspath(dst))
        parent, name = os.path.split(path)
        if not (isinstance(token, str) and token.startswith(f".{name}{STAGING_MARK}") and os.sep not in token):
            raise HpdcpError(f"{path}: {token!r} is not a staging directory of this output")
        return cls(path, os.path.join(parent, token), overwrite)

    def publish(self, fsync: bool = True) -> None:
        """Coordinator, every file written: make ``dst`` the staged directory in one step."""
        if fsync:
            fsync_dir(self.staging)
        try:
            publish_dir(self.staging, self.dst, overwrite=self.overwrite, fsync=fsync)
        finally:
            if not os.path.isdir(self.staging):  # published: the lock has nothing left to guard
                self._release_lock()

    def abort(self) -> None:
        """Best effort: the staging directory goes; the target is never touched."""
        if os.path.lexists(self.staging):
            with contextlib.suppress(OSError):
                remove_tree_safely(self.staging)
        self._release_lock()

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.staging + STAGING_LOCK)
            os.close(fd)
