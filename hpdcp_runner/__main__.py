"""Entry point: ``torchrun --nproc-per-node=N -m hpdcp_runner +job=<name> [overrides]``,
``python -m hpdcp_runner +job=<name>`` (one process), ``hpdcp --nproc-per-node=N +job=<name>``
(torchrun's launcher in-process, quiet failures: see rank_launcher) or the ``hpdcp`` console script.

Thin on purpose: agree the run dir across ranks before Hydra starts, then hand over to Hydra.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from . import config, runtime
from .paths import find_conf_dir


def _task(cfg: DictConfig):
    from . import jobs

    runtime.redact_saved_config()
    if "SUBMITIT_FOLDER" not in os.environ:
        return jobs.run(cfg)
    # a task of a submitit job (hydra/launcher=submitit_*): its tasks are the ranks of one
    # process group, formed from the scheduler's variables; the process ends with the task
    runtime.adopt_scheduler_env()
    try:
        return jobs.run(cfg)
    except SystemExit as e:
        if e.code not in (0, None):  # the job failed and said so (FAILED in its run dir): the
            return None  # launcher reports the point and the sweep goes on; exiting would lose it
        raise
    finally:
        runtime.shutdown_distributed()


# A submitit task runs this module's _task in a fresh process that never ran main(): the
# resolvers the config uses (run stamp, rank) must exist there too.
runtime.register_resolvers()


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


def _check_launcher(argv: list[str]) -> None:
    """A submitit launcher without its plugin: one line saying what to install, not Hydra's
    "Unknown plugin class" traceback."""
    import importlib.util
    import sys

    for arg in argv:
        name = arg.split("=", 1)[1] if arg.startswith("hydra/launcher=") else ""
        if "submitit" in name and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
            if runtime.env_rank() == 0:
                sys.stderr.write(f"error: ConfigError: hydra/launcher={name} needs the slurm extra: "
                                 f"pip install -e \".[slurm]\" (hydra-submitit-launcher)\n")
            raise SystemExit(2)


def _worker() -> None:

    from .cli_help import handle_early_flags

    code = handle_early_flags(sys.argv[1:], runtime.env_rank())
    if code is not None:
        raise SystemExit(code)
    _check_launcher(sys.argv[1:])
    runtime.adopt_scheduler_env()  # srun: each task is a rank, as under torchrun
    runtime.remember_launch_dir()
    runtime.agree_run_stamp()
    runtime.register_resolvers()
    config.register()
    # Register our launcher even where Hydra's plugin scan cannot see the namespace package
    # (setuptools' editable installs hide it from pkgutil).
    from hydra.core.plugins import Plugins
    from hydra_plugins.hpdcp_launcher.torchrun_launcher import TorchrunLauncher

    Plugins.instance().register(TorchrunLauncher)
    from hydra_plugins.hpdcp_launcher import submitit_launchers  # its presets join the ConfigStore on import

    for launcher in submitit_launchers.LAUNCHERS:  # none without the slurm extra
        Plugins.instance().register(launcher)
    from hydra.errors import CompactHydraException

    own = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user asked for Hydra's own traceback
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us as exceptions, not printed text
    try:
        hydra.main(version_base="1.3", config_path=find_conf_dir(), config_name="config")(_task)()
    except CompactHydraException as e:
        if own:
            raise
        if runtime.env_rank() == 0:  # every rank composed the same config: one line, once
            sys.stderr.write(f"error: ConfigError: {config_error_line(e)}\n")
        raise SystemExit(2) from None
    finally:
        runtime.shutdown_distributed()


def config_error_line(e: BaseException) -> str:
    """Hydra's composition error as one line: a key that does not exist names the nearest real
    keys of its section (``checkpoint.kep_last`` -> ``checkpoint.keep_last``); anything else is
    the first line of Hydra's text and of its cause."""
    import difflib

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        full, parent = str(cause.full_key), cause.parent_node
        section = full.rsplit(".", 1)[0] if "." in full else ""
        keys = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
        near = difflib.get_close_matches(str(cause.key), keys, n=3, cutoff=0.5)
        named = [f"{section}.{k}" if section else k for k in near]
        hint = f"did you mean {' or '.join(named)}?" if named else \
            f"{section or 'the config'} has: {', '.join(keys)}" if keys else ""
        value = f" ({hint})" if hint else ""
        return f"{full}: no such config key{value}"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    override = getattr(e, "override", None)  # a parse error names the text, not which override
    if override is not None:
        first = f"{override}: {first}"
    more = (str(cause).strip().splitlines() or [""])[0] if cause is not None else ""
    return f"{first} {more}".strip()


if __name__ == "__main__":
    main()
