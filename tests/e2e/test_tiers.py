"""+job=train with a fast tier drained to a bucket (``checkpoint.fast_tier``), through the real CLI
under torchrun against the loopback S3 server (moto): per-tier retention, copies verified and equal
to the fast tier's, a rank SIGKILLed while a drain runs, a fast-tier checkpoint missing a rank's
file, and a lost fast tier, each resumed by ``checkpoint.resume=latest`` bitwise."""

from __future__ import annotations

import os
import shutil

import pytest

from hpdcp_runner.dcp import tools
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

COMMON = ["+job=train", "job.steps=20", "job.save_every=5"]


def _tiered(fast, durable, *extra):
    return COMMON + [f"checkpoint.fast_tier.dir={fast}", f"checkpoint.dir={durable}", *extra]


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_a_fast_tier_drains_to_the_bucket_with_each_tiers_retention(cli, tmp_path, s3_bucket):
    fast, durable = tmp_path / "fast", f"{s3_bucket}/run"
    r = cli(_tiered(fast, durable, "checkpoint.fast_tier.keep_last=1", "checkpoint.fast_tier.drain_every=2",
                    "checkpoint.keep_last=2", "dcp.async_mode=process", f"hydra.run.dir={tmp_path}/run"), nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "run")["result"]
    assert m["save_mode"] == "async (process)"
    # every save in the fast tier (keeping 1); every 2nd drained (steps 10 and 20), the bucket keeping 2
    assert m["tiers"] == {"fast": ["step_20"], "durable": ["step_10", "step_20"]}
    assert sorted(m["drains"]) == ["step_10", "step_20"] and all(d["tier"] == "durable" for d in m["drains"].values())
    assert sorted(p.name for p in fast.iterdir()) == ["step_20"]  # nothing else left in the fast tier
    # the bucket's copy is whole, verifies, and holds the fast tier's tensors bit for bit
    assert tools.verify(f"{durable}/step_20").ok
    assert tools.full_tensor_digests(f"{durable}/step_20") == tools.full_tensor_digests(fast / "step_20")


@pytest.mark.slow  # the slow tier (CI runs it too); tests/multiproc/test_async_process.py covers it at engine level
def test_a_killed_persisting_process_fails_the_job_and_publishes_nothing(cli, tmp_path, monkeypatch):
    """Rank 1's persisting process is SIGKILLed as it writes step_5 (``persist.write`` armed in
    the persisting processes only): the job stops at its next save, every rank naming rank 1's
    persisting process, and step_5 was never published (nor any staging left)."""
    monkeypatch.setenv("HPDCP_FAULTS", "persist.write@1:kill")
    ck = tmp_path / "ck"
    r = cli(COMMON + ["dcp.async_mode=process", "dcp.persist_start_wait_s=120", f"checkpoint.dir={ck}",
                      f"hydra.run.dir={tmp_path}/run"], nproc=2)  # every save through the process: wait for it
    assert r.returncode != 0, _tail(r)
    assert "rank 1: the persisting process" in r.stderr and "killed by signal 9" in r.stderr, _tail(r)
    assert "error: PersistProcessError: save: write failed on 1 rank(s): rank 1: the persisting process" in r.stderr, \
        _tail(r)
    assert not ck.exists() or sorted(p.name for p in ck.iterdir()) == [], sorted(p.name for p in ck.iterdir())


def test_tier_config_errors(cli, tmp_path, s3_bucket):
    r = cli(["+job=train", f"checkpoint.fast_tier.dir={s3_bucket}/x", "checkpoint.fast_tier.drain_every=0",
             f"hydra.run.dir={tmp_path}/x"])
    assert r.returncode == 2
    assert "checkpoint.fast_tier.dir" in r.stderr and "not a local directory" in r.stderr, _tail(r)
    assert "checkpoint.fast_tier.drain_every" in r.stderr, _tail(r)
    r = cli(["+job=train", "checkpoint.fast_tier.dir=fast", "checkpoint.fast_tier.replicas=-1",
             f"hydra.run.dir={tmp_path}/y"])
    assert r.returncode == 2 and "checkpoint.fast_tier.replicas: must be >= 0, got -1" in r.stderr, _tail(r)
    # node-local on one node: nowhere to put a replica (replicas=0 would run)
    r = cli(["+job=train", "checkpoint.fast_tier.dir=fast", "checkpoint.fast_tier.node_local=true",
             "job.steps=1", f"hydra.run.dir={tmp_path}/z"])
    assert r.returncode == 2, _tail(r)
    assert "checkpoint.fast_tier.replicas=1: each node's part goes to that many other nodes, and this job has 1 " \
           "node(s)" in r.stderr, _tail(r)
    assert not (tmp_path / "fast").exists() or not os.listdir(tmp_path / "fast")


@pytest.mark.slow  # the slow tier (CI runs it too): four 2-rank training runs
def test_kill_during_a_drain_then_resume_from_the_newest_whole_copy_in_any_tier(cli, tmp_path, s3_bucket,
                                                                               monkeypatch):
    ref = tmp_path / "ref"
    r = cli(COMMON + [f"hydra.run.dir={ref}", f"checkpoint.dir={tmp_path}/ref_ck"], nproc=2)
    assert r.returncode == 0, _tail(r)
    fast, durable = tmp_path / "fast", f"{s3_bucket}/run"

    # Sync saves, every one drained; each copied file takes a second, so the drain of step_10 runs
    # when rank 1 is SIGKILLed after step 17 (step_15 is committed in the fast tier, and step_5 in
    # the bucket: a third save waits for the first drain).
    monkeypatch.setenv("HPDCP_FAULTS", "copy.file:sleep=1")
    r = cli(_tiered(fast, durable, "job.async_save=false", "checkpoint.fast_tier.keep_last=0",
                    "job.kill_after_step=17", f"hydra.run.dir={tmp_path}/killed"), nproc=2)
    monkeypatch.delenv("HPDCP_FAULTS")
    assert r.returncode != 0, _tail(r)
    assert sorted(p.name for p in fast.iterdir() if not p.name.startswith(".")) == ["step_10", "step_15", "step_5"]
    have = [e.name for e in tools.list_checkpoints(durable, "step_{step}")]
    assert "step_5" in have and "step_15" not in have, have

    # A node's fast tier lost a rank's file of the newest: resume takes the next newest whole copy.
    (fast / "step_15" / "rank00001.safetensors").unlink()
    r = cli(_tiered(fast, durable, "checkpoint.resume=latest", "checkpoint.overwrite=true",
                    "checkpoint.fast_tier.drain_every=100", f"job.compare_losses={ref}/losses.json",
                    f"hydra.run.dir={tmp_path}/partial"), nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "partial")["result"]
    assert m["resumed_from"] == str(fast / "step_10"), m["resumed_from"]
    assert "step_15 in the fast tier is not whole on every rank" in r.stderr and "rank00001.safetensors is missing" \
        in r.stderr, _tail(r)
    assert m["reproduced"] and m["bitwise"] and m["compared_steps"] == "11..20"

    # The whole fast tier is gone (a lost node): resume from the bucket, then each tier's retention.
    shutil.rmtree(fast)
    r = cli(_tiered(fast, durable, "checkpoint.resume=latest", "checkpoint.keep_last=2",
                    "checkpoint.fast_tier.keep_last=2", f"job.compare_losses={ref}/losses.json",
                    f"hydra.run.dir={tmp_path}/lost"), nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "lost")["result"]
    assert m["resumed_from"] in (f"{durable}/step_5", f"{durable}/step_10"), m["resumed_from"]
    assert m["reproduced"] and m["bitwise"]
    assert m["tiers"] == {"fast": ["step_15", "step_20"], "durable": ["step_15", "step_20"]}
    assert all(d["tier"] == "durable" for d in m["drains"].values())
