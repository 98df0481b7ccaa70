"""Which tensors of a training checkpoint are the model's: optimizer state is found by its
structure (state of a tensor the checkpoint holds), never by guessed names."""

from __future__ import annotations

from hpdcp_runner.dcp.offline.model_weights import describe_split, split_model_weights


def _adam(group: str, fqns: list[str]) -> list[str]:
    return [f"{group}state.{f}.{s}" for f in fqns for s in ("exp_avg", "exp_avg_sq", "step")]


def test_torch_dcp_model_and_optim_dicts_give_the_model_under_its_own_names():
    params = ["model.embed_tokens.weight", "model.layers.0.mlp.w1.weight", "lm_head.weight"]
    keys = [f"model.{p}" for p in params] + ["model.model.rotary.inv_freq"]  # a buffer: no optimizer state
    keys += _adam("optim.", params) + ["optim.param_groups.0.lr", "train.step"]
    s = split_model_weights(keys)
    assert s.prefix == "model." and s.groups == ("optim.",)
    assert s.names == {f"model.{p}": p for p in params} | {"model.model.rotary.inv_freq": "model.rotary.inv_freq"}
    assert len(s.optimizer) == 10 and s.other == ("train.step",)
    text = describe_split(s)
    assert "4 weights" in text and "'model.' stripped" in text and "10 optimizer-state tensors (optim.*)" in text
    assert "train.step" in text


def test_model_keys_at_the_top_level_beside_the_optimizer():
    params = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.moe.experts.w1", "output.weight"]
    frozen = ["layers.0.attention_norm.weight"]  # no optimizer state: still the model's
    s = split_model_weights(params + frozen + _adam("optimizer.", params[:3]))
    assert s.prefix == "" and s.groups == ("optimizer.",)
    assert s.names == {k: k for k in params + frozen} and s.other == ()


def test_without_an_optimizer_every_key_is_kept_as_it_is():
    keys = ["model.state.weight", "state.weight", "encoder.state.proj.bias", "a.state.b.c"]
    s = split_model_weights(keys)
    assert not s.split and s.names == {k: k for k in keys} and s.prefix == ""
    # "state." followed by the name of a tensor of this checkpoint, but no group before it
    s = split_model_weights(["w", "state.w.exp_avg"])
    assert not s.split


def test_a_module_called_state_is_not_mistaken_for_optimizer_state():
    # 'blocks.state.proj.weight' names no other tensor after 'state.': a module, kept
    keys = ["blocks.state.proj.weight", "blocks.proj.weight", "head.weight"] + _adam("opt.", ["head.weight"])
    s = split_model_weights(keys)
    assert s.groups == ("opt.",) and "blocks.state.proj.weight" in s.names and "blocks.proj.weight" in s.names
