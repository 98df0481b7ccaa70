"""reshard: source checkpoint -> target layout at this world size -> saved -> verified.

``job.source.path``: a user's checkpoint, ours, Hugging Face or torch DCP
(``job.source.format=auto`` tells them apart; torch DCP needs ``dcp.allow_pickle=true``), read in
place with ``job.source.rename`` applied to its keys. The target is built from its metadata and
placed by ``layout=`` (``layout.strict`` refuses tensors no rule names). ``job.output_format=hf``
writes a Hugging Face directory instead, its files split among the ranks. With no
``job.source.path`` the source is first written from the ``model=`` workload under
``job.source.layout``, so the bare ``+job=reshard`` works on a fresh checkout.
"""

from __future__ import annotations

import os
from typing import Callable

from ..config import parse_size
from ..dcp import ConfigError, HpdcpError
from ..dcp.tools import (compile_rules, dtype_from_name, export_hf, full_tensor_digests, locate,
                         remove_checkpoint, rename_key)
from ..config import load_preset
from ..layouts import place_state
from ..workloads import reference_state, zeros_like_state
from .context import JobContext
from .load import select
from ..experts import copy_objects, load_state_for, restacked_metadata, stack_plan, unstack_plan


def run(ctx: JobContext) -> dict:
    job = ctx.cfg.job
    foreign = bool(job.source.path)
    only = ctx.keys.only
    if foreign:
        source = ctx.abspath(job.source.path)
    else:
        ref = select(reference_state(ctx.cfg.model), only, ctx.keys.named)
        source = ctx.checkpoint_path("source")
        with ctx.metrics.phase("build"):
            state = place_state(ref, ctx.placer(load_preset(job.source.layout)))
        ctx.save(state, source, phase="reshard.source_save")
        del state
    output = ctx.abspath(job.output) if job.output else ctx.checkpoint_path("resharded")
    out_key = "job.output" if job.output else "checkpoint.dir"
    # whether this job creates the output: if its verify then fails, the output is removed (it holds
    # what was read, e.g. a source corrupted where only the verify's whole reads could tell)
    fresh = (job.verify and not locate(output).is_dir()) if ctx.info.rank == 0 else None
    if job.output_format == "hf":
        result = _to_hf(ctx, source, output, foreign, out_key)
        names = result.pop("names")
    else:
        split = None
        if foreign:
            # the target is whatever the checkpoint holds (keys, shapes, dtypes, objects), placed
            # by layout=; each rank allocates only its own shards; model= plays no part
            md = ctx.source_metadata(source)
            if job.experts:
                split = stack_plan(md.tensors) if job.experts == "stack" else unstack_plan(md.tensors)
                md_out = restacked_metadata(md, split, job.experts)
            with ctx.metrics.phase("build"), ctx.user_errors("job.source.path"):
                target = select(ctx.target_from_metadata(md_out if split else md, source, only), only,
                                ctx.keys.named)
            reading = load_state_for(target, split, job.experts, md_out) if split else target
        else:
            with ctx.metrics.phase("build"):
                target = place_state(zeros_like_state(ref), ctx.placer())
            reading = target
        ctx.load(reading, source, phase="reshard.load", key="job.source.path" if foreign else "checkpoint.dir",
                 foreign=foreign, strict=only is None)
        if reading is not target:
            copy_objects(reading, target)
        ctx.save(target, output, phase="reshard.save", key=out_key)
        del target
        result = {"source": source, "output": output, "output_format": "hpdcp"}
        names = None if only is None else {k: k for k in _tensor_keys(ctx, output)}
        if split:
            result["experts"] = f"{job.experts}: {len(split)} {'stacked' if job.experts == 'stack' else 'per-expert'} " \
                                f"group(s) of {len(next(iter(split.values())))} experts, e.g. {next(iter(split))!r}"
    # what each side's layout really is: a user's checkpoint is read as it was saved, and Hugging
    # Face output holds whole tensors whatever layout= says (layout= places hpdcp output only)
    result.update(source_layout="as saved" if foreign else job.source.layout,
                  target_layout=ctx.cfg.layout.name if job.output_format == "hpdcp" else
                  f"whole tensors (Hugging Face; layout={ctx.cfg.layout.name} not used)")
    if job.verify:
        def check() -> int | None:
            if ctx.info.rank != 0:
                return None
            with ctx.metrics.phase("verify"):
                return _verify(ctx, source, output, foreign, names, split if job.output_format == "hpdcp" else None)

        # rank 0 reads both; a difference is every rank's error and exit code
        try:
            result["verified_tensors"] = ctx.comm.agree("reshard: verify", check)[0]
        except HpdcpError as e:
            raise _output_settled(e, output, fresh) from None
    return result


def _output_settled(e: HpdcpError, output: str, fresh: bool | None) -> HpdcpError:
    """The verify failed after the output was written. Rank 0 (``fresh`` not None) removes an
    output this job created and says so, or names one it replaced as not to be used."""
    if fresh is None:
        return e
    if fresh:
        remove_checkpoint(output)
        what = f"the output {output} was removed (this job wrote it from what it read)"
    else:
        what = f"the output {output} was written from what was read: do not use it"
    e.args = (f"{e.args[0] if e.args else e}\n  {what}",) + tuple(e.args[1:])
    return e


def _to_hf(ctx: JobContext, source: str, output: str, foreign: bool, out_key: str) -> dict:
    e, job = ctx.engine, ctx.cfg.job
    if foreign and ctx.megatron_under_its_own_names(source):
        # its own names (layer-stacked, fused QKV) in model.safetensors would load in no model (known
        # from the files present: no describe of the source before the export's own). Opening the
        # reader first lets what no config.json mends (a zarr backend, a missing iteration) say so
        with ctx.user_errors("job.source.path"):
            ctx.reader(source, foreign).close()
        raise ConfigError(f"job.output_format=hf: {source} is a Megatron-Core checkpoint under Megatron's own names; "
                          f"give the directory holding the model's Hugging Face config.json (job.hf_files_from=<dir>) so "
                          f"its weights are exported under its family's names, with that config beside them")
    with ctx.metrics.phase("reshard.export_hf"), ctx.user_errors(out_key):
        res = export_hf(source, output, rename=ctx.source_renames() if foreign else (),
                        allow_pickle=e.allow_pickle, max_shard_size=parse_size(job.hf_max_shard_size),
                        files_from=ctx.abspath(job.hf_files_from) if job.hf_files_from else None,
                        overwrite=ctx.cfg.checkpoint.overwrite, fsync=e.fsync, timeout=e.timeout_s,
                        reader_factory=lambda: ctx.reader(source, foreign), load_kwargs={"broadcast": e.broadcast},
                        model_only=job.model_only, include=job.include, exclude=job.exclude, dtype=job.dtype)
    ctx.metrics.add(res.pop("counters"), "reshard.export_hf.")
    if res["left_out"] is None:
        res.pop("left_out")
    return {"source": source, "output": output, "output_format": "hf", **res}


def _tensor_keys(ctx: JobContext, path: str) -> list[str]:
    """The tensor keys of the checkpoint just written (rank 0 reads its metadata)."""
    if ctx.info.rank != 0:
        return []
    from ..dcp import read_metadata

    return sorted(read_metadata(path).tensors)


def _verify(ctx: JobContext, source: str, output: str, foreign: bool, names: dict[str, str] | None,
            split: dict[str, list[str]] | None = None) -> int:
    """Every tensor of the output equals the source's, bit for bit (full-tensor digests, one
    tensor in memory at a time); renamed keys are compared under their new names. ``names``: the
    source keys written and their names in the output (default: all, unchanged); with
    ``job.dtype``, the source's floating tensors are cast the same way first. ``split``: stacked
    expert tensors (of the output after stack, of the source before unstack) are compared
    expert by expert under the per-expert names."""
    stacking = ctx.cfg.job.experts
    rules = compile_rules(ctx.source_renames()) if foreign else []
    cast = dtype_from_name(ctx.cfg.job.dtype) if ctx.cfg.job.output_format == "hf" and ctx.cfg.job.dtype else None

    # the verify reads both checkpoints whole: it can take a while, so each has a bar of its bytes
    with ctx.bars.bytes_bar(f"verify: reading the source {os.path.basename(source)}") as bar:
        a = {rename_key(k, rules): v for k, v in full_tensor_digests(
            source, ctx.reader(source, foreign), cast=cast, keep=_keep_renamed(rules, names), progress=bar,
            split=split if stacking == "unstack" else None).items()}
    if names is not None:
        a = {names[k]: v for k, v in a.items() if k in names}
    out_format = "hf" if ctx.cfg.job.output_format == "hf" else "hpdcp"
    from ..dcp import open_reader

    with ctx.bars.bytes_bar(f"verify: reading the output {os.path.basename(output)}") as bar:
        b = full_tensor_digests(output, open_reader(output, out_format), progress=bar,
                                split=split if stacking == "stack" else None)
    bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if bad:
        raise HpdcpError(f"resharded checkpoint {output} differs from {source} in {len(bad)} tensors: {bad[:10]}")
    return len(a)


def _keep_renamed(rules: list, names: dict[str, str] | None) -> Callable[[str], bool] | None:
    """Which source keys (before ``job.source.rename``) the verify reads: those written."""
    if names is None:
        return None
    return lambda k: rename_key(k, rules) in names
