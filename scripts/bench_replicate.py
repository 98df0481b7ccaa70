"""The node-local tier's replication alone (``node_tier.replicate``): real gloo ranks standing for
``--nodes`` nodes of 2 ranks each (torchrun's node rank set per rank, a directory per node), a
Shard(0) tensor of ``--mib`` MiB per rank saved, published, then replicated to ``--replicas``
peers; the seconds from the first rank entering ``replicate`` to the last leaving it, the first
repetition (warm-up) left out.

    OMP_NUM_THREADS=1 python scripts/bench_replicate.py --nodes 3 --mib 64 --reps 4

Every node's leader sends its part to its partners while it receives theirs, so with more nodes
the time should stay near one node's part over one link, not grow with the number of nodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _body(rank: int, world: int, base: str, mib: int, reps: int, k: int) -> list[float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import Comm, node_tier, series_extra

    node = rank // 2
    os.environ["GROUP_RANK"] = str(node)  # (what torchrun sets: tells the nodes apart)
    fast = os.path.join(base, f"node{node}", "fast")
    comm = Comm.create()
    nodes = node_tier.Nodes.discover(comm)
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.randn(world * mib * 256, 1024), mesh, [Shard(0)])}
    out = []
    for rep in range(reps + 1):
        path = os.path.join(fast, f"step_{rep}")
        writer = dcp.FileSystemWriter(path, node_local=True)
        dcp.save(state, checkpoint_id=f"fast/step_{rep}", storage_writer=writer,
                 extra=series_extra("step_{step}", rep))
        worker = node_tier.Background(120)
        got: dict = {}

        def spread(c: Comm) -> None:
            table = node_tier.publish_parts(c, nodes, path, writer.staging_token)
            c.agree("start", lambda: None)
            t0 = time.perf_counter()
            node_tier.replicate(c, nodes, path, table, k, c.group)
            c.agree("end", lambda: None)
            got["s"] = time.perf_counter() - t0

        worker.submit(spread)
        failures = worker.close()
        if failures:
            raise RuntimeError(failures[0])
        out.append(got["s"])
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64, help="per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=1)
    a = ap.parse_args()
    from tests.multiproc.harness import run_ranks

    base = tempfile.mkdtemp(prefix="hpdcp-replicate-")
    try:
        ts = run_ranks(2 * a.nodes, _body, base, a.mib, a.reps, a.replicas, timeout=1800)[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    import torch

    print(f"replicate: {a.nodes} nodes x 2 ranks (gloo on loopback), {a.mib} MiB per rank, {a.replicas} replica(s), "
          f"torch {torch.__version__}: median {statistics.median(ts):.3f} s, min-max {min(ts):.3f}-{max(ts):.3f} "
          f"over {len(ts)}")


if __name__ == "__main__":
    main()
