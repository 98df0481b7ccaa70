"""The committed checkpoints of a local directory, as retention and "latest" see them: names
with ``metadata.json`` (and an overwrite a crash left between its two renames, read where it
is), each with the ``extra`` its metadata records; trash and abandoned saves cleared."""

from __future__ import annotations

import os
from typing import Callable, Iterable

from ...core.rafile import open_regular
from ...format import jsondoc
from ...format.metadata import METADATA_FILE
from ..catalog import Catalog
from .commit import DISPLACED_MARK, TRASH_MARK, clear_abandoned, interrupted_swap, recover_displaced, remove_tree_safely

_MAX_SCAN_BYTES = 256 << 20  # a metadata.json larger than this is not read while scanning


def recorded_extra(path: str) -> dict | None:
    """``extra`` of a committed checkpoint's metadata, or None if it cannot be read (read where
    an overwrite between its renames left it, if it is not under its name)."""
    full = os.path.join(path if os.path.lexists(path) else (interrupted_swap(path) or path), METADATA_FILE)
    try:
        fd = open_regular(full)
    except Exception:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            text = f.read(_MAX_SCAN_BYTES + 1)
        if len(text) > _MAX_SCAN_BYTES:
            return None
        extra = jsondoc.parse(text, "metadata").get("extra")
    except (OSError, ValueError, AttributeError):
        return None
    return extra if isinstance(extra, dict) else None


def committed_names(directory: str, repair: bool = False) -> Iterable[str]:
    """Committed checkpoint names in ``directory``. ``repair`` (writers only: retention after a
    save) finishes overwrites a crash interrupted between their two renames; without it (readers:
    latest, listing) a name whose overwrite is between its renames still counts, read in place."""
    if not os.path.isdir(directory):
        return []
    displaced = [n for n in os.listdir(directory) if n.startswith(".") and DISPLACED_MARK in n and TRASH_MARK not in n]
    if repair:
        for n in displaced:
            recover_displaced(os.path.join(directory, n[1:n.rindex(DISPLACED_MARK)]))
    names = {n for n in os.listdir(directory)
             if not n.startswith(".") and os.path.isfile(os.path.join(directory, n, METADATA_FILE))}
    for n in displaced:
        base = n[1:n.rindex(DISPLACED_MARK)]
        if base not in names and interrupted_swap(os.path.join(directory, base)):
            names.add(base)
    return sorted(names)


def committed_extras(directory: str, name_ok: Callable[[str], object],
                     repair: bool = False) -> list[tuple[str, dict | None]]:
    """(name, recorded extra) of each committed checkpoint in ``directory`` that ``name_ok`` admits."""
    return [(n, recorded_extra(os.path.join(directory, n))) for n in committed_names(directory, repair) if name_ok(n)]


def clear_trash(directory: str) -> None:
    """Delete trash left by a deletion or overwrite that crashed half-way, and the staging
    directories of saves whose coordinator died; saves in progress keep theirs."""
    if os.path.isdir(directory):
        clear_abandoned(directory)


class PosixCatalog(Catalog):
    """The committed checkpoints of a local directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def checkpoints(self, name_ok: Callable[[str], object], *, repair: bool = False) -> list[tuple[str, dict | None]]:
        return committed_extras(self.directory, name_ok, repair)

    def tidy(self, keep: Iterable[str] = ()) -> None:
        clear_trash(self.directory)

    def delete(self, name: str) -> None:
        remove_tree_safely(os.path.join(self.directory, name))  # (renamed to trash first: never half there)

    def is_link(self, name: str) -> bool:
        return os.path.islink(os.path.join(self.directory, name))
