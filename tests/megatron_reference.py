"""The Megatron fixtures' tensors mapped to Hugging Face names by hand, from each tensor-parallel
rank's own ``model.state_dict()`` (tests/fixtures/megatron/*/reference): the expectation the
Megatron reader is compared with, written independently of it."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")


def expected_hf(run: str) -> dict[str, torch.Tensor]:
    cfg = json.load(open(os.path.join(run, "reference", "config.json")))
    hidden, heads, groups = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, ffn, layers = cfg["head_dim"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    ranks = sorted(f for f in os.listdir(os.path.join(run, "reference")) if f.startswith("tp_rank"))
    parts = [load_file(os.path.join(run, "reference", f)) for f in ranks]
    tp = len(parts)

    def cat(key, dim):
        return torch.cat([p[key] for p in parts], dim)

    per = heads // groups
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0),
           "lm_head.weight": cat("output_layer.weight", 0),
           "model.norm.weight": parts[0]["decoder.final_layernorm.weight"]}
    for i in range(layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = cat(m + "self_attention.linear_qkv.weight", 0).view(groups, (per + 2) * hd, hidden)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :per * hd].reshape(-1, hidden)
        out[h + "self_attn.k_proj.weight"] = qkv[:, per * hd:(per + 1) * hd].reshape(-1, hidden)
        out[h + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * hd:].reshape(-1, hidden)
        if m + "self_attention.linear_qkv.bias" in parts[0]:  # Qwen2's q/k/v biases, interleaved as the rows
            bias = cat(m + "self_attention.linear_qkv.bias", 0).view(groups, (per + 2) * hd)
            out[h + "self_attn.q_proj.bias"] = bias[:, :per * hd].reshape(-1)
            out[h + "self_attn.k_proj.bias"] = bias[:, per * hd:(per + 1) * hd].reshape(-1)
            out[h + "self_attn.v_proj.bias"] = bias[:, (per + 1) * hd:].reshape(-1)
        out[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        fc1 = [p[m + "mlp.linear_fc1.weight"] for p in parts]  # each rank: its gate rows, then its up rows
        out[h + "mlp.gate_proj.weight"] = torch.cat([f[:ffn // tp] for f in fc1])
        out[h + "mlp.up_proj.weight"] = torch.cat([f[ffn // tp:] for f in fc1])
        out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        out[h + "input_layernorm.weight"] = parts[0][m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = parts[0][m + "pre_mlp_layernorm.weight"]
    return out
