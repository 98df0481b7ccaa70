"""load: build a zeroed target under the layout, load, verify every local shard bitwise.

``job.include`` / ``job.exclude`` keep only the state keys one regex matches and the other does
not (e.g. the model of a model+optimizer checkpoint); ``job.strict=false`` loads the keys the state and the checkpoint share and reports
the others instead of failing.
"""

from __future__ import annotations

from typing import Any, Callable

from ..dcp import HpdcpError, KeyMismatchError
from ..dcp.tools import flatten_state_dict, local_pieces
from ..layouts import place_state
from ..workloads import reference_state, zeros_like_state
from .context import JobContext, compare_state


def select(state: dict, keep: Callable[[str], bool] | None, named: str = "job.include") -> dict:
    """The nested state with only the leaves whose dotted key ``keep`` admits."""
    if keep is None:
        return state
    out: dict[str, Any] = {}
    for fqn, path in flatten_state_dict(state)[1].items():
        if keep(fqn):
            node, src = out, state
            for k in path[:-1]:
                src, node = src[k], node.setdefault(k, {})
            node[path[-1]] = src[path[-1]]
    if not out:
        raise HpdcpError(f"{named} matches none of the state's keys")
    return out


def run(ctx: JobContext) -> dict:
    job = ctx.cfg.job
    if job.source.path:
        return _load_source(ctx)
    placer = ctx.placer()
    with ctx.metrics.phase("build"):
        ref = select(reference_state(ctx.cfg.model), ctx.keys.only, ctx.keys.named)
        target = place_state(zeros_like_state(ref), placer)
    path = ctx.checkpoint_path()
    try:
        res = ctx.load(target, path, strict=job.strict)
    except KeyMismatchError as e:
        keys = len(flatten_state_dict(ref)[0])
        if len(e.missing) * 2 > keys:  # most of model= is not there: the checkpoint is not of that model
            raise _hinted(e, f"checkpoint.path={path} is not a checkpoint of model={ctx.cfg.model.name} ("
                             f"{len(e.missing)} of its {keys} keys are missing): to load the checkpoint as it is, "
                             f"use job.source.path={path} instead") from None
        raise _hinted(e) from None
    problems = []
    skipped = frozenset(res.missing_keys)  # job.strict=false: the keys the checkpoint lacks stay as they were
    if job.verify:
        with ctx.metrics.phase("verify"):
            problems = compare_state(target, place_state(ref, placer), skip=skipped)
    if problems:
        raise HpdcpError(f"loaded state differs from the reference ({len(problems)} problems): {problems[:10]}")
    return {"checkpoint": path, "verified": bool(job.verify), "loaded_keys": len(flatten_state_dict(ref)[0]) -
            len(skipped), "missing_keys": list(res.missing_keys), "unused_checkpoint_keys": list(res.unexpected_keys)}


def _hinted(e: KeyMismatchError, lead: str = "") -> KeyMismatchError:
    """The engine's key mismatch with the fix first: ``lead`` (what to do instead), else the
    job's own knobs; the lists (already shortened by the engine) after it."""
    fix = lead or "add job.strict=false to load the keys both hold, or job.include=<regex> to pick keys"
    eg = lambda keys: ", ".join(repr(k) for k in sorted(keys)[:3]) + (", ..." if len(keys) > 3 else "")  # noqa: E731
    parts = ([f"{len(e.missing)} key(s) missing from the checkpoint, e.g. {eg(e.missing)}"] if e.missing else []) + \
        ([f"{len(e.unexpected)} checkpoint key(s) not in the state, e.g. {eg(e.unexpected)}"] if e.unexpected else [])
    return KeyMismatchError(f"{fix}. Strict load: {'; '.join(parts)}", e.missing, e.unexpected)


def _load_source(ctx: JobContext) -> dict:
    """A user's checkpoint (ours, Hugging Face, torch DCP) loaded as it is: the target is built
    from its metadata under layout= (each rank allocates its own shards only)."""
    job = ctx.cfg.job
    path = ctx.abspath(job.source.path)
    md = ctx.source_metadata(path)
    only = ctx.keys.only
    with ctx.metrics.phase("build"), ctx.user_errors("job.source.path"):
        target = select(ctx.target_from_metadata(md, path, only), only, ctx.keys.named)
    try:
        res = ctx.load(target, path, strict=job.strict and only is None, key="job.source.path", foreign=True)
    except KeyMismatchError as e:
        raise _hinted(e) from None
    flat = flatten_state_dict(target)[0]
    local = sum(p.numel() * p.element_size() for v in flat.values() if v is not None and hasattr(v, "dtype")
                for _, p in local_pieces(v))
    checked = int(res.counters.get("chunks_verified", 0))
    # nothing to compare with (it loads the checkpoint as it is): what was checked is each chunk
    # against the checksum the format records, where it records one
    return {"checkpoint": path, "format": md.extra.get("source_format", "hpdcp"), "loaded_keys": len(flat),
            "local_tensor_bytes_rank0": local, "unused_checkpoint_keys": list(res.unexpected_keys),
            "verified": f"{checked} chunk checksum(s) on rank 0" if checked else
            "no checksums in this format (loaded as it is: no reference to compare with)"}
