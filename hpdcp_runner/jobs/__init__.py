"""Job dispatch: validate the config, set up the process group, run one job module, report.

Every job module has the same shape: ``run(ctx: JobContext) -> dict`` (a result summary).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

from omegaconf import DictConfig

from .. import runtime
from ..config import JOBS, to_plain, validate
from ..dcp.errors import ConfigError, HpdcpError
from ..dcp.utils import get_logger
from ..metrics import config_digest, summarize, summary_table, write_metrics
from .context import JobContext

log = get_logger("hpdcp_runner")


def _fail(message: str, code: int) -> None:
    runtime.mark_failed()
    sys.stderr.write(f"[rank{runtime.env_rank()}] {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def run(cfg: DictConfig, run_dir: str | None = None) -> Any:
    """The Hydra task function's body (or a launcher worker's, with ``run_dir``). Returns the
    job's objective (for sweepers)."""
    if cfg.get("job") is None:
        _fail("no job given. Run one with +job=<name>, one of: " + ", ".join(JOBS)
              + "\n  e.g. python -m hpdcp_runner +job=reshard", 2)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        c = validate(cfg, world_size)
    except ConfigError as e:
        _fail(f"ConfigError: {e}", 2)
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    info = runtime.init_distributed(c.runtime.backend, c.runtime.device, c.runtime.timeout_s)
    ctx = JobContext(c, to_plain(cfg), info, run_dir)
    digests = ctx.comm.all_gather_json(config_digest(ctx.plain), "config digest")
    if len(set(digests)) > 1:
        _fail(f"ConfigError: the resolved config differs across ranks (digests {digests}); "
              f"a rank-dependent interpolation or override is in use", 2)
    module = importlib.import_module(f"{__name__}.{c.job.name}")

    def body() -> Any:
        if c.job.fail_on_rank == ctx.info.rank:
            raise RuntimeError(f"injected failure on rank {ctx.info.rank} (job.fail_on_rank)")
        return module.run(ctx)

    try:
        result = ctx.comm.agree(f"job {c.job.name}", body)[ctx.info.rank]
    except HpdcpError as e:
        _record(e)
        cause = e.__cause__
        if cause is not None and not isinstance(cause, HpdcpError):  # a bug, not bad input: show where
            sys.stderr.write("".join(traceback.format_exception(cause)))
        _fail(f"{type(e).__name__}: {e}", 1)
    _report(ctx, result, digests[0])
    return result.get("objective") if isinstance(result, dict) else None


def _record(e: BaseException) -> None:
    """Give torchrun's error summary the real traceback (Hydra would otherwise swallow it)."""
    log.debug("job failed:\n%s", "".join(traceback.format_exception(e)))
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)


def _report(ctx: JobContext, result: dict, digest: str) -> None:
    records = ctx.comm.all_gather_json(ctx.metrics.rank_record(ctx.info.rank), "metrics")
    if ctx.info.rank != 0:
        return
    doc = {"job": ctx.cfg.job.name, "world_size": ctx.info.world_size, "layout": ctx.cfg.layout.name,
           "model": ctx.cfg.model.name, "run_dir": ctx.run_dir, "config": ctx.plain,
           "config_digest": digest, "ranks": records,
           "summary": summarize(records), "result": result,
           "engine": ctx.engine_knobs()}
    doc["metrics_path"] = write_metrics(ctx.run_dir, doc)
    print(summary_table(doc), flush=True)
