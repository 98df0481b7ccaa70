"""Job dispatch: validate the config, set up the process group, run one job module, report.

Every job module has the same shape: ``run(ctx: JobContext) -> dict`` (a result summary).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

from omegaconf import DictConfig

from .. import runtime
from ..config import JOBS, to_plain, validate_all
from ..dcp import CollectiveTimeoutError, ConfigError, DistributedError, HpdcpError
from ..dcp.tools import get_logger
from ..metrics import config_digest, summarize, summary_table, write_metrics
from .context import JobContext

log = get_logger("hpdcp_runner")
detail = runtime.detail_logger()
FAILED_MARKER = "FAILED"


def _fail(message: str, code: int, *, every_rank: bool = False, run_dir: str | None = None,
          logged: bool = False, farewell: Any = None) -> None:
    """One line on the console (from rank 0 alone when every rank has the same error), the cause
    in ``<run dir>/FAILED`` (what a sweep reports for the point), the exit code. ``farewell``:
    the group every rank waits on before leaving, once rank 0 has said it (a rank that left first
    would have torchrun stop rank 0 before its line is out)."""
    runtime.mark_failed()
    runtime.job_ending()
    if not logged:
        detail.error("%s", message)
    rank = runtime.env_rank()
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    if every_rank or rank == 0:
        sys.stderr.write(f"{prefix}error: {message}\n")
        sys.stderr.flush()
    if (every_rank or rank == 0) and run_dir and os.path.isdir(run_dir):
        with open(os.path.join(run_dir, FAILED_MARKER), "a") as f:
            f.write(f"{prefix}{message}\n")
    if farewell is not None:
        runtime.farewell_barrier(farewell)
    raise SystemExit(code)


def registry() -> dict[str, Callable[[JobContext], Any]]:
    """Job name -> its run function: the one list of jobs (config.JOB_HELP names the same set,
    checked by the tests)."""
    from . import bench, inspect, load, reshard, save, train, transform, verify

    return {"save": save.run, "load": load.run, "reshard": reshard.run, "inspect": inspect.run,
            "verify": verify.run, "bench": bench.run, "train": train.run, "transform": transform.run}


#: jobs that read a checkpoint and build no model= state (their summary names the checkpoint)
READ_ONLY_JOBS = ("inspect", "verify")


def run(cfg: DictConfig, run_dir: str | None = None) -> Any:
    """The Hydra task function's body (or a launcher worker's, with ``run_dir``). Returns the
    job's objective (for sweepers). SIGINT/SIGTERM end it with one line and ``FAILED`` saying
    so, after the aborts on the way out removed what it staged."""
    runtime.install_interrupt_handlers()
    try:
        return _run(cfg, run_dir)
    except KeyboardInterrupt as e:
        interrupted(e, run_dir)
    finally:
        runtime.job_ending()


def interrupted(e: KeyboardInterrupt, run_dir: str | None) -> None:
    """One line (rank 0, or the one process), ``FAILED`` in the run dir, exit 128+signal."""
    sig = getattr(e, "signame", None) or runtime.interrupted() or "SIGINT"
    code = getattr(e, "exit_code", 130)
    detail.warning("job interrupted by %s", sig, exc_info=e)
    from ..dcp.tools import save_in_flight

    background = " (the checkpoint being written in the background is finished first)" if save_in_flight() else ""
    store = (" (in an object store, an upload that was still in flight may leave objects under the save's own "
             "save-* prefix, never under the name: the next save of that name, or retention, removes them after "
             "dcp.storage.orphan_grace_s)")
    _fail(f"interrupted by {sig}: the job stopped before it finished; nothing is left half-written under a "
          f"checkpoint's name{background}{store if _saving_to_a_store() else ''}", code,
          run_dir=run_dir or _hydra_run_dir(), logged=True)


def _saving_to_a_store() -> bool:
    """Whether this job writes checkpoints to an object store (what the interrupt message says)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        from ..dcp.tools import locate

        overrides = HydraConfig.get().overrides.task
        return any(not locate(o.split("=", 1)[1]).capabilities.atomic_rename for o in overrides if "=" in o and
                   o.lstrip("+~").split("=", 1)[0] in ("checkpoint.dir", "checkpoint.path", "job.output"))
    except Exception:  # (no Hydra run, or a path the job itself refused: nothing more to say)
        return False


def _hydra_run_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except Exception:  # not under Hydra, or before it set up
        return None


def _run(cfg: DictConfig, run_dir: str | None = None) -> Any:
    if cfg.get("job") is None:
        _fail("no job given. Run one with +job=<name>, one of: " + ", ".join(JOBS)
              + "\n  e.g. python -m hpdcp_runner +job=reshard   (python -m hpdcp_runner --help lists them)", 2)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
        internal = [f"{g}={v}" for g, v in HydraConfig.get().runtime.choices.items()
                    if isinstance(v, str) and v.endswith("_schema") and g != "hpdcp_schema"]
        if internal:
            _fail(f"ConfigError: {', '.join(internal)}: the *_schema entries are internal type schemas, not choices; "
                  f"python -m hpdcp_runner --help lists the choices", 2, run_dir=run_dir)
    try:
        c, options = validate_all(cfg, world_size)
    except ConfigError as e:
        _fail(f"ConfigError: {e}", 2, run_dir=run_dir)
    try:
        info = runtime.init_distributed(c.runtime.backend, c.runtime.device, c.runtime.timeout_s)
    except (RuntimeError, OSError) as e:  # torch's store and network errors: a rank that never came
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        ws = os.environ.get("WORLD_SIZE", "1")
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        _fail(f"DistributedError: the {ws} ranks did not form a process group within runtime.timeout_s="
              f"{c.runtime.timeout_s:g} s (rank {runtime.env_rank()}, rendezvous at {where}): {first}. Check that "
              f"every task started (srun --ntasks, tasks_per_node) and can reach {where}", 1,
              every_rank=True, run_dir=run_dir)
    ctx = JobContext(c, to_plain(cfg), info, run_dir, options)
    detail.info("job %s: world size %d, run dir %s, launched from %s", c.job.name, info.world_size, run_dir,
                runtime.launch_dir())
    digests = ctx.comm.all_gather_json(config_digest(ctx.plain), "config digest")
    if len(set(digests)) > 1:
        _fail(f"ConfigError: the resolved config differs across ranks (digests {digests}); "
              f"a rank-dependent interpolation or override is in use", 2, run_dir=run_dir)
    job_run = registry()[c.job.name]

    def body() -> Any:
        if c.job.fail_on_rank == ctx.info.rank:
            raise RuntimeError(f"injected failure on rank {ctx.info.rank} (job.fail_on_rank)")
        return job_run(ctx)

    try:
        result = ctx.comm.agree(f"job {c.job.name}", body)[ctx.info.rank]
    except HpdcpError as e:
        # every rank has this error: leave together, once it is said
        _job_failed(e, run_dir, farewell=None if _unagreed(e) else ctx.comm.control)
    detail.info("job %s: done", c.job.name)
    _report(ctx, result, digests[0])
    return result.get("objective") if isinstance(result, dict) else None


def describe_failure(e: HpdcpError) -> str:
    """One line for an agreed failure: the cause once when every failing rank reports the same,
    else each rank's own."""
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    messages = sorted(set(failures.values()))
    if len(messages) == 1:
        where = "" if len(failures) > 1 or int(os.environ.get("WORLD_SIZE", "1")) == 1 else f" (rank {min(failures)})"
        return f"{type(e).__name__}: {messages[0]}{where}"
    return f"{type(e).__name__}: " + "; ".join(f"rank {r}: {m}" for r, m in failures.items())


def _job_failed(e: HpdcpError, run_dir: str, farewell: Any = None) -> None:
    """User mistakes and bad checkpoints: one line, no traceback (the rank log has it). Bugs (a
    non-hpdcp exception on some rank): also the traceback, on the console and in torchrun's
    error summary."""
    local = e.__cause__
    bug = isinstance(e, DistributedError) or (local is not None and not isinstance(local, HpdcpError))
    detail.error("job failed: %s", describe_failure(e), exc_info=local or e)
    if bug:
        _record(local or e)
        if local is not None and not isinstance(local, HpdcpError):
            sys.stderr.write("".join(traceback.format_exception(local)))
    # a rank that lost its peers may be the only one left to say so
    _fail(describe_failure(e), 2 if isinstance(e, ConfigError) else 1,
          every_rank=_unagreed(e), run_dir=run_dir, logged=True, farewell=farewell)


def _unagreed(e: HpdcpError) -> bool:
    """A failure the ranks could not agree on (a peer gone or busy elsewhere): each rank reports
    its own, since rank 0 may not know it."""
    return isinstance(e, CollectiveTimeoutError) or getattr(e, "partial", False)


def _record(e: BaseException) -> None:
    """Give torchrun's error summary the real traceback of a bug (not of a user mistake)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)


# The phase whose seconds (max over ranks) are each job's ``result.objective``, first present
# wins: what a sweep of that job minimizes unless ``hydra.launcher.objective`` names another
# metric. A reshard of a user's checkpoint times the source as it is read (``reshard.load``),
# not a re-saved copy. bench sets its own (the median load of its repeats, with a spread).
OBJECTIVE_PHASES = {"save": ("save",), "load": ("load",), "reshard": ("reshard.load", "reshard.export_hf"),
                    "verify": ("verify",), "transform": ("transform",),
                    "train": ("train.save_blocking", "train.save", "train.step")}


def _objective(job: str, result: dict, summary: dict) -> None:
    """``result.objective`` (and ``objective_is``: where it comes from) for any job."""
    if "objective" in result:
        result.setdefault("objective_is", "result.objective")
        return
    for phase in OBJECTIVE_PHASES.get(job, ()):
        if phase in summary:
            result["objective"] = summary[phase]["seconds_max"]
            result["objective_is"] = f"summary.{phase}.seconds_max"
            return


def _topology(ctx: JobContext, records: list[dict]) -> dict:
    """Where the ranks ran (as the engine tells nodes apart: host and launcher node rank) and
    what that means for replica broadcast under ``dcp.broadcast.mode``."""
    nodes = list(dict.fromkeys(r.get("node") for r in records))
    mode = ctx.engine.broadcast.mode
    if mode != "auto":
        rule = mode
    elif len(nodes) > 1:
        rule = f"auto: on for replica groups that span nodes ({len(nodes)} nodes here)"
    else:
        rule = "auto: one node, so only for storage declared shared or slow (object stores, dcp.storage.shared=true)"
    return {"launcher": runtime.launcher_name(), "nodes": len(nodes),
            "node_of_rank": [nodes.index(r.get("node")) for r in records], "broadcast": rule}


def _report(ctx: JobContext, result: dict, digest: str) -> None:
    records = ctx.comm.all_gather_json(ctx.metrics.rank_record(ctx.info.rank), "metrics")
    if ctx.info.rank != 0:
        return
    summary = summarize(records)
    if isinstance(result, dict):
        result.update(ctx.layout_result)
        _objective(ctx.cfg.job.name, result, summary)
    # a job on a user's checkpoint names it instead of the (unused) synthetic model= preset
    source = getattr(getattr(ctx.cfg.job, "source", None), "path", None)
    layout = ctx.cfg.layout.name
    if ctx.cfg.job.name in READ_ONLY_JOBS and isinstance(result, dict):  # they read a checkpoint: name it, and
        source, layout = result.get("checkpoint", source), result.get("layout")  # a layout only if one was used
    from .context import section_overrides

    doc = {"job": ctx.cfg.job.name, "world_size": ctx.info.world_size, "layout": layout,
           "model": None if source else ctx.cfg.model.name, "source": source,
           "model_overridden": [] if source else section_overrides("model"), "run_dir": ctx.run_dir, "config": ctx.plain,
           "config_digest": digest, "ranks": records,
           "summary": summary, "result": result,
           "engine": ctx.engine.knobs(), "topology": _topology(ctx, records)}
    doc["metrics_path"] = write_metrics(ctx.run_dir, doc)
    # a job that prints machine-readable output keeps stdout for it alone
    machine = ctx.cfg.job.name == "inspect" and getattr(ctx.cfg.job, "format", None) == "json"
    runtime.write_out(summary_table(doc), sys.stderr if machine else sys.stdout)
