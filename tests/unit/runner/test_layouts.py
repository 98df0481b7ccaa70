"""Layouts: the boxes each rank holds under TP, FSDP x TP and flat layouts (torch.chunk sizes),
rule matching, and the config problems a layout can have."""

from __future__ import annotations

import pytest
import torch

from hpdcp_runner.config import load_preset
from hpdcp_runner.dcp import ConfigError
from hpdcp_runner.layouts import Placer, mesh_shape, problems


def _boxes(layout, fqn, shape, ws):
    p = Placer(layout, 0, ws)
    return [[(b.offsets, b.sizes) for b in p.boxes(fqn, shape, r)] for r in range(ws)]


def test_llama_tp_column_and_row_parallel_and_replicated_norms():
    tp = load_preset("llama_tp")
    assert _boxes(tp, "model.layers.0.self_attn.q_proj.weight", (10, 4), 3) == [
        [((0, 0), (4, 4))], [((4, 0), (4, 4))], [((8, 0), (2, 4))]]  # torch.chunk: 4, 4, 2
    assert _boxes(tp, "model.layers.0.mlp.down_proj.weight", (4, 6), 2) == [[((0, 0), (4, 3))], [((0, 3), (4, 3))]]
    assert _boxes(tp, "model.norm.weight", (4,), 2) == [[((0,), (4,))]] * 2
    # optimizer state follows its parameter's rule; its step scalar stays whole
    assert Placer(tp, 0, 2).rule_for("optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg") == 0
    assert _boxes(tp, "optim.state.model.layers.0.self_attn.q_proj.weight.step", (), 2) == [[((), ())]] * 2


def test_fsdp_x_tp_nests_both_splits():
    lay = load_preset("llama_fsdp_tp")  # mesh [-1, 2]: dp x tp
    assert mesh_shape(lay, 4) == (2, 2)
    got = _boxes(lay, "x.q_proj.weight", (8, 2), 4)  # [S0, S0]: dp halves rows, tp halves again
    assert got == [[((0, 0), (2, 2))], [((2, 0), (2, 2))], [((4, 0), (2, 2))], [((6, 0), (2, 2))]]


def test_a_rule_that_cannot_apply_names_rule_and_tensor():
    lay = load_preset("llama_tp")
    lay.rules[0].placements = ["S1"]
    with pytest.raises(ConfigError, match=r"rules\[0\].*cannot apply to 'a.q_proj.bias': it has 1 dimension"):
        Placer(lay, 0, 2).empty("a.q_proj.bias", (4,), torch.float32)


def test_layout_problems_name_the_field():
    lay = load_preset("llama_fsdp_tp")
    assert problems(lay, 3) == ["mesh: [-1, 2] does not fit world size 3"]
    lay.rules[0].pattern = "("
    assert any(p.startswith("rules[0].pattern: bad regex") for p in problems(lay, 2))
