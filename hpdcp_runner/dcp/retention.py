"""Finding checkpoints in a directory and keeping the newest k, crash-safely.

Only committed checkpoints count: staging (``.NAME.tmp-*``), trash (``.NAME.trash-*``) and
directories without ``metadata.json`` are ignored. Steps order numerically by the trailing number
of the name (``step_9`` < ``step_10``). Deletion renames to a trash name first, so a crash never
leaves half a checkpoint under a real name.
"""

from __future__ import annotations

import os
import re
import shutil

from .filesystem_storage import TRASH_MARK, remove_tree_safely
from .metadata import METADATA_FILE

_STEP = re.compile(r"(\d+)$")


def _order(name: str) -> tuple:
    m = _STEP.search(name)
    return (int(m.group(1)) if m else -1, name)


def list_checkpoints(directory: str | os.PathLike) -> list[str]:
    """Committed checkpoint names in ``directory``, oldest first."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        return []
    names = [n for n in os.listdir(d)
             if not n.startswith(".") and os.path.isfile(os.path.join(d, n, METADATA_FILE))]
    return sorted(names, key=_order)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The path of the newest committed checkpoint in ``directory``, or None."""
    names = list_checkpoints(directory)
    return os.path.join(os.fspath(directory), names[-1]) if names else None


def apply_retention(directory: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints (0 keeps all); also clears
    trash left by an earlier crash. Returns the names removed. Call it only after a save committed."""
    d = os.fspath(directory)
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    if os.path.isdir(d):
        for n in os.listdir(d):
            if n.startswith(".") and TRASH_MARK in n:
                shutil.rmtree(os.path.join(d, n), ignore_errors=True)
    if keep_last == 0:
        return []
    names = list_checkpoints(d)
    removed = names[:-keep_last] if len(names) > keep_last else []
    for n in removed:
        remove_tree_safely(os.path.join(d, n))
    return removed
