"""What the fixture writers (write_deepspeed_fixtures.py, write_megatron_fixtures.py) share: each
runs itself again under torchrun, on 2 gloo ranks, on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_self(script: str, args: list[str], env: dict, nproc: int = 2) -> None:
    """``script`` (the caller's own file) with ``args`` under torchrun; raises if it fails."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    f"--master-port={free_port()}", os.path.abspath(script), *args], check=True, env=env)
