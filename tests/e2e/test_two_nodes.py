"""Two torchrun agents on one machine (--nnodes=2): replicated shards cross "nodes", so the
auto broadcast mode reads each once and broadcasts it (node identity from torchrun's node rank)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import _env, metrics
from tests.multiproc.harness import free_port


def _load_on_two_nodes(tmp_path, ck, layout: str) -> dict:
    """``+job=load`` of ``ck``'s step 0 by two agents of one rank each; its metrics."""
    port = free_port()
    run = tmp_path / "load"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "hpdcp_runner",
               "+job=load", f"layout={layout}", f"checkpoint.path={ck}/step_0", "dcp.broadcast.mode=auto",
               f"hydra.run.dir={run}"]
        procs.append(subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    return metrics(run)


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_auto_mode_broadcasts_across_two_nodes(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", "layout=dp", f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path}/save"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = _load_on_two_nodes(tmp_path, ck, "dp")
    assert m["world_size"] == 2 and m["result"]["verified"] is True
    c0, c1 = (rec["counters"] for rec in m["ranks"])
    assert c0.get("load.broadcasts", 0) > 0 and c1.get("load.broadcasts", 0) > 0
    assert c0.get("load.bytes_received", 0) + c1.get("load.bytes_received", 0) > 0
    # each replicated byte was read once in total, not once per node
    tensor_read = sum(c["load.bytes_read"] - c.get("load.object_bytes_read", 0) for c in (c0, c1))
    received = sum(c.get("load.bytes_received", 0) for c in (c0, c1))
    assert tensor_read > 0 and received == tensor_read  # replicated everywhere: one read it, the other received


@pytest.mark.slow
def test_auto_mode_shares_column_split_reads_across_two_nodes(cli, tmp_path):
    """Saved under tp (column- and row-parallel weights), loaded under fsdp (rows) on two
    "nodes": each chunk both ranks need a part of is read once and its parts sent."""
    ck = tmp_path / "ck"
    r = cli(["+job=save", "layout=tp", f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path}/save"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = _load_on_two_nodes(tmp_path, ck, "fsdp")
    assert m["world_size"] == 2 and m["result"]["verified"] is True  # bitwise against the saved state
    c0, c1 = (rec["counters"] for rec in m["ranks"])
    assert c0.get("load.shared_reads", 0) > 0 and c1.get("load.shared_reads", 0) > 0
    assert c0.get("load.shared_bytes_sent", 0) + c1.get("load.shared_bytes_sent", 0) > 0
