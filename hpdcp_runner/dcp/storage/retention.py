"""The checkpoints of one *series* in a directory, newest first, and keeping the newest k.

A series is the naming pattern a job writes, e.g. ``step_{step}``. A checkpoint saved as part of
one records it in its metadata (``extra``, see :func:`series_extra`): the pattern, its step and
the coordinator's clock when it was committed. Retention and "latest" consider only committed
checkpoints whose name matches the pattern *and* whose metadata records that same series, so
other names (``best``, ``init``, ``step_5_backup``), checkpoints of another series, copies under
another name and checkpoints written by other tools are never touched. "Newest" is the highest
recorded step, ties broken by commit time; a member's name must be the pattern formatted with
its recorded step (see ``why_not_member``), so a name can never claim an order its metadata
does not record, nor a recorded step a name it does not have.

Only committed checkpoints count: staging (``.NAME.tmp-*``), trash (``.NAME.trash-*``) and
directories without ``metadata.json`` are ignored. Deletion renames to a trash name first, so a
crash never leaves half a checkpoint under a real name; the next retention clears the trash.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

from ..core.errors import ConfigError
from ..core.utils import get_logger
from .location import locate
from .uri import join

log = get_logger(__name__)
STEP_FIELD = "{step}"


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint of a series, as its metadata records it."""

    name: str
    path: str
    step: int | None
    committed_at_ns: int

    @property
    def order(self) -> tuple:
        return (self.step if self.step is not None else -1, self.committed_at_ns, self.name)


def series_extra(series: str, step: int | None) -> dict[str, Any]:
    """What a save records in ``Metadata.extra`` to join ``series`` (pass as ``save(extra=...)``)."""
    return {"series": series, "step": step, "committed_at_ns": time.time_ns()}


def series_regex(series: str) -> re.Pattern:
    """Names a series writes: ``{step}`` is a run of digits, the rest literal."""
    if series.count(STEP_FIELD) > 1:
        raise ConfigError(f"series {series!r}: at most one {STEP_FIELD} field")
    return re.compile("".join(r"\d+" if p == STEP_FIELD else re.escape(p)
                              for p in re.split(r"(\{step\})", series) if p))


def _scan(directory: str, rx: re.Pattern, repair: bool = False) -> Iterable[tuple[str, str, dict | None, bool]]:
    """(name, path, recorded extra, is a link) of each committed checkpoint named like ``rx``:
    one catalog for the directory, not a location per entry."""
    loc = locate(directory)
    catalog = loc.catalog()
    return [(n, join(loc.url, n), x, catalog.is_link(n)) for n, x in catalog.checkpoints(rx.fullmatch, repair=repair)]


def series_name(series: str, step: int | None) -> str | None:
    """The name ``series`` gives ``step`` (None: the series has a step field and no step)."""
    if STEP_FIELD not in series:
        return series
    return series.replace(STEP_FIELD, str(step)) if type(step) is int and step >= 0 else None


def _step_in_name(series: str, name: str) -> int | None:
    """The step a name of ``series`` carries (``step_007`` -> 7), None if it does not fit."""
    if STEP_FIELD not in series:
        return None
    head, tail = series.split(STEP_FIELD)
    m = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), name)
    return int(m.group(1)) if m else None


def why_not_member(name: str, path: str, series: str, extra: dict | None, *, link: bool | None = None) -> str | None:
    """Why a committed checkpoint named like ``series`` is not one of its members (None: it is).
    Membership is claimed by the metadata and confirmed by the name: the recorded series must be
    this one, and the name exactly the series pattern formatted with the recorded step (a
    checkpoint copied in under a series name, e.g. another run's final step as ``step_0``, would
    otherwise sort by its recorded step and make retention delete real ones). A symbolic link is
    never a member: what it points to belongs to another directory (or run)."""
    if link if link is not None else locate(path).parent().catalog().is_link(name):
        return "it is a symbolic link (what it points to is not this directory's to order or delete)"
    if extra is None or "series" not in extra:
        return "its metadata records no series (another tool or an older version wrote it)"
    if extra.get("series") != series:
        return f"its metadata records the series {extra.get('series')!r}"
    step = extra.get("step")
    if STEP_FIELD not in series:
        return None if name == series else f"the series {series!r} has one name, not {name!r}"
    if not (type(step) is int and step >= 0):
        return f"its metadata records no step ({step!r}) for a series with a step in its name"
    if _step_in_name(series, name) != step:
        return (f"its metadata records step {step}, which the series names {series_name(series, step)!r}, not "
                f"{name!r} (copied or renamed in)")
    return None


def series_outsiders(directory: str | os.PathLike, series: str) -> list[tuple[str, str]]:
    """(name, why) of the committed checkpoints named like ``series`` that are not its members:
    never picked as latest, never deleted by retention; summaries and inspect say why."""
    d = os.fspath(directory)
    return [(n, why) for n, p, x, ln in _scan(d, series_regex(series)) if (why := why_not_member(n, p, series, x, link=ln))]


def list_checkpoints(directory: str | os.PathLike, series: str, *, repair: bool = False) -> list[CheckpointEntry]:
    """Committed members of ``series`` in ``directory`` (a local directory or a URI), oldest first
    (see :func:`why_not_member`). ``repair``: writers only (see ``_committed``)."""
    d, rx = os.fspath(directory), series_regex(series)
    out = []
    for name, path, extra, link in _scan(d, rx, repair):
        if extra is None or why_not_member(name, path, series, extra, link=link) is not None:
            continue
        step, when = extra.get("step"), extra.get("committed_at_ns")
        out.append(CheckpointEntry(name, path, step if type(step) is int else None,
                                   when if type(when) is int else 0))
    return sorted(out, key=lambda e: e.order)


def unrecorded_checkpoints(directory: str | os.PathLike, series: str) -> list[str]:
    """Committed checkpoints whose name fits ``series`` but whose metadata records no series
    (written before series were recorded, or by another tool): never used or deleted by name."""
    d, rx = os.fspath(directory), series_regex(series)
    return [n for n, _, extra, _ in _scan(d, rx) if "series" not in (extra or {})]


def latest_checkpoint(directory: str | os.PathLike, series: str) -> str | None:
    """The path of the newest committed checkpoint of ``series`` in ``directory``, or None."""
    entries = list_checkpoints(directory, series)
    return entries[-1].path if entries else None


def apply_retention(directory: str | os.PathLike, keep_last: int, *, series: str,
                    keep: Iterable[str] = ()) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints of ``series`` (0 keeps all); names in
    ``keep`` (the checkpoint just committed) are never deleted. Also clears old trash. Returns the
    names removed. Call it only after a save committed."""
    if keep_last < 0:
        raise ConfigError(f"keep_last must be >= 0, got {keep_last}")
    loc = locate(directory)
    catalog = loc.catalog()
    catalog.tidy(keep)
    if keep_last == 0:
        return []
    entries = list_checkpoints(loc.url, series, repair=True)
    protected = set(keep)
    removed = [e.name for e in entries[:-keep_last] if e.name not in protected] if len(entries) > keep_last else []
    for n in removed:
        log.info("retention (keep_last=%d, series %s): removing %s", keep_last, series, join(loc.url, n))
        catalog.delete(n)
    return removed
