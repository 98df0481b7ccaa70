"""Megatron-Core torch_dist checkpoints read in place (hpdcp_runner/dcp/storage/formats/megatron.py), on
files megatron-core 0.19.2 wrote (tests/fixtures/megatron, by scripts/write_megatron_fixtures.py):
under Hugging Face names (layers un-stacked, QKV cut per query group, fc1 into gate and up) every
tensor bitwise equal to Megatron's own tensors mapped by hand, at tensor-parallel 1 and 2,
pipeline-parallel 2, and for
mixtures of experts (Mixtral's names at expert-parallel 2; Qwen2-MoE's, with a shared expert and a
dense first layer, at tensor-parallel 2; Qwen3-MoE's, with its per-head query and key norms): every expert cut out of Megatron's [layers, experts, ...]
records in place."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hpdcp_runner.dcp import load, open_reader
from hpdcp_runner.dcp.core.errors import CheckpointNotFoundError, HpdcpError, MetadataError
from hpdcp_runner.dcp.format.metadata import Metadata, dtype_from_name
from hpdcp_runner.dcp.storage.formats.foreign import detect_format
from tests.megatron_reference import FIXTURES, expected_hf


def _config(run):
    return json.load(open(os.path.join(run, "reference", "config.json")))


def _read(run, **kw):
    r = open_reader(run, allow_pickle=True, **kw)
    md = Metadata.from_json(r.read_metadata_text())
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})
    load(state, storage_reader=r, strict=True)
    return md, state


@pytest.mark.parametrize("name", ["gpt_tp1", "gpt_tp2", "gpt_tp2_qkv_bias", "gpt_pp2", "moe_ep2",
                                  "moe_tp2_shared", "moe_qk_norm"])
def test_hugging_face_names_equal_megatrons_tensors_mapped_by_hand(name):
    run = os.path.join(FIXTURES, name)
    tp = 2 if "tp2" in name else 1
    assert detect_format(run) == "megatron" and detect_format(os.path.join(run, "iter_0000002")) == "megatron"
    md, state = _read(run, hf_config=_config(run))
    expect = expected_hf(run)
    assert set(state) == set(expect) and md.extra["source_format"] == "megatron"
    for k, v in expect.items():
        assert torch.equal(state[k], v), k
    if name.endswith("bias"):  # Qwen2's q/k/v biases, cut per query group as the weights are
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"} <= set(state)
    if tp == 2:  # a query group's rows come from the rank that held them: no bytes copied between
        q = md.tensors["model.layers.1.self_attn.q_proj.weight"]
        assert sorted({c.file for c in q.chunks}) == ["__0_0.distcp", "__1_0.distcp"]
    if name == "moe_tp2_shared":  # a dense layer, then a layer of experts with the shared one and its gate
        assert "model.layers.0.mlp.gate_proj.weight" in state and "model.layers.0.mlp.experts.0.up_proj.weight" not in state
        assert state["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 24)
        assert state["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (16, 24)
    if name == "gpt_pp2":  # each pipeline stage wrote its own layer, the first the embedding, the last the head
        assert {c.file for c in md.tensors["model.layers.0.mlp.up_proj.weight"].chunks} == {"__0_0.distcp"}
        assert {c.file for c in md.tensors["model.layers.1.mlp.up_proj.weight"].chunks} == {"__1_0.distcp"}
        assert {c.file for c in md.tensors["lm_head.weight"].chunks} == {"__1_0.distcp"}
    if name == "moe_qk_norm":  # Qwen3-MoE: a norm on each query and key head
        assert state["model.layers.1.self_attn.k_norm.weight"].shape == (6,)


def test_each_expert_is_read_from_the_rank_file_that_held_it():
    """Expert parallel 2: experts 0-1 were saved by rank 0, 2-3 by rank 1; one expert's weight is
    read from its own file, its bytes only."""
    run = os.path.join(FIXTURES, "moe_ep2")
    r = open_reader(run, allow_pickle=True, hf_config=_config(run))
    md = Metadata.from_json(r.read_metadata_text())
    files = {e: {c.file for c in md.tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"].chunks}
             for e in range(4)}
    assert files == {0: {"__0_0.distcp"}, 1: {"__0_0.distcp"}, 2: {"__1_0.distcp"}, 3: {"__1_0.distcp"}}
    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"  # the up rows: fc1's second half
    state = {key: torch.empty(md.tensors[key].shape)}
    before = r.counters.bytes_read
    load(state, storage_reader=r, strict=False)
    assert r.counters.bytes_read - before == state[key].numel() * 4
    assert torch.equal(state[key], expected_hf(run)[key])


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama", num_local_experts=None), "is a mixture of experts; config.json's model_type 'llama' has no experts"),
    (dict(model_type="deepseek_v3"), "model_type 'deepseek_v3' is not mapped \\(mapped: mixtral, qwen2_moe, qwen3_moe\\)"),
    (dict(num_local_experts=8), "experts.linear_fc1.weight' holds 4 experts; config.json says 8"),
    (dict(intermediate_size=20), "experts.linear_fc1.weight' has 32 rows; a SwiGLU MLP of config.json's width 20 has 40"),
])
def test_a_mixture_of_experts_under_a_config_that_does_not_fit_is_named(change, message):
    run = os.path.join(FIXTURES, "moe_ep2")
    with pytest.raises(MetadataError, match=message):
        _read(run, hf_config=dict(_config(run), **change))


def test_without_a_config_megatrons_own_names():
    run = os.path.join(FIXTURES, "gpt_tp2")
    md, state = _read(run)
    assert md.tensors["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 48, 24)
    assert "model.embed_tokens.weight" not in state


def test_a_config_of_another_shape_is_named(tmp_path):
    run = os.path.join(FIXTURES, "gpt_tp1")
    cfg = dict(_config(run), num_key_value_heads=4)
    with pytest.raises(MetadataError, match="linear_qkv.weight' has 48 rows; config.json's 4 heads in 4 groups"):
        _read(run, hf_config=cfg)


def test_a_zarr_checkpoint_and_a_missing_iteration_are_named(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(FIXTURES, "gpt_tp1"), run)
    marker = run / "iter_0000002" / "metadata.json"
    marker.write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(MetadataError, match=f"{marker}: a Megatron-Core checkpoint of backend 'zarr'"):
        open_reader(str(run), allow_pickle=True)
    (run / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointNotFoundError, match="names iteration 7, but .*iter_0000007 is missing"):
        open_reader(str(run), allow_pickle=True)
    (run / "latest_checkpointed_iteration.txt").write_text("../x")
    with pytest.raises(HpdcpError, match="not an iteration number"):
        open_reader(str(run), allow_pickle=True)
