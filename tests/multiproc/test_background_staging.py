"""async_save(staging="background"): the call returns before the state is copied, the copy runs
in the background thread, the caller changes its tensors only after ``wait_staged()``, and the
checkpoint holds the state as it was at the call. A copy that fails on one rank fails the save on
every rank and publishes nothing. Real gloo ranks; the ``stage.copy`` fault point holds or
breaks the copy."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import ConfigError, async_save, faults, load, start_async_persist


def _state(ws: int) -> tuple[dict, torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33)
    mesh = DeviceMesh("cpu", list(range(ws)))
    return {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "h": torch.arange(7, dtype=torch.bfloat16),
            "step": 3, "odd": torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, 1]}, full


def _check(root: str, name: str, full: torch.Tensor) -> bool:
    tgt = {"w": torch.zeros(64, 33), "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0,
           "odd": torch.zeros(3, dtype=torch.int16)}
    load(tgt, checkpoint_id=f"{root}/{name}", timeout=60)
    return (torch.equal(tgt["w"], full) and torch.equal(tgt["h"], torch.arange(7, dtype=torch.bfloat16))
            and tgt["step"] == 3 and torch.equal(tgt["odd"], torch.tensor([1, 5, 9], dtype=torch.int16)))


def _cases(rank: int, ws: int, root: str, mode: str) -> dict:
    out: dict = {}
    if mode == "process":
        assert start_async_persist("process", wait_s=120)
    state, full = _state(ws)
    gate = threading.Event()
    with faults.armed("stage.copy", lambda **_: gate.wait(60)):  # the copy waits until the test lets it
        resp = async_save(state, checkpoint_id=f"{root}/b1", timeout=60, mode=mode, staging="background",
                          cache_plan=True)
        out["returned_before_copy"] = not resp.wait_staged(timeout=0.2)
        state["step"] = 4  # a non-tensor value was copied at the call
        gate.set()
        out["staged"] = resp.wait_staged(timeout=60)
    with torch.no_grad():  # now the caller may change its tensors
        state["w"].to_local().add_(1000)
        state["h"].add_(5)
        state["odd"].add_(1)
    resp.result(timeout=120)
    out["copy_seconds"] = resp.copy_seconds is not None and resp.mode == mode
    out["values"] = _check(root, "b1", full)

    # a copy that fails on rank 1: both ranks' result() raise it, nothing is published
    state, full = _state(ws)
    boom = lambda rank, **_: rank == 1 and faults.fail(RuntimeError("device copy failed"))  # noqa: E731
    with faults.armed("stage.copy", boom):
        resp = async_save(state, checkpoint_id=f"{root}/b2", timeout=30, mode=mode, staging="background",
                          cache_plan=True)
        try:
            resp.result(timeout=120)
            out["failed"] = None
        except Exception as e:
            out["failed"] = f"{type(e).__name__}: {e}"
    out["b2_absent"] = not os.path.exists(f"{root}/b2")
    # the next save is whole again
    async_save(state, checkpoint_id=f"{root}/b3", timeout=60, mode=mode, staging="background",
               cache_plan=True).result(timeout=120)
    out["b3"] = _check(root, "b3", full)
    return out


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_staging(tmp_path, mode):
    out = run_ranks(2, _cases, str(tmp_path), mode, timeout=300)
    for r in out:
        assert r["returned_before_copy"] and r["staged"] and r["copy_seconds"], r
        assert r["values"] and r["b3"] and r["b2_absent"], r
        assert r["failed"] and "StateDictError" in r["failed"] and "device copy failed" in r["failed"], r
        assert "rank 1" in r["failed"], r


def test_staging_is_checked():
    with pytest.raises(ConfigError, match="staging"):
        async_save({"a": torch.zeros(2)}, checkpoint_id="/nonexistent/x", staging="later")
