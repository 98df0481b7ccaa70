"""Sweeps: our launcher (N torch workers per point), multirun inside torchrun, the report."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, metrics


def _tail(r):
    return f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-4000:]}"


BENCH = ["+job=bench", "job.repeats=1", "job.warmup=0"]


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_launcher_sweep_2x2_with_two_workers_per_point_and_report(cli, tmp_path):
    sweep = tmp_path / "sweep"
    r = cli(["-m", "hydra/launcher=hpdcp_torchrun", "hydra.launcher.nproc_per_node=2", *BENCH,
             "layout=dp", "dcp.broadcast.mode=always", "dcp.broadcast.batch_bytes=1KiB,64MiB",
             "dcp.broadcast.max_in_flight=1,4", f"hydra.sweep.dir={sweep}"], timeout=400)
    assert r.returncode == 0, _tail(r)
    points = sorted(p for p in os.listdir(sweep) if p.isdigit())
    assert points == ["0", "1", "2", "3"]
    for p in points:
        names = set(os.listdir(sweep / p))
        assert {".hydra", "hpdcp_rank0.log", "hpdcp_rank1.log", "metrics.json"} <= names, names
        m = metrics(sweep / p)
        assert m["world_size"] == 2 and m["result"]["objective"] > 0
    batch = {metrics(sweep / p)["engine"]["dcp.broadcast.batch_bytes"] for p in points}
    assert batch == {1024, 64 << 20}
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep_report.py"), str(sweep)],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    objectives = [float(r["objective"]) for r in rows]
    assert objectives == sorted(objectives)
    png = (sweep / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    # one repeat per point measures no spread: no best point is named from it, the lowest is shown
    assert "best: " not in rep.stdout and "no best point (no measured spread" in rep.stdout, rep.stdout
    assert "No best point named" in (sweep / "report.md").read_text()


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_world_size_sweep_and_a_failing_point_does_not_stop_the_sweep(cli, tmp_path):
    sweep = tmp_path / "sweep"
    r = cli(["-m", "hydra/launcher=hpdcp_torchrun", "runtime.nproc_per_node=1,2", "job.fail_on_rank=null,1",
             *BENCH, "dcp.timeout_s=15", "runtime.timeout_s=15", f"hydra.sweep.dir={sweep}"], timeout=400)
    assert r.returncode == 0, _tail(r)
    status = {}
    for p in sorted(q for q in os.listdir(sweep) if q.isdigit()):
        failed = (sweep / p / "FAILED").exists()
        ws = None if failed else metrics(sweep / p)["world_size"]
        status[p] = (failed, ws)
    # points: (1 worker, no fault) (1, fault on rank 1: there is none) (2, none) (2, fault on rank 1)
    assert status == {"0": (False, 1), "1": (False, 1), "2": (False, 2), "3": (True, None)}, status
    # the marker holds the job's own error, not torchrun's summary
    cause = (sweep / "3" / "FAILED").read_text()
    # rank 1 fails inside the job while rank 0 waits in the job's own collectives: rank 1 says why
    assert "[rank1] DistributedError: RuntimeError: injected failure on rank 1 (job.fail_on_rank)" in cause, cause
    assert "ChildFailedError" not in cause and "injected failure on rank 1" in r.stderr


def test_multirun_inside_torchrun(cli, tmp_path):
    sweep = tmp_path / "in"
    r = cli(["-m", *BENCH, "dcp.broadcast.max_in_flight=1,4,8", f"hydra.sweep.dir={sweep}"], nproc=2)
    assert r.returncode == 0, _tail(r)
    vals = [metrics(sweep / p)["engine"]["dcp.broadcast.max_in_flight"] for p in ("0", "1", "2")]
    assert vals == [1, 4, 8]
    for p in ("0", "1", "2"):
        assert (sweep / p / ".hydra").is_dir() and (sweep / p / "hpdcp_rank1.log").is_file()


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_point_failing_on_one_rank_fails_on_both_within_the_timeout(cli, tmp_path):
    # a hang would outlive the collective timeouts (15 s) plus start-up: cli() raises TimeoutExpired
    r = cli(["-m", *BENCH, "job.fail_on_rank=1", "dcp.timeout_s=15", "runtime.timeout_s=15",
             f"hydra.sweep.dir={tmp_path}/f"], nproc=2, timeout=15 + 105)
    assert r.returncode != 0, _tail(r)
    assert "[rank0] error: " in r.stderr, _tail(r)
    assert "[rank1] error: DistributedError: RuntimeError: injected failure on rank 1" in r.stderr, _tail(r)


def test_optuna_study_if_installed(cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "opt"
    r = cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.seed=7",
             "hydra/launcher=hpdcp_torchrun", "hydra.launcher.nproc_per_node=2", *BENCH,
             "dcp.broadcast.max_in_flight=range(1,9)", f"hydra.sweep.dir={sweep}"], timeout=600)
    assert r.returncode == 0, _tail(r)
    assert len([p for p in os.listdir(sweep) if p.isdigit()]) == 4
    assert (sweep / "optimization_results.yaml").is_file()


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_any_job_sweeps_with_the_launcher_and_reports(cli, tmp_path):
    """+job=load swept (it has no bench-style objective): every point records result.objective
    (its load seconds, objective_is says so), the launcher and the report finish; a named
    objective a point lacks is reported with the metrics it has, not a KeyError."""
    ck = tmp_path / "ck"
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=c", f"hydra.run.dir={tmp_path}/s"])
    assert r.returncode == 0, _tail(r)
    sweep = tmp_path / "sweep"
    r = cli(["-m", "hydra/launcher=hpdcp_torchrun", "hydra.launcher.nproc_per_node=1", "+job=load",
             f"checkpoint.path={ck}/c", "dcp.broadcast.mode=never,always", f"hydra.sweep.dir={sweep}"], timeout=400)
    assert r.returncode == 0 and "KeyError" not in r.stderr, _tail(r)
    for p in ("0", "1"):
        res = metrics(sweep / p)["result"]
        assert res["objective"] > 0 and res["objective_is"] == "summary.load.seconds_max"
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep_report.py"), str(sweep), "--no-plot"],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0 and "best: " not in rep.stdout, rep.stderr  # one sample per point
    missing = tmp_path / "missing"
    r = cli(["-m", "hydra/launcher=hpdcp_torchrun", "hydra.launcher.nproc_per_node=1", "+job=load",
             "hydra.launcher.objective=result.load_gbps", f"checkpoint.path={ck}/c", "dcp.broadcast.mode=never,always",
             f"hydra.sweep.dir={missing}"], timeout=400)
    assert r.returncode == 0 and "KeyError" not in r.stderr, _tail(r)
    note = (missing / "0" / "NO_OBJECTIVE").read_text()
    assert "result.load_gbps" in note and "summary.load.seconds_max" in note
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep_report.py"), str(missing), "--no-plot",
                          "--objective", "result.load_gbps"], capture_output=True, text=True, timeout=120)
    md = (missing / "report.md").read_text()
    assert "no objective" in md and "summary.load.seconds_max" in md, md
