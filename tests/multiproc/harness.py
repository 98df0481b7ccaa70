"""Run a function on N real gloo ranks (spawned processes) and collect results or tracebacks.

One spawn per call; tests put many cases into one call to keep start-up cost low.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now (for launchers that need one named, e.g. two torchrun agents); it can be
    taken before it is bound, so ``run_ranks`` does not use it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, store_file: str, fn: Callable, args: tuple, queue: Any,
            pg_timeout: float) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # the rendezvous is a file, not a port: nothing another process can take between choosing
        # it and binding it (gloo's own connections bind port 0, which cannot collide)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"file://{store_file}",
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0, pg_timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Any rank's exception (or a timeout) fails the caller with every rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="hpdcp-rdzv-")
    try:
        return _run(ctx, queue, world_size, os.path.join(store_dir, "store"), fn, args, timeout, pg_timeout)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _run(ctx: Any, queue: Any, world_size: int, store_file: str, fn: Callable, args: tuple, timeout: float,
         pg_timeout: float) -> list[Any]:
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_file, fn, args, queue, pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, ok, payload = queue.get()
            results[rank] = (ok, payload)
            continue
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        time.sleep(0.02)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()) if len(results) == world_size else 1)
        if p.is_alive():
            p.kill()
            p.join()
    failed = {r: payload for r, (ok, payload) in results.items() if not ok}
    absent = [r for r in range(world_size) if r not in results]
    if failed or absent:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        if absent:
            text += f"\nranks {absent} reported nothing (crashed or timed out after {timeout}s)"
        raise AssertionError(f"distributed run failed:\n{text}")
    return [results[r][1] for r in range(world_size)]
