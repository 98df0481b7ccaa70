"""inspect: tensors, dtypes, shapes, chunks, files, bytes, commit state, format version."""

from __future__ import annotations

import json

from ..dcp.inspection import describe
from .context import JobContext


def format_table(d: dict) -> str:
    lines = [f"checkpoint {d['path']} [{d['state']}] format v{d['format_version']}, saved at world size "
             f"{d['world_size']}, {d['tensor_bytes']} tensor bytes in {len(d['files'])} files"]
    lines.append(f"{'key':<48}{'dtype':<10}{'shape':<22}{'chunks':>7}{'bytes':>14}")
    for k, t in sorted(d["tensors"].items()):
        lines.append(f"{k:<48}{t['dtype']:<10}{str(t['shape']):<22}{t['chunks']:>7}{t['bytes']:>14}")
    for k in d["objects"]:
        lines.append(f"{k:<48}{'object':<10}")
    lines.append("files: " + ", ".join(f"{n} ({f['size']} B)" for n, f in d["files"].items()))
    return "\n".join(lines)


def run(ctx: JobContext) -> dict:
    if ctx.info.rank != 0:
        return {}
    d = describe(ctx.checkpoint_path())
    print(json.dumps(d, indent=2) if ctx.cfg.job.format == "json" else format_table(d), flush=True)
    return {"tensors": len(d["tensors"]), "objects": len(d["objects"]), "tensor_bytes": d["tensor_bytes"]}
