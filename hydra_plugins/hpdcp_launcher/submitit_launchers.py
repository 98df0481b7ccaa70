"""``hydra/launcher=hpdcp_submitit_slurm`` (a SLURM cluster) and ``hpdcp_submitit_local`` (the
same code path on one machine): Hydra's submitit launcher, where each job or sweep point is one
distributed job of ``nodes x tasks_per_node`` ranks.

Each task of a submitted job runs the point's job as one rank: the process group forms from the
scheduler's variables (``hpdcp_runner.runtime.scheduler_env``), the tasks share the run directory
(the run stamp is agreed before submission), rank 0 alone writes ``.hydra/`` and
``metrics.json``. Points run as a job array, concurrently where the scheduler allows. A failing
point leaves its ``FAILED`` file, is reported in one line, and the sweep goes on
(``on_failure=stop`` ends it after the batch with an error); a point whose tasks died without a
word (killed, out of memory) is reported with the scheduler's account of it.

Needs the ``slurm`` extra (``pip install -e ".[slurm]"``: ``hydra-submitit-launcher``).
"""

# No `from __future__ import annotations`: Hydra's plugin scan loads this module outside
# sys.modules, where dataclasses cannot resolve string annotations.
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
RANK_BYTES = 300 << 20  # a rank's resident memory before any checkpoint (torch + the runner, measured ~300 MiB)


def _available_bytes() -> Optional[int]:
    """This machine's available memory (the engine's own measure), or None where unknown."""
    from hpdcp_runner.dcp.tools import available_bytes

    return available_bytes("cpu")


try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError:  # the slurm extra is not installed: the presets say so in one line
    LocalQueueConf = SlurmQueueConf = BaseSubmititLauncher = None


def _missing(**_: Any) -> None:
    raise ImportError("hydra/launcher=hpdcp_submitit_local|hpdcp_submitit_slurm needs the slurm extra: "
                      "pip install -e \".[slurm]\" (hydra-submitit-launcher)")


if BaseSubmititLauncher is not None:
    @dataclass
    class HpdcpLocalConf(LocalQueueConf):
        _target_: str = "hydra_plugins.hpdcp_launcher.submitit_launchers.HpdcpLocalLauncher"
        tasks_per_node: int = 2  # ranks of each point
        on_failure: str = "continue"  # continue | stop
        failure_value: Optional[float] = math.inf  # objective of a failed point (minimizing sweepers)

    @dataclass
    class HpdcpSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.hpdcp_launcher.submitit_launchers.HpdcpSlurmLauncher"
        on_failure: str = "continue"
        failure_value: Optional[float] = math.inf

    class _Hpdcp(BaseSubmititLauncher):
        """Runs each point as one distributed job; reports failed points instead of ending the sweep."""

        def __init__(self, **params: Any) -> None:
            self.on_failure = params.pop("on_failure", "continue")
            self.failure_value = params.pop("failure_value", math.inf)
            if self.on_failure not in ("continue", "stop"):
                raise ValueError(f"hydra.launcher.on_failure must be continue or stop, got {self.on_failure!r}")
            problem = self._problem(int(params.get("tasks_per_node", 1)), int(params.get("nodes", 1)))
            if problem:  # one line, before anything is submitted (Hydra would print a traceback)
                import sys

                sys.stderr.write(f"error: ConfigError: {problem}\n")
                raise SystemExit(2)
            super().__init__(**params)

        def _problem(self, tasks: int, nodes: int) -> Optional[str]:
            if tasks < 1 or nodes < 1:
                return f"hydra.launcher.tasks_per_node ({tasks}) and hydra.launcher.nodes ({nodes}) must be >= 1"
            if self._EXECUTOR != "local":
                return None
            if nodes != 1:
                return (f"hydra.launcher.nodes={nodes}: submitit's local executor runs on this machine only; "
                        f"use hydra/launcher=hpdcp_submitit_slurm for several nodes")
            avail = _available_bytes()
            if avail is not None and tasks * RANK_BYTES > avail:
                return (f"hydra.launcher.tasks_per_node={tasks}: this machine cannot start that many ranks (each "
                        f"needs about {RANK_BYTES >> 20} MiB before any checkpoint; {avail >> 20} MiB available); "
                        f"use at most {max(1, avail // RANK_BYTES)} or hydra/launcher=hpdcp_submitit_slurm")
            return None

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            import submitit

            params = dict(self.params)
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop("submitit_folder"),
                                             **({f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")}
                                                if "max_num_timeout" in params else {}))
            shared = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            log.info(f"submitit '{self._EXECUTOR}': {len(job_overrides)} points of {params.get('nodes', 1)} x "
                     f"{params.get('tasks_per_node', 1)} ranks under {sweep_dir}")
            args: List[tuple] = []
            for i, overrides in enumerate(job_overrides):
                idx = initial_job_idx + i
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                args.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
            jobs = executor.map_array(self, *zip(*args))
            results, failed = [], []
            for (overrides, _, idx, _, _), job in zip(args, jobs):
                run_dir = str(sweep_dir / str(idx))
                try:
                    ret = job.results()[0]  # rank 0's
                except Exception as e:  # every task died without a result: the scheduler's account
                    cause = str(e).strip().splitlines()
                    cause = " ".join(cause[-3:])[:500] if cause else type(e).__name__
                    os.makedirs(run_dir, exist_ok=True)
                    marker = os.path.join(run_dir, "FAILED")
                    if not os.path.isfile(marker):
                        with open(marker, "w") as f:
                            f.write(f"the point's tasks ended without a result: {cause}\n")
                    ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=None,
                                    working_dir=run_dir)
                marker = os.path.join(run_dir, "FAILED")
                if os.path.isfile(marker):
                    with open(marker) as f:
                        cause = f.read().strip().splitlines()
                    failed.append(idx)
                    log.error(f"sweep point #{idx} ({run_dir}) failed: {cause[0] if cause else '?'}")
                    ret.return_value = self.failure_value
                results.append(ret)
            if failed and self.on_failure == "stop":
                raise RuntimeError(f"sweep points {failed} failed (hydra.launcher.on_failure=stop); see FAILED in "
                                   f"their directories under {sweep_dir}")
            return results

    class HpdcpLocalLauncher(_Hpdcp):
        _EXECUTOR = "local"

    class HpdcpSlurmLauncher(_Hpdcp):
        _EXECUTOR = "slurm"

    LAUNCHERS: tuple = (HpdcpLocalLauncher, HpdcpSlurmLauncher)
    ConfigStore.instance().store(group="hydra/launcher", name="hpdcp_submitit_local", node=HpdcpLocalConf,
                                 provider="hpdcp_runner")
    ConfigStore.instance().store(group="hydra/launcher", name="hpdcp_submitit_slurm", node=HpdcpSlurmConf,
                                 provider="hpdcp_runner")
else:
    LAUNCHERS = ()

    @dataclass
    class MissingConf:
        _target_: str = "hydra_plugins.hpdcp_launcher.submitit_launchers._missing"

    for _name in ("hpdcp_submitit_local", "hpdcp_submitit_slurm"):
        ConfigStore.instance().store(group="hydra/launcher", name=_name, node=MissingConf, provider="hpdcp_runner")
