import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("HPDCP_RUN_STAMP", None)
    env.pop("HPDCP_LAUNCH_DIR", None)  # each launch resolves relative paths against its own cwd
    return env


@pytest.fixture
def cli(tmp_path):
    """Run the real CLI: cli(args, nproc=None) -> CompletedProcess; nproc uses torchrun."""

    def run(args, nproc=None, timeout=240, cwd=None):
        if nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "-m", "hpdcp_runner"]
        else:
            cmd = [sys.executable, "-m", "hpdcp_runner"]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=_env(),
                              cwd=cwd or str(tmp_path))

    return run


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.json")) as f:
        return json.load(f)
