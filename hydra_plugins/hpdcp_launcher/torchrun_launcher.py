"""``hydra/launcher=hpdcp_torchrun``: N torch workers per sweep point.

Hydra runs once, in this process; for each sweep point the launcher prepares the job dir
(``.hydra/`` is written here, once) and starts ``nproc_per_node`` workers with
``elastic_launch``. The workers get the resolved config as plain data, form a gloo/NCCL group
and run the job; the point's return value (for optimizing sweepers) is read from rank 0's
``metrics.json``. A failing point is reported, marked with a ``FAILED`` file and, with
``on_failure=continue``, the sweep goes on with ``failure_value`` as its objective. The elastic
agent stops every worker of a point as soon as one fails, so none is left hanging.
"""

# No `from __future__ import annotations`: Hydra's plugin scan loads this module outside
# sys.modules, where dataclasses cannot resolve string annotations.
import logging
import math
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.hpdcp_launcher.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 2
    start_method: str = "auto"  # auto (fork when safe, else spawn) | fork | spawn
    objective: str = "result.objective"  # dotted path into rank 0's metrics.json
    on_failure: str = "continue"  # continue | stop
    failure_value: Optional[float] = math.inf  # objective of a failed point (minimizing sweepers)
    monitor_interval_s: float = 0.1


ConfigStore.instance().store(group="hydra/launcher", name="hpdcp_torchrun", node=TorchrunLauncherConf,
                             provider="hpdcp_runner")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method(wanted: str) -> str:
    if wanted != "auto":
        return wanted
    import torch

    cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
    return "fork" if threading.active_count() == 1 and not cuda_live else "spawn"


class TorchrunLauncher(Launcher):
    def __init__(self, **conf: Any) -> None:
        self.conf = TorchrunLauncherConf(**conf)
        if self.conf.on_failure not in ("continue", "stop"):
            raise ValueError(f"hydra.launcher.on_failure must be continue or stop, got {self.conf.on_failure!r}")
        if self.conf.nproc_per_node < 1:
            raise ValueError(f"hydra.launcher.nproc_per_node must be >= 1, got {self.conf.nproc_per_node}")
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs, {self.conf.nproc_per_node} torch workers each")
        runs = []
        for idx, overrides in enumerate(job_overrides):
            idx = initial_job_idx + idx
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            ret = run_job(hydra_context=self.hydra_context, task_function=self._spawn, config=sweep_config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            runs.append(ret)
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def _spawn(self, task_cfg: DictConfig) -> Any:
        """Runs inside ``run_job`` for one sweep point: start the workers, return rank 0's objective."""
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from hpdcp_runner.launch import read_objective, run_worker

        hc = HydraConfig.get()
        run_dir = hc.runtime.output_dir
        # Hydra refuses to sweep hydra.* keys, so the world size sweeps as runtime.nproc_per_node=1,2,4
        nproc = task_cfg.get("runtime", {}).get("nproc_per_node") or self.conf.nproc_per_node
        plain = OmegaConf.to_container(task_cfg, resolve=True)
        port = _free_port()
        lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          max_restarts=0, monitor_interval=self.conf.monitor_interval_s,
                          start_method=_start_method(self.conf.start_method))
        try:
            elastic_launch(lc, run_worker)(plain, run_dir)
        except Exception as e:  # ChildFailedError: the agent already stopped every worker of this point
            marker = os.path.join(run_dir, "FAILED")
            cause = ""
            if os.path.isfile(marker):  # rank 0 wrote the job's own error there
                with open(marker) as f:
                    cause = f.read().strip()
            if not cause:  # a worker died without saying why (killed, crashed): torchrun's summary
                cause = f"a worker died: {e}"
                with open(marker, "w") as f:
                    f.write(cause + "\n")
            msg = f"sweep point {run_dir} failed: {cause}"
            if self.conf.on_failure == "stop":
                raise
            log.error(msg)
            return self.conf.failure_value
        return read_objective(run_dir, self.conf.objective)
