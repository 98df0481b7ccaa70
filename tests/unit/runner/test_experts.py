"""Per-expert <-> stacked expert tensors: which keys group, the errors for gaps and mismatches,
and that the load targets share storage with the output's state (nothing copied)."""

from __future__ import annotations

from types import SimpleNamespace as T

import pytest
import torch

from hpdcp_runner.dcp import ConfigError, FusedShard, LocalShard, ShardPieces
from hpdcp_runner.dcp.tools import Box, local_pieces
from hpdcp_runner.experts import expert_views, stack_plan, stacked_carrier, unstack_plan


def _meta(shape=(6, 4), dtype="float32"):
    return T(shape=shape, dtype=dtype)


def test_stack_plan_groups_experts_in_order_and_names_what_does_not_fit():
    keys = {f"m.l.0.moe.experts.{e}.w1.weight": _meta() for e in (2, 0, 1)} | {"m.l.0.attn.q.weight": _meta()}
    assert stack_plan(keys) == {"m.l.0.moe.experts.w1.weight": [f"m.l.0.moe.experts.{e}.w1.weight" for e in range(3)]}
    with pytest.raises(ConfigError, match=r"experts \[1\] are missing \(have \[0, 2\]\)"):
        stack_plan({f"x.experts.{e}.w": _meta() for e in (0, 2)})
    with pytest.raises(ConfigError, match="differ in shape or dtype"):
        stack_plan({"x.experts.0.w": _meta(), "x.experts.1.w": _meta((5, 4))})
    with pytest.raises(ConfigError, match="no per-expert keys"):
        stack_plan({"a": _meta()})


def test_unstack_plan_leaves_shared_experts_and_routers_alone():
    plan = unstack_plan({"l.moe.experts.w2": _meta((3, 4, 5)), "l.moe.shared_experts.w2": _meta((4, 5)),
                         "l.moe.router.gate.weight": _meta((3, 4))})
    assert plan == {"l.moe.experts.w2": ["l.moe.experts.0.w2", "l.moe.experts.1.w2", "l.moe.experts.2.w2"]}


def test_expert_views_share_storage_with_the_stacked_shard():
    local = torch.zeros(2, 3, 4)  # experts 2..3 of 4, rows 3..5 of 6
    stacked = LocalShard(local, (2, 3, 0), (4, 6, 4))
    views = expert_views(stacked, (4, 6, 4), 4)
    assert views[0] is None and views[1] is None
    assert isinstance(views[3], LocalShard) and views[3].box == Box((3, 0), (3, 4))
    views[3].local.fill_(7)
    assert local[1].eq(7).all() and local[0].eq(0).all()
    fused = FusedShard(torch.zeros(1, 4, 2), (2, 8, 2), [Box((1, 0, 0), (1, 2, 2)), Box((1, 4, 0), (1, 2, 2))], 1)
    v = expert_views(fused, (2, 8, 2), 2)[1]
    assert isinstance(v, FusedShard) and v.boxes == (Box((0, 0), (2, 2)), Box((4, 0), (2, 2))) and v.dim == 0


def test_stacked_carrier_is_made_of_the_per_expert_tensors():
    a, b = torch.zeros(3, 4), torch.zeros(3, 4)
    carrier = stacked_carrier([None, LocalShard(a, (3, 0), (6, 4)), b], (3, 6, 4))
    assert isinstance(carrier, ShardPieces)
    # expert 1: its rows 3..5; expert 2: a plain tensor, its box from offset 0
    assert [p[0] for p in local_pieces(carrier)] == [Box((1, 3, 0), (1, 3, 4)), Box((2, 0, 0), (1, 3, 4))]
    local_pieces(carrier)[0][1].fill_(5)
    assert a.eq(5).all()
    assert stacked_carrier([None, None], (2, 3)) is None
