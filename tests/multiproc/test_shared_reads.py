"""Shared reads on real gloo groups: a chunk that several ranks each need a part of (a column
split of a row-sharded checkpoint) is read once, by one of them, and the parts are sent.

What is asserted: every rank's tensors bitwise equal to the reference; the bytes each rank read
from storage (the reader's counter) and the parts it received; the same load with sharing off
reading the chunks once per rank; a failed read raising on every rank with nothing waiting.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import BroadcastOptions, FileSystemReader, load, save

ROWS, COLS = 64, 96


def _ref(name: str, shape: tuple, dtype=torch.float32) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return ((torch.arange(n, dtype=torch.float64) * 7 + sum(map(ord, name))) % 509).reshape(shape).to(dtype)


def _mesh(ws: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(ws))


def _state(ws: int, dim: int, zeros: bool) -> dict:
    """Three tensors in ``Shard(dim)`` (one bf16, one 3-d) and one replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = _mesh(ws)
    out = {}
    for name, shape, dtype, place in (("w", (ROWS, COLS), torch.float32, Shard(dim)),
                                      ("b16", (ROWS * 2, COLS // 2), torch.bfloat16, Shard(dim)),
                                      ("cube", (8, ROWS // 4, COLS), torch.float32, Shard(dim)),
                                      ("rep", (16, 8), torch.float32, Replicate())):
        d = distribute_tensor(_ref(name, shape, dtype), mesh, [place])
        if zeros:
            d = DTensor.from_local(torch.zeros_like(d.to_local()), mesh, [place], run_check=False,
                                   shape=d.shape, stride=d.stride())
        out[name] = d
    return out


def _bad(sd: dict, ws: int, dim: int) -> list[str]:
    ref = _state(ws, dim, zeros=False)
    return [k for k in ref if not torch.equal(sd[k].to_local(), ref[k].to_local())]


def _reshard(rank: int, ws: int, root: str, mode: str, share: bool) -> dict:
    """Saved in Shard(0), loaded in Shard(1): every rank needs a part of every row chunk."""
    save(_state(ws, 0, zeros=False), checkpoint_id=f"{root}/c", timeout=60)
    sd = _state(ws, 1, zeros=True)
    reader = FileSystemReader(f"{root}/c")
    load(sd, storage_reader=reader, timeout=60, broadcast=BroadcastOptions(mode=mode, share_reads=share))
    c = reader.counters
    return {"bad": _bad(sd, ws, 1), "bytes_read": c.bytes_read, "received": c.extra.get("bytes_received", 0),
            "shared": c.extra.get("shared_reads", 0)}


def _kept(ws: int) -> int:
    """The bytes of the Shard(1) tensors one rank keeps (the replicated one aside)."""
    return (ROWS * COLS * 4 + ROWS * 2 * COLS // 2 * 2 + 8 * ROWS // 4 * COLS * 4) // ws


def test_column_split_is_read_once_and_sent(tmp_path):
    shared = run_ranks(2, _reshard, str(tmp_path / "a"), "always", True)
    alone = run_ranks(2, _reshard, str(tmp_path / "b"), "always", False)
    for r in shared + alone:
        assert r["bad"] == [], r
    total = 2 * _kept(2)  # the sharded tensors' bytes, stored once
    rep = 16 * 8 * 4
    # without sharing each rank reads every chunk whole (checksummed blocks): the whole tensors
    assert all(r["bytes_read"] >= total for r in alone), alone
    # shared: each chunk read once in all, each rank receiving the other's half of its chunk
    assert sum(r["bytes_read"] for r in shared) == total + rep, shared
    # (and the replicated tensor, broadcast to the rank that did not read it)
    assert sum(r["received"] for r in shared) == _kept(2) + rep, shared
    assert [r["shared"] for r in shared] == [3, 3], shared  # 6 chunks, 3 read by each rank


def test_four_ranks_and_auto_on_one_node(tmp_path):
    shared = run_ranks(4, _reshard, str(tmp_path / "a"), "always", True)
    assert all(r["bad"] == [] for r in shared), shared
    total = 4 * _kept(4)
    assert sum(r["bytes_read"] for r in shared) == total + 16 * 8 * 4, shared
    # each rank keeps a quarter of each chunk: 3 of 4 quarters arrive from the chunk's reader
    assert sum(r["received"] for r in shared) == total * 3 // 4 + 3 * 16 * 8 * 4, shared
    # auto, one node, a local disk: the page cache serves the repeats; nothing is shared
    auto = run_ranks(4, _reshard, str(tmp_path / "b"), "auto", True)
    assert all(r["bad"] == [] and r["shared"] == 0 and r["received"] == 0 for r in auto), auto


def _dp_tp(rank: int, ws: int, root: str) -> dict:
    """Saved row-sharded over 4 ranks, loaded on a (2, 2) mesh as [Replicate(), Shard(1)]: each
    column half is held by two ranks (one reads it, then broadcasts it) and is cut out of the
    four row chunks (read once each, the parts sent)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = _ref("w", (ROWS, COLS))
    save({"w": distribute_tensor(full, _mesh(ws), [Shard(0)])}, checkpoint_id=f"{root}/c", timeout=60)
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    place = [Replicate(), Shard(1)]
    like = distribute_tensor(full, mesh, place)
    sd = {"w": DTensor.from_local(torch.zeros_like(like.to_local()), mesh, place, run_check=False,
                                  shape=like.shape, stride=like.stride())}
    reader = FileSystemReader(f"{root}/c")
    load(sd, storage_reader=reader, timeout=60, broadcast=BroadcastOptions(mode="always"))
    c = reader.counters
    return {"ok": torch.equal(sd["w"].to_local(), like.to_local()), "bytes_read": c.bytes_read,
            "shared": c.extra.get("shared_reads", 0), "broadcasts": c.extra.get("broadcasts", 0)}


def test_shared_reads_feed_replica_broadcasts(tmp_path):
    out = run_ranks(4, _dp_tp, str(tmp_path))
    assert all(r["ok"] for r in out), out
    assert sum(r["bytes_read"] for r in out) == ROWS * COLS * 4, out  # every stored byte read once
    assert sum(r["shared"] for r in out) == 4 and all(r["broadcasts"] for r in out), out


def _failing(rank: int, ws: int, root: str) -> dict:
    save(_state(ws, 0, zeros=False), checkpoint_id=f"{root}/c", timeout=60)
    dist.barrier()
    if rank == 0:  # flip a byte inside rank 1's file: its chunks fail their checksums
        name = "rank00001.safetensors"
        with open(f"{root}/c/{name}", "r+b") as f:
            f.seek(os.path.getsize(f"{root}/c/{name}") - 8)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    sd = _state(ws, 1, zeros=True)
    try:
        load(sd, checkpoint_id=f"{root}/c", timeout=30, broadcast=BroadcastOptions(mode="always"))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def test_a_failed_shared_read_fails_every_rank(tmp_path):
    out = run_ranks(2, _failing, str(tmp_path), timeout=120)
    for r in out:
        assert r["error"] and "CorruptCheckpointError" in r["error"] and "checksum" in r["error"], out


def _on_s3(rank: int, ws: int, root: str, env: dict) -> dict:
    os.environ.update(env)
    save(_state(ws, 0, zeros=False), checkpoint_id=f"{root}/c", timeout=60)
    sd = _state(ws, 1, zeros=True)
    res = load(sd, checkpoint_id=f"{root}/c", timeout=60)  # the defaults: auto, an object store is slow
    return {"bad": _bad(sd, ws, 1), "bytes_read": res.counters.get("bytes_read", 0),
            "shared": res.counters.get("shared_reads", 0)}


def test_object_store_reshard_reads_each_chunk_once_by_default(s3_bucket):
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_REGION", "AWS_ALLOW_HTTP")}
    out = run_ranks(2, _on_s3, f"{s3_bucket}/shared", env)
    assert all(r["bad"] == [] for r in out), out
    assert sum(r["bytes_read"] for r in out) == 2 * _kept(2) + 16 * 8 * 4, out
    assert sum(r["shared"] for r in out) == 6, out
