"""Issue "A new user's hour, round 3": the items fixed so far, each through the CLI where a user
meets it."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.e2e.conftest import _env


def test_output_to_a_closed_pipe_ends_quietly(tmp_path):
    """Item 4: ``python -m hpdcp_runner +job=inspect ... | head -3`` printed a BrokenPipeError
    traceback and ``error: DistributedError: BrokenPipeError``, exit 1. The reader leaving is not
    the job's failure: exit 0, nothing on stderr about it. (The listing is larger than a pipe's
    buffer, so the writer does meet the closed pipe.)"""
    from safetensors.torch import save_file

    src = tmp_path / "many"
    src.mkdir()
    save_file({f"model.layers.{i}.block.weight_with_a_long_name": torch.zeros(2) for i in range(3000)},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    p = subprocess.Popen([sys.executable, "-m", "hpdcp_runner", "+job=inspect", f"job.source.path={src}",
                          f"hydra.run.dir={tmp_path}/r"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(), cwd=str(tmp_path))
    first = p.stdout.readline()
    p.stdout.close()  # what `head -1` does
    err = p.stderr.read().decode()
    code = p.wait(timeout=240)
    assert first.startswith(b"checkpoint ") and code == 0, err[-3000:]
    assert "BrokenPipe" not in err and "error:" not in err, err[-3000:]
