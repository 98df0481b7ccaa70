"""load: build a zeroed target under the layout, load, verify every local shard bitwise."""

from __future__ import annotations

from ..dcp.errors import HpdcpError
from ..layouts import place_state
from ..workloads import reference_state, zeros_like_state
from .context import JobContext, compare_state


def run(ctx: JobContext) -> dict:
    placer = ctx.placer()
    with ctx.metrics.phase("build"):
        ref = reference_state(ctx.cfg.model)
        target = place_state(zeros_like_state(ref), placer)
    path = ctx.checkpoint_path()
    ctx.load(target, path)
    problems = []
    if ctx.cfg.job.verify:
        with ctx.metrics.phase("verify"):
            problems = compare_state(target, place_state(ref, placer))
    if problems:
        raise HpdcpError(f"loaded state differs from the reference ({len(problems)} problems): {problems[:10]}")
    return {"checkpoint": path, "verified": bool(ctx.cfg.job.verify)}
