"""async_save and FQN-keyed optimizer state on real gloo groups."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import faults
from hpdcp_runner.dcp import (HpdcpError, async_save, get_optim_state_dict, load, save,
                              set_optim_state_dict, wait_for_async_saves)


def _mesh(ws):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(ws)))


def _async_cases(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict = {}
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    state = {"w": distribute_tensor(full.clone(), _mesh(ws), [Shard(0)]), "b": torch.full((5,), 2.0),
             "meta": {"step": 7, "tag": "x"}, "nested": [torch.ones(3), {"k": torch.zeros(2, dtype=torch.int64)}]}
    # The background writer is held at its write until the caller has mutated its state: the
    # save must persist what was staged, not what the tensors hold by then.
    gate = threading.Event()
    with faults.armed("save.write", lambda **_: gate.wait(60)):
        resp = async_save(state, checkpoint_id=f"{root}/a1", timeout=60)
        out["returned_before_done"] = not resp.done()
        with torch.no_grad():
            state["w"].to_local().add_(1000)
            state["b"].add_(1000)
            state["nested"][0].add_(1000)
        state["meta"]["step"] = 8
        gate.set()
        md = resp.result(timeout=60)
    out["staging_s"] = resp.staging_seconds
    out["tensors"] = sorted(md.tensors)
    tgt = {"w": torch.zeros(10, 3), "b": torch.zeros(5), "meta": {"step": 0, "tag": ""},
           "nested": [torch.zeros(3), {"k": torch.ones(2, dtype=torch.int64)}]}
    load(tgt, checkpoint_id=f"{root}/a1", timeout=60)
    out["staged_values"] = (torch.equal(tgt["w"], full) and torch.equal(tgt["b"], torch.full((5,), 2.0))
                            and torch.equal(tgt["nested"][0], torch.ones(3))
                            and torch.equal(tgt["nested"][1]["k"], torch.zeros(2, dtype=torch.int64)))
    out["meta"] = tgt["meta"]
    # Two async saves back to back: the second waits for the first; both commit.
    r1 = async_save({"v": torch.full((4,), 1.0)}, checkpoint_id=f"{root}/b1", timeout=60)
    r2 = async_save({"v": torch.full((4,), 2.0)}, checkpoint_id=f"{root}/b2", timeout=60)
    out["first_done_before_second_returned"] = r1.done()
    r2.result(timeout=60)
    v = {"v": torch.zeros(4)}
    load(v, checkpoint_id=f"{root}/b1", timeout=60)
    out["b1"] = v["v"].tolist()
    load(v, checkpoint_id=f"{root}/b2", timeout=60)
    out["b2"] = v["v"].tolist()

    # A failure in rank 1's background writer: result() raises it on every rank naming rank and
    # file, nothing is committed, and the previous checkpoint under that name still loads.
    def disk_full(rank, path, **_):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "rank00001.safetensors"))

    save({"v": torch.full((4,), 5.0)}, checkpoint_id=f"{root}/c", timeout=60)
    called = []
    with faults.armed("save.write", disk_full):
        resp = async_save({"v": torch.full((4,), 6.0)}, checkpoint_id=f"{root}/c", overwrite=True, timeout=60,
                          callback=called.append)
        try:
            resp.result(timeout=60)
            out["failure"] = None
        except HpdcpError as e:
            out["failure"] = f"{type(e).__name__}: {e}"
    out["callback_after_failure"] = bool(called)  # the retention hook must not run after a failed save
    load(v, checkpoint_id=f"{root}/c", timeout=60)
    out["old_c"] = v["v"].tolist()
    async_save({"v": torch.full((4,), 7.0)}, checkpoint_id=f"{root}/d", timeout=60).result(timeout=60)
    # A bug (not an OSError) on rank 0 while the background writer plans: agreed, fast, nothing committed.
    t0 = time.monotonic()
    with faults.armed("save.plan", lambda rank, **_: rank == 0 and faults.fail(RuntimeError("boom"))):
        resp = async_save({"v": torch.ones(4)}, checkpoint_id=f"{root}/e", timeout=60)
        exc = resp.exception()
    out["persist_fail"] = f"{type(exc).__name__}: {exc}"
    out["persist_fail_s"] = time.monotonic() - t0
    wait_for_async_saves()
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    return out


def test_async_save_stages_then_persists_and_reports_failures(tmp_path):
    res = run_ranks(2, _async_cases, str(tmp_path))
    for r in res:
        assert r["returned_before_done"]
        assert r["staged_values"], "the checkpoint must hold the values at async_save time, not the mutated ones"
        assert r["meta"] == {"step": 7, "tag": "x"}
        assert r["tensors"] == ["b", "nested.0", "nested.1.k", "w"]
        assert r["first_done_before_second_returned"]
        assert r["b1"] == [1.0] * 4 and r["b2"] == [2.0] * 4
        assert r["failure"] is not None and "rank 1" in r["failure"] and "rank00001.safetensors" in r["failure"]
        assert "No space left on device" in r["failure"]
        assert r["old_c"] == [5.0] * 4 and not r["callback_after_failure"]
        assert r["persist_fail"].startswith("DistributedError") and "rank 0: RuntimeError: boom" in r["persist_fail"]
        assert r["persist_fail_s"] < 30  # agreed at once, not discovered by a timeout
    # committed: a1 b1 b2 c d; e failed; no staging or trash directory is left behind
    assert res[0]["listing"] == ["a1", "b1", "b2", "c", "d"], res[0]["listing"]


# -- optimizer state --------------------------------------------------------------------------

def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))


def _shard(model: torch.nn.Module, layout: str, ws: int) -> torch.nn.Module:
    if layout == "plain" or ws == 1 and layout != "fsdp":
        return model
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(ws)
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
        return model
    placements = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}  # tp
    for name, p in list(model.named_parameters()):
        mod_name, pname = name.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        setattr(mod, pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placements[name]])))
    return model


def _full(v):
    """Full value as (dtype, nested list): exact for these dtypes, and safe to send between processes."""
    from torch.distributed.tensor import DTensor

    t = v.full_tensor() if isinstance(v, DTensor) else v
    return str(t.dtype), t.tolist()


def _train_and_save(rank: int, ws: int, path: str) -> dict:
    model = _shard(_net(), "fsdp", ws)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    osd = get_optim_state_dict(model, opt)
    save({"optim": osd}, checkpoint_id=path, timeout=60)
    return {fqn: {k: _full(v) for k, v in s.items()} for fqn, s in osd["state"].items()}


def _load_under(rank: int, ws: int, path: str, layout: str) -> dict:
    model = _shard(_net(), layout, ws)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    target = get_optim_state_dict(model, opt)  # zero-initialised, correctly shaped
    load({"optim": target}, checkpoint_id=path, timeout=60)
    set_optim_state_dict(model, opt, target)
    osd = get_optim_state_dict(model, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    placements = {names[id(p)]: str(getattr(p, "placements", "plain")) for p in model.parameters()}
    return {"state": {fqn: {k: _full(v) for k, v in s.items()} for fqn, s in osd["state"].items()},
            "placements": placements, "lr": opt.param_groups[0]["lr"]}


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_optimizer_state_saved_under_fsdp_loads_under_tp_and_one_rank(tmp_path):
    path = str(tmp_path / "opt")
    ref = run_ranks(2, _train_and_save, path)[0]
    assert set(ref) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ref["0.weight"]["step"] == ("torch.float32", 3.0) and any(ref["0.weight"]["exp_avg"][1][0])
    for ws, layout in ((2, "tp"), (1, "plain")):
        got = run_ranks(ws, _load_under, path, layout)
        for r in got:
            if layout == "tp":
                assert r["placements"]["2.weight"] == "(Shard(dim=1),)", r["placements"]
            assert r["lr"] == 0.05
            for fqn, s in ref.items():
                for k, v in s.items():
                    assert r["state"][fqn][k] == v, (ws, layout, fqn, k)
