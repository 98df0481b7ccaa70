"""Replica-deduplicated load vs every-rank-reads, side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_broadcast.py --throttle 200MB
    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_broadcast.py            # unthrottled: auto vs never
    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_broadcast.py --sweep    # batch_bytes x max_in_flight

Workload: the peer mix (15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 fp32, 1.008 GiB at --scale 1)
as plain tensors replicated on every rank. ``--throttle`` caps each process's read bandwidth with
the storage token bucket, modelling network storage. Prints medians, min-max, the ratio to
``never`` and per-rank bytes read / received.
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

from hpdcp_runner import dcp
from hpdcp_runner.config import parse_size


def workload(scale: float) -> dict:
    sd = {}
    for shape, count in [((max(1, int(4096 * scale)), 4096), 15), ((512, 512), 64), ((1024,), 2000)]:
        for _ in range(count):
            k = f"p{len(sd)}"
            sd[k] = (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) % 977 + len(sd)).reshape(shape)
    return sd


def one_load(path: str, sd: dict, opts: dcp.BroadcastOptions, throttle: int | None) -> tuple[float, dict]:
    tgt = {k: torch.empty_like(v) for k, v in sd.items()}
    reader = dcp.FileSystemReader(path, max_read_bytes_per_s=throttle)
    dist.barrier()
    t0 = time.perf_counter()
    res = dcp.load(tgt, storage_reader=reader, broadcast=opts)
    el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    for k in ("p0", "p100", f"p{len(sd) - 1}"):
        if not torch.equal(tgt[k], sd[k]):
            raise SystemExit(f"mismatch in {k}")
    return el.item(), dict(res.counters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--throttle", default=None, help="per-process read cap, e.g. 200MB")
    ap.add_argument("--sweep", action="store_true", help="sweep batch_bytes x max_in_flight with mode=always")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    throttle = parse_size(args.throttle) if args.throttle else None
    base = os.path.join(args.dir or tempfile.gettempdir(), f"hpdcp-bcast-{os.environ.get('MASTER_PORT', '0')}")
    sd = workload(args.scale)
    dcp.save(sd, checkpoint_id=f"{base}/c", overwrite=True)
    if args.sweep:
        cases = [(f"always b={b} f={f}", dcp.BroadcastOptions("always", parse_size(b), f))
                 for b in ("0", "1MiB", "4MiB", "8MiB", "16MiB", "64MiB") for f in (1, 4, 8)]
        cases.insert(0, ("never", dcp.BroadcastOptions("never")))
    else:
        cases = [("never", dcp.BroadcastOptions("never")), ("always", dcp.BroadcastOptions("always")),
                 ("auto", dcp.BroadcastOptions("auto"))]
    one_load(f"{base}/c", sd, cases[0][1], None)  # warm the page cache
    results = {}
    for rep in range(args.reps):
        # interleaved and rotated, so drift and position effects on a noisy machine hit every case alike
        for name, opts in cases[rep % len(cases):] + cases[:rep % len(cases)]:
            t, counters = one_load(f"{base}/c", sd, opts, throttle)
            results.setdefault(name, []).append(t)
            if rep == 0:
                got = [None] * ws
                dist.all_gather_object(got, {k: counters.get(k, 0) for k in ("bytes_read", "bytes_received")})
                results[name + ":bytes"] = got
    if rank == 0:
        nbytes = sum(v.numel() * 4 for v in sd.values())
        print(f"ws={ws} replicated {nbytes / 2**30:.3f} GiB, throttle={args.throttle or 'none'}, reps={args.reps}")
        ref = statistics.median(results["never"])
        for name, _ in cases:
            xs = results[name]
            med = statistics.median(xs)
            per = ", ".join(f"r{r}: read {b['bytes_read'] / 2**20:.0f} MiB recv {b['bytes_received'] / 2**20:.0f} MiB"
                            for r, b in enumerate(results[name + ":bytes"]))
            print(f"{name:<22} {med:7.3f}s ({min(xs):.3f}-{max(xs):.3f})  speedup vs never {ref / med:5.2f}x  [{per}]")
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
