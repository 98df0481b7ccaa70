"""+job=train end to end: checkpoint every 5 steps, SIGKILL a worker after step 12, resume from
the newest committed checkpoint (same world size, and 1 rank) and reproduce the losses bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from hpdcp_runner.dcp import save

from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

COMMON = ["+job=train", "job.steps=20", "job.save_every=5"]


@pytest.mark.slow  # the slow tier (CI runs it too): keeps the default run near 10 minutes
def test_train_kill_resume_reproduces_losses(cli, tmp_path):
    ref, ck, ck1 = tmp_path / "ref", tmp_path / "ck", tmp_path / "ck1"
    r = cli(COMMON + [f"hydra.run.dir={ref}", "checkpoint.keep_last=2", f"checkpoint.dir={tmp_path}/ref_ck"], nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(ref)["result"]
    assert m["start_step"] == 0 and m["final_step"] == 20 and m["save_mode"] == "async (thread)"
    assert m["checkpoints"] == ["step_15", "step_20"]  # keep_last=2 after every commit
    losses = json.loads((ref / "losses.json").read_text())["losses"]
    assert len(losses) == 20 and losses["20"] < losses["1"]  # it learns

    r = cli(COMMON + [f"hydra.run.dir={tmp_path}/killed", f"checkpoint.dir={ck}", "job.kill_after_step=12"], nproc=2)
    assert r.returncode != 0, _tail(r)
    committed = sorted(p.name for p in ck.iterdir())
    assert "step_10" in committed or "step_5" in committed, committed
    # Decoys that resume must never pick: an unfinished save, trash, a directory without metadata.
    (ck / ".step_15.tmp-deadbeef").mkdir()
    (ck / ".step_3.trash-0123").mkdir()
    (ck / "step_99").mkdir()
    # ... and committed checkpoints that are not of this series: other names, and one named like a
    # step but recording no series (another tool or an older version)
    for name in ("step_50", "best"):
        save({"w": torch.zeros(2)}, checkpoint_id=ck / name)

    r = cli(COMMON + [f"hydra.run.dir={tmp_path}/resumed", f"checkpoint.dir={ck}", "checkpoint.resume=latest",
                      f"job.compare_losses={ref}/losses.json"], nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "resumed")["result"]
    assert m["resumed_from"].rsplit("/", 1)[1] in ("step_10", "step_5"), m["resumed_from"]
    assert m["start_step"] in (10, 5) and m["final_step"] == 20 and m["rank_state"] == "restored"
    assert m["reproduced"] and m["bitwise"] and m["compared_steps"] == f"{m['start_step'] + 1}..20"

    # One process (no torchrun), another layout: per-rank RNG is reseeded by rule, losses still match.
    r = cli(COMMON + [f"hydra.run.dir={tmp_path}/one", f"checkpoint.dir={ck1}", f"checkpoint.resume={ck}/step_5",
                      "layout=tp", "job.async_save=false", f"job.compare_losses={ref}/losses.json"])
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "one")["result"]
    assert m["start_step"] == 5 and m["reproduced"] and m["bitwise"] and m["save_mode"] == "sync"
    assert m["checkpoints"] == ["step_10", "step_15", "step_20"]
    assert m["rank_state"] == "reseeded (saved by 2 ranks, resumed on 1)"
    assert "cannot be resharded to 1 ranks: reseeded" in r.stderr

    r = cli(COMMON + [f"hydra.run.dir={tmp_path}/refuse", f"checkpoint.dir={ck1}", f"checkpoint.resume={ck}/step_5",
                      "checkpoint.rank_state=error"])
    assert r.returncode == 1 and "saved by 2 ranks and this run has 1" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr


def test_train_config_errors(cli, tmp_path):
    r = cli(["+job=train", "layout=uneven", "model=peer", "checkpoint.rank_state=maybe", f"hydra.run.dir={tmp_path}/x"])
    assert r.returncode == 2
    for key in ("layout.kind", "model.kind", "checkpoint.rank_state"):
        assert key in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_staging_resumes_bitwise(cli, tmp_path, mode, monkeypatch):
    """dcp.async_staging=background: the copy runs beside the next step's forward and backward,
    the step waits for it before its optimizer update. Each copy is held back 0.5 s (the
    ``stage.copy`` fault point), longer than a step here: a copy that raced the update would
    save a state the losses after a resume cannot reproduce."""
    ck = tmp_path / "ck"
    run = ["+job=train", "job.steps=8", "job.save_every=2", "dcp.async_staging=background", f"dcp.async_mode={mode}",
           "dcp.persist_start_wait_s=60"]
    monkeypatch.setenv("HPDCP_FAULTS", "stage.copy:sleep=0.5")
    r = cli(run + [f"hydra.run.dir={tmp_path}/a", f"checkpoint.dir={ck}", "checkpoint.keep_last=0"], nproc=2)
    assert r.returncode == 0, _tail(r)
    monkeypatch.delenv("HPDCP_FAULTS")
    m = metrics(tmp_path / "a")
    assert m["engine"]["dcp.async_staging"] == "background"
    waits = [rk["phases_s"].get("train.staging_wait") for rk in m["ranks"]]
    assert all(w is not None and w > 0.3 for w in waits), m["ranks"]  # each step after a save waited there
    r = cli(run + [f"hydra.run.dir={tmp_path}/b", f"checkpoint.dir={tmp_path}/ck2", f"checkpoint.resume={ck}/step_4",
                   f"job.compare_losses={tmp_path}/a/losses.json"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "b")["result"]
    assert res["start_step"] == 4 and res["reproduced"] and res["bitwise"], res
