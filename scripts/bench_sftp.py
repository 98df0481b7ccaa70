"""Checkpoints on an SFTP server: ours vs torch DCP's fsspec path (fsspec's ``sftp``, paramiko), side
by side in one run, against the same loopback OpenSSH server, with the client's own bound measured
in the same run (paramiko's ``putfo``/``getfo`` of the same bytes as one file: one stream, nothing
checked, nothing committed).

    OMP_NUM_THREADS=1 python scripts/bench_sftp.py --mib 256 --reps 3

One process (a user's save from one rank; the server is this machine's sshd, started with keys of
its own by ``tests/sftp_server.py``). Cases per repetition, in alternating order: save and load.
Every load is checked tensor by tensor. Printed: versions, medians with min-max, ratios
(torch DCP / ours: > 1 we are faster), and the bound.
"""

from __future__ import annotations

import argparse
import importlib.metadata as im
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = max(1, mib // 8)  # 8 large tensors + 64 small ones
    rows = big * (1 << 20) // (4 * 1024)
    sd = {f"layers.{i}.w": torch.randn(rows, 1024, generator=g) for i in range(8)}
    sd.update({f"norms.{i}": torch.randn(1024, generator=g) for i in range(64)})
    return sd


def _zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _check(got: dict, want: dict, who: str) -> None:
    for k, v in want.items():
        if not torch.equal(got[k], v):
            raise SystemExit(f"{who}: {k} differs after the load")


def _first_error(e: BaseException) -> str:
    """The innermost cause's one line (torch DCP wraps a rank's error in CheckpointException)."""
    text = str(e)
    for line in text.splitlines():
        if line and not line.startswith((" ", "Traceback", "CheckpointException")):
            text = line
    return f"{type(e).__name__}: {text.strip()[:200]}"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size, MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dcp-threads", type=int, default=2, help="torch DCP's thread_count")
    args = ap.parse_args()

    import paramiko
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from hpdcp_runner import dcp
    from tests import emulators, sftp_server

    why = sftp_server.unavailable()
    if why:
        raise SystemExit(why)
    endpoint, proc = sftp_server.start()
    os.environ.update(sftp_server.env(endpoint))
    host, port = endpoint.split(":")
    sshd = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    print(f"torch {torch.__version__}, paramiko {im.version('paramiko')}, fsspec {im.version('fsspec')}, "
          f"server: sshd ({sshd}) on loopback; one process; state {args.mib} MiB fp32")
    root = tempfile.mkdtemp(prefix="hpdcp-bench-sftp-")
    sd = _state(args.mib)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    ssh = dict(port=int(port), username=os.environ["SFTP_USER"], key_filename=os.environ["SFTP_KEY_FILE"])
    times: dict[str, list[float]] = {k: [] for k in ("ours save", "ours load", "dcp save", "dcp load",
                                                     "bound put", "bound get")}
    try:
        client = paramiko.SSHClient()
        client.load_host_keys(os.environ["SFTP_KNOWN_HOSTS"])
        client.connect(host, **ssh)
        sftp = client.open_sftp()
        blob = b"".join(v.numpy().tobytes() for v in sd.values())
        failed: list[str] = []
        for rep in range(args.reps):
            ours, peer = f"sftp://{endpoint}{root}/ours{rep}", f"sftp://{endpoint}{root}/dcp{rep}"

            def run_ours() -> None:
                times["ours save"].append(_timed(lambda: dcp.save(sd, checkpoint_id=ours)))
                got = _zeros(sd)
                times["ours load"].append(_timed(lambda: dcp.load(got, checkpoint_id=ours)))
                _check(got, sd, "ours")

            def run_dcp() -> None:
                w = FsspecWriter(peer, thread_count=args.dcp_threads, **ssh)
                times["dcp save"].append(_timed(lambda: tdcp.save(sd, storage_writer=w)))
                got = _zeros(sd)
                r = FsspecReader(peer, **ssh)
                times["dcp load"].append(_timed(lambda: tdcp.load(got, storage_reader=r)))
                _check(got, sd, "torch DCP")

            for run in ((run_ours, run_dcp) if rep % 2 == 0 else (run_dcp, run_ours)):
                if run is run_dcp and failed:
                    continue
                try:
                    run()
                except (Exception, CheckpointException) as e:  # the peer as it is: a row with its error (torch DCP's is a BaseException)
                    if run is run_ours:
                        raise
                    failed.append(_first_error(e))
            path = f"{root}/bound{rep}"
            times["bound put"].append(_timed(lambda: sftp.putfo(io.BytesIO(blob), path)))
            sink = io.BytesIO()
            times["bound get"].append(_timed(lambda: sftp.getfo(path, sink)))
        client.close()
    finally:
        emulators.stop(proc)
        shutil.rmtree(root, ignore_errors=True)
    if failed:
        print(f"\ntorch DCP's fsspec path on sftp:// failed: {failed[0]}")
    med = {k: statistics.median(v) for k, v in times.items() if v}
    peer = (lambda case: f"{_fmt(times['dcp ' + case])}" if times["dcp " + case] else f"failed ({failed[0][:60]}...)")
    ratio = (lambda case: f"**{med['dcp ' + case] / med['ours ' + case]:.2f}x**" if times["dcp " + case] else "-")
    print(f"\n| case | ours, s | torch DCP fsspec sftp (tc={args.dcp_threads}), s | ratio | paramiko one stream, s | "
          f"ours / bound |")
    print("|---|---|---|---|---|---|")
    for case, bound in (("save", "bound put"), ("load", "bound get")):
        print(f"| {case} {nbytes / 2**20:.0f} MiB | {_fmt(times['ours ' + case])} | {peer(case)} | {ratio(case)} | "
              f"{_fmt(times[bound])} | {med['ours ' + case] / med[bound]:.2f} |")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # (seen once: the interpreter's exit waiting on a paramiko transport thread past the run)
