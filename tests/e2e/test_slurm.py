"""Beyond torchrun: tasks started by SLURM's srun, Hydra's submitit launcher (its local executor:
the same code path as on a cluster, on one machine), and restarts that resume by themselves.

srun is simulated by starting the job's tasks with the variables srun gives each task of a step
(no SLURM on this machine); everything else is the real thing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpdcp_runner.dcp import read_metadata
from hpdcp_runner.runtime import first_host, scheduler_env
from tests.e2e.conftest import _env, metrics


def _rank_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("rank") and n.endswith(".safetensors"))


def test_scheduler_variables_to_a_rank():
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "4",
            "SLURM_STEP_NODELIST": "gpu[012-015]"}
    env = scheduler_env(step)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "2"
    assert env["MASTER_ADDR"] == "gpu012" and env["LOCAL_WORLD_SIZE"] == "2" and env["HPDCP_RUN_STAMP"] == "slurm-77.3"
    assert scheduler_env(dict(step, SLURM_PROCID="0"))["MASTER_PORT"] == env["MASTER_PORT"]  # every task alike
    assert scheduler_env(dict(step, RANK="0")) is None  # torchrun under srun: torchrun's variables win
    assert scheduler_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # a batch script, not an srun task
    assert first_host("rack[1-2]-n[08,10],login") == "rack1-n08" and first_host("a,b") == "a"


def _srun(tmp_path, args, ntasks=2, job="4242", **extra):
    """Start ``ntasks`` tasks of one simulated srun step; returns their CompletedProcess-like results."""
    procs = []
    for r in range(ntasks):
        env = dict(_env(), SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                   SLURM_NODEID="0", SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES="1",
                   SLURM_STEP_NODELIST="localhost")
        env.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-m", "hpdcp_runner", *args], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


def test_srun_tasks_are_the_ranks_of_one_job(tmp_path):
    out = _srun(tmp_path, ["+job=save", "layout=tp", "checkpoint.dir=ck", "checkpoint.name=s"])
    assert all(code == 0 for code, _, _ in out), out
    run_dir = tmp_path / "outputs" / "slurm-4242.0"  # one run directory, agreed with nothing exchanged
    m = metrics(run_dir)
    assert m["world_size"] == 2 and m["topology"]["launcher"] == "srun" and m["topology"]["nodes"] == 1
    assert sorted(os.listdir(run_dir)) == [".hydra", "hpdcp_rank0.log", "hpdcp_rank1.log", "metrics.json"]
    assert _rank_files(tmp_path / "ck" / "s") == ["rank00000.safetensors", "rank00001.safetensors"]
    # a task id that is not below the task count: one line naming the variables, exit 2
    bad = _srun(tmp_path, ["+job=save", "checkpoint.dir=ck", "checkpoint.name=t"], ntasks=1, job="9", SLURM_PROCID="3")
    code, _, err = bad[0]
    assert code == 2 and err.count("\n") == 1 and "SLURM_PROCID='3'" in err and "SLURM_STEP_NUM_TASKS='1'" in err, err
    assert not (tmp_path / "ck" / "t").exists()


def test_a_task_that_never_starts_is_one_line_after_the_timeout(tmp_path):
    # task 1 of 2 never starts: task 0 waits runtime.timeout_s, then says how many joined
    out = _srun(tmp_path, ["+job=save", "checkpoint.dir=ck", "runtime.timeout_s=3"], ntasks=1, job="31",
                SLURM_STEP_NUM_TASKS="2")
    code, _, err = out[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert code == 1 and len(lines) == 1 and "did not form a process group within runtime.timeout_s=3" in lines[0]
    assert "1/2 clients joined" in lines[0] and "Traceback" not in err, err[-2000:]
    assert "did not form" in (tmp_path / "outputs" / "slurm-31.0" / "FAILED").read_text()
    assert not (tmp_path / "ck").exists()


def _sweep(tmp_path, args):
    return subprocess.run([sys.executable, "-m", "hpdcp_runner", "-m", "hydra/launcher=hpdcp_submitit_local", *args],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_submitit_sweep_points_are_distributed_jobs(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")
    r = _sweep(tmp_path, ["hydra.sweep.dir=saves", "+job=save", "layout=tp", "checkpoint.dir=ck", "checkpoint.name=a,b"])
    assert r.returncode == 0, r.stderr[-3000:]
    for i, name in enumerate("ab"):  # each point: one job of 2 ranks, its own checkpoint
        m = metrics(tmp_path / "saves" / str(i))
        assert m["world_size"] == 2 and m["topology"]["launcher"] == "submitit"
        assert _rank_files(tmp_path / "ck" / name) == ["rank00000.safetensors", "rank00001.safetensors"]
        assert read_metadata(tmp_path / "ck" / name).world_size == 2
        assert (tmp_path / "saves" / str(i) / ".hydra").is_dir() and (tmp_path / "saves" / str(i) / "hpdcp_rank1.log").is_file()
    # a failing point: FAILED holds the error, the other point completes, the sweep ends normally
    # (rank 1 goes on into the bench while rank 0 fails: rank 0 hears of it no later than the
    # timeouts, kept short here)
    r = _sweep(tmp_path, ["hydra.sweep.dir=bench", "+job=bench", "job.repeats=1", "job.warmup=0",
                          "job.fail_on_rank=null,0", "runtime.timeout_s=20", "dcp.timeout_s=20"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sweep point #1" in r.stderr and "failed" in r.stderr
    assert "injected failure on rank 0" in (tmp_path / "bench" / "1" / "FAILED").read_text()
    assert metrics(tmp_path / "bench" / "0")["result"]["objective"] > 0
    rep = subprocess.run([sys.executable, "-m", "hpdcp_runner.sweep_report", str(tmp_path / "bench"), "--no-plot"],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0 and "failed" in rep.stdout and "injected failure" in rep.stdout, rep.stdout + rep.stderr


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_a_restart_after_a_killed_rank_resumes_bitwise(tmp_path):
    """torchrun --max-restarts=1 restarts the job after a rank is SIGKILLed at step 7;
    checkpoint.resume=latest continues from the newest committed checkpoint and the losses equal
    the uninterrupted run's bit for bit."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    job = ["-m", "hpdcp_runner", "+job=train", "job.steps=12", "job.save_every=3"]
    r = subprocess.run(base + job + [f"hydra.run.dir={tmp_path}/ref"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(base + ["--max-restarts=1"] + job + ["checkpoint.dir=ck", "checkpoint.resume=latest",
                                                            "job.kill_after_step=7", "job.compare_losses=ref/losses.json"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 2  # the killed attempt, and the restarted one
    res = metrics(runs[-1])["result"]
    # the newest committed checkpoint (step 6's async save may not have committed before the kill)
    assert res["resumed_from"].endswith(("step_3", "step_6")) and res["final_step"] == 12 and res["reproduced"], res
    assert json.loads((runs[-1] / "losses.json").read_text())["losses"]["12"] == \
        json.loads((tmp_path / "ref" / "losses.json").read_text())["losses"]["12"]
    assert not any(".tmp-" in n for n in os.listdir(tmp_path / "ck"))
