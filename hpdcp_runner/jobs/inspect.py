"""inspect: tensors, dtypes, shapes, chunks, files, bytes, commit state, format version; of our
checkpoints, Hugging Face directories and torch DCP checkpoints alike (``job.source.format``).

With ``layout=`` on the command line (or ``job.ranks=N``) it also shows how that layout would
place the checkpoint: the rule each tensor matched and the shard each rank would hold, so a
layout can be checked against a real checkpoint before any rank is started.
"""

from __future__ import annotations

import json
import math
import os

from ..dcp import ConfigError, Metadata, rename_keys
from ..dcp.tools import METADATA_FILE, describe, dtype_from_name, intersect, join_location
from ..layouts import Placer, mesh_shape, problems
from ..runtime import write_out
from .context import JobContext

SHOWN_RANKS = 8


def format_table(d: dict) -> str:
    lines = [f"checkpoint {d['path']} [{d['state']}] {d['format']} format v{d['format_version']}, saved at world "
             f"size {d['world_size']}, {d['tensor_bytes']} tensor bytes in {len(d['files'])} files"]
    # columns as wide as their longest entry (plus a gap): long key names never run into the next
    kw = max([len("key"), *map(len, d["tensors"]), *map(len, d["objects"])]) + 2
    sw = max([len("shape"), *(len(str(t["shape"])) for t in d["tensors"].values())]) + 2
    dw = max([len("object"), *(len(t["dtype"]) for t in d["tensors"].values())]) + 2
    lines.append(f"{'key':<{kw}}{'dtype':<{dw}}{'shape':<{sw}}{'chunks':>7}{'bytes':>14}")
    for k, t in sorted(d["tensors"].items()):
        lines.append(f"{k:<{kw}}{t['dtype']:<{dw}}{str(t['shape']):<{sw}}{t['chunks']:>7}{t['bytes']:>14}")
    for k in d["objects"]:
        lines.append(f"{k:<{kw}}{'object':<{dw}}")
    lines.append("files: " + ", ".join(f"{n} ({f['size']} B)" for n, f in d["files"].items()))
    if "series" in d:
        sr = d["series"]
        lines.append(f"series {sr['series']!r} step {sr['step']!r}: " + (
            "a member (retention and checkpoint.resume=latest consider it)" if sr["member"] else
            f"NOT a member: {sr['why']}; retention never deletes it and resume=latest never picks it"))
    if "layout" in d:
        lines += _layout_lines(d["layout"])
    return "\n".join(lines)


def _layout_lines(lay: dict) -> list[str]:
    ranks = min(lay["ranks"], SHOWN_RANKS)
    kw = max([len("key"), *map(len, lay["tensors"])]) + 2
    lines = [f"layout {lay['name']} at {lay['ranks']} ranks (mesh {lay['mesh']}): rule matched, placements, "
             f"shard per rank as offsets+sizes" + (f" (first {ranks} ranks)" if lay["ranks"] > ranks else "")]
    for k, t in sorted(lay["tensors"].items()):
        rule = f"rules[{t['rule']}]" if t["rule"] is not None else "no rule (R)"
        shards = " ".join(f"{r}:{_shard(x)}" for r, x in enumerate(t["shards"][:ranks]))
        extra = "".join(f" {n}={t[n]}" for n in ("parts", "unit", "expert") if n in t)
        why = f"  <- {t['why']}" if t.get("why") else ""
        lines.append(f"  {k:<{kw}}{rule:<14}{','.join(t['placements']):<10}{shards}{extra}{why}")
    if lay["unmatched"]:
        lines.append(f"  {len(lay['unmatched'])} tensor(s) match no rule and are replicated on every rank "
                     f"(layout.strict=true refuses them)")
    split, total = lay.get("split_bytes"), lay.get("tensor_bytes")
    if total:
        lines.append(f"  split across ranks: {split} of {total} tensor bytes ({100 * split / total:.0f}%); the rest is "
                     f"whole on every rank")
    plan = lay.get("plan") or {}
    for what, text in (("replicated_kv", "key/value heads fewer than the tensor-parallel ranks: replicated"),
                       ("no_entry", "weights the family's plan names no rule for: whole on every rank"),
                       ("unmapped", "weights the plan splits that auto could not place"),
                       ("experts_whole_in_tp", "stacked expert weights kept whole inside their tensor-parallel "
                                               "group (no plan entry says how they split)")):
        if plan.get(what):
            names = plan[what]
            lines.append(f"  {text}: {len(names)}, e.g. {', '.join(names[:3])}")
    if lay.get("picture"):
        lines.append(f"picture: {lay['picture']}")
    if lay.get("recognised"):
        lines.insert(0, lay["recognised"])
    return lines


def _shard(x: list) -> str:
    """One rank's shard: one box ``[offsets, sizes]``, several (fused parts, flat pieces) joined
    by ``+``, or ``-`` for none (another group's expert)."""
    if not x:
        return "-"
    if len(x) == 2 and all(isinstance(v, int) for v in x[0] + x[1]):
        return _box(*x)
    return "+".join(_box(o, s) for o, s in x)


def _box(offsets: list[int], sizes: list[int]) -> str:
    return "[" + ",".join(f"{o}+{s}" for o, s in zip(offsets, sizes)) + "]"


def layout_report(ctx: JobContext, md: Metadata, ranks: int, path: str | None = None) -> dict:
    """Per tensor: the rule it matched, its placements and each rank's box under ``layout=``."""
    ctx.use_source_layout(md, path, ranks, every_rank=False)  # inspect runs on rank 0 alone
    layout = ctx.cfg.layout
    bad = problems(layout, ranks)
    if bad:
        raise ConfigError(f"layout {layout.name!r} at job.ranks={ranks}: " + "; ".join(bad))
    placer = Placer(layout, 0, ranks, model_config=ctx.model_config, keys=md.tensors)
    tensors, every = {}, {}
    for k, t in sorted(md.tensors.items()):
        boxes = every[k] = [placer.boxes(k, t.shape, r) for r in range(ranks)]
        tensors[k] = {"rule": placer.rule_for(k),
                      "placements": placer.placements_for(k, len(t.shape)) if layout.kind == "dtensor" else
                      [layout.kind],
                      "shards": [[list(b[0].offsets), list(b[0].sizes)] if len(b) == 1 else
                                 [[list(x.offsets), list(x.sizes)] for x in b] for b in boxes],
                      **(placer.describe_rule(k) if layout.kind == "dtensor" else {})}
        rule = layout.rules[tensors[k]["rule"]] if tensors[k]["rule"] is not None else None
        if getattr(rule, "why", None):
            tensors[k]["why"] = rule.why
    nbytes = {k: math.prod(t.shape) * dtype_from_name(t.dtype).itemsize for k, t in md.tensors.items()}
    # what is not on every rank: a fused tensor's key/value heads held whole by all count as whole
    split = sum(n - _held_by_all(every[k]) * n // max(math.prod(md.tensors[k].shape), 1)
                for k, n in nbytes.items() if len(md.tensors[k].shape))
    rules = [{k: v for k, v in vars(r).items() if v is not None and not (k == "parts_dim" and not r.parts)}
             for r in layout.rules]
    return {"name": layout.name, "kind": layout.kind, "ranks": ranks, "mesh": list(mesh_shape(layout, ranks)),
            "rules": rules, "recognised": ctx.layout_note, "model_config": ctx.model_config_from,
            "tensors": tensors, "unmatched": placer.unmatched(sorted(k for k, t in md.tensors.items() if t.shape)),
            "split_bytes": split, "tensor_bytes": sum(nbytes.values()),
            "plan": {k: v for k, v in (ctx.layout_plan or {}).items() if k in ("replicated_kv", "no_entry", "unmapped", "experts_whole_in_tp")}}


def _layout_requested(ctx: JobContext) -> bool:
    if ctx.cfg.job.ranks is not None:
        return True
    try:
        from hydra.core.hydra_config import HydraConfig

        return any(o.split("=", 1)[0].lstrip("+~") == "layout" for o in HydraConfig.get().overrides.task)
    except Exception:  # not under Hydra (tests calling the job directly)
        return False


def run(ctx: JobContext) -> dict:
    if ctx.info.rank != 0:
        return {}
    job = ctx.cfg.job
    path = ctx.abspath(job.source.path or ctx.cfg.checkpoint.path)
    key = "job.source.path" if job.source.path else "checkpoint.path"
    reader = ctx.reader(path, foreign=True)
    with ctx.user_errors(key):
        try:
            source = f"{path} (as {reader.format_name})" if reader.format_name != "hpdcp" else \
                join_location(path, METADATA_FILE)
            md = Metadata.from_json(reader.read_metadata_text(), source=source, open_file=reader.open_file)
        finally:
            reader.close()
        md = rename_keys(md, ctx.source_renames(), source=f"{path} (job.source.rename)")
    d = describe(path, reader, md)
    if _layout_requested(ctx) or job.picture:
        if job.picture:
            from ..layout_picture import check_available

            check_available(ctx.abspath(job.picture))
        d["layout"] = layout_report(ctx, md, job.ranks or ctx.info.world_size, path)
        if job.picture:
            from ..layout_picture import draw

            for k, t in d["layout"]["tensors"].items():
                t["shape"] = list(md.tensors[k].shape)
            d["layout"]["picture"] = draw(d["layout"], ctx.abspath(job.picture), os.path.basename(path))
    write_out(json.dumps(d, indent=2) if job.format == "json" else format_table(d))
    return {"checkpoint": path, "tensors": len(d["tensors"]), "objects": len(d["objects"]),
            "tensor_bytes": d["tensor_bytes"], "format": d["format"],
            **({"layout": d["layout"]["name"]} if "layout" in d else {})}


def _held_by_all(boxes_per_rank: list) -> int:
    """Elements of a tensor every rank holds (each rank's boxes are disjoint, so their
    intersections with another rank's stay disjoint)."""
    common = list(boxes_per_rank[0]) if boxes_per_rank else []
    for other in boxes_per_rank[1:]:
        common = [ov for a in common for b in other if (ov := intersect(a, b)) is not None]
    return sum(b.numel for b in common)
