"""Ctrl-C and SIGTERM (a SLURM preemption, ``kill``) during a job: one line, ``FAILED`` saying
"interrupted", nothing staged left behind, exit 128+signal. The signal goes to the whole process
group, as a terminal's Ctrl-C does, and torchrun relays it to its workers once more."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hpdcp_runner.dcp import read_metadata
from tests.e2e.conftest import _env


def _staging(ck) -> list[str]:
    return sorted(n for n in os.listdir(ck) if ".tmp-" in n) if os.path.isdir(ck) else []


def _interrupt(tmp_path, args, sig, faults, *, torchrun=False, nproc=2):
    """Start the job in its own process group, wait until its save is staging, signal the group;
    returns (exit code, stderr lines, FAILED text)."""
    env = dict(_env(), HPDCP_FAULTS=faults)
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "-m", "hpdcp_runner"] \
        if torchrun else [sys.executable, "-m", "hpdcp_runner", f"--nproc-per-node={nproc}"]
    run_dir = tmp_path / "run"
    p = subprocess.Popen(launch + list(args) + [f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not _staging(tmp_path / "ck") and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert _staging(tmp_path / "ck"), "the save never started staging"
    time.sleep(0.5)
    os.killpg(p.pid, sig)
    out, err = p.communicate(timeout=120)
    failed = (run_dir / "FAILED").read_text() if (run_dir / "FAILED").exists() else ""
    return p.returncode, [ln for ln in err.splitlines() if ln.strip()], failed


@pytest.mark.slow  # the slow tier: keeps the default run near 10 minutes on 2 cores
def test_ctrl_c_during_a_save_is_one_line_and_leaves_nothing(tmp_path):
    # each tensor write sleeps: the signal lands while rank files are half written
    code, lines, failed = _interrupt(tmp_path, ["+job=save", "checkpoint.dir=ck", "checkpoint.name=s"],
                                     signal.SIGINT, "file.write:sleep=0.2")
    assert code == 130 and len(lines) == 1, lines
    assert "interrupted by SIGINT" in lines[0] and "Traceback" not in "".join(lines)
    assert "interrupted by SIGINT" in failed
    assert _staging(tmp_path / "ck") == [] and not (tmp_path / "ck" / "s").exists()

    # a save killed outright (SIGKILL: nothing of it runs) leaves its staging; the next save into
    # that directory removes it, with retention off (keep_last=0)
    env = dict(_env(), HPDCP_FAULTS="save.written@0:kill")
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "--nproc-per-node=2", "+job=save", "checkpoint.dir=ck",
                        "checkpoint.name=killed", f"hydra.run.dir={tmp_path}/k"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and len(_staging(tmp_path / "ck")) == 2  # the directory and its lock
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", "checkpoint.dir=ck", "checkpoint.name=next",
                        "checkpoint.keep_last=0", f"hydra.run.dir={tmp_path}/n"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _staging(tmp_path / "ck") == [] and sorted(os.listdir(tmp_path / "ck")) == ["next"]


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_sigterm_while_a_rank_waits_in_a_collective_through_torchrun(tmp_path):
    """Rank 0 is in the commit step while rank 1 waits for it inside a gloo collective (where a
    Python signal handler cannot run); bare torchrun relays the signal. The workers still say it
    in one line (torchrun's own agent prints its traceback; that is torchrun's), and the
    staging is gone."""
    code, lines, failed = _interrupt(tmp_path, ["+job=save", "checkpoint.dir=ck", "checkpoint.name=s"],
                                     signal.SIGTERM, "save.commit@0:sleep=5", torchrun=True)
    ours = [ln for ln in lines if "interrupted by" in ln]
    assert len(ours) == 1 and "SIGTERM" in ours[0] and not any("KeyboardInterrupt" in ln for ln in lines), lines
    assert not any(ln.startswith("[rank1]") for ln in lines), lines
    assert "interrupted by SIGTERM" in failed and _staging(tmp_path / "ck") == []


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_ctrl_c_while_an_async_save_persists_finishes_that_checkpoint(tmp_path):
    """The training loop is interrupted while step_2 persists in the background: that checkpoint
    is finished and committed (whole, loadable) before the job exits with one line."""
    code, lines, failed = _interrupt(tmp_path, ["+job=train", "job.steps=40", "job.save_every=2", "checkpoint.dir=ck"],
                                     signal.SIGINT, "file.write:sleep=0.1")
    ours = [ln for ln in lines if "error:" in ln]
    assert code == 130 and len(ours) == 1 and "finished first" in ours[0], lines
    assert _staging(tmp_path / "ck") == [] and os.listdir(tmp_path / "ck") == ["step_2"]
    assert read_metadata(tmp_path / "ck" / "step_2").tensors
