"""Cached save plans: a repeated save of the same structure on the same group skips the
gather/dedup (digests only); any change in keys, shapes, dtypes or placements, on any rank, is
planned in full, so a changed structure is never written with a stale plan."""

from __future__ import annotations

import torch

from tests.multiproc.harness import run_ranks


def _cases(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner.dcp import load, save
    from hpdcp_runner.dcp.protocol import PLAN_CACHE_STATS

    mesh = DeviceMesh("cpu", [0, 1])

    def state(v: float, rows: int = 4, dim: int = 0, extra: bool = False) -> dict:
        sd = {"w": distribute_tensor(torch.full((rows, 6), v), mesh, [Shard(dim)]), "b": torch.full((3,), v)}
        if rank == 1:
            sd["mine"] = {"n": int(v)}  # a key only rank 1 holds
            if extra:
                sd["mine2"] = 1  # a change on rank 1 only
        return sd

    def loads_back(path: str, v: float, rows: int = 4, dim: int = 0, extra: bool = False) -> bool:
        want = state(v, rows, dim, extra)
        got = state(-1.0, rows, dim, extra)
        if rank == 1:
            got["mine"] = {"n": None}
            if extra:
                got["mine2"] = None
        load(got, checkpoint_id=path, timeout=60, strict=False)
        return torch.equal(got["w"].full_tensor(), want["w"].full_tensor()) and torch.equal(got["b"], want["b"]) \
            and (rank == 0 or got["mine"] == want["mine"])

    out = {}
    steps = [("first", 1.0, 4, 0, False), ("same", 2.0, 4, 0, False), ("same_again", 3.0, 4, 0, False),
             ("shape", 4.0, 6, 0, False), ("placement", 5.0, 6, 1, False), ("one_rank", 6.0, 6, 1, True),
             ("back", 7.0, 6, 1, True)]
    for name, v, rows, dim, extra in steps:
        before = dict(PLAN_CACHE_STATS)
        save(state(v, rows, dim, extra), checkpoint_id=f"{root}/{name}", timeout=60, cache_plan=True)
        out[name] = ("hit" if PLAN_CACHE_STATS["hits"] > before["hits"] else "miss",
                     loads_back(f"{root}/{name}", v, rows, dim, extra))
    # planning fails on rank 1 during a save the cache would have served: every rank raises the
    # failure (the digest round sends no plan, so the full round reports it), none hangs
    from hpdcp_runner.dcp import HpdcpError
    from hpdcp_runner.dcp.core import faults

    with faults.armed("save.plan", lambda rank, **_: rank == 1 and faults.fail(RuntimeError("boom on 1"))):
        try:
            save(state(8.0, 6, 1, True), checkpoint_id=f"{root}/fails", timeout=60, cache_plan=True)
            out["fails"] = "saved"
        except HpdcpError as e:
            out["fails"] = "rank 1" in str(e) and "boom on 1" in str(e)
    before = dict(PLAN_CACHE_STATS)
    save(state(9.0, 6, 1, True), checkpoint_id=f"{root}/after", timeout=60, cache_plan=True)
    out["after"] = ("hit" if PLAN_CACHE_STATS["hits"] > before["hits"] else "miss",
                    loads_back(f"{root}/after", 9.0, 6, 1, True))
    # rank 1 holds no cached plan for this save (it dropped its cache) while rank 0 does: the
    # ranks must not take different paths (rank 0 the cached one, rank 1 the plan round: a hang)
    from hpdcp_runner.dcp import protocol

    if rank == 1:
        protocol._PLAN_CACHE.clear()
    before = dict(PLAN_CACHE_STATS)
    save(state(9.0, 6, 1, True), checkpoint_id=f"{root}/dropped", timeout=20, cache_plan=True)
    out["dropped"] = ("hit" if PLAN_CACHE_STATS["hits"] > before["hits"] else "miss",
                      loads_back(f"{root}/dropped", 9.0, 6, 1, True))
    return out


def test_cached_plans_are_reused_only_for_the_same_structure(tmp_path):
    for res in run_ranks(2, _cases, str(tmp_path)):
        assert res == {"first": ("miss", True), "same": ("hit", True), "same_again": ("hit", True),
                       "shape": ("miss", True), "placement": ("miss", True), "one_rank": ("miss", True),
                       "back": ("hit", True), "fails": True, "after": ("hit", True),
                       "dropped": ("miss", True)}, res
