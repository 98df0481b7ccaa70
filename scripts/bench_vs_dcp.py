"""Side-by-side save/load timing: hpdcp_runner.dcp vs torch.distributed.checkpoint.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_vs_dcp.py --layout sharded --reps 3

Workload (peer_baseline.md §4): 15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 fp32 (1.008 GiB at
--scale 1), deterministic contents, every load checked. Prints per-phase medians, min-max and the
ratio peer/ours (>1 means we are faster). Timings are max over ranks of each repetition.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hpdcp_runner import dcp


def workload(scale: float, layout: str, mesh: DeviceMesh) -> dict:
    spec = [((4096, 4096), 15), ((512, 512), 64), ((1024,), 2000)]
    sd, g = {}, torch.Generator().manual_seed(0)
    for shape, count in spec:
        shape = (max(1, int(shape[0] * scale)),) + shape[1:] if len(shape) > 1 else shape
        for i in range(count):
            t = torch.empty(shape).uniform_(generator=g)
            sd[f"p{len(sd)}"] = distribute_tensor(t, mesh, [Shard(0)]) if layout == "sharded" else t
    return sd


def zeros_like_sd(sd: dict) -> dict:
    return {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride()) if isinstance(v, DTensor) else torch.zeros_like(v))
            for k, v in sd.items()}


def check(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        x, y = (x.to_local(), y.to_local()) if isinstance(x, DTensor) else (x, y)
        if not torch.equal(x, y):
            raise SystemExit(f"mismatch in {k}")


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    return el.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["sharded", "replicated"], default="sharded")
    ap.add_argument("--scale", type=float, default=1.0, help="scales the big tensors' rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(ws)))
    root = args.dir or tempfile.gettempdir()
    base = os.path.join(root, f"hpdcp-bench-{os.environ.get('MASTER_PORT', '0')}")
    sd = workload(args.scale, args.layout, mesh)
    nbytes = sum((v.to_local() if isinstance(v, DTensor) else v).numel() * 4 for v in sd.values())
    times: dict[str, list[float]] = {k: [] for k in ("dcp_save", "ours_save", "dcp_load", "ours_load")}
    for rep in range(args.reps):
        pd, po = f"{base}/dcp{rep}", f"{base}/ours{rep}"
        times["dcp_save"].append(timed(lambda: tdcp.save(
            sd, storage_writer=tdcp.FileSystemWriter(pd, thread_count=args.dcp_threads))))
        times["ours_save"].append(timed(lambda: dcp.save(sd, checkpoint_id=po)))
        tgt = zeros_like_sd(sd)
        times["dcp_load"].append(timed(lambda: tdcp.load(tgt, storage_reader=tdcp.FileSystemReader(pd))))
        check(sd, tgt)
        tgt = zeros_like_sd(sd)
        times["ours_load"].append(timed(lambda: dcp.load(tgt, checkpoint_id=po)))
        check(sd, tgt)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(pd, ignore_errors=True)
            shutil.rmtree(po, ignore_errors=True)
    if rank == 0:
        print(f"ws={ws} layout={args.layout} local bytes/rank={nbytes / 2**30:.3f} GiB reps={args.reps} "
              f"dcp thread_count={args.dcp_threads}")
        for phase in ("save", "load"):
            d, o = times[f"dcp_{phase}"], times[f"ours_{phase}"]
            md, mo = statistics.median(d), statistics.median(o)
            print(f"{phase}: torch DCP {md:.3f}s ({min(d):.3f}-{max(d):.3f})  ours {mo:.3f}s ({min(o):.3f}-{max(o):.3f})"
                  f"  ratio {md / mo:.2f}x")
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
