"""What slows a training step when a persist runs on another core: memory traffic or CPU?

    OMP_NUM_THREADS=1 python scripts/bench_step_interference.py --reps 3

The step is ``scripts/bench_peers.py``'s training step, rebuilt here: ``--matmuls`` products of
384x384, then an in-place update of every tensor of the state (``--state-mib`` in 2,079 tensors,
as that bench's sharded state per rank). It is timed alone, then beside a process pinned to the
other core that does one of three things while the step runs:

* ``spin``: arithmetic on a few registers, no memory traffic (a core busy, nothing else);
* ``stream``: copies between two 256 MiB buffers (what a persist's write path moves);
* ``hash``: a checksum pass over a 256 MiB buffer, then a copy of it to a file in the page cache
  (the persist's own pattern: read the staged bytes twice, write them once);
* ``save`` / ``save, no fsync``: our own ``dcp.save`` of a state like the step's, to a fresh
  directory each time, one after another (a persist, but pinned to the other core).

If the steps beside ``stream``/``hash`` slow down by what they do beside a real persist and the
steps beside ``spin`` do not, the persist costs the step memory bandwidth, not a core. Linux only
(it pins with ``os.sched_setaffinity``); needs 2 cores.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})


def _neighbour(kind: str, core: int, stop: "mp.synchronize.Event", ready: "mp.synchronize.Event") -> None:
    _pin(core)
    import torch
    import zlib

    torch.set_num_threads(1)
    if kind == "spin":
        ready.set()
        x = 1
        while not stop.is_set():
            for _ in range(100_000):
                x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        return
    if kind.startswith("save"):
        from hpdcp_runner import dcp

        st = {f"t{i}": torch.randn(1024) for i in range(2000)}
        st.update({f"b{i}": torch.randn(1 << 20) for i in range(22)})
        ready.set()
        with tempfile.TemporaryDirectory() as d:
            i = 0
            while not stop.is_set():
                path = os.path.join(d, f"c{i % 2}")
                dcp.save(st, storage_writer=dcp.FileSystemWriter(path, fsync=kind == "save"), overwrite=True)
                i += 1
        return
    a = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    ready.set()
    with tempfile.TemporaryFile() as f:
        while not stop.is_set():
            if kind == "stream":
                b.copy_(a)
                a.copy_(b)
            else:  # hash: a checksum pass, then the write (into the page cache)
                zlib.crc32(memoryview(a.numpy()))
                f.seek(0)
                f.write(memoryview(a.numpy()))


def _steps(n: int, matmuls: int, state: list, w) -> list[float]:
    import torch

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        x = w
        for _ in range(matmuls):
            x = torch.mm(x, w)
        with torch.no_grad():
            for t in state:
                t.mul_(0.999).add_(0.001)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--matmuls", type=int, default=24)
    ap.add_argument("--state-mib", type=int, default=96)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores")
    import torch

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    _pin(cores[0])
    small = 2000
    big = max(1, (args.state_mib << 20) // 4 - small * 1024) // (1 << 20)
    state = [torch.randn(1024) for _ in range(small)] + [torch.randn(1 << 20) for _ in range(big)]
    w = torch.randn(384, 384) / 384 ** 0.5
    _steps(5, args.matmuls, state, w)  # warm
    ctx = mp.get_context("spawn")
    rows: dict[str, list[float]] = {k: [] for k in ("alone", "spin", "stream", "hash", "save", "save, no fsync")}
    for _ in range(args.reps):
        for kind in rows:
            if kind == "alone":
                rows[kind].append(statistics.median(_steps(args.steps, args.matmuls, state, w)))
                continue
            stop, ready = ctx.Event(), ctx.Event()
            p = ctx.Process(target=_neighbour, args=(kind, cores[1], stop, ready))
            p.start()
            ready.wait(60)
            time.sleep(0.2)
            rows[kind].append(statistics.median(_steps(args.steps, args.matmuls, state, w)))
            stop.set()
            p.join(60)
    base = statistics.median(rows["alone"])
    print(f"# step beside a neighbour on the other core: {args.matmuls} matmuls 384x384 + in-place update of "
          f"{args.state_mib} MiB in {small + big} tensors; {args.reps} reps x {args.steps} steps, torch "
          f"{torch.__version__}\n")
    print("| neighbour | step (median of medians, min-max) | / alone |\n|---|---|---|")
    for kind, xs in rows.items():
        med = statistics.median(xs)
        print(f"| {kind} | {med * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}) | {med / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
