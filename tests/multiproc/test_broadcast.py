"""Replica-deduplicated loading on real gloo groups: read once per replica group, broadcast."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import BroadcastOptions, CheckpointNotFoundError, FileSystemReader, LocalShard, load, save
from hpdcp_runner.dcp.comm.broadcast import GROUPS, DEFAULT_BATCH_BYTES


def _ref(name, shape):
    n = torch.Size(shape).numel()
    return ((torch.arange(n, dtype=torch.float32) * 3 + sum(map(ord, name))) % 251).reshape(shape)


SHAPES = {"rep": (64, 48), "tp_w": (96, 32), "full": (40, 36), "plain": (128, 16), "tagged": (64, 10),
          "small": [(16,)] * 30}


def _state(rank, mesh, zeros):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def dt(name, placements):
        full = _ref(name, SHAPES[name])
        d = torch.distributed.tensor.distribute_tensor(full, mesh, placements)
        if zeros:
            d = DTensor.from_local(torch.zeros_like(d.to_local()), mesh, placements, run_check=False,
                                   shape=d.shape, stride=d.stride())
        return d

    half = rank % 2  # tp coordinate on a (2,2) mesh [[0,1],[2,3]]: groups (0,2) and (1,3)
    tagged_full = _ref("tagged", SHAPES["tagged"])
    tagged = tagged_full[half * 32:(half + 1) * 32].clone()
    sd = {"rep": dt("rep", [Replicate(), Replicate()]), "tp_w": dt("tp_w", [Replicate(), Shard(0)]),
          "full": dt("full", [Shard(0), Shard(1)]), "plain": _ref("plain", SHAPES["plain"]),
          "tagged": LocalShard(torch.zeros_like(tagged) if zeros else tagged, (half * 32, 0), SHAPES["tagged"]),
          "small": [_ref(f"small{i}", s) for i, s in enumerate(SHAPES["small"])], "step": 5}
    if zeros:
        sd["plain"] = torch.zeros_like(sd["plain"])
        sd["small"] = [torch.zeros_like(t) for t in sd["small"]]
        sd["step"] = 0
    return sd


def _check(sd, rank, mesh) -> list[str]:
    ref = _state(rank, mesh, zeros=False)
    bad = []
    for k in ("rep", "tp_w", "full"):
        if not torch.equal(sd[k].to_local(), ref[k].to_local()):
            bad.append(k)
    if not torch.equal(sd["plain"], ref["plain"]):
        bad.append("plain")
    if not torch.equal(sd["tagged"].local, ref["tagged"].local):
        bad.append("tagged")
    if any(not torch.equal(a, b) for a, b in zip(sd["small"], ref["small"])):
        bad.append("small")
    if sd["step"] != 5:
        bad.append("step")
    return bad


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _dp_tp(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    save(_state(rank, mesh, zeros=False), checkpoint_id=f"{root}/c", timeout=60)
    out = {"cases": {}}
    for batch_bytes in (0, 1024, DEFAULT_BATCH_BYTES, 1 << 30):
        for inflight in (1, 8):
            tgt = _state(rank, mesh, zeros=True)
            before = _rchar()
            res = load(tgt, checkpoint_id=f"{root}/c", timeout=60,
                       broadcast=BroadcastOptions("always", batch_bytes, inflight))
            out["cases"][f"{batch_bytes}/{inflight}"] = {
                "bad": _check(tgt, rank, mesh), "rchar": _rchar() - before, "all_read": res.counters["bytes_read"],
                "read": res.counters["bytes_read"] - res.counters.get("object_bytes_read", 0),
                "received": res.counters.get("bytes_received", 0), "broadcasts": res.counters.get("broadcasts", 0)}
    # Never: every rank reads all it holds (the baseline the dedup is measured against).
    tgt = _state(rank, mesh, zeros=True)
    res = load(tgt, checkpoint_id=f"{root}/c", timeout=60, broadcast=BroadcastOptions("never"))
    out["never"] = {"bad": _check(tgt, rank, mesh),
                    "read": res.counters["bytes_read"] - res.counters.get("object_bytes_read", 0)}
    # files_kept=1 with ordered reads opens each file once; no thread or group leak across loads.
    threads, groups = [], []
    for _ in range(3):
        tgt = _state(rank, mesh, zeros=True)
        reader = FileSystemReader(f"{root}/c", files_kept=1)
        res = load(tgt, storage_reader=reader, timeout=60, broadcast=BroadcastOptions("always"))
        threads.append(threading.active_count())
        groups.append(GROUPS.created)
        out["files_opened"] = res.counters["files_opened"]
    out["nfiles"] = len(os.listdir(f"{root}/c")) - 1  # without metadata.json
    out["threads"], out["groups"] = threads, groups
    out["bad_last"] = _check(tgt, rank, mesh)
    return out


def test_dp_tp_mesh_dedup_is_bitwise_and_reads_each_shard_once(tmp_path):
    res = run_ranks(4, _dp_tp, str(tmp_path), timeout=400)
    data_bytes = sum(torch.Size(s).numel() * 4 for k, s in SHAPES.items() if k != "small") + 30 * 16 * 4
    for case in res[0]["cases"]:
        per = [r["cases"][case] for r in res]
        assert all(not p["bad"] for p in per), (case, [p["bad"] for p in per])
        total_read = sum(p["read"] for p in per)
        assert total_read == data_bytes, (case, total_read, data_bytes)  # every byte read once, in total
        for p in per:  # engine counters and the kernel's count agree (slack: metadata + objects)
            assert p["all_read"] <= p["rchar"] <= p["all_read"] + 256 * 1024, (case, p)
        assert sum(p["received"] for p in per) > 0
    never_total = sum(r["never"]["read"] for r in res)
    assert all(not r["never"]["bad"] for r in res)
    assert never_total > 2 * data_bytes  # replicas each read their own copy without dedup
    for r in res:
        assert not r["bad_last"]
        assert 0 < r["files_opened"] <= r["nfiles"]  # files_kept=1: sorted reads open each file once
        assert r["threads"][0] == r["threads"][1] == r["threads"][2]
        assert r["groups"][0] == r["groups"][1] == r["groups"][2]
    # batching really packs the 30 small tensors: fewer broadcasts with a large batch size
    assert res[0]["cases"][f"{1 << 30}/8"]["broadcasts"] < res[0]["cases"]["0/8"]["broadcasts"]


def _nothing_to_load(rank: int, ws: int, root: str) -> dict:
    full = _ref("rep", SHAPES["rep"])
    save({"rep": full}, checkpoint_id=f"{root}/c", timeout=60)
    tgt = {} if rank == 3 else {"rep": torch.zeros_like(full)}
    res = load(tgt, checkpoint_id=f"{root}/c", timeout=60, broadcast=BroadcastOptions("always"))
    return {"ok": rank == 3 or torch.equal(tgt["rep"], full), "read": res.counters["bytes_read"]}


def test_rank_with_nothing_to_load_still_takes_part(tmp_path):
    res = run_ranks(4, _nothing_to_load, str(tmp_path))
    assert all(r["ok"] for r in res)
    assert sum(r["read"] for r in res) == torch.Size(SHAPES["rep"]).numel() * 4
    assert res[3]["read"] == 0


def _reader_file_missing(rank: int, ws: int, root: str) -> dict:
    full = _ref("rep", SHAPES["rep"])
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(ws)))
    save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=f"{root}/c", timeout=60)
    dist.barrier()
    if rank == 0:
        os.remove(f"{root}/c/rank00001.safetensors")
    dist.barrier()
    tgt = {"w": torch.zeros_like(full)}  # replicated target: each half read by one rank, then broadcast
    t0 = time.monotonic()
    try:
        load(tgt, checkpoint_id=f"{root}/c", timeout=20, broadcast=BroadcastOptions("always"))
    except CheckpointNotFoundError as e:
        return {"msg": str(e), "elapsed": time.monotonic() - t0, "filled": bool(tgt["w"].abs().sum() > 0)}
    raise AssertionError("load did not fail")


def test_failed_reader_fails_every_rank_and_fills_nothing_by_broadcast(tmp_path):
    res = run_ranks(2, _reader_file_missing, str(tmp_path))
    for r in res:
        assert "rank00001.safetensors is missing" in r["msg"] and r["elapsed"] < 20
    assert res[0]["msg"] == res[1]["msg"]


def _submesh_replicas(rank: int, ws: int, root: str) -> dict:
    """TP on each data-parallel replica's own 2-rank mesh (no Replicate placement anywhere):
    ranks 0/2 and 1/3 hold the same boxes. A DTensor sharded over the whole 4-rank mesh is held
    by one rank each and is left out of the replica plan's input."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hpdcp_runner.dcp import StandardLoadPlanner

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    world = DeviceMesh("cpu", list(range(ws)))
    full = {"tp_w": _ref("tp_w", SHAPES["tp_w"]), "full": _ref("full", SHAPES["full"])}

    def state(zeros):
        out = {}
        for name, mesh in (("tp_w", tp), ("full", world)):
            d = distribute_tensor(full[name], mesh, [Shard(0)], src_data_rank=None)
            out[name] = DTensor.from_local(torch.zeros_like(d.to_local()), mesh, [Shard(0)], run_check=False,
                                           shape=d.shape, stride=d.stride()) if zeros else d
        return out

    save(state(False), checkpoint_id=f"{root}/c", timeout=60)
    tgt = state(True)
    planner = StandardLoadPlanner()
    from hpdcp_runner.dcp import read_metadata
    planner.configure(tgt, read_metadata(f"{root}/c"), rank=rank, world_size=ws, allow_cast=False,
                      sendable=("cpu",))
    summarized = sorted({s.fqn for s in planner.create_local_plan().shards})
    res = load(tgt, checkpoint_id=f"{root}/c", timeout=60, broadcast=BroadcastOptions("always"))
    ok = all(torch.equal(tgt[k].to_local(), distribute_tensor(full[k], tgt[k].device_mesh, [Shard(0)],
                                                               src_data_rank=None).to_local()) for k in full)
    return {"summarized": summarized, "ok": ok, "read": res.counters["bytes_read"],
            "broadcasts": res.counters.get("broadcasts", 0)}


def test_replicas_across_submeshes_are_broadcast_and_fully_sharded_tensors_never_planned(tmp_path):
    res = run_ranks(4, _submesh_replicas, str(tmp_path), timeout=300)
    assert all(r["ok"] for r in res)
    assert all(r["summarized"] == ["tp_w"] for r in res)  # "full" is held by one rank each
    tp_bytes = torch.Size(SHAPES["tp_w"]).numel() * 4
    full_bytes = torch.Size(SHAPES["full"]).numel() * 4
    assert sum(r["read"] for r in res) == tp_bytes + full_bytes  # the TP halves read once, not per replica
    assert sum(r["broadcasts"] for r in res) > 0


def _corrupt_part_on_one_rank(rank: int, ws: int, root: str) -> dict:
    """bf16 1024-wide matrices saved Shard(0) by 2 ranks, loaded Shard(1) (partial reads) and
    Shard(0) (whole chunks): a flipped byte in rank 1's file, and a checkpoint whose metadata
    places a chunk past its file's end, fail the load on every rank, naming the file."""
    import json

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hpdcp_runner.dcp import CorruptCheckpointError, HpdcpError

    mesh = DeviceMesh("cpu", list(range(ws)))
    full = {f"w{i}": (torch.arange(1024 * 1024, dtype=torch.float32) % 251 + i).reshape(1024, 1024).to(torch.bfloat16)
            for i in range(2)}

    def state(dim, zeros):
        out = {}
        for k, v in full.items():
            d = distribute_tensor(v, mesh, [Shard(dim)], src_data_rank=None)
            out[k] = DTensor.from_local(torch.zeros_like(d.to_local()), mesh, [Shard(dim)], run_check=False,
                                        shape=d.shape, stride=d.stride()) if zeros else d
        return out

    save(state(0, False), checkpoint_id=f"{root}/c", timeout=60, format_version=1)  # chunk table tampered below
    out = {}
    if rank == 0:  # one byte in the middle of rank 1's file
        p = f"{root}/c/rank00001.safetensors"
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) - 1500)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
    dist.barrier()
    for dim in (1, 0):
        try:
            load(state(dim, True), checkpoint_id=f"{root}/c", timeout=60)
            out[f"flip S{dim}"] = "loaded"
        except HpdcpError as e:
            out[f"flip S{dim}"] = f"{type(e).__name__}: {e}"
    # unverified reads of a chunk the metadata places past its file's end
    if rank == 0:
        md = json.load(open(f"{root}/c/metadata.json"))
        size = md["files"]["rank00001.safetensors"]["size"] if "files" in md else None
        for chunk in md["tensors"]["w1"]["chunks"]:
            if chunk[3] == "rank00001.safetensors" or "rank00001.safetensors" in chunk:
                chunk[4] = (size or 1 << 30) - 1000
        json.dump(md, open(f"{root}/c/metadata.json", "w"))
    dist.barrier()
    try:
        load(state(1, True), storage_reader=FileSystemReader(f"{root}/c", verify_checksums=False), timeout=60)
        out["past end"] = "loaded"
    except HpdcpError as e:
        out["past end"] = f"{type(e).__name__}: {e}"
    out["corrupt_type"] = CorruptCheckpointError.__name__
    return out


def test_a_bad_partial_read_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    res = run_ranks(2, _corrupt_part_on_one_rank, str(tmp_path), timeout=300)
    for r in res:
        assert r["flip S1"].startswith("CorruptCheckpointError") and "rank00001.safetensors" in r["flip S1"], r
        assert "fails its checksum" in r["flip S1"]
        # read by rank 1 alone: rank 0 fails too, with rank 1's reason
        assert r["flip S0"].startswith("CorruptCheckpointError") and "rank 1: checkpoint file" in r["flip S0"], r
        assert "rank00001.safetensors" in r["past end"] and "beyond the end" in r["past end"], r
