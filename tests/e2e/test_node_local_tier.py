"""A node-local fast tier through the CLI on two real torchrun agents (``--nnodes=2``, rendezvous
on loopback): each agent runs in a directory of its own, so ``checkpoint.fast_tier.dir=fast`` is
the same path on both "nodes" and a different disk on each, as on a cluster. A node is lost by
SIGKILLing its agent and its ranks and deleting its directory; the restarted job resumes from
the newest step the survivors hold (their own part and the lost node's replica), bitwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import _env, metrics
from tests.multiproc.harness import free_port

pytestmark = pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier

FILES = 9  # of a 4-rank train checkpoint: 4 tensor files, 3 object files, the chunk index, metadata.json


def _agents(tmp_path, nproc, args, *, wait=True, timeout=240, durable=None):
    """Start the two agents (node 0 in tmp/a, node 1 in tmp/b, each in a session of its own);
    ``durable``: checkpoint.dir (default tmp/durable)."""
    port = free_port()
    procs = []
    for node, d in enumerate(("a", "b")):
        cwd = tmp_path / d
        cwd.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "hpdcp_runner",
               "+job=train", "checkpoint.fast_tier.dir=fast", "checkpoint.fast_tier.node_local=true",
               f"checkpoint.dir={durable or tmp_path / 'durable'}", "dcp.timeout_s=30", *args]
        log = open(tmp_path / f"{d}.log", "w")  # (a file, not a pipe: a long run never blocks on it)
        procs.append(subprocess.Popen(cmd, cwd=str(cwd), env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    if not wait:
        return procs
    for p in procs:
        p.wait(timeout=timeout)
    return [(p.returncode, (tmp_path / f"{d}.log").read_text()) for p, d in zip(procs, ("a", "b"))]


def _descendants(pid):
    """Every process below ``pid`` (torchrun's ranks run in process groups of their own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_node(proc):
    """SIGKILL an agent and every rank it started, at once (a node lost)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def _reference(tmp_path, steps):
    """The same training on one node of 4 ranks, never interrupted: its losses."""
    run = tmp_path / f"ref{steps}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "-m", "hpdcp_runner", "+job=train",
           f"job.steps={steps}", f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "losses.json"


def _ok(results):
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]


def _whole_steps(fast):
    """The steps of ``fast`` (one node's directory) that hold every file of the checkpoint."""
    out = []
    for name in os.listdir(fast) if os.path.isdir(fast) else []:
        d = os.path.join(fast, name)
        if name.startswith("step_") and os.path.isfile(os.path.join(d, "metadata.json")) and \
                len(os.listdir(d)) == FILES:
            out.append(int(name.split("_")[1]))
    return sorted(out)


def test_node_killed_resumes_from_the_peers_replica_bitwise(tmp_path):
    # node 1 dies mid-run (agent and ranks SIGKILLed) once node 0 holds a step with node 1's replica
    procs = _agents(tmp_path, 2, ["job.steps=100000", "job.save_every=3", "checkpoint.fast_tier.drain_every=1000",
                                  "hydra.run.dir=run"], wait=False)
    fast_a = tmp_path / "a" / "fast"
    deadline = time.monotonic() + 180
    while not [s for s in _whole_steps(fast_a) if s >= 9] and time.monotonic() < deadline:
        assert procs[0].poll() is None and procs[1].poll() is None, (tmp_path / "a.log").read_text()[-3000:]
        time.sleep(0.05)
    _kill_node(procs[1])
    procs[0].wait(timeout=120)
    assert procs[0].returncode != 0  # its peers are gone: the job fails, it does not hang
    shutil.rmtree(tmp_path / "b")  # the node's disk is lost with it
    survived = max(_whole_steps(fast_a))
    assert survived >= 9 and not [n for n in os.listdir(tmp_path / "durable") if n.startswith("step_")] \
        if (tmp_path / "durable").exists() else survived >= 9
    saved = tmp_path / "fast_after_loss"
    shutil.copytree(fast_a, saved)

    # both agents restarted, 2 nodes x 2 ranks: from the survivor's copy, node 1's part from its replica
    steps = survived + 3
    ref = _reference(tmp_path, steps)
    _ok(_agents(tmp_path, 2, [f"job.steps={steps}", "job.save_every=3", "checkpoint.resume=latest",
                              f"job.compare_losses={ref}", "hydra.run.dir=resumed"]))
    r = metrics(tmp_path / "a" / "resumed")["result"]
    assert r["start_step"] == survived and r["bitwise"] is True and r["resumed_from"].endswith(f"fast/step_{survived}")
    restored, (n0, n1) = r["node_tier"]["restored"], r["node_tier"]["nodes"]
    assert n0.endswith("#0") and n1.endswith("#1")  # the host and torchrun's node rank
    assert restored["checkpoint"] == f"step_{survived}"
    # node 0 reads its own copy; node 1 gets what its ranks read (and what every copy needs) from node 0's
    parts = restored["parts"]
    assert parts[n0] == {"local": FILES} and parts[n1]["local"] == 0
    assert parts[n1][f"from {n0}"] + parts[n1]["not needed"] == FILES and parts[n1]["not needed"] >= 2
    assert _whole_steps(tmp_path / "b" / "fast")  # the new node holds the checkpoint again (and the new saves)

    # the same loss, resumed on 2 nodes x 1 rank (another world size): resharded from the survivor's parts
    for gone in (tmp_path / "a" / "fast", tmp_path / "b", tmp_path / "durable"):  # (as they were after the loss)
        shutil.rmtree(gone, ignore_errors=True)
    shutil.copytree(saved, fast_a)
    _ok(_agents(tmp_path, 1, [f"job.steps={steps}", "job.save_every=3", "checkpoint.resume=latest",
                              f"job.compare_losses={ref}", "hydra.run.dir=resumed_ws2"]))
    r = metrics(tmp_path / "a" / "resumed_ws2")["result"]
    assert r["start_step"] == survived and r["bitwise"] is True
    assert r["rank_state"].startswith("reseeded (saved by 4 ranks, resumed on 2)")
    got = r["node_tier"]["restored"]["parts"][n1]
    assert got["local"] == 0 and got[f"from {n0}"] + got.get("not needed", 0) == FILES


@pytest.mark.parametrize("store", ["local", "s3"])
def test_both_copies_of_a_part_gone_fall_back_to_the_durable_tier(tmp_path, store, request):
    from hpdcp_runner.dcp.tools import remove_checkpoint

    durable = f"{request.getfixturevalue('s3_bucket')}/run" if store == "s3" else str(tmp_path / "durable")
    ref = _reference(tmp_path, 12)
    _ok(_agents(tmp_path, 2, ["job.steps=9", "job.save_every=3", "checkpoint.fast_tier.drain_every=1",
                              "hydra.run.dir=run"], durable=durable))
    m = metrics(tmp_path / "a" / "run")["result"]
    assert m["node_tier"]["replication"]["step_9"]["moved"]["files_received"] == 3  # node 1's files, on node 0
    assert sorted(m["tiers"]["durable"]) == ["step_3", "step_6", "step_9"]
    # node 1 lost, and node 0's replica of node 1's ranks lost too: those files exist only in the durable copy
    shutil.rmtree(tmp_path / "b" / "fast")
    for name in ("rank00002.safetensors", "rank00002.objects.json", "rank00003.safetensors"):
        os.unlink(tmp_path / "a" / "fast" / "step_9" / name)
    results = _agents(tmp_path, 2, ["job.steps=12", "job.save_every=3", "checkpoint.fast_tier.drain_every=1",
                                    "checkpoint.resume=latest", f"job.compare_losses={ref}", "hydra.run.dir=resumed"],
                      durable=durable)
    _ok(results)
    r = metrics(tmp_path / "a" / "resumed")["result"]
    n0, n1 = r["node_tier"]["nodes"]
    assert r["start_step"] == 9 and r["bitwise"] is True
    parts = r["node_tier"]["restored"]["parts"]
    # the 3 files of node 1's ranks are only in the bucket, and both nodes' ranks read from them:
    # each is read from the bucket once, by the lower node that needs it whole, and sent on to the
    # other. Node 0's ranks read only the few replicated chunks the save's dedup put in rank 2's
    # and 3's tensor files: those come in part (the ranges read)
    assert parts[n1]["local"] == 0 and parts[n0]["local"] == FILES - 3
    assert parts[n0].get("durable", 0) + parts[n1].get("durable", 0) == 3, parts
    assert parts[n0].get("durable", 0) + parts[n0].get(f"from {n1}", 0) == 3, parts
    assert parts[n1]["durable"] + parts[n1][f"from {n0}"] + parts[n1].get("not needed", 0) == FILES
    assert 1 <= parts[n0]["of them in part"] <= 2
    line = [ln for ln in results[0][1].splitlines() if "from the node-local tier" in ln]
    assert len(line) == 1 and f"{n0}: 6 local, " in line[0] and f"; {n1}: 0 local" in line[0]  # said in one line

    # no durable copy of the newest step and a part on no node: the next newest whole one, and the
    # broken step set aside (renamed, not deleted) so its next save is not in the way
    shutil.rmtree(tmp_path / "b" / "fast")
    remove_checkpoint(f"{durable}/step_12")
    for name in ("rank00002.safetensors", "rank00002.objects.json", "rank00003.safetensors"):
        os.unlink(tmp_path / "a" / "fast" / "step_12" / name)
    ref15 = _reference(tmp_path, 15)
    results = _agents(tmp_path, 2, ["job.steps=15", "job.save_every=3", "checkpoint.fast_tier.drain_every=1",
                                    "checkpoint.resume=latest", f"job.compare_losses={ref15}", "checkpoint.overwrite=true",
                                    "hydra.run.dir=resumed2"], durable=durable)
    _ok(results)
    r = metrics(tmp_path / "a" / "resumed2")["result"]
    assert r["start_step"] == 9 and r["bitwise"] is True and r["node_tier"]["set_aside"] == ["step_12"]
    assert "step_12 is not whole on the nodes" in results[0][1]
    assert [n for n in os.listdir(tmp_path / "a" / "fast") if n.startswith(".step_12.partial-")]


@pytest.mark.parametrize("args, says", [
    (["checkpoint.fast_tier.replicas=2"], "checkpoint.fast_tier.replicas=2: each node's part goes to that many other "
                                          "nodes, and this job has 2 node(s)"),
    (["checkpoint.fast_tier.node_local=false"], "checkpoint.fast_tier.dir=fast is not shared between the nodes: "),
    (["checkpoint.fast_tier.dir={tmp}/shared_fast"], "checkpoint.fast_tier.node_local=true, but "
                                                     "checkpoint.fast_tier.dir={tmp}/shared_fast is shared"),
])
def test_a_tier_declared_wrong_is_one_line_naming_the_key(tmp_path, args, says):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    results = _agents(tmp_path, 2, ["job.steps=3", "job.save_every=3", "hydra.run.dir=run", *args])
    assert all(rc != 0 for rc, _ in results)
    lines = [ln for ln in results[0][1].splitlines() if "error:" in ln]
    assert len(lines) == 1 and says.replace("{tmp}", str(tmp_path)) in lines[0], results[0][1][-3000:]
    assert not (tmp_path / "a" / "fast").exists() or not [n for n in os.listdir(tmp_path / "a" / "fast")
                                                          if n.startswith("step_")]
    json.dumps(results)  # (nothing else to check: nothing was saved)
