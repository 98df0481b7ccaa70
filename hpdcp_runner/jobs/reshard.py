"""reshard: source checkpoint -> target layout at this world size -> saved -> verified.

``job.source.path``: any checkpoint in our format (a user's, e.g. imported from Hugging Face);
the target is built from its metadata and placed by ``layout=`` (``layout.strict`` refuses
tensors no rule names). With no ``job.source.path`` the source is first written from the
``model=`` workload under ``job.source.layout``, so the bare ``+job=reshard`` works on a fresh
checkout.
"""

from __future__ import annotations


from ..dcp import read_metadata
from ..dcp.errors import HpdcpError
from ..dcp.inspection import full_tensor_digests
from ..layouts import load_preset, place_state
from ..targets import state_from_metadata
from ..workloads import reference_state, zeros_like_state
from .context import JobContext


def run(ctx: JobContext) -> dict:
    job = ctx.cfg.job
    if job.source.path:
        # a user's checkpoint: the target is whatever it holds (keys, shapes, dtypes, objects),
        # placed by layout=; model= plays no part
        source = ctx.abspath(job.source.path)
        with ctx.metrics.phase("build"), ctx.user_errors("job.source.path"):
            md = read_metadata(source)
            target = state_from_metadata(md, ctx.placer(), strict=ctx.cfg.layout.strict)
    else:
        ref = reference_state(ctx.cfg.model)
        source = ctx.checkpoint_path("source")
        with ctx.metrics.phase("build"):
            state = place_state(ref, ctx.placer(load_preset(job.source.layout)))
        ctx.save(state, source, phase="reshard.source_save")
        del state
        with ctx.metrics.phase("build"):
            target = place_state(zeros_like_state(ref), ctx.placer())
    ctx.load(target, source, phase="reshard.load", key="job.source.path" if job.source.path else "checkpoint.dir")
    output = ctx.abspath(job.output) if job.output else ctx.checkpoint_path("resharded")
    ctx.save(target, output, phase="reshard.save", key="job.output" if job.output else "checkpoint.dir")
    result = {"source": source, "output": output, "source_layout": job.source.layout if not job.source.path else None,
              "target_layout": ctx.cfg.layout.name}
    if job.verify and ctx.info.rank == 0:
        with ctx.metrics.phase("verify"):
            a, b = full_tensor_digests(source), full_tensor_digests(output)
        bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if bad:
            raise HpdcpError(f"resharded checkpoint {output} differs from {source} in {len(bad)} tensors: {bad[:10]}")
        result["verified_tensors"] = len(a)
    return result
