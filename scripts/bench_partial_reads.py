"""The three ways to read part of a chunk, timed on this machine (docs/benchmarks.md, issue 17).

    OMP_NUM_THREADS=1 python scripts/bench_partial_reads.py [--procs 1 4] [--mib 128]

A file of ``--mib`` MiB in the page cache is read as runs of ``run`` bytes separated by ``gap``
bytes (a Shard(0) -> Shard(1) read of a row-major matrix), by 1 and by 4 processes at once:

* through: ``vectored.read_ranges`` with gaps read through into a discard buffer;
* slab: whole windows into a scratch buffer and one strided copy per window (1 MiB and 16 MiB);
* exact: ``read_ranges`` with every gap splitting the request (only the kept bytes).

Also prints the cost model the loads would use (``measured_cost_model``) and its choice.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from multiprocessing import Barrier, Process, Queue

import torch

from hpdcp_runner.dcp.storage.vectored import (Sink, _preadv_table, check_destination, measured_cost_model,
                                               read_ranges)

CASES = [(512, 1536), (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192)]


def work(path: str, size: int, run: int, gap: int, how: str, barrier, out: Queue) -> None:
    torch.set_num_threads(1)
    fd = os.open(path, os.O_RDONLY)
    k = size // (run + gap)
    dest = torch.ones(k * run, dtype=torch.uint8)
    offs = torch.arange(k, dtype=torch.int64) * (run + gap)
    addrs = check_destination(dest, torch.arange(k) * run, run, name=path, what="bench")
    barrier.wait()
    t = time.perf_counter()
    if how.startswith("slab"):
        win = int(how.split()[1]) << 20
        scratch = torch.empty(win, dtype=torch.uint8)
        rows, rows_out = win // (run + gap), dest.view(k, run)
        for r0 in range(0, k, rows):
            m = min(rows, k - r0)
            _preadv_table(fd, torch.tensor([[scratch.data_ptr(), m * (run + gap)]]), r0 * (run + gap))
            rows_out[r0:r0 + m].copy_(scratch[:m * (run + gap)].view(m, run + gap)[:, :run])
    else:
        read_ranges(fd, offs, run, addrs, gap_bytes=(1 << 30) if how == "through" else 0, sink=Sink(),
                    name=path, what="bench", file_size=size)
    out.put(time.perf_counter() - t)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--mib", type=int, default=128)
    args = ap.parse_args()
    size = args.mib << 20
    m = measured_cost_model()
    print(f"cost model: {m.call_s * 1e6:.2f} us per request, {m.run_s * 1e6:.3f} us per run, "
          f"{m.bytes_per_s / 1e9:.2f} GB/s read, {m.copy_bytes_per_s / 1e9:.2f} GB/s copy, "
          f"gaps up to {m.gap_bytes} bytes read through")
    with tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()) as f:
        f.write(os.urandom(size))
        f.flush()
        print("| run / gap | model's choice | " + " | ".join(
            f"{how}, {' / '.join(f'{p} proc' for p in args.procs)}"
            for how in ("through", "slab 1", "slab 16", "exact")) + " |")
        print("|---|---|" + "---|" * 4)
        for run, gap in CASES:
            k = size // (run + gap)
            cells = [f"{run} / {gap}", m.choose(k, run, size)]
            for how in ("through", "slab 1", "slab 16", "exact"):
                per = []
                for n in args.procs:
                    b, q = Barrier(n), Queue()
                    ps = [Process(target=work, args=(f.name, size, run, gap, how, b, q)) for _ in range(n)]
                    for p in ps:
                        p.start()
                    ts = [q.get() for _ in ps]
                    for p in ps:
                        p.join()
                    per.append(f"{min(ts):.3f}-{max(ts):.3f}" if n > 1 else f"{ts[0]:.3f}")
                cells.append(" / ".join(per))
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
