"""A run directory that cannot be made is one line naming ``hydra.run.dir``, not Hydra's
traceback: a Hydra callback creates it before Hydra does (and before any log file opens in it)."""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .runtime import env_rank, launch_dir


class RunDirCheck(Callback):
    """``hydra.callbacks.run_dir`` in ``conf/config.yaml``."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make(str(config.hydra.sweep.dir), "hydra.sweep.dir")


def _make(path: str, key: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        where = os.path.abspath(path)
        if env_rank() == 0:
            why = e.strerror or str(e)
            hint = f"run from a writable directory or pass {key}=<a writable directory>" \
                if not os.path.isabs(path) else f"pass {key}=<a writable directory>"
            sys.stderr.write(f"error: ConfigError: cannot create the run directory {where} ({key}): {why} "
                             f"(launched from {launch_dir()}); {hint}\n")
        raise SystemExit(2) from None
