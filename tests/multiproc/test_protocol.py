"""Multi-process behaviour of save/load on real gloo groups: dedup, failures, sub-meshes, bytes read."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import (CheckpointNotFoundError, CollectiveTimeoutError, FileSystemWriter, HpdcpError,
                              MinimumRankSavePlanner, ReplicaMismatchError, ShapeMismatchError, load, save)


def _raises(fn, exc_type):
    try:
        fn()
    except exc_type as e:
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__}")


class _FailOnRank1(FileSystemWriter):
    def write(self, tensors, objects):
        if self.rank == 1:
            raise OSError("injected write failure")
        return super().write(tensors, objects)


def _failures(rank: int, ws: int, root: str) -> dict:
    out = {}
    rep = {f"t{k}": torch.full((64,), float(k)) for k in range(4)}
    # Dedup: 4 equal replicated tensors on 2 ranks -> each rank writes 2; minimum_rank -> rank 0 writes all.
    md = save(rep, checkpoint_id=f"{root}/bal", timeout=30)
    out["bal_files"] = sorted({c.file for t in md.tensors.values() for c in t.chunks})
    md = save(rep, checkpoint_id=f"{root}/minr", planner=MinimumRankSavePlanner(), timeout=30)
    out["minr_files"] = sorted({c.file for t in md.tensors.values() for c in t.chunks})
    # An exception on rank 1 while writing: every rank gets it, nothing committed, old checkpoint intact.
    save({"w": torch.ones(8)}, checkpoint_id=f"{root}/keep", timeout=30)
    msg = _raises(lambda: save({"w": torch.zeros(8)}, storage_writer=_FailOnRank1(f"{root}/keep"),
                               overwrite=True, timeout=30), HpdcpError)
    out["write_fail"] = msg
    tgt = {"w": torch.zeros(8)}
    load(tgt, checkpoint_id=f"{root}/keep", timeout=30)
    out["old_intact"] = bool(torch.equal(tgt["w"], torch.ones(8)))
    # Ranks disagreeing on a global shape.
    bad = {"w": torch.zeros(4 + rank, 2)}
    out["shape"] = _raises(lambda: save(bad, checkpoint_id=f"{root}/bad", timeout=30), ShapeMismatchError)
    # Opt-in replica verification catches per-rank values under one key.
    per_rank = {"rng": torch.full((4,), float(rank))}
    out["replica"] = _raises(lambda: save(per_rank, checkpoint_id=f"{root}/rng", verify_replicas=True, timeout=30),
                             ReplicaMismatchError)
    # Missing rank file on load: all ranks raise naming the file.
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(ws)))
    full = torch.arange(16, dtype=torch.float32)
    save({"s": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=f"{root}/shard", timeout=30)
    dist.barrier()
    if rank == 0:
        os.remove(f"{root}/shard/rank00001.safetensors")
    dist.barrier()
    tgt = {"s": torch.zeros(16)}
    out["missing_file"] = _raises(lambda: load(tgt, checkpoint_id=f"{root}/shard", timeout=30),
                                  CheckpointNotFoundError)
    out["listing"] = sorted(n for n in os.listdir(root))
    return out


def test_dedup_and_agreed_failures(tmp_path):
    res = run_ranks(2, _failures, str(tmp_path))
    r0, r1 = res
    assert r0["bal_files"] == ["rank00000.safetensors", "rank00001.safetensors"]
    assert r0["minr_files"] == ["rank00000.safetensors"]
    for r in res:
        assert "rank 1: OSError: injected write failure" in r["write_fail"]
        assert r["old_intact"]
        assert "key 'w': rank 0 has float32 [4, 2] but rank 1 has float32 [5, 2]" in r["shape"]
        assert "key 'rng'" in r["replica"]
        assert "rank00001.safetensors is missing" in r["missing_file"]
    assert r0["missing_file"] == r1["missing_file"]
    # nothing uncommitted left behind: only committed checkpoint names in the directory
    assert r0["listing"] == ["bal", "keep", "minr", "shard"]


def _hang(rank: int, ws: int, root: str) -> dict:
    if rank == 1:
        time.sleep(8)  # a hung rank: never joins in time
        return {}
    t0 = time.monotonic()
    try:
        save({"w": torch.ones(4)}, checkpoint_id=f"{root}/h", timeout=2)
    except CollectiveTimeoutError as e:
        return {"elapsed": time.monotonic() - t0, "msg": str(e), "exists": os.path.exists(f"{root}/h")}
    raise AssertionError("save did not time out")


def test_hung_rank_is_a_timeout_error_not_a_hang(tmp_path):
    r0 = run_ranks(2, _hang, str(tmp_path), timeout=120)[0]
    assert r0["elapsed"] < 7, r0
    assert "rank 0 of 2" in r0["msg"] and not r0["exists"]


def _submesh(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    mesh4 = DeviceMesh("cpu", list(range(ws)))
    save({"w": distribute_tensor(full, mesh4, [Shard(1)]), "n": 5}, checkpoint_id=f"{root}/c", timeout=30)
    sub = DeviceMesh("cpu", [0, 1])  # every rank constructs it; only 0-1 are on it
    if rank < 2:
        tgt = {"w": DTensor.from_local(torch.zeros(4 if rank == 0 else 3, 5), sub, [Shard(0)], run_check=False,
                                   shape=(7, 5), stride=(5, 1)),
               "n": 0}
    else:
        tgt = {}
    load(tgt, checkpoint_id=f"{root}/c", timeout=30)
    if rank < 2:
        expect = full[:4] if rank == 0 else full[4:]
        return {"ok": bool(torch.equal(tgt["w"].to_local(), expect)) and tgt["n"] == 5}
    return {"ok": tgt == {}}


def test_load_into_sub_mesh_while_other_ranks_pass_empty(tmp_path):
    assert all(r["ok"] for r in run_ranks(4, _submesh, str(tmp_path)))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _bytes_read(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner.dcp import LocalShard

    full = torch.arange(4 * 1024 * 1024, dtype=torch.float32).reshape(2048, 2048)  # 16 MiB
    mesh = DeviceMesh("cpu", list(range(ws)))
    save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=f"{root}/s0", timeout=30)
    solo = dist.new_group([0])  # a one-rank group: rank 0 saves the whole tensor as a world-size-1 checkpoint
    if rank == 0:
        save({"w": full}, checkpoint_id=f"{root}/ws1", process_group=solo, timeout=30)
    dist.barrier()
    out = {}
    # Rank 0 keeps rows 512..1535 (half from each Shard(0) file), rank 1 rows 0..511.
    a, b = (512, 1536) if rank == 0 else (0, 512)
    for name in ("s0", "ws1"):
        tgt = LocalShard(torch.zeros(b - a, 2048), (a, 0), (2048, 2048))
        before = _rchar()
        res = load({"w": tgt}, checkpoint_id=f"{root}/{name}", timeout=30)
        out[name] = {"rchar": _rchar() - before, "kept": tgt.local.numel() * 4, "counter": res.counters["bytes_read"],
                     "ok": bool(torch.equal(tgt.local, full[a:b]))}
    return out


def test_dim0_reshard_reads_about_the_bytes_kept(tmp_path):
    for r in run_ranks(2, _bytes_read, str(tmp_path)):
        for name in ("s0", "ws1"):
            m = r[name]
            assert m["ok"], name
            assert m["counter"] == m["kept"], (name, m)
            assert m["rchar"] <= 1.1 * m["kept"], (name, m)


def _coordinator(rank: int, ws: int, root: str) -> dict:
    """Global planning runs once, on rank 0; each rank receives only its own part."""
    from hpdcp_runner.dcp import BroadcastOptions, StandardLoadPlanner, StandardSavePlanner

    calls = {"save": 0, "load": 0}

    class CountingSave(StandardSavePlanner):
        def create_global_plan(self, layouts):
            calls["save"] += 1
            calls["save_plans"] = len(layouts.plans)  # every rank's table differs here: three layouts
            return super().create_global_plan(layouts)

    class CountingLoad(StandardLoadPlanner):
        def create_global_plan(self, shards, **kw):
            calls["load"] += 1
            return super().create_global_plan(shards, **kw)

    # "rep" is replicated on ranks 0-1 only; "all" on every rank; "own" differs per rank (per-rank key)
    state = {"all": torch.arange(6.0), f"own{rank}": torch.full((3,), float(rank))}
    if rank < 2:
        state["rep"] = torch.arange(1024.0)
    # a collective subgroup that rank 2 is not a member of: ranks now hold different numbers of
    # groups, which broke our groups' names under local synchronisation (a 30 s hang, then an error)
    dist.new_group([0, 1])
    md = save(state, checkpoint_id=f"{root}/c", planner=CountingSave(), timeout=30)
    target = {"all": torch.zeros(6), f"own{rank}": torch.zeros(3)}
    if rank < 2:
        target["rep"] = torch.zeros(1024)
    res = load(target, checkpoint_id=f"{root}/c", planner=CountingLoad(), timeout=30, strict=False,
               broadcast=BroadcastOptions(mode="always", batch_bytes=0))
    ok = all(torch.equal(target[k], state[k]) for k in state)
    return {"calls": calls, "ok": ok, "keys": sorted(md.tensors), "broadcasts": res.counters.get("broadcasts", 0),
            "received": res.counters.get("bytes_received", 0)}


def _layouts_sent_once(rank: int, ws: int, root: str) -> dict:
    """FSDP shards (a DTensor over the whole group) never reach the coordinator; ranks with equal
    shared items (TP positions across data-parallel replicas, replicated norms) send them once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hpdcp_runner.dcp import StandardSavePlanner, load, read_metadata

    seen = {}

    class Recording(StandardSavePlanner):
        def create_global_plan(self, layouts):
            seen["tables"], seen["layouts"] = len(layouts.tables), len(layouts.plans)
            seen["rows"] = [int(p.item_key.numel()) for p in layouts.plans]
            seen["holders"] = layouts.layout_of.tolist()
            seen["unique_bytes"] = layouts.unique_bytes.tolist()
            return super().create_global_plan(layouts)

    flat = DeviceMesh("cpu", list(range(ws)))
    grid = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = {"fsdp": torch.randn(8, 5), "tp": torch.randn(6, 3), "norm": torch.randn(7)}
    state = {"fsdp": distribute_tensor(full["fsdp"], flat, [Shard(0)]),
             "tp": distribute_tensor(full["tp"], grid, [Replicate(), Shard(0)]),
             "norm": full["norm"].clone(), "step": 4}
    save(state, checkpoint_id=f"{root}/c", planner=Recording(), timeout=30)
    back = {"fsdp": distribute_tensor(torch.zeros(8, 5), flat, [Shard(0)]),
            "tp": distribute_tensor(torch.zeros(6, 3), grid, [Replicate(), Shard(0)]), "norm": torch.zeros(7), "step": 0}
    load(back, checkpoint_id=f"{root}/c", timeout=30)
    md = read_metadata(f"{root}/c")
    owners = {k: sorted({c.file for c in t.chunks}) for k, t in md.tensors.items()}
    return {"seen": seen, "bitwise": all(torch.equal(back[k].full_tensor() if k != "norm" else back[k], full[k])
                                         for k in full) and back["step"] == 4, "owners": owners}


def test_the_coordinator_sees_each_distinct_layout_once(tmp_path):
    res = run_ranks(4, _layouts_sent_once, str(tmp_path))
    seen = res[0]["seen"]
    assert all(not r["seen"] for r in res[1:])
    # one key table; two layouts (tp positions 0 and 1, each held by two data-parallel ranks);
    # each layout carries tp, norm and step, never the fsdp shard (written by its holder)
    assert seen["tables"] == 1 and seen["layouts"] == 2 and seen["rows"] == [3, 3]
    assert seen["holders"] == [0, 1, 0, 1] and seen["unique_bytes"] == [2 * 5 * 4] * 4
    assert all(r["bitwise"] for r in res)
    assert res[0]["owners"]["fsdp"] == [f"rank{r:05d}.safetensors" for r in range(4)]
    assert len(res[0]["owners"]["norm"]) == 1 and len(res[0]["owners"]["tp"]) == 2


def test_global_plans_run_on_the_coordinator_only(tmp_path):
    res = run_ranks(3, _coordinator, str(tmp_path))
    assert [r["calls"]["save"] for r in res] == [1, 0, 0] and res[0]["calls"]["save_plans"] == 3
    assert [r["calls"]["load"] for r in res] == [1, 0, 0]
    assert all(r["ok"] for r in res)
    # every rank returns the same committed metadata
    assert all(r["keys"] == ["all", "own0", "own1", "own2", "rep"] for r in res)
    # "all" goes to ranks 0-2, "rep" to ranks 0-1: rank 2 takes part in one broadcast only
    assert res[2]["broadcasts"] == 1 and res[0]["broadcasts"] + res[1]["broadcasts"] == 4
    assert res[0]["received"] + res[1]["received"] + res[2]["received"] == 4096 + 2 * 24
