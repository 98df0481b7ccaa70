"""``hpdcp --nproc-per-node=N +job=...`` (or ``python -m hpdcp_runner --nproc-per-node=N ...``):
torchrun's own launcher, run in-process, that ends a failed job with the workers' one-line error
and their exit code instead of torchrun's ``ChildFailedError`` traceback and summary.

Leading options that torchrun knows (``--nproc-per-node``, ``--nnodes``, ``--rdzv-endpoint``,
...) go to torchrun; everything after them is the job's Hydra command line.
"""

from __future__ import annotations

import logging
import sys

LAUNCH_FLAGS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--standalone")


def split_launcher_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the job's arguments): leading ``--options`` torchrun's parser knows,
    with their values, then the rest."""
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    i, ours = 0, []
    while i < len(argv) and argv[i].startswith("--"):
        name = argv[i].split("=", 1)[0]
        action = actions.get(name)
        if action is None or name in ("--help", "--module", "--no-python", "--run-path"):
            break
        ours.append(argv[i])
        if "=" not in argv[i] and action.nargs != 0 and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        i += 1
    return ours, argv[i:]


def compose_error(job: list[str]) -> str | None:
    """The one line a rank would print for a config that does not compose (a mistyped key, a
    value of the wrong type), found by composing it here once; None when it composes, or when
    the command line holds Hydra flags or sweeps that only a Hydra run handles."""
    if any(a.lstrip("+~").startswith(("-", "hydra/")) for a in job) or \
            any("," in a.split("=", 1)[-1] for a in job if "=" in a):
        return None  # --cfg, -m, a sweep (a=1,2), Hydra's own groups: left to the ranks' own Hydra run
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from . import config, runtime
    from .__main__ import config_error_line
    from .paths import find_conf_dir

    runtime.register_resolvers()
    config.register()
    try:
        with initialize_config_dir(config_dir=find_conf_dir(), version_base="1.3"):
            compose(config_name="config", overrides=list(job), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        return config_error_line(e)
    return None


def launch(argv: list[str]) -> int | None:
    """Launch the workers when ``argv`` starts with a launch option; returns the exit code, or
    None when this is not a launch (a worker, or a one-process run)."""
    if not argv or argv[0].split("=", 1)[0] not in LAUNCH_FLAGS:
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    launcher, job = split_launcher_args(argv)
    from .cli_help import report_mistakes

    if report_mistakes(job, 0):  # a mistake every rank would make: said before any starts
        return 2
    wrong = compose_error(job)
    if wrong is not None:  # a key that does not exist: said in a second, not after every rank started
        sys.stderr.write(f"error: ConfigError: {wrong}\n")
        return 2
    # torchrun's agent logs its banner and a failure summary at WARNING/ERROR: the workers
    # already said what went wrong, once
    import torch.distributed.elastic.agent.server.api  # noqa: F401 (its logger is made on import)

    for name in list(logging.root.manager.loggerDict):  # some set their own level: each is quieted
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run(parse_args([*launcher, "-m", "hpdcp_runner", *job]))
    except SignalException as e:  # Ctrl-C / SIGTERM: relayed to the workers, which said so and cleaned up
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: no worker could say why
            sys.stderr.write(f"hpdcp: rank {rank} was killed by signal {-failure.exitcode} "
                             f"({failure.signal_name()}); see its log in the run directory\n")
            return 1
        return failure.exitcode
    return 0
