"""Process faults: ranks SIGKILLed or hung under torchrun, ranks that disagree, two saves racing
for one name, crashes in the middle of a commit and of retention. Faults are armed in the child
processes through HPDCP_FAULTS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hpdcp_runner.dcp import ShapeMismatchError, save
from hpdcp_runner.dcp.offline.inspection import full_tensor_digests, verify
from hpdcp_runner.dcp.storage.retention import apply_retention, latest_checkpoint, list_checkpoints, series_extra
from tests.faults.conftest import loads_bitwise, state
from tests.multiproc.harness import run_ranks

SERIES = "step_{step}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(faults: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("HPDCP_RUN_STAMP", None)
    env.pop("HPDCP_FAULTS", None)
    if faults:
        env["HPDCP_FAULTS"] = faults
    return env


def _torchrun(args, tmp_path, faults=None, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "hpdcp_runner", *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(faults), cwd=str(tmp_path))
    return r, time.monotonic() - t0


def _python(code, faults=None, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=_env(faults), cwd=ROOT)


def _staging(root):
    return [n for n in os.listdir(root) if ".tmp-" in n]


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_rank_killed_mid_save_and_mid_load(tmp_path, fault_row):
    ck = tmp_path / "ck"
    base = ["layout=tp", f"checkpoint.dir={ck}", "checkpoint.name=step_1"]
    r, _ = _torchrun(["+job=save", *base, f"hydra.run.dir={tmp_path}/r0"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    before = full_tensor_digests(ck / "step_1")

    r, _ = _torchrun(["+job=save", *base, "checkpoint.overwrite=true", "model.seed=5", f"hydra.run.dir={tmp_path}/r1"],
                     tmp_path, faults="save.write@1:kill")
    # torchrun's summary names whichever rank it saw fail first (rank 1's SIGKILL or rank 0's
    # error about the lost peer), so only the outcome is asserted here.
    assert r.returncode != 0, r.stderr[-2000:]
    intact = full_tensor_digests(ck / "step_1") == before and verify(ck / "step_1").ok
    assert intact and latest_checkpoint(ck, SERIES) == str(ck / "step_1")
    fault_row("rank 1 SIGKILLed while writing (overwriting step_1), torchrun", "process faults",
              "job fails; nothing committed; the old checkpoint stays latest and verifies; staging is ignored",
              "SIGKILL (torchrun reports exit -9)", "rank", intact, None, None)

    r, secs = _torchrun(["+job=load", "layout=fsdp", f"checkpoint.path={ck}/step_1", "dcp.timeout_s=30",
                         f"hydra.run.dir={tmp_path}/r2"], tmp_path, faults="load.read@1:kill")
    assert r.returncode != 0 and secs < 120, (secs, r.stderr[-2000:])
    # Either rank 0 notices first (its collective fails at once: the peer's socket closed) or
    # torchrun, seeing rank 1 die, terminates it first: a race, but never a hang.
    reported = "[rank0]" in r.stderr and any(e in r.stderr for e in ("PeerLostError", "CollectiveTimeoutError",
                                                                       "DistributedError"))
    assert reported or "closing signal" in r.stderr, r.stderr[-2000:]
    fault_row("rank 1 SIGKILLed while reading, torchrun", "process faults",
              f"job ends in {secs:.0f} s, no hang: rank 0 raises (peer connection closed) unless torchrun "
              f"terminates it first; the checkpoint is untouched",
              "PeerLostError (a CollectiveTimeoutError) on rank 0", "rank", full_tensor_digests(ck / "step_1") == before, None, None)


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_hung_rank_times_out(tmp_path, fault_row):
    ck = tmp_path / "ck"
    r, _ = _torchrun(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_1", f"hydra.run.dir={tmp_path}/r0"],
                     tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    before = full_tensor_digests(ck / "step_1")
    r, secs = _torchrun(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_1", "checkpoint.overwrite=true",
                         "dcp.timeout_s=5", f"hydra.run.dir={tmp_path}/r1"], tmp_path, faults="save.write@1:hang")
    assert r.returncode != 0 and secs < 90, (secs, r.stderr[-2000:])
    assert "CollectiveTimeoutError" in r.stderr and "rank 0 of 2" in r.stderr
    intact = full_tensor_digests(ck / "step_1") == before
    assert intact
    fault_row("rank 1 hangs while writing (dcp.timeout_s=5), torchrun", "process faults",
              f"rank 0 raises after the timeout (job ended in {secs:.0f} s); nothing committed", "CollectiveTimeoutError",
              "rank", intact, None, None)


def _disagree(rank, ws, root):
    try:
        save({"w": torch.zeros(4 + rank, 2)}, checkpoint_id=f"{root}/bad", timeout=30)
    except ShapeMismatchError as e:
        return str(e)
    return None


def test_ranks_disagreeing_on_the_plan(tmp_path, fault_row):
    res = run_ranks(2, _disagree, str(tmp_path))
    for msg in res:
        assert msg and "'w'" in msg and "rank 0" in msg and "rank 1" in msg
    assert sorted(os.listdir(tmp_path)) == []
    fault_row("ranks disagree on a key's global shape", "process faults", "refused at planning on every rank",
              "ShapeMismatchError", "key and ranks", None, None, None)


def test_two_saves_racing_for_one_name(tmp_path, fault_row):
    target, ready = tmp_path / "step_7", tmp_path / "ready"
    slow = _python_async(f"""
        import time, torch
        from hpdcp_runner.dcp import faults, save
        faults.arm("save.commit", lambda **_: (open({str(ready)!r}, "w").close(), time.sleep(2)))
        save({{"w": torch.full((8,), 1.0)}}, checkpoint_id={str(target)!r})
    """)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:  # the slow save is paused before its commit
        time.sleep(0.05)
    save({"w": torch.full((8,), 2.0)}, checkpoint_id=target)
    out, err = slow.communicate(timeout=60)
    assert slow.returncode != 0 and str(target) in err and "appeared while this save was in progress" in err, err[-1500:]
    tgt = {"w": torch.zeros(8)}
    from hpdcp_runner.dcp import load

    load(tgt, checkpoint_id=target)
    intact = bool(torch.equal(tgt["w"], torch.full((8,), 2.0))) and verify(target).ok
    assert intact and not _staging(tmp_path)
    fault_row("two saves race for the same new name", "process faults",
              "the first commit wins; the other fails at its commit naming the path and removes its staging",
              err.strip().splitlines()[-1].split(":")[0].split(".")[-1], "file", intact, None, None)


def _python_async(code, faults=None):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(faults), cwd=ROOT)


def test_crash_mid_commit_and_mid_retention(tmp_path, fault_row):
    for k in (1, 2, 3):
        save(state(k), checkpoint_id=tmp_path / f"step_{k}", extra=series_extra(SERIES, k))
    r = _python(f"""
        from hpdcp_runner.dcp import save
        from hpdcp_runner.dcp.storage.retention import series_extra
        from tests.faults.conftest import state
        save(state(9), checkpoint_id={str(tmp_path / 'step_3')!r}, overwrite=True, extra=series_extra({SERIES!r}, 3))
    """, faults="commit.rename:kill")
    assert r.returncode == -9
    intact = loads_bitwise(tmp_path / "step_3", 3)
    assert intact and _names(tmp_path) == ["step_1", "step_2", "step_3"] and _staging(tmp_path)
    fault_row("process killed just before the commit renames (overwrite)", "process faults",
              "the old checkpoint stays under its name; the staging dir is ignored by discovery", "SIGKILL", None,
              intact, None, None)

    save(state(0), checkpoint_id=tmp_path / "init")  # another name in the directory: never retention's
    r = _python(f"""
        from hpdcp_runner.dcp.storage.retention import apply_retention
        apply_retention({str(tmp_path)!r}, 1, series={SERIES!r}, keep=["step_3"])
    """, faults="retention.delete:kill")
    assert r.returncode == -9
    trash = [n for n in os.listdir(tmp_path) if ".trash-" in n]
    listed = _names(tmp_path)
    intact = loads_bitwise(tmp_path / "step_3", 3) and loads_bitwise(tmp_path / "step_2", 2)
    assert trash and listed == ["step_2", "step_3"] and intact
    assert apply_retention(tmp_path, 1, series=SERIES, keep=["step_3"]) == ["step_2"]
    assert not [n for n in os.listdir(tmp_path) if ".trash-" in n] and _names(tmp_path) == ["step_3"]
    assert loads_bitwise(tmp_path / "step_3", 3) and loads_bitwise(tmp_path / "init", 0)
    fault_row("process killed in the middle of retention (after the rename to trash)", "process faults",
              "no half-deleted checkpoint under a real name; trash ignored, cleared by the next retention; "
              "the checkpoint just committed and other names untouched", "SIGKILL", None, intact, None, None)


def _names(root):
    return [e.name for e in list_checkpoints(root, SERIES)]
