"""transform: offline conversions in one process (no torchrun), with a progress bar.

``transform=merge_hf`` (ours -> Hugging Face shards), ``transform=import`` (HF / safetensors /
.pt / torch DCP / hyper-parallel -> ours, laid out for ``transform.layout`` at
``transform.world_size``), ``transform=to_torch_dcp`` (ours -> torch DCP). The engine functions
are ``hpdcp_runner.dcp.offline.transforms``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..config import parse_size
from ..dcp import CheckpointExistsError
from ..dcp.tools import transforms as ot
from ..config import load_preset
from ..layouts import Placer
from .context import JobContext


@contextlib.contextmanager
def _existing_dst() -> Iterator[None]:
    """An existing output names the keys that decide it (not the engine's keyword)."""
    try:
        yield
    except CheckpointExistsError as e:
        what = str(e).split(";")[0].rstrip(". ")
        raise CheckpointExistsError(f"{what} (transform.dst). To replace it, add transform.overwrite=true, or pick "
                                    f"another transform.dst.") from None


def run(ctx: JobContext) -> dict:
    t = ctx.cfg.transform
    src, dst = ctx.abspath(t.src), ctx.abspath(t.dst)
    rename = [(r["pattern"], r["replace"]) for r in t.rename]

    def progress(it: Any, total: int, desc: str) -> Any:
        return ctx.bars.progress(it, desc, total=total)

    with ctx.metrics.phase("transform"), _existing_dst():
        if t.kind == "merge_hf":
            res = ot.merge_to_hf(src, dst, max_shard_size=parse_size(t.max_shard_size, "transform.max_shard_size"),
                                 dtype=t.dtype, rename=rename, include=t.include, exclude=t.exclude,
                                 single_file=t.single_file, overwrite=t.overwrite, fsync=ctx.engine.fsync,
                                 progress=progress, model_only=t.model_only,
                                 files_from=ctx.abspath(t.files_from) if t.files_from else None)
            if res["left_out"] is None:
                res.pop("left_out")
        elif t.kind == "import":
            placer = Placer(load_preset(t.layout), 0, t.world_size)
            md = ot.import_checkpoint(src, dst, source_format=t.source_format, world_size=t.world_size,
                                      boxes=placer.boxes, allow_pickle=t.allow_pickle, rename=rename,
                                      include=t.include, exclude=t.exclude, overwrite=t.overwrite,
                                      fsync=ctx.engine.fsync, progress=progress)
            res = {"dst": dst, "tensors": len(md.tensors), "objects": len(md.objects), "world_size": md.world_size,
                   "layout": t.layout, "total_size": md.total_tensor_bytes,
                   "files": sorted(md.files)}
        else:
            res = ot.export_torch_dcp(src, dst, rename=rename, include=t.include, exclude=t.exclude,
                                      allow_pickle=t.allow_pickle, overwrite=t.overwrite, progress=progress)
    ctx.metrics.add({"bytes_written": int(res["total_size"])}, "transform.")
    return {"kind": t.kind, "src": src, **res}
