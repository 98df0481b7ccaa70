"""hpdcp_runner.dcp vs torch.distributed.checkpoint's fsspec path (s3fs) on the same S3 server, side
by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_s3.py --reps 3
    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_s3.py --reps 3 --latency-ms 20 --bandwidth 100MB

Rank 0 starts the S3 server (moto on loopback; ``--endpoint`` to use another) and a loopback proxy in
front of it (tests/s3_proxy.py) that counts requests and, with ``--latency-ms`` / ``--bandwidth``,
makes the store slow (latency added per request, one bandwidth cap shared by every connection).
Both sides go through the same proxy. Workload: ``--tensors`` fp32 matrices of 1024 x ``--width``
as Shard(0) DTensors on 2 ranks. Cases: save; warm load (same layout); reshard Shard(0) ->
Shard(1) (each rank keeps half of every row range: partial reads). Times are the max over ranks,
median with min-max over repetitions; ratio = peer median / ours. Requests and bytes are through
the proxy per case; "bound" (slow store only) = bytes moved / bandwidth + the latency per round of
concurrent requests (requests of the busiest rank / concurrency), what the store's own limits allow.
Needs the `s3` and `bench` extras plus s3fs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse_size(s: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1 << 20, "GIB": 1 << 30}
    s = s.strip().upper()
    for u, m in units.items():
        if s.endswith(u):
            return float(s[:-len(u)]) * m
    return float(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--bandwidth", default=None, help="e.g. 400MB (per second, the store's total)")
    ap.add_argument("--conn-bandwidth", default=None, help="e.g. 50MB (per second, per request/connection)")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--direct", action="store_true", help="no proxy (no request counts)")
    ap.add_argument("--part-size", default="16MiB", help="dcp.storage.part_size for ours")
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    from tests import s3_server
    from tests.s3_proxy import Proxy

    os.environ.update(s3_server.CREDENTIALS)
    box = [None]
    proxy = server = None
    if rank == 0:
        endpoint, server = (a.endpoint, None) if a.endpoint else s3_server.start()
        bw = _parse_size(a.bandwidth) if a.bandwidth else None
        proxy = Proxy(endpoint, latency_s=a.latency_ms / 1000, bandwidth_bps=bw,
                      conn_bandwidth_bps=_parse_size(a.conn_bandwidth) if a.conn_bandwidth else None)
        bucket = s3_server.new_bucket(endpoint)
        box = [(endpoint if a.direct else proxy.endpoint, bucket)]
    dist.broadcast_object_list(box, src=0)
    endpoint, bucket = box[0]
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import ObjectStoreOptions, configure_object_store

    configure_object_store(ObjectStoreOptions(part_size=int(_parse_size(a.part_size)), concurrency=a.concurrency))
    from torch.distributed.checkpoint import load as tload, save as tsave
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    mesh = DeviceMesh("cpu", list(range(ws)))
    g = torch.Generator().manual_seed(0)
    full = {f"layer{i}.w": torch.randn(1024, a.width, generator=g) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in full.values())

    def state(dim: int, zeros: bool = False) -> dict:
        return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [Shard(dim)]) for k, v in full.items()}

    def check(sd: dict) -> None:
        for k, v in sd.items():
            if not torch.equal(v.to_local(), distribute_tensor(full[k], mesh, v.placements).to_local()):
                raise SystemExit(f"rank {rank}: {k} differs after load")

    def timed(fn) -> tuple[float, int, int]:
        dist.barrier()
        r0 = proxy.requests if proxy and not a.direct else 0
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item(), (proxy.requests - r0) if proxy and not a.direct else 0, 0

    results: dict[str, dict[str, list]] = {}
    last: list = [None]
    per_kept: dict[str, float] = {}
    for rep in range(a.reps):
        for side in (("ours", "peer") if rep % 2 == 0 else ("peer", "ours")):
            base = f"s3://{bucket}/{side}{rep}"
            src, dst0, dst1 = state(0), state(0, True), state(1, True)
            if side == "ours":
                save_fn = lambda: dcp.save(src, checkpoint_id=base)  # noqa: E731
                load_fn = lambda sd: last.__setitem__(0, dcp.load(sd, checkpoint_id=base).counters)  # noqa: E731
            else:
                save_fn = lambda: tsave(src, storage_writer=FsspecWriter(base, thread_count=2))  # noqa: E731
                load_fn = lambda sd: tload(sd, storage_reader=FsspecReader(base))  # noqa: E731
            for case, fn in (("save", save_fn), ("load", lambda: load_fn(dst0)), ("reshard S0->S1", lambda: load_fn(dst1))):
                last[0] = None
                t, req, _ = timed(fn)
                results.setdefault(case, {}).setdefault(side, []).append((t, req))
                if side == "ours" and last[0] is not None:  # bytes fetched by all ranks / bytes kept
                    got = torch.tensor([float(last[0].get("bytes_requested", 0))])
                    dist.all_reduce(got)
                    per_kept[case] = got.item() / nbytes
            check(dst0)
            check(dst1)
    if rank == 0:
        bw = _parse_size(a.bandwidth) if a.bandwidth else None
        print(f"\n{ws} ranks, {a.tensors} x 1024x{a.width} fp32 = {nbytes / 2**20:.0f} MiB, latency {a.latency_ms} ms, "
              f"bandwidth {a.bandwidth or 'uncapped'} in all, {a.conn_bandwidth or 'uncapped'} per connection, "
              f"{a.reps} reps ({'direct' if a.direct else 'through the loopback proxy'})")
        print(f"{'case':16} {'ours s (min-max)':>22} {'peer s (min-max)':>22} {'ratio':>6} {'req ours':>9} "
              f"{'req peer':>9} {'read/kept':>9}" + (f" {'bound s':>8} {'ours/bound':>10}" if bw else ""))
        for case, sides in results.items():
            o = [t for t, _ in sides["ours"]]
            p = [t for t, _ in sides["peer"]]
            ro, rp = sides["ours"][-1][1], sides["peer"][-1][1]
            line = (f"{case:16} {statistics.median(o):8.3f} ({min(o):.3f}-{max(o):.3f}) "
                    f"{statistics.median(p):8.3f} ({min(p):.3f}-{max(p):.3f}) "
                    f"{statistics.median(p) / statistics.median(o):6.2f} {ro:9d} {rp:9d} "
                    f"{per_kept.get(case, float('nan')):9.2f}")
            if bw:
                # the store's own limits: the kept bytes at its bandwidth, plus its latency per round
                # of concurrent requests (requests of a rank / concurrency, at least one)
                bound = nbytes / bw + a.latency_ms / 1000 * max(1, math.ceil(ro / ws / a.concurrency))
                line += f" {bound:8.3f} {statistics.median(o) / bound:10.2f}"
            print(line, flush=True)
        proxy.close()
        if server is not None:
            server.terminate()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
