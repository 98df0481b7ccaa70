"""A correct load exits cleanly (reliability round 3, item 7): saved at 4 ranks, loaded at 3 with
random shapes and placements, then ``dist.destroy_process_group()`` the way torch DCP users end a
script, with nothing of the engine's released first. Before the engine held its groups weakly,
one run in three to six aborted at exit ("terminate called without an active exception")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.multiproc.harness import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "clean_exit_script.py")


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # an abort prints every stack
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                           f"--master-port={free_port()}", SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _save_then_loads(tmp_path, loads: int) -> None:
    ck = str(tmp_path / "c")
    r = _torchrun(4, "save", ck)
    assert r.returncode == 0, r.stderr[-3000:]
    for i in range(loads):
        r = _torchrun(3, "load", ck, str(i))
        assert "terminate called" not in r.stderr, f"load {i}: a rank aborted at exit:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"load {i}:\n{r.stderr[-3000:]}"
        assert os.path.exists(os.path.join(ck, f"loaded_{i}"))  # the load itself ran and was bitwise


def test_a_load_at_3_ranks_of_a_4_rank_checkpoint_exits_0(tmp_path):
    _save_then_loads(tmp_path, 2)


@pytest.mark.slow
def test_many_loads_at_3_ranks_exit_0(tmp_path):
    _save_then_loads(tmp_path, 8)
