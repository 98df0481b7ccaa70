"""What checkpointing costs a training loop: the train job run through the CLI (torchrun, ``--nproc`` ranks)
with no saves, sync saves, thread async, process async (each with the host copy in the background,
the default, and made before the save returns: "staged now"), process async into a fast tier
drained to a bucket (moto on loopback), and process async straight to the bucket.

    python scripts/bench_train_saves.py --reps 3

Per case and repetition, from the run's ``timeline.json`` (rank 0): the median step time of the
steps that ran beside a save or drain ("overlapped") and of the others, the loop's blocking time
per save (``async_save`` returning, or the whole sync save), the time from a save's start to its
commit (local, or the bucket's for the direct case) and, with tiers, to its commit in the bucket.
The first step and the first save are left out (warm-up: the persisting process, first
allocations). Reported: medians over repetitions with min-max, overlapped steps against the
no-save steps of the same repetition round, blocking against a sync save. The machine is shared
and noisy: read the ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["model.vocab=8192", "model.hidden=512", "model.layers=4", "model.ffn=2048", "model.heads=8",
         "model.seq_len=16", "job.units=2", "job.micro_batch=1"]
CASES = {
    "no saves": ["job.save_every=0"],
    "sync": ["job.async_save=false"],
    "thread async": ["dcp.async_mode=thread"],
    "thread async (staged now)": ["dcp.async_mode=thread", "dcp.async_staging=now"],
    "process async": ["dcp.async_mode=process"],
    "process async (staged now)": ["dcp.async_mode=process", "dcp.async_staging=now"],
    "tiers (local + bucket)": ["dcp.async_mode=process", "checkpoint.fast_tier.dir={fast}",
                               "checkpoint.dir={bucket}/tiered", "checkpoint.fast_tier.keep_last=2",
                               "checkpoint.keep_last=2"],
    "tiers (every 2nd drained)": ["dcp.async_mode=process", "checkpoint.fast_tier.dir={fast}",
                                 "checkpoint.dir={bucket}/tiered", "checkpoint.fast_tier.keep_last=2",
                                 "checkpoint.fast_tier.drain_every=2", "checkpoint.keep_last=2"],
    "direct to bucket": ["dcp.async_mode=process", "checkpoint.dir={bucket}/direct", "checkpoint.keep_last=2"],
}


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_case(name: str, extra: list[str], work: str, bucket: str | None, steps: int, every: int, nproc: int) -> dict:
    run = tempfile.mkdtemp(prefix="run-", dir=work)
    fast = os.path.join(run, "fast")
    args = [a.format(fast=fast, bucket=f"{bucket}/{os.path.basename(run)}") for a in extra]
    if not any(a.startswith("checkpoint.dir=") for a in args):
        args.append(f"checkpoint.dir={run}/ck")
    if not any(a.startswith("job.save_every=") for a in args):
        args.append(f"job.save_every={every}")
    if not any(a.startswith("checkpoint.keep_last=") for a in args):
        args.append("checkpoint.keep_last=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "-m", "hpdcp_runner", "+job=train",
           f"job.steps={steps}", f"hydra.run.dir={run}/out", "runtime.progress=false", *MODEL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(run, "out", "timeline.json")) as f:
        t = json.load(f)
    shutil.rmtree(run, ignore_errors=True)
    steps_ = [s for s in t["steps"] if s[0] > 1]
    first_save = t["saves"][0][0] if t["saves"] else None
    return {"overlapped": _med([s[1] for s in steps_ if s[2]]), "quiet": _med([s[1] for s in steps_ if not s[2]]),
            "all": _med([s[1] for s in steps_]), "n_overlapped": sum(1 for s in steps_ if s[2]),
            "blocking": _med([s[1] for s in t["saves"] if s[0] != first_save]),
            # the first save too: a persisting process still starting once stalled the loop here
            "first_blocking": t["saves"][0][1] if t["saves"] else float("nan"),
            "total_blocked": sum(s[1] for s in t["saves"]) if t["saves"] else float("nan"),
            "committed": _med([s[1] for s in t["committed"] if s[0] != first_save]),
            "durable": _med([d for n, d in t.get("durable", []) if d is not None and n != f"step_{first_save}"]),
            "wall": wall}


def _fmt(xs: list[float], digits: int = 3) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--nproc", type=int, default=1, help="training ranks (1 leaves a core of a 2-core machine for "
                                                         "the persisting work, as a GPU job leaves its CPUs)")
    a = ap.parse_args()
    import torch

    from tests import s3_server

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {a.nproc} rank(s); model "
          f"overrides: {' '.join(MODEL)}; {a.steps} steps, a save every {a.save_every}")
    os.environ.update(s3_server.CREDENTIALS)
    endpoint, server = s3_server.start()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    bucket = f"s3://{s3_server.new_bucket(endpoint)}"
    work = tempfile.mkdtemp(prefix="bench-train-")
    names = [n for n in CASES if n in a.cases.split(",")]
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rep in range(a.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no case always first
            for n in order:
                r = run_case(n, CASES[n], work, bucket, a.steps, a.save_every, a.nproc)
                results[n].append(r)
                print(f"rep {rep} {n}: {json.dumps({k: round(v, 4) for k, v in r.items()})}", flush=True)
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)
    base = results.get("no saves")
    sync = results.get("sync")
    print("\n| case | step, beside a save (s) | step, no save beside (s) | overlapped / no-saves run | "
          "blocking per save (s) | blocking / sync save | first save's blocking (s) | all saves' blocking (s) | "
          "save start -> commit (s) | -> in the bucket (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        rs = results[n]
        ratio = [r["overlapped"] / b["all"] for r, b in zip(rs, base)] if base and n != "no saves" else []
        block = [r["blocking"] / s["blocking"] for r, s in zip(rs, sync)] if sync and n not in ("no saves", "sync") \
            else []
        print(f"| {n} | {_fmt([r['overlapped'] for r in rs])} | {_fmt([r['quiet'] for r in rs])} | "
              f"{_fmt(ratio, 2)} | {_fmt([r['blocking'] for r in rs])} | {_fmt(block, 3)} | "
              f"{_fmt([r['first_blocking'] for r in rs])} | {_fmt([r['total_blocked'] for r in rs])} | "
              f"{_fmt([r['committed'] for r in rs])} | {_fmt([r['durable'] for r in rs])} |")


if __name__ == "__main__":
    main()
