"""Planning at thousands of ranks, simulated in one process: time and memory per rank.

    python scripts/sim_planning_scale.py --ranks 64 256 1024 8192 --tensors 2000

Every rank of a save or load runs the same pure planning functions on the gathered plans, so one
process measures what each rank pays. Workload: ``--tensors`` tensors of 1024 x 1024 fp32, 9 of
every 10 sharded Shard(0) over all ranks (FSDP), every 10th replicated on every rank (norms).

* save: ``assign_owners`` (dedup of replicated chunks + the tiling check) on N gathered plans;
* load, one rank: ``StandardLoadPlanner.create_local_plan`` against metadata with N chunks per
  sharded tensor (a resharding load into Shard(0) over N ranks);
* replicas: ``plan_replica_reads`` for the same state loaded on N ranks (who reads what).

Memory is tracemalloc's peak while the function runs, after the inputs were built. Per-rank work
that grows faster than N x T shows up as time per item growing with N.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import torch

from hpdcp_runner.dcp.geometry import Box, split_piece, whole
from hpdcp_runner.dcp.metadata import ChunkMeta, FileMeta, Metadata, TensorMeta
from hpdcp_runner.dcp.planner import TENSOR, SavePlan, WriteItem
from hpdcp_runner.dcp.ragged import LocalShard
from hpdcp_runner.dcp.replica_plan import ShardSummary, plan_replica_reads
from hpdcp_runner.dcp.standard_planner import StandardLoadPlanner, assign_owners

ROWS, COLS = 1024, 1024


def _box(i: int, n: int, rank: int) -> Box:
    if i % 10 == 9:
        return whole((ROWS, COLS))
    start, size = split_piece(ROWS, n, rank)
    return Box((start, 0), (size, COLS))


def save_plans(n: int, t: int) -> list[SavePlan]:
    plans = []
    for r in range(n):
        items = []
        for i in range(t):
            b = _box(i, n, r)
            items.append(WriteItem(f"t{i}", TENSOR, b, "float32", (ROWS, COLS), b.numel * 4))
        plans.append(SavePlan(r, tuple(items), {}))
    return plans


def metadata(n: int, t: int) -> Metadata:
    files = {f"rank{r:05d}.safetensors": FileMeta(f"rank{r:05d}.safetensors", 1 << 40, "0", r) for r in range(n)}
    tensors = {}
    for i in range(t):
        owners = [0] if i % 10 == 9 else range(n)
        chunks = tuple(ChunkMeta(_box(i, n, r).offsets, _box(i, n, r).sizes, f"rank{r:05d}.safetensors",
                                 f"t{i}", 0, "0") for r in owners if _box(i, n, r).numel)
        tensors[f"t{i}"] = TensorMeta("float32", (ROWS, COLS), chunks, (f"t{i}",))
    return Metadata(n, tensors, {}, files)


def measure(fn) -> tuple[float, float]:
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    fn()
    secs = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return secs, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 8192])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t = args.tensors
    rows = ["| ranks | tensors | save: assign_owners s (MiB) | load: local plan of one rank s (MiB) | "
            "replica plan s (MiB) | save us per item |", "|---|---|---|---|---|---|"]
    for n in args.ranks:
        plans = save_plans(n, t)
        s_save, m_save = measure(lambda: assign_owners(plans, "balanced"))
        del plans
        md = metadata(n, t)
        target = {}  # one rank's destination shards; meta tensors: planning never touches data
        for i in range(t):
            b = _box(i, n, n // 2)
            target[f"t{i}"] = LocalShard(torch.empty(b.sizes, device="meta"), b.offsets, (ROWS, COLS))
        lp = StandardLoadPlanner()
        lp.configure(target, md, rank=n // 2, world_size=n)
        s_load, m_load = measure(lp.create_local_plan)
        del md, target, lp
        summaries = [[ShardSummary(f"t{i}", _box(i, n, r).offsets, _box(i, n, r).sizes, _box(i, n, r).numel * 4,
                                   "float32", "cpu") for i in range(t)] for r in range(n)]
        s_rep, m_rep = measure(lambda: plan_replica_reads(summaries, mode="always", nodes=["a"] * n,
                                                          slow_storage=False))
        del summaries
        rows.append(f"| {n} | {t} | {s_save:.2f} ({m_save:.0f}) | {s_load:.3f} ({m_load:.0f}) | {s_rep:.2f} ({m_rep:.0f}) "
                    f"| {1e6 * s_save / (n * t):.2f} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
