"""The Megatron fixtures' tensors mapped to Hugging Face names by hand, from each tensor-parallel
rank's own ``model.state_dict()`` (tests/fixtures/megatron/*/reference): the expectation the
Megatron reader is compared with, written independently of it."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")


def expected_hf(run: str) -> dict[str, torch.Tensor]:
    cfg = json.load(open(os.path.join(run, "reference", "config.json")))
    hidden, heads, groups = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, ffn, layers = cfg["head_dim"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    by_rank: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (tp rank, ep rank): its tensors
    files = [f for f in os.listdir(os.path.join(run, "reference")) if f.startswith("tp_rank")]
    ranks = [{k: int(v) for k, v in re.findall(r"(tp|ep|pp|vp)_rank(\d+)", f)} for f in files]
    stages = 1 + max(r.get("pp", 0) for r in ranks)
    chunks = 1 + max(r.get("vp", 0) for r in ranks)  # (interleaved: chunk v of stage s is virtual stage v * stages + s)
    for f, r in zip(files, ranks):
        at = by_rank.setdefault((r["tp"], r.get("ep", 0)), {})
        first = (r.get("vp", 0) * stages + r.get("pp", 0)) * layers // (stages * chunks)
        for k, v in load_file(os.path.join(run, "reference", f)).items():  # a stage's layers, numbered from 0
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", k)
            at[k if m is None else f"decoder.layers.{first + int(m[1])}.{m[2]}"] = v
    tps = sorted({t for t, _ in by_rank})
    eps = sorted({e for _, e in by_rank})
    parts = [by_rank[(t, 0)] for t in tps]
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
        for norm in ("q", "k"):  # Qwen3's RMSNorm on each query and key head (the same on every rank)
            if f"{m}self_attention.{norm}_layernorm.weight" in parts[0]:
                out[f"{h}self_attn.{norm}_norm.weight"] = parts[0][f"{m}self_attention.{norm}_layernorm.weight"]
        if m + "mlp.router.weight" in parts[0]:
            out.update(_experts(cfg, m, h, by_rank, tps, eps, parts))
        else:
            fc1 = [p[m + "mlp.linear_fc1.weight"] for p in parts]  # each rank: its gate rows, then its up rows
            out[h + "mlp.gate_proj.weight"] = torch.cat([f[:ffn // tp] for f in fc1])
            out[h + "mlp.up_proj.weight"] = torch.cat([f[ffn // tp:] for f in fc1])
            out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        out[h + "input_layernorm.weight"] = parts[0][m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = parts[0][m + "pre_mlp_layernorm.weight"]
    return out


def _swiglu(fc1: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up of a SwiGLU fc1 cut over tensor-parallel ranks: each rank its gate rows, then its up rows."""
    return torch.cat([f[:f.shape[0] // 2] for f in fc1]), torch.cat([f[f.shape[0] // 2:] for f in fc1])


def _experts(cfg, m, h, by_rank, tps, eps, parts) -> dict[str, torch.Tensor]:
    mixtral = cfg["model_type"] == "mixtral"
    block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj", "up_proj",
                                                                                    "down_proj")
    n = cfg.get("num_local_experts") or cfg["num_experts"]
    per = n // len(eps)
    out = {f"{h}{block}.gate.weight": parts[0][m + "mlp.router.weight"]}
    for ep in eps:
        for j in range(per):
            e, at = ep * per + j, f"{m}mlp.experts.local_experts.{j}."
            ranks = [by_rank[(t, ep)] for t in tps]
            g, u = _swiglu([r[at + "linear_fc1.weight"] for r in ranks])
            out[f"{h}{block}.experts.{e}.{gate}.weight"], out[f"{h}{block}.experts.{e}.{up}.weight"] = g, u
            out[f"{h}{block}.experts.{e}.{down}.weight"] = torch.cat([r[at + "linear_fc2.weight"] for r in ranks], 1)
    if m + "mlp.shared_experts.linear_fc1.weight" in parts[0]:  # Qwen2-MoE's shared expert and its gate
        g, u = _swiglu([p[m + "mlp.shared_experts.linear_fc1.weight"] for p in parts])
        out[h + "mlp.shared_expert.gate_proj.weight"], out[h + "mlp.shared_expert.up_proj.weight"] = g, u
        out[h + "mlp.shared_expert.down_proj.weight"] = torch.cat(
            [p[m + "mlp.shared_experts.linear_fc2.weight"] for p in parts], 1)
        out[h + "mlp.shared_expert_gate.weight"] = parts[0][m + "mlp.shared_experts.gate_weight"]
    return out
