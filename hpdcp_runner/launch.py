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


def read_objective(run_dir: str, path: str) -> Any:
    """The value at dotted ``path`` of ``metrics.json`` (written by rank 0)."""
    with open(os.path.join(run_dir, "metrics.json")) as f:
        node: Any = json.load(f)
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node
