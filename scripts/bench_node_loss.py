"""The restore after a lost node (issue 51): from the node-local fast tier (the survivor's own
copy, the lost node's part from its replica, sent over the process group) against the same
restore from the durable tier alone (the bucket), side by side in one run, through the CLI.

    python scripts/bench_node_loss.py --reps 3
    python scripts/bench_node_loss.py --steps-bench --reps 2   # what the saves cost the loop

Two torchrun agents on loopback (``--nnodes=2``, 2 ranks each, each agent in a directory of its
own) train the ``+job=train`` model (``--hidden``/``--layers``/``--vocab``: by default ~68M
parameters, 260 MiB of weights, ~780 MiB with AdamW's moments) for one step and save it to a
node-local fast tier, replicated, drained to ``s3://`` on the loopback S3 server behind the proxy of
``scripts/bench_s3.py`` (``--latency-ms``, ``--conn-bandwidth``: a store's latency and per-connection
rate). Then node 1's directory is deleted and both agents restart with ``checkpoint.resume=latest``:

- ``fast tier``: node 0 reads its own copy; node 1 gets every file from node 0 (verified, written
  to its disk), then both load locally;
- ``durable only``: both nodes' fast tiers gone, the resume reads the bucket.

Each repetition runs both, in rotating order, from the same saved state (the fast tier copied
back, the bucket untouched). The time is the restore as the job reports it: ``train.restore`` of
``metrics.json`` (choosing the checkpoint, fetching what a node lacks, loading; the max over
ranks). Median, min-max, ratio.
"""

from __future__ import annotations

import argparse
import importlib.metadata as im
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


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument("--conn-bandwidth", default="50MB", help="per connection, as bench_s3.py")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--steps-bench", action="store_true",
                    help="instead: what saves into a replicated node-local tier cost the training loop")
    return ap.parse_args()


def _size(s: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(s[:-2]) * units[s[-2:].upper()] if s[-2:].upper() in units else float(s)


def _free_port() -> int:
    from tests.multiproc.harness import free_port

    return free_port()


def _agents(work: str, args: list[str], env: dict, nproc: int = 2) -> None:
    port = _free_port()
    procs = []
    for node in (0, 1):
        cwd = os.path.join(work, f"node{node}")
        os.makedirs(cwd, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "hpdcp_runner",
               "+job=train", *args]
        log = open(os.path.join(work, f"node{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    for node, p in enumerate(procs):
        if p.wait(timeout=1800) != 0:
            tail = open(os.path.join(work, f"node{node}.log")).read()[-3000:]
            raise SystemExit(f"node {node} failed:\n{tail}")


def _resume_seconds(run_dir: str) -> tuple[float, dict]:
    with open(os.path.join(run_dir, "metrics.json")) as f:
        m = json.load(f)
    return m["summary"]["train.restore"]["seconds_max"], m["result"]


STEP_MODEL = ["model.vocab=8192", "model.hidden=512", "model.layers=4", "model.ffn=2048", "model.heads=8",
              "model.seq_len=16", "job.units=2", "job.micro_batch=1"]  # (scripts/bench_train_saves.py's)
STEP_CASES = {
    "no saves": ["job.save_every=0"],
    "sync, node-local + replica": ["job.async_save=false"],
    "process async, node-local + replica": ["dcp.async_mode=process", "dcp.persist_start_wait_s=60"],
    "process async, background staging": ["dcp.async_mode=process", "dcp.persist_start_wait_s=60",
                                           "dcp.async_staging=background"],
    "process async, background staging, no replica": ["dcp.async_mode=process", "dcp.persist_start_wait_s=60",
                                                      "dcp.async_staging=background",
                                                      "checkpoint.fast_tier.replicas=0"],
}


def _steps_bench(a: argparse.Namespace, env: dict) -> None:
    """Two agents x 1 rank (a core left for the background work, as bench_train_saves.py's
    default), 25 steps, a save every 4 into a node-local tier replicated to the other node: the
    median step time beside a save or its replication against the no-save run's, and the loop's
    blocking per save against a sync save's. Medians over repetitions, min-max."""
    import statistics as st

    work = a.workdir or tempfile.mkdtemp(prefix="hpdcp-node-steps-")
    rows: dict[str, dict[str, list[float]]] = {c: {"steps": [], "beside": [], "blocking": []} for c in STEP_CASES}
    for rep in range(a.reps):
        for case in (list(STEP_CASES) if rep % 2 == 0 else list(reversed(STEP_CASES))):
            for node in (0, 1):
                shutil.rmtree(os.path.join(work, f"node{node}"), ignore_errors=True)
            run = "run"
            _agents(work, [*STEP_MODEL, *STEP_CASES[case], "job.steps=25", "checkpoint.fast_tier.dir=fast",
                           "checkpoint.fast_tier.node_local=true", "checkpoint.fast_tier.drain_every=1000",
                           f"checkpoint.dir={work}/durable", "runtime.progress=false", f"hydra.run.dir={run}"]
                    + ([] if "save_every=0" in STEP_CASES[case][0] else ["job.save_every=4"]), env, nproc=1)
            with open(os.path.join(work, "node0", run, "timeline.json")) as f:
                t = json.load(f)
            steps = [x for x in t["steps"] if x[0] > 1]
            rows[case]["steps"].append(st.median(x[1] for x in steps))
            beside = [x[1] for x in steps if x[2]]
            if beside:
                rows[case]["beside"].append(st.median(beside))
            saves = [x[1] for x in t["saves"][1:]]
            if saves:
                rows[case]["blocking"].append(st.median(saves))

    def fmt(xs: list[float]) -> str:
        return f"{st.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"

    base = st.median(rows["no saves"]["steps"])
    sync = st.median(rows["sync, node-local + replica"]["blocking"])
    print(f"# steps beside saves into a node-local tier with one replica: 2 agents x 1 rank, {' '.join(STEP_MODEL)}, "
          f"25 steps, a save every 4, {a.reps} repetitions")
    print("| case | step s (all) | step s beside a save/replication | vs no saves | blocking per save s | vs sync |")
    print("|---|---|---|---|---|---|")
    for case, r in rows.items():
        vs = f"{st.median(r['beside']) / base - 1:+.1%}" if r["beside"] else "-"
        blk = f"{st.median(r['blocking']) / sync:.0%}" if r["blocking"] else "-"
        print(f"| {case} | {fmt(r['steps'])} | {fmt(r['beside'])} | {vs} | {fmt(r['blocking'])} | {blk} |")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    a = _args()
    if a.steps_bench:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("HPDCP_LAUNCH_DIR", None)
        _steps_bench(a, env)
        return
    from tests import s3_server
    from tests.s3_proxy import Proxy

    work = a.workdir or tempfile.mkdtemp(prefix="hpdcp-node-loss-")
    endpoint, server = s3_server.start()
    proxy = Proxy(endpoint, latency_s=a.latency_ms / 1000, conn_bandwidth_bps=_size(a.conn_bandwidth))
    bucket = s3_server.new_bucket(endpoint)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", AWS_ENDPOINT_URL=proxy.endpoint,
               **s3_server.CREDENTIALS)
    env.pop("HPDCP_LAUNCH_DIR", None)
    model = [f"model.hidden={a.hidden}", f"model.layers={a.layers}", f"model.vocab={a.vocab}",
             f"model.ffn={4 * a.hidden}", "model.heads=8"]
    tier = ["checkpoint.fast_tier.dir=fast", "checkpoint.fast_tier.node_local=true",
            f"checkpoint.dir=s3://{bucket}/run", "job.save_every=1"]
    try:
        t0 = time.perf_counter()
        _agents(work, [*model, *tier, "job.steps=1", "hydra.run.dir=save"], env)
        saved = time.perf_counter() - t0
        fast0 = os.path.join(work, "node0", "fast")
        keep = os.path.join(work, "fast_saved")
        shutil.copytree(fast0, keep)
        nbytes = sum(os.path.getsize(os.path.join(keep, "step_1", n)) for n in os.listdir(os.path.join(keep, "step_1")))
        results: dict[str, list[float]] = {"fast tier": [], "durable only": []}
        where: dict = {}
        for rep in range(a.reps):
            order = list(results) if rep % 2 == 0 else list(reversed(results))
            for case in order:
                for node in (0, 1):
                    shutil.rmtree(os.path.join(work, f"node{node}", "fast"), ignore_errors=True)
                if case == "fast tier":  # node 0 as it was; node 1 lost with its disk
                    shutil.copytree(keep, fast0)
                subprocess.run(["sync"], check=False)
                run = f"resume_{rep}_{case.split()[0]}"
                _agents(work, [*model, *tier, "job.steps=1", "checkpoint.resume=latest", f"hydra.run.dir={run}"], env)
                secs, result = _resume_seconds(os.path.join(work, "node0", run))
                expect = "fast/step_1" if case == "fast tier" else f"s3://{bucket}/run/step_1"
                if not result["resumed_from"].endswith(expect):
                    raise SystemExit(f"{case}: resumed from {result['resumed_from']}, not {expect}")
                results[case].append(secs)
                if case == "fast tier":
                    where = result["node_tier"]["restored"]
        print(f"# restore after a lost node: 2 nodes x 2 ranks (torchrun agents on loopback), checkpoint "
              f"{nbytes / 2**20:.0f} MiB (weights + AdamW moments), S3 = moto {im.version('moto')} behind a proxy "
              f"({a.latency_ms:g} ms per request, {a.conn_bandwidth} per connection); torch {im.version('torch')}; "
              f"save (with replication and the drain) {saved:.1f} s")
        print(f"# fast-tier restore: {where}")
        print("| restore | median s | min-max s | durable / this |")
        print("|---|---|---|---|")
        dur = statistics.median(results["durable only"])
        for case, xs in results.items():
            med = statistics.median(xs)
            print(f"| {case} | {med:.2f} | {min(xs):.2f}-{max(xs):.2f} | {dur / med:.2f}x |")
    finally:
        proxy.close()
        if server is not None:
            server.terminate()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
