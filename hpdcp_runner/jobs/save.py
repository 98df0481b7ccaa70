"""save: build the workload under the layout and save it (then apply retention)."""

from __future__ import annotations

from ..dcp.tools import location_dirname
from ..layouts import place_state
from ..workloads import reference_state
from .context import JobContext


def run(ctx: JobContext) -> dict:
    with ctx.metrics.phase("build"):
        state = place_state(reference_state(ctx.cfg.model), ctx.placer())
    name, series, step = ctx.series
    path = ctx.checkpoint_path()
    md = ctx.save(state, path, series=(series, step))
    removed = ctx.apply_retention(location_dirname(path), series, name) if not ctx.cfg.checkpoint.path else []
    out = {"checkpoint": path, "series": series, "step": step, "tensors": len(md.tensors),
           "tensor_bytes": md.total_tensor_bytes, "removed_by_retention": removed}
    if ctx.outsiders:  # named like the series but not in it: kept, and said why
        out["not_in_series"] = [f"{n}: {why}" for n, why in sorted(ctx.outsiders.items())]
    return out
