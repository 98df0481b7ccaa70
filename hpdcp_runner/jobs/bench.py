"""bench: repeated save and load (after warmup), medians and min-max; optionally torch DCP
side by side in the same run (``job.peer=true``, needs numpy for torch.distributed.checkpoint)."""

from __future__ import annotations

import os
import statistics
import time
import uuid

import torch
import torch.distributed as dist

from ..dcp import ConfigError, HpdcpError
from ..dcp.tools import (fsspec_package, get_logger, join_location, locate, location_dirname, remove_checkpoint,
                         resolve_location)
from ..layouts import place_state
from ..targets import state_from_metadata
from ..workloads import reference_state, zeros_like_state
from .context import JobContext, compare_state, section_overrides
from .load import select

log = get_logger(__name__)


def _scratch(ctx: JobContext) -> tuple[str, str | None]:
    """(where the timed checkpoints go, the folder the bench made for it or None). The place:
    ``checkpoint.dir`` when set; else beside a ``job.source.path`` in a store (the store the
    user's checkpoint lives on is the one timed); else the run directory's ``checkpoints``. The
    checkpoints go into a new directory of the bench's own under it (``hpdcp-bench-<run>-<id>``,
    claimed empty), so that removing them afterwards removes nothing that was there before: a
    user's ``bench_0``, or any checkpoint of theirs, in that directory is never touched."""
    src = ctx.cfg.job.source.path
    if not ctx.cfg.checkpoint.dir and src and locate(src).capabilities.conditional_write:
        base = locate(location_dirname(resolve_location(src)))
    else:
        base = locate(ctx.checkpoint_dir)
    made = None if base.is_dir() else base.url
    for _ in range(3):
        scratch = base.claim(f"hpdcp-bench-{os.path.basename(ctx.run_dir.rstrip('/'))}-{uuid.uuid4().hex[:8]}")
        if scratch is not None:
            return scratch.url, made
    raise HpdcpError(f"bench: could not find an unused scratch name under {base.url}")


def _without_effect(scratch: str) -> list[str]:
    """The ``dcp.storage.*`` overrides that do not apply to the storage timed (an object-store
    knob swept on a local directory times nothing it changes)."""
    unused = locate(scratch).inert_options
    keys = [o.lstrip("+~").split("=", 1)[0] for o in section_overrides("dcp.storage")]
    return [k for k in keys if k.rsplit(".", 1)[-1] in unused]


def _timed(ctx: JobContext, fn) -> float:
    """The slowest rank's seconds for ``fn``, started together, on the job's own group (whose
    collectives a failing rank never joins: it reports through the control group), with the
    tensor on the job's device (NCCL carries no CPU tensors)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=ctx.info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _check_peer_can_read(state: dict, layout: str) -> None:
    """torch DCP knows DTensors and plain tensors; our explicit shards (flat, fused, per-expert)
    it would pickle as opaque objects, timing nothing comparable: refuse, naming the key."""
    from ..dcp.tools import TENSOR_LEAVES, flatten_state_dict

    for k, v in flatten_state_dict(state)[0].items():
        if isinstance(v, TENSOR_LEAVES) and not isinstance(v, torch.Tensor):
            raise ConfigError(f"job.peer: torch DCP cannot hold {k!r} as layout {layout!r} places it "
                              f"({type(v).__name__}); compare under a layout of DTensors or plain tensors")


def _stats(xs: list[float]) -> dict:
    return {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4), "max_s": round(max(xs), 4),
            "n": len(xs)}


def _peer(ctx: JobContext, state, target, path: str) -> tuple[float, float]:
    import torch.distributed.checkpoint as tdcp  # numpy checked by the config validation
    package = fsspec_package(path)
    if package is not None:  # the peer's own object-store path: its fsspec writer and reader (s3fs, ...)
        import importlib

        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(f"job.peer=true on {path} times torch DCP's fsspec path, which needs {package}: "
                              f"pip install {package}" + (" (or the bench extra)" if package == "s3fs" else "")) from None
        writer, reader = (lambda: FsspecWriter(path, thread_count=2)), (lambda: FsspecReader(path))
    else:
        writer, reader = (lambda: tdcp.FileSystemWriter(path)), (lambda: tdcp.FileSystemReader(path))
    s = _timed(ctx, lambda: tdcp.save(state, storage_writer=writer()))
    l_ = _timed(ctx, lambda: tdcp.load(target, storage_reader=reader()))
    return s, l_


def _copy_objects(src: dict, dst: dict) -> None:
    """Non-tensor leaves of the loaded state into the target's placeholders (torch DCP's load
    needs a value of the right kind to replace)."""
    for k, v in src.items():
        if isinstance(v, dict):
            _copy_objects(v, dst[k])
        elif not isinstance(v, torch.Tensor):
            dst[k] = v


def run(ctx: JobContext) -> dict:
    job = ctx.cfg.job
    if job.source.path:  # a user's checkpoint, loaded once under layout=, is the state timed
        path = ctx.abspath(job.source.path)
        md = ctx.source_metadata(path)
        only = ctx.keys.only  # job.include / job.exclude: time part of it
        with ctx.metrics.phase("build"), ctx.user_errors("job.source.path"):
            state = select(ctx.target_from_metadata(md, path, only, copies=2), only, ctx.keys.named)
            # placed as the first (target_from_metadata found the config and made layout=auto concrete)
            target = select(state_from_metadata(md, ctx.placer(keys=md.tensors), strict=ctx.cfg.layout.strict, only=only), only,
                            ctx.keys.named)
        ctx.load(state, path, phase="source_load", key="job.source.path", foreign=True, strict=only is None)
        _copy_objects(state, target)
    else:
        with ctx.metrics.phase("build"):
            ref = reference_state(ctx.cfg.model)
            placer = ctx.placer()
            state = place_state(ref, placer)
            target = place_state(zeros_like_state(ref), placer)
    if job.peer:
        _check_peer_can_read(state, ctx.cfg.layout.name)
    times = {"save": [], "load": [], "peer_save": [], "peer_load": []}
    # where the timed checkpoints go and are removed again (rank 0 names it: one scratch for all)
    scratch, made = ctx.comm.agree_root("bench: where the timed checkpoints go", lambda: list(_scratch(ctx)))
    ignored = _without_effect(scratch)
    if ignored and ctx.info.rank == 0:
        log.warning("%s: no effect on what this bench times (%s)", ", ".join(ignored), locate(scratch).describe())
    for i in ctx.bars.progress(range(job.warmup + job.repeats), "bench"):
        path = join_location(scratch, f"bench_{i}")
        # warm-up runs are timed under their own phases, which the summary table leaves out
        tag = "warmup." if i < job.warmup else ""
        s = _timed(ctx, lambda: ctx.save(state, path, phase=f"{tag}save"))
        l_ = _timed(ctx, lambda: ctx.load(target, path, phase=f"{tag}load"))
        if job.verify and i == 0:
            problems = compare_state(target, state)
            if problems:
                raise HpdcpError(f"bench load differs from what was saved: {problems[:10]}")
        ps = pl = None
        if job.peer:
            ps, pl = _peer(ctx, state, target, join_location(scratch, f"peer_{i}"))
        dist.barrier()
        if ctx.info.rank == 0:
            remove_checkpoint(path)
            remove_checkpoint(join_location(scratch, f"peer_{i}"))
        if i >= job.warmup:
            times["save"].append(s)
            times["load"].append(l_)
            if job.peer:
                times["peer_save"].append(ps)
                times["peer_load"].append(pl)
    if ctx.info.rank == 0:  # its own folder goes with them, and the one it made for it
        for folder in (scratch, made):
            if folder:
                locate(folder).remove_if_empty()
    result = {k: _stats(v) for k, v in times.items() if v}
    result["store_timed"] = locate(scratch).describe()
    if ignored:
        result["no_effect"] = ignored
    if job.peer:
        for p in ("save", "load"):
            result[f"speedup_{p}_vs_torch_dcp"] = round(result[f"peer_{p}"]["median_s"] / result[p]["median_s"], 3)
    result["objective"] = result["load"]["median_s"]
    result["objective_range"] = [result["load"]["min_s"], result["load"]["max_s"]]  # the noise, for sweep reports
    return result
