"""Fault-injection points for tests and drills; free when nothing is armed.

The engine calls ``point(name, **info)`` at the places where real failures happen (before and
after a rank's file write, before the commit, in the background writer of ``async_save``). A
test arms a point with an action that raises, sleeps or kills the process::

    with faults.armed("save.write", lambda rank, **_: rank == 1 and faults.fail(OSError(28, "disk full"))):
        ...

In production ``_ARMED`` is empty and ``point`` is one dict truthiness check.

Points. Inside the agreed save protocol (a failure on one rank is raised on every rank), each
with ``rank`` and ``path`` (the checkpoint's final path): ``save.plan`` as a rank starts planning
(in ``async_save``: inside the background writer), ``save.write`` before a rank writes its files,
``save.written`` after, ``save.commit`` on the coordinator before the commit. Storage level, with
``path`` (the file or directory): ``file.write`` before each tensor is written, ``file.fsync``
before a file is synced, ``commit.rename`` just before the renames that publish a checkpoint,
``copy.file`` (also ``rank``) before a drain copies a file (``drain.copy_checkpoint``),
``persist.write`` (``rank``) in a persisting process before it writes (``async_save(mode="process")``),
``stage.copy`` (``rank``) in ``async_save``'s background thread before a background staging copy,
``retention.delete`` between renaming a checkpoint to trash and deleting it, ``load.read`` (also
``file``, ``rank``) before each read of a checkpoint file.

Processes started by torchrun cannot be armed from a test, so ``HPDCP_FAULTS`` arms points at
import: ``point[@rank]:action[;...]`` with actions ``kill`` (SIGKILL this process), ``hang``
(sleep an hour), ``sleep=<s>``, ``eio`` / ``enospc`` (raise that OSError naming ``path``). Example:
``HPDCP_FAULTS='save.write@1:kill'``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .errors import ConfigError

_ARMED: dict[str, Callable[..., Any]] = {}


def point(name: str, **info: Any) -> None:
    """Run the action armed at ``name`` (if any) with ``info``; its exception propagates."""
    if _ARMED:
        action = _ARMED.get(name)
        if action is not None:
            action(**info)


def is_armed(name: str) -> bool:
    """Whether ``name`` has an action: a point passed once per read asks this before it builds
    its ``info`` (the rank lookup alone is ~2 us, on ~1,000 reads per load)."""
    return bool(_ARMED) and name in _ARMED


def arm(name: str, action: Callable[..., Any]) -> None:
    _ARMED[name] = action


def disarm(name: str | None = None) -> None:
    """Disarm one point, or every point."""
    if name is None:
        _ARMED.clear()
    else:
        _ARMED.pop(name, None)


@contextmanager
def armed(name: str, action: Callable[..., Any]) -> Iterator[None]:
    arm(name, action)
    try:
        yield
    finally:
        disarm(name)


def fail(exc: BaseException) -> None:
    """Raise ``exc`` (usable inside a lambda action)."""
    raise exc


def _env_action(spec: str) -> Callable[..., Any]:
    import errno
    import os
    import signal
    import time

    point_rank, _, action = spec.partition(":")
    _, _, rank_text = point_rank.partition("@")
    try:
        only = int(rank_text) if rank_text else None
        if action.startswith("sleep="):
            float(action[6:])
        elif action not in ("kill", "hang", "eio", "enospc"):
            raise ValueError
    except ValueError:
        raise ConfigError(f"HPDCP_FAULTS: bad spec {spec!r} (point[@rank]:kill|hang|sleep=<s>|eio|enospc)") from None

    def act(**info: Any) -> None:
        rank = info.get("rank", int(os.environ.get("RANK", "0")))
        if only is not None and rank != only:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "hang":
            time.sleep(3600)
        elif action.startswith("sleep="):
            time.sleep(float(action[6:]))
        elif action in ("eio", "enospc"):
            code = errno.EIO if action == "eio" else errno.ENOSPC
            raise OSError(code, os.strerror(code), str(info.get("path", "?")))
        else:
            raise ConfigError(f"HPDCP_FAULTS: unknown action {action!r} in {spec!r}")

    return act


def arm_from_env(text: str) -> None:
    """Arm the points listed in an ``HPDCP_FAULTS`` value (see the module docstring). Several
    specs for one point (``save.write@0:kill;save.write@1:hang``) all apply, in order."""
    by_point: dict[str, list[Callable[..., Any]]] = {}
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        by_point.setdefault(spec.partition(":")[0].partition("@")[0], []).append(_env_action(spec))
    for name, actions in by_point.items():
        arm(name, _all(actions))


def _all(actions: list[Callable[..., Any]]) -> Callable[..., Any]:
    def act(**info: Any) -> None:
        for a in actions:
            a(**info)

    return act


def _arm_env() -> None:
    import os

    if os.environ.get("HPDCP_FAULTS"):
        arm_from_env(os.environ["HPDCP_FAULTS"])


_arm_env()
