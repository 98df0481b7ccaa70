"""A DeepSpeed ZeRO-3 checkpoint to a Hugging Face model: ours (read in place) beside DeepSpeed's
own ``zero_to_fp32.py``, on the same files, side by side, with peak memory.

The checkpoint is written by DeepSpeed itself (in its own virtualenv, see
scripts/write_deepspeed_fixtures.py)::

    /tmp/dsvenv/bin/python scripts/write_deepspeed_fixtures.py --big --out /tmp/dsbig
    python scripts/bench_deepspeed_export.py --run /tmp/dsbig --ds-python /tmp/dsvenv/bin/python

Each tool runs as its own process, alternating (each first in turn), ``--repeats`` times after
one warm-up of each (the checkpoint's files are in the page cache for both: what is measured is
the work, not the first read from disk), after an ``os.sync()`` (untimed) so that no run pays
for the writeback of another's output. Timed: the whole command, start to exit. Peak memory: the process's
maximum resident set (``ru_maxrss`` of the child). Ours writes with fsync (a durable model);
``zero_to_fp32`` does not fsync, so the durable-write bound of this disk is printed beside.
Both outputs are compared tensor by tensor (bitwise) before any figure is printed.
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

_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
            "dt = time.perf_counter() - t; "
            "print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode); "
            "sys.stderr.write(r.stderr[-2000:] if r.returncode else '')")


def measure(cmd: list[str], env: dict) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one run of ``cmd`` in a fresh process."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env)
    seconds, rss_kib, code = r.stdout.split()
    if int(code) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    return float(seconds), int(rss_kib) / (1 << 20)


def durable_write_bound(directory: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` with one fsync on this disk (what a durable export cannot beat)."""
    path = os.path.join(directory, "bound.bin")
    block = os.urandom(16 << 20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block) + 1):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.unlink(path)
    return dt


def same_tensors(a: str, b: str) -> int:
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            raise SystemExit(f"the outputs hold different keys: {sorted(set(fa.keys()) ^ set(fb.keys()))[:5]}")
        for k in fa.keys():
            if not torch.equal(fa.get_tensor(k), fb.get_tensor(k)):
                raise SystemExit(f"the outputs differ at {k}")
        return len(list(fa.keys()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a DeepSpeed run directory (write_deepspeed_fixtures.py --big)")
    p.add_argument("--ds-python", required=True, help="the python of the virtualenv holding deepspeed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scratch", default=None, help="where outputs are written (default: a temporary directory)")
    a = p.parse_args()
    run = os.path.abspath(a.run)
    scratch = tempfile.mkdtemp(prefix="bench-ds-", dir=a.scratch)
    env = dict(os.environ, OMP_NUM_THREADS="1", CI="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    versions = subprocess.run([a.ds_python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                              capture_output=True, text=True, env=env).stdout.split()
    import torch

    import hpdcp_runner

    step = open(os.path.join(run, "latest")).read().strip()
    ckpt_bytes = sum(os.path.getsize(os.path.join(run, step, f)) for f in os.listdir(os.path.join(run, step)))
    print(f"deepspeed {versions[0]} (torch {versions[1]}), hpdcp_runner {getattr(hpdcp_runner, '__version__', '?')} "
          f"(torch {torch.__version__}); checkpoint {run}/{step}: {ckpt_bytes / 2**30:.2f} GiB on disk; "
          f"{os.cpu_count()} CPUs")

    def ours(verify: bool):
        def make(i: int) -> tuple[list[str], str]:
            out = os.path.join(scratch, f"ours_{verify}_{i}")
            return ([sys.executable, "-m", "hpdcp_runner", "+job=reshard", f"job.source.path={run}",
                     "job.output_format=hf", f"job.verify={str(verify).lower()}", f"job.hf_files_from={run}/reference",
                     f"job.output={out}", f"hydra.run.dir={scratch}/r_{verify}_{i}"],
                    os.path.join(out, "model.safetensors"))
        return make

    def theirs(i: int) -> tuple[list[str], str]:
        out = os.path.join(scratch, f"zero_to_fp32_{i}")
        return ([a.ds_python, os.path.join(run, "zero_to_fp32.py"), run, out, "--safe_serialization"],
                os.path.join(out, "model.safetensors"))

    # ours without the bitwise check of the output is the same work as zero_to_fp32's (which checks
    # nothing); the default re-reads both sides to prove the copy
    tools = {"ours (1 process, job.verify=false)": ours(False), "deepspeed zero_to_fp32.py": theirs,
             "ours (1 process, verified: the default)": ours(True)}
    times: dict[str, list[float]] = {k: [] for k in tools}
    peaks: dict[str, list[float]] = {k: [] for k in tools}
    outputs = {}
    names_ = list(tools)
    make_of = dict(tools)
    for i in range(a.repeats + 1):
        for name in names_[i % len(names_):] + names_[:i % len(names_)]:  # each tool first in turn
            cmd, out = make_of[name](i)
            # the disk drained first: zero_to_fp32 never fsyncs, so its output's dirty pages would
            # otherwise be written back during (and charged to) whichever run came next
            os.sync()
            dt, rss = measure(cmd, env)
            if not os.path.exists(out):
                raise SystemExit(f"{name} wrote no {out}")
            outputs[name] = out
            if i > 0:  # the first of each is the warm-up
                times[name].append(dt)
                peaks[name].append(rss)
        if i == 0:
            n = same_tensors(outputs[names_[0]], outputs[names_[1]])
            print(f"outputs bitwise equal: {n} tensors")
        for name in tools:
            d = os.path.dirname(outputs[name])
            if i < a.repeats:
                shutil.rmtree(d, ignore_errors=True)
    model_bytes = os.path.getsize(outputs[next(iter(tools))])
    bound = durable_write_bound(scratch, model_bytes)
    print(f"{'tool':42s} {'median s':>9s} {'min-max s':>14s} {'peak RSS GiB':>13s}")
    for name in tools:
        ts = times[name]
        print(f"{name:42s} {statistics.median(ts):9.2f} {min(ts):6.2f}-{max(ts):<7.2f} {max(peaks[name]):13.2f}")
    names = list(tools)
    ratio = statistics.median(times[names[1]]) / statistics.median(times[names[0]])
    print(f"ratio zero_to_fp32 / ours unverified (medians): {ratio:.2f}x; model written: {model_bytes / 2**30:.2f} GiB; "
          f"durable-write bound on this disk: {bound:.2f} s; a bare `python -m hpdcp_runner` start: "
          f"{measure([sys.executable, '-m', 'hpdcp_runner', '--help'], env)[0]:.2f} s")
    print(json.dumps({"times": times, "peak_rss_gib": peaks, "ratio": ratio, "bound_s": bound}))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
