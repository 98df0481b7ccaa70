"""The real CLI in subprocesses: torchrun with 2 gloo ranks, and single-process offline jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import _env, metrics


def _tail(r):
    return f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"


def test_bare_reshard_under_torchrun(cli, tmp_path):
    run = tmp_path / "run"
    r = cli(["+job=reshard", f"hydra.run.dir={run}", "dcp.storage.files_kept=3", "dcp.broadcast.batch_bytes=64MiB",
             "dcp.broadcast.mode=always", "layout=tp", "job.source.layout=fsdp"], nproc=2)
    assert r.returncode == 0, _tail(r)
    names = sorted(p.name for p in run.iterdir())
    assert names == [".hydra", "checkpoints", "hpdcp_rank0.log", "hpdcp_rank1.log", "metrics.json"], names
    m = metrics(run)
    assert m["world_size"] == 2 and m["result"]["verified_tensors"] > 0
    assert m["result"]["source_layout"] == "fsdp" and m["result"]["target_layout"] == "tp"
    assert m["engine"]["dcp.storage.files_kept"] == 3 and m["config"]["dcp"]["storage"]["files_kept"] == 3
    assert m["engine"]["dcp.broadcast.batch_bytes"] == 64 << 20 and m["engine"]["dcp.broadcast.mode"] == "always"
    # the fsdp->tp reshard has replicated norms: with mode=always someone received them by broadcast
    assert sum(rec["counters"].get("reshard.load.bytes_received", 0) for rec in m["ranks"]) > 0
    assert [rec["rank"] for rec in m["ranks"]] == [0, 1]
    assert all(rec["counters"]["reshard.load.bytes_read"] > 0 for rec in m["ranks"])
    assert "hpdcp reshard: world_size=2" in r.stdout and r.stdout.count("hpdcp reshard:") == 1


def test_save_load_inspect_verify_chain(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", "layout=tp", "model=mlp_adamw", f"checkpoint.dir={ck}", "checkpoint.name=step_1",
             f"hydra.run.dir={tmp_path}/r1"], nproc=2)
    assert r.returncode == 0, _tail(r)
    r = cli(["+job=load", "layout=uneven", "model=mlp_adamw", f"checkpoint.path={ck}/step_1",
             f"hydra.run.dir={tmp_path}/r2"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert metrics(tmp_path / "r2")["result"]["verified"] is True
    r = cli(["+job=inspect", f"checkpoint.path={ck}/step_1", "job.format=json", f"hydra.run.dir={tmp_path}/r3"])
    assert r.returncode == 0, _tail(r)
    desc = json.loads(r.stdout)  # stdout is JSON alone; the summary goes to stderr
    assert "hpdcp inspect:" in r.stderr
    assert desc["world_size"] == 2 and desc["state"] == "committed"
    assert "model.0.weight" in desc["tensors"] and "optim.param_groups" in desc["objects"]
    r = cli(["+job=verify", f"checkpoint.path={ck}/step_1", f"hydra.run.dir={tmp_path}/r4"])
    assert r.returncode == 0 and "OK:" in r.stdout, _tail(r)
    f = ck / "step_1" / "rank00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    r = cli(["+job=verify", f"checkpoint.path={ck}/step_1", f"hydra.run.dir={tmp_path}/r5"])
    assert r.returncode != 0 and "rank00001.safetensors" in r.stderr and "checksum" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr


def test_bench_job(cli, tmp_path):
    r = cli(["+job=bench", "job.repeats=2", "job.warmup=0", f"hydra.run.dir={tmp_path}/b"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "b")["result"]
    assert res["save"]["n"] == 2 and res["load"]["n"] == 2 and res["objective"] == res["load"]["median_s"]


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_bench_side_by_side_with_torch_dcp(cli, tmp_path):
    import pytest

    pytest.importorskip("numpy")  # torch.distributed.checkpoint needs it
    r = cli(["+job=bench", "job.peer=true", "job.repeats=1", "job.warmup=0", f"hydra.run.dir={tmp_path}/p"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "p")["result"]
    assert res["peer_save"]["n"] == 1 and res["peer_load"]["n"] == 1
    assert res["speedup_load_vs_torch_dcp"] == round(res["peer_load"]["median_s"] / res["load"]["median_s"], 3)
    # torch DCP would pickle our explicit shards as opaque objects: no comparison, one line
    r = cli(["+job=bench", "job.peer=true", "layout=uneven", "job.repeats=1", "job.warmup=0",
             f"hydra.run.dir={tmp_path}/u"], nproc=2)
    assert r.returncode != 0 and "job.peer: torch DCP cannot hold" in r.stderr and "FlatShard" in r.stderr, _tail(r)


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_config_errors_name_the_key_and_exit_nonzero(cli, tmp_path):
    r = cli(["+job=save", "dcp.storage.files_kep=3"])
    assert r.returncode != 0 and "dcp.storage.files_kep" in r.stderr, _tail(r)
    r = cli(["+job=save", "+dcp.storage.files_kep=3"])  # `+` bypasses struct mode: caught by our re-check
    assert r.returncode == 2 and "ConfigError" in r.stderr and "files_kep" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr
    r = cli(["+job=save", "dcp.storage.max_metadata_bytes=12XB", "layout=dp_tp", "dcp.planner.name=fastest"])
    assert r.returncode == 2, _tail(r)
    for key in ("dcp.storage.max_metadata_bytes", "layout.mesh", "dcp.planner.name"):
        assert key in r.stderr, (key, _tail(r))
    r = cli(["+job=save", "dcp.storage.files_kept=many"])
    assert r.returncode != 0 and "dcp.storage.files_kept" in r.stderr, _tail(r)


def test_no_job_lists_jobs_and_fails(cli):
    r = cli([])
    assert r.returncode == 2 and "+job=<name>" in r.stderr
    for job in ("save", "load", "reshard", "inspect", "verify", "bench"):
        assert job in r.stderr


def test_two_launches_in_the_same_second_get_distinct_run_dirs(tmp_path):
    cmd = [sys.executable, "-m", "hpdcp_runner", "+job=save"]
    procs = [subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read().decode()[-2000:]
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert (run / ".hydra").is_dir() and (run / "metrics.json").is_file()


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_save_retention_keeps_the_newest_of_its_series_only(cli, tmp_path):
    ck = tmp_path / "ck_ret"
    for i, name in enumerate(("step_100", "init", "x")):  # committed checkpoints, two of other names
        r = cli(["+job=save", f"checkpoint.dir={ck}", f"checkpoint.name={name}", f"hydra.run.dir={tmp_path}/p{i}"])
        assert r.returncode == 0, _tail(r)
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_5", "checkpoint.keep_last=2",
             f"hydra.run.dir={tmp_path}/r5"])
    assert r.returncode == 0, _tail(r)
    assert sorted(os.listdir(ck)) == ["init", "step_100", "step_5", "x"]  # other names untouched
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_6", "checkpoint.keep_last=1",
             f"hydra.run.dir={tmp_path}/r6"])
    assert r.returncode == 0, _tail(r)
    # step_100 is the newest by its recorded step; step_6 was just committed: both stay
    assert sorted(os.listdir(ck)) == ["init", "step_100", "step_6", "x"]
    m = metrics(tmp_path / "r6")["result"]
    assert m["removed_by_retention"] == ["step_5"] and m["series"] == "step_{step}" and m["step"] == 6
    # a series pattern with {step}: quoted for Hydra's override grammar
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name='run_{step}'", "checkpoint.step=3",
             f"hydra.run.dir={tmp_path}/r7"])
    assert r.returncode == 0 and (ck / "run_3" / "metadata.json").is_file(), _tail(r)
    # resume=latest picks the newest of the train job's series by recorded step: step_100, written
    # by the save job, holds no optimizer state: an error naming it, not a silent pick of another
    r = cli(["+job=train", "job.steps=2", f"checkpoint.dir={ck}", "checkpoint.resume=latest",
             f"hydra.run.dir={tmp_path}/t"])
    assert r.returncode != 0 and f"{ck}/step_100 does not fit this job's state" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr


