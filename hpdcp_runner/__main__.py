"""Entry point: ``torchrun --nproc-per-node=N -m hpdcp_runner +job=<name> [overrides]``,
``python -m hpdcp_runner +job=<name>`` (one process), ``hpdcp --nproc-per-node=N +job=<name>``
(torchrun's launcher in-process, quiet failures: see rank_launcher) or the ``hpdcp`` console script.

Thin on purpose: agree the run dir across ranks before Hydra starts, then hand over to Hydra.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from . import config, runtime
from .paths import find_conf_dir


def _task(cfg: DictConfig):
    from . import jobs

    return jobs.run(cfg)


def main() -> None:
    import sys

    from .rank_launcher import launch

    code = launch(sys.argv[1:])
    if code is not None:
        raise SystemExit(code)
    runtime.install_interrupt_handlers()
    try:
        _worker()
    except KeyboardInterrupt as e:  # outside the job (config composition, rendezvous, teardown)
        sig = getattr(e, "signame", "SIGINT")
        if runtime.env_rank() == 0:
            sys.stderr.write(f"error: interrupted by {sig}\n")
        raise SystemExit(getattr(e, "exit_code", 130)) from None


def _worker() -> None:
    import sys

    from .cli_help import handle_early_flags

    code = handle_early_flags(sys.argv[1:], runtime.env_rank())
    if code is not None:
        raise SystemExit(code)
    runtime.remember_launch_dir()
    runtime.agree_run_stamp()
    runtime.register_resolvers()
    config.register()
    # Register our launcher even where Hydra's plugin scan cannot see the namespace package
    # (setuptools' editable installs hide it from pkgutil).
    from hydra.core.plugins import Plugins
    from hydra_plugins.hpdcp_launcher.torchrun_launcher import TorchrunLauncher

    Plugins.instance().register(TorchrunLauncher)
    try:
        hydra.main(version_base="1.3", config_path=find_conf_dir(), config_name="config")(_task)()
    finally:
        runtime.shutdown_distributed()


if __name__ == "__main__":
    main()
