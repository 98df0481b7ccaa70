"""What a launcher-started worker runs: one rank of one sweep point (see hydra_plugins/hpdcp_launcher)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from omegaconf import OmegaConf

from . import runtime


def _configure_logging(run_dir: str) -> None:
    rank = runtime.env_rank()
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler()
    console.addFilter(runtime.RankZeroFilter())
    fh = logging.FileHandler(os.path.join(run_dir, f"hpdcp_rank{rank}.log"))
    for h in (console, fh):
        h.setFormatter(fmt)
        root.addHandler(h)


def run_worker(plain: dict, run_dir: str) -> Any:
    """Entry point of one worker: rebuild the resolved config and run the job."""
    from . import jobs

    _configure_logging(run_dir)
    try:
        return jobs.run(OmegaConf.create(plain), run_dir=run_dir)
    finally:
        runtime.shutdown_distributed()


def metric_paths(node: Any, prefix: str = "") -> list[str]:
    """The dotted paths of every number in a ``metrics.json`` document (config and per-rank
    records left out): what an objective can name."""
    if isinstance(node, dict):
        return [p for k, v in node.items() if k not in ("config", "ranks", "engine")
                for p in metric_paths(v, f"{prefix}{k}.")]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [prefix[:-1]]
    return []


def lookup(doc: Any, path: str) -> Any:
    """The value at dotted ``path`` of a ``metrics.json`` document; KeyError if absent."""
    node = doc
    for part in path.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (IndexError, ValueError, TypeError):
            raise KeyError(path) from None
    return node


def read_objective(run_dir: str, path: str) -> Any:
    """The value at dotted ``path`` of ``metrics.json`` (written by rank 0), or None when the
    point has no such metric: logged with the metrics it does have, and written to the point's
    ``NO_OBJECTIVE`` file (which the sweep report shows), never a crash of the whole sweep."""
    with open(os.path.join(run_dir, "metrics.json")) as f:
        doc: Any = json.load(f)
    try:
        return lookup(doc, path)
    except KeyError:
        have = [p for p in metric_paths(doc) if p.startswith(("result.", "summary."))]
        msg = (f"{run_dir}: no objective {path!r} in metrics.json (job {doc.get('job')!r}); set "
               f"hydra.launcher.objective to one of: {', '.join(have[:30])}")
        logging.getLogger(__name__).warning("%s", msg)
        with open(os.path.join(run_dir, "NO_OBJECTIVE"), "w") as f:
            f.write(msg + "\n")
        return None
