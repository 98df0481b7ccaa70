"""A directory's committed checkpoints, as retention and "latest" see them (``Location.catalog``):
listed with what each records, tidied of what crashed saves left, deleted whole. Each kind of
storage implements it beside its commit: ``posix.series.PosixCatalog``, ``objects.object_checkpoint.StoreCatalog``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable


class Catalog(ABC):
    """The committed checkpoints of one directory (``Location.catalog``): what retention and
    "latest" list, tidy and delete, on any storage."""

    @abstractmethod
    def checkpoints(self, name_ok: Callable[[str], object], *, repair: bool = False) -> list[tuple[str, dict | None]]:
        """(name, the ``extra`` its metadata records) of each committed checkpoint whose name
        ``name_ok`` admits. ``repair`` (writers only): finish what a crashed commit left half done."""

    @abstractmethod
    def tidy(self, keep: Iterable[str] = ()) -> None:
        """Remove what crashed or superseded saves left (after their grace; never a name in
        ``keep``, never a committed checkpoint)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove the committed checkpoint ``name``, never leaving half of it under its name."""

    def is_link(self, name: str) -> bool:
        """True when ``name`` is a symbolic link (a store has none)."""
        return False
