"""Fault-injection points for tests and drills; free when nothing is armed.

The engine calls ``point(name, **info)`` at the places where real failures happen (before and
after a rank's file write, before the commit, in the background writer of ``async_save``). A
test arms a point with an action that raises, sleeps or kills the process::

    with faults.armed("save.write", lambda rank, **_: rank == 1 and faults.fail(OSError(28, "disk full"))):
        ...

In production ``_ARMED`` is empty and ``point`` is one dict truthiness check.

Points (each gets ``rank`` and ``path``, the checkpoint's final path): ``save.plan`` as a rank
starts planning (in ``async_save``: inside the background writer), ``save.write`` before a rank
writes its files, ``save.written`` after, ``save.commit`` on the coordinator before the commit.
All run inside the agreed protocol, so a failure on one rank is raised on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

_ARMED: dict[str, Callable[..., Any]] = {}


def point(name: str, **info: Any) -> None:
    """Run the action armed at ``name`` (if any) with ``info``; its exception propagates."""
    if _ARMED:
        action = _ARMED.get(name)
        if action is not None:
            action(**info)


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
