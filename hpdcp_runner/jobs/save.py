"""save: build the workload under the layout and save it (then apply retention)."""

from __future__ import annotations

import os

from ..layouts import place_state
from ..workloads import reference_state
from .context import JobContext


def run(ctx: JobContext) -> dict:
    with ctx.metrics.phase("build"):
        state = place_state(reference_state(ctx.cfg.model), ctx.placer())
    path = ctx.checkpoint_path()
    md = ctx.save(state, path)
    removed = ctx.apply_retention(os.path.dirname(path))
    return {"checkpoint": path, "tensors": len(md.tensors), "tensor_bytes": md.total_tensor_bytes,
            "removed_by_retention": removed}
