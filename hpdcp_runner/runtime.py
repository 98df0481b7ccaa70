"""Process-group lifetime, rank info, run-directory agreement and rank-aware logging.

Under torchrun every rank runs Hydra. Before Hydra starts, all ranks of one launch agree on one
run stamp through torchrun's own TCPStore, so they share one run directory; rank 0 alone writes
``.hydra/``; each rank logs to its own file; the console shows INFO from rank 0 and warnings
from every rank.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import secrets
import signal
import sys
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from .dcp import ConfigError

STAMP_ENV = "HPDCP_RUN_STAMP"
LAUNCH_DIR_ENV = "HPDCP_LAUNCH_DIR"


def remember_launch_dir() -> str:
    """Record the directory the command was run in (inherited by torchrun/launcher workers),
    before anything can change the working directory (``hydra.job.chdir=true``)."""
    return os.environ.setdefault(LAUNCH_DIR_ENV, os.getcwd())


def launch_dir() -> str:
    """Where relative paths given by the user are resolved: the command's working directory."""
    return os.environ.get(LAUNCH_DIR_ENV) or os.getcwd()


def env_rank() -> int:
    """This process's global rank from its launcher (torchrun's RANK, else SLURM's or submitit's
    task id), before any process group exists (Hydra resolves the rank-0-only paths with it)."""
    if "RANK" in os.environ:
        try:
            return int(os.environ["RANK"])
        except ValueError:
            return 0  # a launcher's garbage: the group's own checks say so
    try:
        sched = scheduler_env()
    except ConfigError:  # adopt_scheduler_env reports it
        return 0
    return int(sched["RANK"]) if sched else 0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[03-05,9],gpu7`` -> ``node03``): the first
    entry with each bracket group replaced by its first value (zero padding kept)."""
    depth, entry = 0, ""
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(nodelist)
        entry += ch
    if depth != 0 or not entry or not re.fullmatch(r"[A-Za-z0-9._\-]+(\[[0-9,\-]+\][A-Za-z0-9._\-]*)*", entry):
        raise ValueError(nodelist)
    while "[" in entry:
        head, rest = entry.split("[", 1)
        group, tail = rest.split("]", 1)
        entry = head + group.split(",")[0].split("-")[0] + tail
    return entry


def scheduler_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> dict[str, str] | None:
    """torch.distributed's env:// variables for a process a scheduler started as one task of a
    job, with no launcher having set them: ``srun`` (SLURM's variables of the job step) or
    submitit (its SLURM executor sets SLURM's; its local executor its own). None when a launcher
    (torchrun) set ``RANK`` or no scheduler started this process as a task."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return None
    def number(name: str, default: str, least: int = 0) -> str:
        """A variable that must be a whole number (at least ``least``): ConfigError naming it."""
        value = env.get(name, default)
        if not (value.isdigit() and int(value) >= least and len(value) <= 9):
            raise ConfigError(f"{name}={value!r} is not a number{' >= 1' if least else ''} (as the scheduler sets "
                              f"it); start the tasks with srun, or set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
        return str(int(value))

    if "SUBMITIT_LOCAL_GLOBALID" in env:
        rank, world = number("SUBMITIT_LOCAL_GLOBALID", "0"), number("SUBMITIT_LOCAL_NTASKS", "1", 1)
        local, node = number("SUBMITIT_LOCAL_LOCALID", rank), number("SUBMITIT_LOCAL_NODEID", "0")
        nodes = number("SUBMITIT_LOCAL_JOB_NUM_NODES", "1", 1)
        host, job = "127.0.0.1", env.get("SUBMITIT_LOCAL_JOB_ID", "0")
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # a task of an srun step
        rank, world = number("SLURM_PROCID", "0"), number("SLURM_STEP_NUM_TASKS", "1", 1)
        local, node = number("SLURM_LOCALID", "0"), number("SLURM_NODEID", "0")
        nodes = number("SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES", "1", 1)
        which = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        try:
            host = first_host(env.get(which) or "127.0.0.1")
        except ValueError:
            raise ConfigError(f"{which}={env.get(which)!r} is not a SLURM node list (e.g. node[03-05,9],gpu7)") \
                from None
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    else:
        return None
    # the same port and run stamp on every task of the job, with nothing exchanged (a task of a
    # submitit job inherits the stamp its launcher agreed; srun's tasks derive it from the step)
    port = env.get("MASTER_PORT") or str(20000 + zlib.crc32(job.encode()) % 40000)
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port!r} is not a port (1-65535)")
    stamp = env.get(STAMP_ENV) or (f"slurm-{job}" if "SUBMITIT_LOCAL_GLOBALID" not in env else "")
    per_node = max(1, int(world) // max(1, int(nodes)))
    return {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": node, "MASTER_ADDR": env.get("MASTER_ADDR") or host, "MASTER_PORT": port,
            STAMP_ENV: stamp}


def launcher_name() -> str:
    """Who started this process as a rank: what the metrics record."""
    if "SUBMITIT_FOLDER" in os.environ:
        return "submitit"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun (under srun)" if "SLURM_STEP_NUM_TASKS" in os.environ else "torchrun"
    if "SLURM_STEP_NUM_TASKS" in os.environ and "WORLD_SIZE" in os.environ:
        return "srun"
    return "one process"


def adopt_scheduler_env() -> bool:
    """Export :func:`scheduler_env` (when a scheduler started this process) so the process group
    forms from it, as under torchrun. True when it did."""
    try:
        sched = scheduler_env()
    except ConfigError as e:  # a variable that is not what a scheduler sets: one line naming it
        task = os.environ.get("SUBMITIT_LOCAL_GLOBALID", os.environ.get("SLURM_PROCID", "0"))
        if not task.isdigit() or int(task) == 0:  # once: task 0 (or every task, when its own id is garbage)
            sys.stderr.write(f"error: ConfigError: {e}\n")
        raise SystemExit(2) from None
    if not sched:
        return False
    rank, world, local = int(sched["RANK"]), int(sched["WORLD_SIZE"]), int(sched["LOCAL_RANK"])
    if not (0 <= rank < world and 0 <= local < world):
        names = ("SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_NTASKS", "SUBMITIT_LOCAL_LOCALID") \
            if "SUBMITIT_LOCAL_GLOBALID" in os.environ else ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
        shown = ", ".join(f"{n}={os.environ.get(n)!r}" for n in names)
        sys.stderr.write(f"error: ConfigError: the scheduler's task variables do not describe a rank of the job "
                         f"({shown}): a task's id must be below the task count; start the tasks with srun (or "
                         f"set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT yourself)\n")
        raise SystemExit(2)
    os.environ.update({k: v for k, v in sched.items() if v})
    return True


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ


def agree_run_stamp(timeout_s: float = 120.0) -> str:
    """One ``date_time_id`` stamp per launch, identical on every rank; the random id keeps two
    launches in the same second apart."""
    if STAMP_ENV in os.environ:
        return os.environ[STAMP_ENV]
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S") + "_" + secrets.token_hex(3)
    if under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=_dt.timedelta(seconds=timeout_s))
        key = f"hpdcp/stamp/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if env_rank() == 0:
            store.set(key, stamp)
        stamp = store.get(key).decode()
    os.environ[STAMP_ENV] = stamp
    return stamp


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("hpdcp.stamp", lambda: os.environ.get(STAMP_ENV, "local"), replace=True)
    OmegaConf.register_new_resolver("hpdcp.rank", lambda: env_rank(), replace=True)
    OmegaConf.register_new_resolver("hpdcp.rank0_only", lambda v: v if env_rank() == 0 else None, replace=True)


DETAIL_LOGGER = "hpdcp_runner.detail"  # rank log only: phases, failures with their tracebacks


class RankZeroFilter(logging.Filter):
    """Console filter: INFO and below from rank 0 only; WARNING and above from every rank;
    records of the ``hpdcp_runner.detail`` logger never (they are for the rank log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == DETAIL_LOGGER or record.name.startswith(DETAIL_LOGGER + "."):
            return False
        return env_rank() == 0 or record.levelno >= logging.WARNING


def write_out(text: str, file=None) -> None:
    """Print a job's output. A reader that left (``... | head -3``) is not the job's failure: the
    rest of the output goes to /dev/null (so neither this nor the interpreter's last flush raises
    BrokenPipeError) and the job ends as it would have."""
    out = file or sys.stdout
    try:
        print(text, file=out, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, out.fileno())
        except (OSError, ValueError):  # not a real file descriptor (captured output)
            pass
        finally:
            os.close(devnull)


def redact_saved_config() -> None:
    """Hydra saves the composed config under ``.hydra/`` before the job runs: a secret that a
    config file (not the command line, which is checked before Hydra starts) put in a URI, a
    signature in a query string or a key in ``user:secret@``, is rewritten out of those copies
    before anything else happens (the job then refuses the location itself)."""
    from hydra.core.hydra_config import HydraConfig

    from .dcp.tools import redact

    try:
        hc = HydraConfig.get()
        folder = os.path.join(hc.runtime.output_dir, hc.output_subdir) if hc.output_subdir else None
    except Exception:  # not under Hydra (a test calling a job directly)
        return
    if not folder or not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.endswith(".yaml") or not os.path.isfile(path):
            continue
        with open(path) as f:
            text = f.read()
        clean = redact(text)
        if clean != text:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(clean)
            os.replace(tmp, path)


def detail_logger() -> logging.Logger:
    """Where jobs log what only the rank log needs (phases, tracebacks of failures)."""
    return logging.getLogger(DETAIL_LOGGER)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    device: str


def init_distributed(backend: str, device: str, timeout_s: float) -> RankInfo:
    """Create the process group once (reused across multirun jobs inside one torchrun)."""
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    if device == "cuda":
        if not torch.cuda.is_available():
            from .dcp import ConfigError

            raise ConfigError("runtime.device: cuda was asked for but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = _dt.timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
            # torchrun's agent keeps one store across restarts (--max-restarts): a restarted
            # attempt must not read the dead attempt's addresses (torch issue 135712), so each
            # attempt's group lives under its own prefix
            tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"hpdcp/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt_{attempt}", tcp)
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=ws,
                                    timeout=timeout)
        elif ws > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # one process: a private store, no ports
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, node_rank, device)


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_FAILED = False


class JobInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (Ctrl-C, ``kill``, a SLURM preemption) arrived: raised in the main
    thread so every ``finally`` and abort on the way out runs (a save's staging is removed)."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame

    @property
    def exit_code(self) -> int:
        return 128 + int(getattr(signal, self.signame, signal.SIGINT))


_INTERRUPTED: list[tuple[str, float]] = []  # (signal name, when) of the first interrupt
_REPEAT_IGNORED_S = 5.0  # a second signal this soon is the launcher relaying the same one


def install_interrupt_handlers() -> None:
    """SIGINT and SIGTERM raise :class:`JobInterrupted` once. A repeat within a few seconds is
    ignored, so the cleanup it started is not itself interrupted (a terminal's Ctrl-C reaches
    every worker, and torchrun then relays the same signal to them); a later one interrupts
    again. Main thread only (Python delivers signals there)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if _INTERRUPTED and now - _INTERRUPTED[0][1] < _REPEAT_IGNORED_S:
            return
        if _ENDING:  # the job's outcome is told; this is the launcher ending the teardown: go quietly
            detail_logger().warning("%s during teardown: exiting now", name)
            os._exit(128 + signum)
        first = not _INTERRUPTED
        _INTERRUPTED[:] = [(name, now)]
        if first:
            detail_logger().warning("interrupted by %s: stopping, removing what this job staged", name)
        raise JobInterrupted(name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


_ENDING = False


def job_ending() -> None:
    """The job's outcome is decided and told (or being told): a signal from now on ends the
    process at once instead of interrupting the teardown with a traceback."""
    global _ENDING
    _ENDING = True


def interrupted() -> str | None:
    """The signal that interrupted this job, if one did."""
    return _INTERRUPTED[0][0] if _INTERRUPTED else None


def mark_failed() -> None:
    """The job failed: peers may be dead or hung, so teardown must not wait for them."""
    global _FAILED
    _FAILED = True


def farewell_barrier(group: object, timeout_s: float = 10.0) -> None:
    """Every rank raised the same agreed error and is about to exit: wait (bounded) until all got
    here, so no rank closes its connections while a peer is still finishing the collective that
    agreed on the error (which would turn the peer's clear error into 'connection closed')."""
    try:
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.monitored_barrier(group=group, timeout=_dt.timedelta(seconds=timeout_s))
    except Exception:  # a peer is gone already: nothing left to wait for
        pass


def shutdown_distributed() -> None:
    """Tear the process group down before interpreter exit (gloo threads alive at exit can abort).
    An in-flight async save finishes first: it needs the group, and losing it silently is worse."""
    from .dcp import wait_for_async_saves

    wait_for_async_saves()
    if dist.is_available() and dist.is_initialized():
        if not _FAILED:
            try:  # every rank done with every collective before any rank closes its connections
                dist.barrier()
            except Exception:  # a peer already failed; tearing down is all that is left
                pass
        dist.destroy_process_group()
