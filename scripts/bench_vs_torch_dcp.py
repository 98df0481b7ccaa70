"""hpdcp_runner.dcp vs torch.distributed.checkpoint, side by side in one run (peer_baseline.md §4).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_vs_torch_dcp.py --reps 3 --out docs/benchmarks.md

Workload: 15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 fp32 (1.008 GiB at --scale 1), deterministic,
every load checked element by element. Cases (each repetition runs them all, ours and the peer's
in alternating order):

* sharded (Shard(0) DTensors) and replicated (plain tensors on both ranks): save; warm load;
  cold load (only with ``--drop-caches``: the machine's whole page cache is dropped first, which
  needs root and slows every other process on the machine, so it is never done unasked);
* reshard 2->1 (saved Shard(0) by 2 ranks, loaded by rank 0 alone), 1->2 (saved by rank 0 alone,
  loaded Shard(0) by 2 ranks), Shard(0)->Shard(1) on 2 ranks (one read per kept 8 KiB row
  segment by default, and as slab reads), warm: every file is read once and writeback flushed
  before each reshard case;
* small tensors only (the 2064 small and medium ones): save and warm load, per item.

``--reshard-rows`` runs the reshard matrix instead (issue 17), on model-like widths:
``4W x W`` matrices of bf16 and fp32, ``W`` = 1024 and 2048 (``--matrix-mib`` per case), saved
Shard(0) and loaded as Shard(0) -> Shard(1) at 2 and 4 ranks, FSDP (Shard(0), 4 ranks) -> 2-D
FSDP x TP (2x2 mesh, [Shard(0), Shard(1)]), and world-size changes 4 -> 2 and 2 -> 4 (Shard(0)
-> Shard(1)); warm (files read into the page cache first) and cold (the checkpoint's files
evicted from the page cache with ``posix_fadvise(DONTNEED)`` after a sync: no root needed, no
other process disturbed); ours with checksums verified (the default), ours unverified (exact
reads), torch DCP. Read/kept = bytes read per rank / bytes the rank keeps (max over ranks).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=4 scripts/bench_vs_torch_dcp.py --reshard-rows --reps 3

torch DCP runs with its default ``thread_count=1`` and with ``--dcp-threads`` (default 2); the
best of the two is the peer. Times are the max over ranks; medians with min-max over repetitions;
ratio = peer median / ours. Bytes read per rank come from /proc/self/io ``rchar`` (page-cache
reads included, as in the baseline); RSS+ is the peak RSS growth per rank during the phase.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hpdcp_runner import dcp

SPEC = [((4096, 4096), 15), ((512, 512), 64), ((1024,), 2000)]


def workload(scale: float, layout: str, mesh: DeviceMesh | None, small_only: bool = False, dim: int = 0) -> dict:
    """The peer mix; ``layout`` sharded (Shard(dim) DTensors) or replicated (plain tensors)."""
    sd, g = {}, torch.Generator().manual_seed(0)
    for spec_shape, count in SPEC:
        if small_only and spec_shape == SPEC[0][0]:
            continue  # the 15 big tensors
        shape = (max(1, int(spec_shape[0] * scale)),) + spec_shape[1:] if spec_shape == SPEC[0][0] else spec_shape
        for _ in range(count):
            t = torch.empty(shape).uniform_(generator=g)
            key = f"p{len(sd)}"
            sharded = layout == "sharded" and t.dim() > dim
            sd[key] = distribute_tensor(t, mesh, [Shard(dim)]) if sharded else t
    return sd


def zeros_like_sd(sd: dict) -> dict:
    return {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride()) if isinstance(v, DTensor) else torch.zeros_like(v))
            for k, v in sd.items()}


def check(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        x, y = (x.to_local(), y.to_local()) if isinstance(x, DTensor) else (x, y)
        if not torch.equal(x, y):
            raise SystemExit(f"mismatch in {k}")


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    return el.item()


def _proc(field: str, file: str = "status") -> int:
    with open(f"/proc/self/{file}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measured(fn: Callable[[], None]) -> tuple[float, int, float]:
    """(seconds max over ranks, this rank's rchar delta, this rank's peak RSS growth MiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss0, rchar0 = _proc("VmRSS"), _proc("rchar", "io")
    secs = timed(fn)
    return secs, _proc("rchar", "io") - rchar0, (_proc("VmHWM") - rss0) / 1024


def drop_caches() -> bool:
    """Drop the page cache (root only); every rank waits for it."""
    ok = torch.tensor([1], dtype=torch.int32)
    if dist.get_rank() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
        except OSError:
            ok[0] = 0
    dist.broadcast(ok, 0)
    return bool(ok.item())


def settle() -> None:
    """Write back every dirty page first (rank 0; every rank waits), so no timed save pays for the
    writeback of the one before it."""
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


def durable_write(path: str, nbytes: int) -> None:
    """A plain sequential write of ``nbytes`` in 16 MiB requests and one fdatasync: what the disk
    allows for the bytes a save writes (the bound the save is measured against)."""
    buf = memoryview(bytearray(b"\x5a" * min(nbytes, 16 << 20)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[:min(left, len(buf))])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def warm(path: str) -> None:
    """Flush pending writeback and read every file of ``path`` into the page cache (rank 0), so a
    "warm" case is warm for ours and the peer alike: the cold loads above dropped the cache and
    the saves left gigabytes of writeback competing with reads."""
    if dist.get_rank() == 0:
        os.sync()
        for dirpath, _, names in os.walk(path):
            for n in names:
                with open(os.path.join(dirpath, n), "rb") as f:
                    while f.read(64 << 20):
                        pass
    dist.barrier()


class Results:
    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}
        self.read: dict[str, list[int]] = {}
        self.rss: dict[str, list[float]] = {}

    def add(self, name: str, secs: float, rchar: int, rss: float) -> None:
        both = [torch.tensor([rchar, rss], dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(both, torch.tensor([rchar, rss], dtype=torch.float64))
        self.t.setdefault(name, []).append(secs)
        self.read.setdefault(name, []).append(max(int(b[0]) for b in both))
        self.rss.setdefault(name, []).append(max(float(b[1]) for b in both))

    def med(self, name: str) -> float:
        return statistics.median(self.t[name])

    def cell(self, name: str) -> str:
        xs = self.t[name]
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def run_case(res: Results, name: str, fn: Callable[[], None]) -> None:
    res.add(name, *measured(fn))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0, help="scales the big tensors' rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=2, help="the second torch DCP thread_count tried")
    ap.add_argument("--out", default=None, help="write the markdown table here (rank 0)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="run the cold-load cases: drop the machine's page cache before each (root; affects "
                         "every process on the machine)")
    ap.add_argument("--reshard-rows", action="store_true", help="run the reshard matrix (see the module doc)")
    ap.add_argument("--saves-only", action="store_true", help="only the sharded and replicated saves and the bound")
    ap.add_argument("--replicated-first", action="store_true",
                    help="time the replicated layout before the sharded one (what runs second inherits the disk's "
                         "state after the first: compare both orders)")
    ap.add_argument("--matrix-mib", type=int, default=128, help="state size per reshard-matrix case, MiB")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.reshard_rows:
        reshard_rows(args)
        dist.destroy_process_group()
        return
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(ws)))
    solo = dist.new_group([0])  # rank 0 alone: the world-size-1 side of the 2->1 and 1->2 reshards
    base = os.path.join(args.dir or tempfile.gettempdir(), f"hpdcp-vs-dcp-{os.environ.get('MASTER_PORT', '0')}")
    res = Results()
    cold_ok = True
    peers = {"dcp1": 1, f"dcp{args.dcp_threads}": args.dcp_threads}

    def dcp_save(sd, path, tc, group=None):
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(path, thread_count=tc), process_group=group)

    def dcp_load(sd, path, group=None):
        tdcp.load(sd, storage_reader=tdcp.FileSystemReader(path), process_group=group)

    for rep in range(args.reps):
        root = f"{base}/rep{rep}"
        for layout in ("replicated", "sharded") if args.replicated_first else ("sharded", "replicated"):
            sd = workload(args.scale, layout, mesh)
            paths = {"ours": f"{root}/{layout}-ours", **{p: f"{root}/{layout}-{p}" for p in peers}}
            order = ["ours", *peers] if rep % 2 == 0 else [*peers, "ours"]
            for who in order:
                settle()
                run_case(res, f"{layout} save|{who}", (lambda: dcp.save(sd, checkpoint_id=paths["ours"])) if who == "ours"
                         else (lambda w=who: dcp_save(sd, paths[w], peers[w])))
            # the disk's bound for the same bytes: each rank writes what our save wrote on it
            mine = sum(os.path.getsize(os.path.join(paths["ours"], n)) for n in os.listdir(paths["ours"])
                       if n.startswith(f"rank{rank:05d}"))
            settle()
            run_case(res, f"{layout} save|durable write bound", lambda: durable_write(f"{root}/bound-{rank}", mine))
            os.unlink(f"{root}/bound-{rank}")
            for temp in () if args.saves_only else ("warm", "cold") if args.drop_caches else ("warm",):
                for who in order:
                    if temp == "cold":
                        cold_ok = drop_caches() and cold_ok
                    tgt = zeros_like_sd(sd)
                    run_case(res, f"{layout} load {temp}|{who}",
                             (lambda: dcp.load(tgt, checkpoint_id=paths["ours"])) if who == "ours"
                             else (lambda w=who: dcp_load(tgt, paths[w])))
                    check(sd, tgt)
            del sd
        if args.saves_only:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()
            continue
        # reshards, warm: 2->1 and S0->S1 read the sharded checkpoints saved above.
        full = workload(args.scale, "replicated", None)
        if rank == 0:  # 1-rank side: plain tensors saved by rank 0 alone (for 1->2)
            dcp.save(full, checkpoint_id=f"{root}/solo-ours", process_group=solo)
            dcp_save(full, f"{root}/solo-dcp", 1, solo)
        dist.barrier()
        for who in ("ours", "dcp"):
            src = f"{root}/sharded-ours" if who == "ours" else f"{root}/sharded-dcp1"
            tgt = zeros_like_sd(full)

            def to_one(w=who, s=src, t=tgt):
                if rank == 0:
                    (dcp.load(t, checkpoint_id=s, process_group=solo) if w == "ours" else dcp_load(t, s, solo))

            warm(src)
            run_case(res, f"reshard 2->1|{who}", to_one)
            if rank == 0:
                check(full, tgt)
            tgt = zeros_like_sd(workload(args.scale, "sharded", mesh))
            s1 = f"{root}/solo-ours" if who == "ours" else f"{root}/solo-dcp"
            warm(s1)
            run_case(res, f"reshard 1->2|{who}", (lambda t=tgt, s=s1: dcp.load(t, checkpoint_id=s)) if who == "ours"
                     else (lambda t=tgt, s=s1: dcp_load(t, s)))
            check(workload(args.scale, "sharded", mesh), tgt)
            ref1 = workload(args.scale, "sharded", mesh, dim=1)
            tgt = zeros_like_sd(ref1)
            warm(src)
            run_case(res, f"reshard S0->S1|{who}", (lambda t=tgt: dcp.load(t, checkpoint_id=src)) if who == "ours"
                     else (lambda t=tgt: dcp_load(t, src)))
            check(ref1, tgt)
            # the same unverified with exact reads: only the kept 8 KiB row segments, one request each
            tgt = zeros_like_sd(ref1)
            run_case(res, f"reshard S0->S1, unverified exact reads|{who}",
                     (lambda t=tgt: dcp.load(t, storage_reader=dcp.FileSystemReader(src, verify_checksums=False,
                                                                                  read_gap_bytes=0)))
                     if who == "ours" else (lambda t=tgt: dcp_load(t, src)))
            check(ref1, tgt)
        del full
        # small tensors only: per-item cost
        small = workload(args.scale, "sharded", mesh, small_only=True)
        for who in ("ours", "dcp"):
            p = f"{root}/small-{who}"
            run_case(res, f"small save|{who}", (lambda: dcp.save(small, checkpoint_id=p)) if who == "ours"
                     else (lambda: dcp_save(small, p, 1)))
            tgt = zeros_like_sd(small)
            run_case(res, f"small load warm|{who}", (lambda: dcp.load(tgt, checkpoint_id=p)) if who == "ours"
                     else (lambda: dcp_load(tgt, p)))
            check(small, tgt)
        n_small = len(small)
        del small
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        text = report(res, args, ws, cold_ok, 0 if args.saves_only else n_small, list(peers))
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


WIDTHS = [(torch.bfloat16, 1024), (torch.bfloat16, 2048), (torch.float32, 1024), (torch.float32, 2048)]


def matrices(dtype: torch.dtype, width: int, total: int) -> dict:
    """``4W x W`` matrices (a transformer's MLP-like shape), deterministic, ``total`` bytes."""
    one = 4 * width * width * torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(width)
    return {f"layers.{i}.w": torch.randn(4 * width, width, generator=g).to(dtype) for i in range(max(1, total // one))}


def evict(path: str) -> None:
    """Evict ``path``'s files from the page cache (rank 0 after a sync; every rank waits)."""
    if dist.get_rank() == 0:
        os.sync()
        for dirpath, _, names in os.walk(path):
            for n in names:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


def reshard_rows(args) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    base = os.path.join(args.dir or tempfile.gettempdir(), f"hpdcp-reshard-{os.environ.get('MASTER_PORT', '0')}")
    meshes = {2: DeviceMesh("cpu", [0, 1])}
    if ws >= 4:
        meshes[4] = DeviceMesh("cpu", [0, 1, 2, 3])
        meshes["2x2"] = DeviceMesh("cpu", [[0, 1], [2, 3]])
    # (name, source mesh, target mesh, target placements)
    cases = [("S0->S1 @2", 2, 2, [Shard(1)])]
    if ws >= 4:
        cases += [("S0->S1 @4", 4, 4, [Shard(1)]), ("FSDP->FSDPxTP @4", 4, "2x2", [Shard(0), Shard(1)]),
                  ("4->2 S0->S1", 4, 2, [Shard(1)]), ("2->4 S0->S1", 2, 4, [Shard(1)])]
    res = Results()
    kept: dict[str, int] = {}
    # the read cost model is measured once per process (~60 ms): not part of any one load
    from hpdcp_runner.dcp.storage.vectored import measured_cost_model
    model = measured_cost_model()
    if rank == 0:
        print(f"read cost model: {model.call_s * 1e6:.2f} us per request, {model.bytes_per_s / 1e9:.2f} GB/s -> "
              f"gaps up to {model.gap_bytes} bytes read through", flush=True)

    def place(full: dict, mesh_key, placements) -> dict | None:
        mesh = meshes[mesh_key]
        if mesh.get_coordinate() is None:
            return None
        return {k: distribute_tensor(v, mesh, placements, src_data_rank=None) for k, v in full.items()}

    def group(mesh_key):
        return dist.group.WORLD if mesh_key == "2x2" else meshes[mesh_key].get_group()

    for dtype, width in WIDTHS:
        full = matrices(dtype, width, args.matrix_mib << 20)
        tag = f"{str(dtype).split('.')[-1]} W={width}"
        for name, src, dst, placements in cases:
            root = f"{base}/{tag.replace(' ', '_').replace('=', '')}-{name.replace(' ', '_').replace('>', '')}"
            sd = place(full, src, [Shard(0)])
            if sd is not None:
                dcp.save(sd, checkpoint_id=f"{root}-ours", process_group=group(src))
                tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(f"{root}-dcp"), process_group=group(src))
            del sd
            dist.barrier()
            case = f"{tag} {name}"
            for rep in range(args.reps):
                for temp in ("warm", "cold"):
                    order = ["ours", "ours unverified", "dcp"]
                    for who in order if rep % 2 == 0 else order[::-1]:
                        path = f"{root}-dcp" if who == "dcp" else f"{root}-ours"
                        tgt = place({k: torch.zeros_like(v) for k, v in full.items()}, dst, placements)
                        (warm if temp == "warm" else evict)(path)

                        def run(t=tgt, w=who, p=path):
                            if t is None:
                                return
                            if w == "dcp":
                                tdcp.load(t, storage_reader=tdcp.FileSystemReader(p), process_group=group(dst))
                            else:
                                reader = dcp.FileSystemReader(p, verify_checksums=w == "ours")
                                dcp.load(t, storage_reader=reader, process_group=group(dst))
                        res.add(f"{case} {temp}|{who}", *measured(run))
                        if tgt is not None:
                            for k, v in tgt.items():
                                ref = distribute_tensor(full[k], v.device_mesh, v.placements, src_data_rank=None)
                                if not torch.equal(v.to_local(), ref.to_local()):
                                    raise SystemExit(f"{case} {who}: mismatch in {k}")
                            mine = sum(v.to_local().numel() * v.to_local().element_size() for v in tgt.values())
                        else:
                            mine = 0
                        k_all = torch.tensor([mine], dtype=torch.int64)
                        dist.all_reduce(k_all, op=dist.ReduceOp.MAX)
                        kept[case] = int(k_all.item())
                        del tgt
            dist.barrier()
            if rank == 0:
                shutil.rmtree(f"{root}-ours", ignore_errors=True)
                shutil.rmtree(f"{root}-dcp", ignore_errors=True)
        del full
    if rank == 0:
        text = reshard_report(res, kept, args, ws)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        shutil.rmtree(base, ignore_errors=True)


def reshard_report(res: Results, kept: dict[str, int], args, ws: int) -> str:
    lines = ["# Reshard rows: hpdcp_runner.dcp vs torch.distributed.checkpoint", "",
             f"Command: `OMP_NUM_THREADS=1 torchrun --nproc-per-node={ws} scripts/bench_vs_torch_dcp.py --reshard-rows "
             f"--reps {args.reps} --matrix-mib {args.matrix_mib}`", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, torch "
             f"{torch.__version__}, gloo on CPU, local disk. {args.matrix_mib} MiB of 4W x W matrices per case. Seconds: "
             "median (min-max) over repetitions, max over ranks. Ratio = torch DCP median / ours. Read/kept = max "
             "rchar per rank / max bytes kept per rank. RSS+ = peak RSS growth per rank.", "",
             "| case | ours (verified), s | ratio | read/kept | ours unverified, s | ratio | read/kept | torch DCP, s | "
             "read/kept DCP | RSS+ ours / unverified / DCP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cases = list(dict.fromkeys(k.split("|")[0] for k in res.t))
    for case in cases:
        kb = kept[case.rsplit(" ", 1)[0]]
        o, u, d = f"{case}|ours", f"{case}|ours unverified", f"{case}|dcp"

        def rk(x):
            return f"{statistics.median(res.read[x]) / kb:.2f}x"
        lines.append(f"| {case} | {res.cell(o)} | **{res.med(d) / res.med(o):.2f}x** | {rk(o)} | {res.cell(u)} | "
                     f"**{res.med(d) / res.med(u):.2f}x** | {rk(u)} | {res.cell(d)} | {rk(d)} | "
                     f"{statistics.median(res.rss[o]):.0f} / {statistics.median(res.rss[u]):.0f} / "
                     f"{statistics.median(res.rss[d]):.0f} MiB |")
    return "\n".join(lines)


def report(res: Results, args, ws: int, cold_ok: bool, n_small: int, peers: list[str]) -> str:
    local = 1.008 * args.scale  # GiB, approximately, of the full state
    lines = ["# Benchmarks: hpdcp_runner.dcp vs torch.distributed.checkpoint", "",
             f"Command: `OMP_NUM_THREADS=1 torchrun --nproc-per-node={ws} scripts/bench_vs_torch_dcp.py "
             f"--reps {args.reps}{f' --scale {args.scale}' if args.scale != 1 else ''}"
             f"{' --drop-caches' if args.drop_caches else ''} --out docs/benchmarks.md`", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, Python "
             f"{platform.python_version()}, torch {torch.__version__}, gloo on CPU, {ws} ranks, local disk; "
             f"state {local:.3f} GiB (15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 fp32). Cold loads: "
             + (f"{'page cache dropped before each' if cold_ok else 'page cache could NOT be dropped (not root): cold = warm'}."
              if args.drop_caches else "not run (pass --drop-caches to drop the page cache before each cold load)."),
             "", "Seconds: median (min-max) over repetitions, max over ranks. Ratio = best torch DCP median / ours "
             "(> 1: we are faster). Read = max over ranks of rchar per rank. RSS+ = max peak RSS growth per rank.", "",
             "| case | ours, s | torch DCP tc=1, s | torch DCP best, s | ratio | read/rank ours | read/rank DCP | RSS+ ours | RSS+ DCP |",
             "|---|---|---|---|---|---|---|---|---|"]
    cases = sorted({k.split("|")[0] for k in res.t}, key=lambda c: list(res.t).index(f"{c}|ours"))
    for case in cases:
        ps = [p for p in peers if f"{case}|{p}" in res.t] or ["dcp"]
        best = min(ps, key=lambda p: res.med(f"{case}|{p}"))
        o, b = f"{case}|ours", f"{case}|{best}"
        first = f"{case}|{ps[0]}"
        lines.append(f"| {case} | {res.cell(o)} | {res.cell(first)} | {res.cell(b)} ({best}) | "
                     f"**{res.med(b) / res.med(o):.2f}x** | {_gib(res.read[o])} | {_gib(res.read[b])} | "
                     f"{statistics.median(res.rss[o]):.0f} MiB | {statistics.median(res.rss[b]):.0f} MiB |")
    lines.append("")
    for layout in ("sharded", "replicated"):
        b, o = f"{layout} save|durable write bound", f"{layout} save|ours"
        if b in res.t:
            per_rep = [bt / ot for bt, ot in zip(res.t[b], res.t[o])]
            best = min((p for p in peers if f"{layout} save|{p}" in res.t), key=lambda p: res.med(f"{layout} save|{p}"))
            per_peer = [pt / ot for pt, ot in zip(res.t[f"{layout} save|{best}"], res.t[o])]
            lines.append(f"- {layout} save: the disk's durable write of the same bytes per rank (sequential writes + "
                         f"fdatasync) {res.cell(b)} s; ours reaches **{100 * res.med(b) / res.med(o):.0f}%** of it "
                         f"(per repetition {min(per_rep):.0%}-{max(per_rep):.0%}), vs torch DCP best "
                         f"{min(per_peer):.2f}x-{max(per_peer):.2f}x per repetition")
    if "small save|ours" not in res.t:
        return "\n".join(lines)
    so, ss = res.med("small save|ours"), res.med("small save|dcp")
    lo, ls = res.med("small load warm|ours"), res.med("small load warm|dcp")
    lines += ["", f"Per small tensor ({n_small} items): save ours {1e3 * so / n_small:.3f} ms vs DCP "
              f"{1e3 * ss / n_small:.3f} ms; load ours {1e3 * lo / n_small:.3f} ms vs DCP {1e3 * ls / n_small:.3f} ms."]
    return "\n".join(lines)


def _gib(xs: list[int]) -> str:
    return f"{statistics.median(xs) / 2**30:.2f} GiB"


if __name__ == "__main__":
    main()
