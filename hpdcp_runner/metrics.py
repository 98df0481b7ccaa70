"""Per-rank phase timers and byte counters, gathered into ``metrics.json`` plus a summary table."""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from typing import Iterator

from .dcp.tools import PhaseTimer
from .runtime import detail_logger, peak_rss_mib


def config_digest(plain_cfg: dict) -> str:
    return hashlib.sha256(json.dumps(plain_cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Metrics(PhaseTimer):
    """What one rank measured: ``phase`` (from PhaseTimer) times wall-clock; ``add`` accumulates counters."""

    def __init__(self) -> None:
        super().__init__()
        self.counters: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` and log its start and end (or failure) to the rank log."""
        log = detail_logger()
        log.info("phase %s: started", name)
        t0 = time.perf_counter()
        with super().phase(name):
            try:
                yield
            except BaseException as e:
                log.info("phase %s: failed after %.3f s (%s)", name, time.perf_counter() - t0, type(e).__name__)
                raise
        log.info("phase %s: done in %.3f s", name, time.perf_counter() - t0)

    def add(self, counters: dict[str, int], prefix: str = "") -> None:
        for k, v in counters.items():
            if isinstance(v, (int, float)):
                self.counters[prefix + k] = self.counters.get(prefix + k, 0) + v

    def rank_record(self, rank: int) -> dict:
        from .dcp.tools import node_id

        return {"rank": rank, "phases_s": self.seconds, "counters": self.counters,
                "peak_rss_mib": round(peak_rss_mib(), 1), "node": node_id()}


def summarize(records: list[dict]) -> dict:
    """Max-over-ranks phase seconds, and GB/s for phases that moved bytes (``<phase>.bytes_*``)."""
    phases = sorted({p for r in records for p in r["phases_s"]})
    out = {}
    for p in phases:
        secs = max(r["phases_s"].get(p, 0.0) for r in records)
        row = {"seconds_max": round(secs, 4)}
        keys = (f"{p}.bytes_written", f"{p}.bytes_read")
        if any(k in r["counters"] for r in records for k in keys):
            total = sum(r["counters"].get(k, 0) for r in records for k in keys)
            row["bytes"] = total
            row["GB_per_s"] = round(total / secs / 1e9, 3) if secs > 0 else None
        out[p] = row
    return out


def write_metrics(run_dir: str, doc: dict) -> str:
    path = os.path.join(run_dir, "metrics.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)
    return path


def summary_table(doc: dict) -> str:
    changed = doc.get("model_overridden")  # the preset's name alone would describe another model
    what = f"source={doc['source']}" if doc.get("source") else \
        f"model={doc['model']}" + (f" ({' '.join(changed)})" if changed else "")
    layout = f" layout={doc['layout']}" if doc.get("layout") else ""
    lines = [f"hpdcp {doc['job']}: world_size={doc['world_size']}{layout} {what}"]
    lines.append(f"{'phase':<20}{'seconds(max)':>14}{'bytes':>16}{'GB/s':>10}")
    for p, row in doc["summary"].items():
        if p.startswith("warmup."):  # timed, kept in metrics.json, not part of the measurement
            continue
        b = row.get("bytes")
        lines.append(f"{p:<20}{row['seconds_max']:>14.3f}{(str(b) if b is not None else '-'):>16}"
                     f"{(str(row.get('GB_per_s')) if row.get('GB_per_s') is not None else '-'):>10}")
    rss = max(r["peak_rss_mib"] for r in doc["ranks"])
    lines.append(f"peak RSS (max over ranks): {rss:.0f} MiB; metrics: {doc['metrics_path']}")
    for k, v in doc.get("result", {}).items():
        lines.append(f"{k}: {_readable(v)}")
    return "\n".join(lines)


def _readable(v: object) -> str:
    """Scalars as they are, containers as JSON (not Python reprs), None as 'none'."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=str)
    return str(v)
