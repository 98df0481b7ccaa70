"""Faults of the saves that stay out of training's way (issue 39): a persisting process killed
while it writes (a real SIGKILL, armed through HPDCP_FAULTS in the persisting process only), and
a fast-tier checkpoint changed on disk after its commit, caught by the drain's verified copy.
Against real directories and the loopback S3 server; no mocks."""

from __future__ import annotations

import os

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp.background import process as persister
from hpdcp_runner.dcp.storage.uri import join


def _sd(v):
    return {"w": torch.full((64, 32), float(v)), "b": torch.arange(7, dtype=torch.bfloat16) + v, "step": int(v)}


def _loads_as(path, v):
    got = {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1}
    dcp.load(got, checkpoint_id=path)
    return got["step"] == v and torch.equal(got["w"], _sd(v)["w"]) and torch.equal(got["b"], _sd(v)["b"])


def _kind(place):
    return place.split("://")[0] if "://" in place else "local"


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ck")
    return join(request.getfixturevalue("s3_bucket"), "ck")


def test_a_persisting_process_killed_while_it_writes_publishes_nothing(place, monkeypatch, fault_row):
    dcp.save(_sd(1), checkpoint_id=place)
    persister.shutdown()
    monkeypatch.setenv("HPDCP_FAULTS", "persist.write:kill")  # read by the persisting process it starts
    try:
        assert dcp.start_async_persist("process", wait_s=120)  # the save goes to the process, not a thread
        response = dcp.async_save(_sd(2), checkpoint_id=place, overwrite=True, mode="process")
        with pytest.raises(dcp.PersistProcessError, match=r"persisting process \(pid \d+\) died \(killed by signal 9\)"
                                                          r" while writing rank 0's files"):
            response.result(timeout=120)
    finally:
        monkeypatch.delenv("HPDCP_FAULTS")
        persister.shutdown()
    assert _loads_as(place, 1)  # the overwrite never published
    if "://" not in place:
        assert sorted(os.listdir(os.path.dirname(place))) == ["ck"]  # no staging left beside it
    dcp.async_save(_sd(3), checkpoint_id=place, overwrite=True, mode="process").result(timeout=120)
    persister.shutdown()
    assert _loads_as(place, 3)  # the next save starts a fresh persisting process
    fault_row(
        f"async save (mode=process): the persisting process SIGKILLed while it writes ({_kind(place)})",
        "process failures",
        "the save fails on every rank naming the rank, the pid and the signal; nothing is published; the next "
        "save starts a fresh persisting process",
        "PersistProcessError",
        "rank",
        True,
        None,
        None)


def test_a_fast_tier_file_changed_after_its_commit_is_never_drained(tmp_path, place, fault_row):
    fast = tmp_path / "fast" / "step_2"
    dcp.save(_sd(1), checkpoint_id=place)
    dcp.save(_sd(2), checkpoint_id=fast)
    f = fast / "rank00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match="rank00000.safetensors: checksum .* differs from the .* "
                                                         "metadata.json records"):
        dcp.copy_checkpoint(fast, place, overwrite=True)
    assert _loads_as(place, 1)
    fault_row(
        f"drain of a fast tier: a rank file changed on disk after its commit ({_kind(place)} durable tier)",
        "tiers",
        "the copy recomputes every entry's digest as it reads; the mismatching file is never completed in the "
        "durable tier; nothing is published there; the durable tier's previous checkpoint is untouched",
        "CorruptCheckpointError",
        "file",
        True,
        None,
        None)


@pytest.mark.slow  # two 2-rank training runs (~40 s); the fault table runs the slow tier too
def test_a_fast_copy_failing_its_checksums_resumes_from_the_buckets_copy(tmp_path, s3_bucket, fault_row):
    """Item 11 of round 5: a fast-tier rank file with one byte flipped (same size) after its drain
    landed: ``resume=latest`` took the fast copy (sizes only), failed with CorruptCheckpointError
    and the job ended, although the bucket held a whole copy of that step; and
    ``fast_tier.keep_last=1`` ended a job with three checkpoints in the fast tier (those kept
    while they drained were never retired). Through the CLI under torchrun, 2 ranks."""
    import subprocess
    import sys

    from tests.e2e.conftest import _env, metrics

    fast, durable = tmp_path / "fast", f"{s3_bucket}/run"
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "hpdcp_runner", "+job=train",
            "job.save_every=5", f"checkpoint.fast_tier.dir={fast}", f"checkpoint.dir={durable}",
            "checkpoint.fast_tier.keep_last=1"]
    slow_drains = {**_env(), "HPDCP_FAULTS": "copy.file:sleep=0.5"}  # each drain outlives the next commits
    r = subprocess.run(base + ["job.steps=15", f"hydra.run.dir={tmp_path}/first"], capture_output=True, text=True,
                       timeout=300, env=slow_drains, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(tmp_path / "first")["result"]
    assert m["tiers"]["fast"] == ["step_15"], m["tiers"]  # keep_last=1 holds once every drain landed
    assert sorted(p.name for p in fast.iterdir() if not p.name.startswith(".")) == ["step_15"]
    assert "step_15" in m["tiers"]["durable"], m["tiers"]
    f = fast / "step_15" / "rank00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) - 5] ^= 0x01  # inside the last tensor's bytes, the size unchanged
    f.write_bytes(bytes(raw))
    r = subprocess.run(base + ["job.steps=20", "checkpoint.resume=latest", "checkpoint.overwrite=true",
                               f"hydra.run.dir={tmp_path}/resumed"], capture_output=True, text=True, timeout=300,
                       env=_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(tmp_path / "resumed")["result"]
    assert m["resumed_from"] == f"{durable}/step_15" and m["start_step"] == 15, m
    assert [s["path"] for s in m["resume_skipped"]] == [str(fast / "step_15")], m["resume_skipped"]
    assert "CorruptCheckpointError" in m["resume_skipped"][0]["error"]
    assert "rank00001.safetensors" in m["resume_skipped"][0]["error"]
    assert "failed while loading" in r.stderr and "trying the next newest whole copy" in r.stderr
    fault_row("fast tier: one byte flipped (same size) in a rank file of the newest step, drained before; "
              "resume=latest (2 ranks, CLI)", "tiers", "the fast copy fails its checksums on load, every rank agrees, "
              "the bucket's copy of the same step is resumed from, saying so; fast_tier.keep_last=1 leaves one",
              "CorruptCheckpointError", "file", True, None, None)
