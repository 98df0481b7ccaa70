"""The standard planners without a process group: local plans from state dicts, the pure global
save plan over several ranks' plans, the load plan against metadata, and device capability."""

from __future__ import annotations

import pytest
import torch

from hpdcp_runner.dcp import LocalShard, MinimumRankSavePlanner, ShapeMismatchError, StandardLoadPlanner, StandardSavePlanner, save
from hpdcp_runner.dcp.planning.save_dedup import SaveLayouts
from hpdcp_runner.dcp import read_metadata


def _plan(planner, sd, rank, ws=2):
    planner.configure(sd, rank=rank, world_size=ws)
    return planner.create_local_plan()


def test_a_replicated_tensor_is_written_once_and_shards_by_their_holder():
    # two ranks: "rep" replicated (same box on both), "row" split by rows as LocalShards
    sds = [{"rep": torch.ones(4), "row": LocalShard(torch.full((2, 3), float(r)), (2 * r, 0), (4, 3)),
            "step": 3} for r in range(2)]
    for cls, rep_writer in ((StandardSavePlanner, None), (MinimumRankSavePlanner, 0)):
        planners = [cls() for _ in range(2)]
        plans = [_plan(p, sd, r) for r, (p, sd) in enumerate(zip(planners, sds))]
        layouts, shared_idx, _ = SaveLayouts.from_plans(plans)
        g = planners[0].create_global_plan(layouts)
        written = {r: sorted(plans[r].items[int(shared_idx[r][i])].fqn for i in g.writes[r]) for r in range(2)}
        assert sorted(written[0] + written[1]) == ["rep", "row", "row", "step"]  # each replica once
        if rep_writer is not None:
            assert "rep" in written[rep_writer] and "step" in written[rep_writer]


def test_load_plan_checks_shapes_and_reports_missing_keys(tmp_path):
    save({"w": torch.arange(6.0).view(2, 3), "n": 5}, checkpoint_id=tmp_path / "c")
    md = read_metadata(tmp_path / "c")
    p = StandardLoadPlanner()
    p.configure({"w": torch.zeros(2, 3), "extra": torch.zeros(1), "n": None}, md, rank=0, world_size=1)
    plan = p.create_local_plan()
    assert plan.missing == ("extra",) and plan.requested == frozenset({"w", "n"}) and plan.objects == ("n",)
    p.configure({"w": torch.zeros(3, 2)}, md, rank=0, world_size=1)
    with pytest.raises(ShapeMismatchError, match=r"key 'w': checkpoint shape \[2, 3\] != target shape \[3, 2\]"):
        p.create_local_plan()


def test_device_capability_arrives_as_data(tmp_path):
    save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "c")
    md = read_metadata(tmp_path / "c")
    for sendable, device in ((frozenset({"cpu"}), "cpu"), (frozenset(), "none")):
        p = StandardLoadPlanner()
        p.configure({"w": torch.zeros(4)}, md, rank=0, world_size=1, sendable=sendable)
        (shard,) = p.create_local_plan().shards
        assert shard.device == device
