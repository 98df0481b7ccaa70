"""async_save side by side: ours vs torch.distributed.checkpoint, against a synchronous save.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_async_save.py --reps 3

Workload (peer_baseline.md §4): 15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 fp32, Shard(0) over
the ranks (0.5 GiB local per rank at --scale 1). Per repetition, in rotating order: our
synchronous ``save``; our ``async_save`` (time until it returns = the training stall, and until
``result()``); torch DCP ``async_save`` the same way (its own gloo group, as its docs advise);
torch DCP ``save``. Times are the max over ranks; medians with min-max. Memory: peak RSS growth
per rank during each async save (``/proc/self/clear_refs`` resets the peak), and what our staging
buffers keep between saves. After the timings, every checkpoint is loaded and checked.
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
from bench_vs_torch_dcp import check, timed, workload, zeros_like_sd
from torch.distributed.device_mesh import DeviceMesh

from hpdcp_runner import dcp
from hpdcp_runner.dcp.background.saver import _BUFFERS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS")


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def async_case(start, wait) -> tuple[float, float, float]:
    """(seconds until the call returns, seconds until persisted, peak RSS growth MiB), max over ranks."""
    dist.barrier()
    rss0 = _reset_peak()
    t0 = time.perf_counter()
    handle = start()
    t_block = time.perf_counter() - t0
    wait(handle)
    t_total = time.perf_counter() - t0
    grow = (_status_kib("VmHWM") - rss0) / 1024
    return _max(t_block), _max(t_total), _max(grow)


def fmt(xs: list[float], unit: str = "s") -> str:
    return f"{statistics.median(xs):.3f}{unit} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0, help="scales the big tensors' rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(ws)))
    dcp_group = dist.new_group(backend="gloo")
    base = os.path.join(args.dir or tempfile.gettempdir(), f"hpdcp-async-bench-{os.environ.get('MASTER_PORT', '0')}")
    sd = workload(args.scale, "sharded", mesh)
    local = sum(v.to_local().numel() * 4 for v in sd.values())
    t: dict[str, list[float]] = {k: [] for k in ("ours_sync", "ours_block", "ours_total", "ours_rss", "dcp_sync",
                                                 "dcp_block", "dcp_total", "dcp_rss")}
    for rep in range(args.reps):
        paths = {k: f"{base}/{k}{rep}" for k in ("os", "oa", "ds", "da")}

        def ours_sync():
            t["ours_sync"].append(timed(lambda: dcp.save(sd, checkpoint_id=paths["os"])))

        def ours_async():
            b, tot, g = async_case(lambda: dcp.async_save(sd, checkpoint_id=paths["oa"]), lambda r: r.result())
            t["ours_block"].append(b), t["ours_total"].append(tot), t["ours_rss"].append(g)

        def dcp_sync():
            t["dcp_sync"].append(timed(lambda: tdcp.save(
                sd, storage_writer=tdcp.FileSystemWriter(paths["ds"], thread_count=args.dcp_threads))))

        def dcp_async():
            b, tot, g = async_case(lambda: tdcp.async_save(
                sd, storage_writer=tdcp.FileSystemWriter(paths["da"], thread_count=args.dcp_threads),
                process_group=dcp_group), lambda f: f.result())
            t["dcp_block"].append(b), t["dcp_total"].append(tot), t["dcp_rss"].append(g)

        cases = [ours_sync, ours_async, dcp_sync, dcp_async]
        for case in cases[rep % 4:] + cases[: rep % 4]:
            case()
        for key, loader in (("os", dcp.load), ("oa", dcp.load)):
            tgt = zeros_like_sd(sd)
            loader(tgt, checkpoint_id=paths[key])
            check(sd, tgt)
        tgt = zeros_like_sd(sd)
        tdcp.load(tgt, storage_reader=tdcp.FileSystemReader(paths["da"]))
        check(sd, tgt)
        dist.barrier()
        if rank == 0:
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
    staging_mib = _max(_BUFFERS.nbytes / 2**20)
    if rank == 0:
        ours_sync, ob, ot = (statistics.median(t[k]) for k in ("ours_sync", "ours_block", "ours_total"))
        print(f"ws={ws} sharded, local bytes/rank={local / 2**30:.3f} GiB, reps={args.reps}, "
              f"dcp thread_count={args.dcp_threads}")
        print(f"ours  save (sync)            {fmt(t['ours_sync'])}")
        print(f"ours  async_save returns     {fmt(t['ours_block'])}  = {ob / ours_sync:.0%} of our sync save "
              f"(target <= 25%)")
        print(f"ours  async_save persisted   {fmt(t['ours_total'])}  = {ot / ours_sync:.2f}x our sync save "
              f"(target <= 1.5x)")
        print(f"ours  peak RSS+ per rank     {fmt(t['ours_rss'], ' MiB')} (first save allocates the staging copy); "
              f"staging buffers kept: {staging_mib:.0f} MiB")
        db, dt_ = statistics.median(t["dcp_block"]), statistics.median(t["dcp_total"])
        print(f"torch DCP save (sync)        {fmt(t['dcp_sync'])}")
        print(f"torch DCP async_save returns {fmt(t['dcp_block'])}  -> ratio DCP/ours {db / ob:.1f}x")
        print(f"torch DCP async persisted    {fmt(t['dcp_total'])}  -> ratio DCP/ours {dt_ / ot:.2f}x")
        print(f"torch DCP peak RSS+ per rank {fmt(t['dcp_rss'], ' MiB')}")
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
