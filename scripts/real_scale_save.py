"""A first save at the largest world size a machine starts: real gloo ranks, small tensors, where
the time goes per role (the collectives' share is what the one-process simulation cannot time).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=32 scripts/real_scale_save.py --tensors 2000

Every rank holds ``--tensors`` fp32 tensors of (4 x world) x 64: 9 of 10 a DTensor sharded over
the whole group (FSDP, one row block per rank), every 10th replicated (norms). Three saves into
a temporary directory: a first save, a second with ``cache_plan`` (its structure is new to the
cache: planned in full), a third (served from the cache). Per save and phase (plan, write,
commit: ``PhaseTimer``) the slowest rank's seconds; the slowest rank's own computation (its local
plan, its writing) and the coordinator's (the global plan; the metadata build and commit): the
rest of a phase is the collectives and waiting. Rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner.dcp import save
    from hpdcp_runner.dcp import protocol
    from hpdcp_runner.dcp.core.utils import PhaseTimer

    compute: dict[str, float] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                compute[name] = compute.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    steps = protocol.SaveSteps
    for name in ("_prepare", "write", "global_plan", "build_metadata", "commit"):  # own work, per rank
        if hasattr(steps, name):
            setattr(steps, name, timed(name, getattr(steps, name)))
    mesh = DeviceMesh("cpu", list(range(ws)))
    rows, cols = 4 * ws, 64
    state = {}
    for i in range(args.tensors):
        if i % 10 == 9:
            state[f"t{i}"] = torch.full((rows, cols), float(i))
        else:
            state[f"t{i}"] = distribute_tensor(torch.full((rows, cols), float(i)), mesh, [Shard(0)], src_data_rank=None)
    root = args.dir or (tempfile.mkdtemp(prefix="real_scale_") if rank == 0 else None)
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    out = []
    for i, cache in enumerate((False, True, True)):
        compute.clear()
        timer = PhaseTimer()
        dist.barrier()
        t0 = time.perf_counter()
        save(state, checkpoint_id=os.path.join(root, f"s{i}"), timer=timer, timeout=600, cache_plan=cache)
        wall = time.perf_counter() - t0
        mine = torch.tensor([wall] + [timer.seconds.get(p, 0.0) for p in ("plan", "write", "commit")]
                            + [compute.get("_prepare", 0.0), compute.get("write", 0.0)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out.append((["first", "cached (miss)", "cached (hit)"][i], mine.tolist(), dict(compute)))
    if rank == 0:
        print(f"| {ws} ranks x {args.tensors} tensors | wall | plan | write | commit | slowest rank's own: local plan | "
              f"writing | coordinator's own: global plan | metadata build | commit (with build) |\n"
              f"|---|---|---|---|---|---|---|---|---|---|")
        for name, (wall, plan, write, commit, prep, wr), c in out:
            print(f"| {name} | {wall:.2f} | {plan:.2f} | {write:.2f} | {commit:.2f} | {prep:.2f} | {wr:.2f} | "
                  f"{c.get('global_plan', 0):.2f} | {c.get('build_metadata', 0):.2f} | {c.get('commit', 0):.2f} |",
                  flush=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
