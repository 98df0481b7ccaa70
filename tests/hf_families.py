"""Tiny Hugging Face models of many families, built by transformers itself (``from_config``, real
head / key-value head / expert counts, two layers) and written by ``save_pretrained``: what
``layout=auto`` is tested on. Every family listed has a tensor- or expert-parallel plan in
transformers 5.x; EXPERT_FAMILIES place experts."""

from __future__ import annotations

import json
from pathlib import Path

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=64, moe_intermediate_size=32, num_experts=4,
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
            n_shared_experts=1, shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# shapes other than BASE's, so nothing passes for one width only: 2 key/value heads (replicated at
# 4 ranks), 12 heads of 16 (4 kv), uneven MLP widths, bfloat16 files
VARIANTS = {
    "starcoder2": dict(num_key_value_heads=2, intermediate_size=72),
    "qwen2": dict(hidden_size=192, num_attention_heads=12, num_key_value_heads=4, head_dim=16, intermediate_size=100),
    "gemma2": dict(head_dim=16, hidden_size=96, num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(num_local_experts=8, num_experts=8, num_key_value_heads=2),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=24),
}
BF16 = {"llama", "qwen3", "olmoe", "granitemoe", "phi3"}
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "olmo3",
                  "starcoder2", "phi3", "phi", "granite", "cohere", "cohere2", "glm", "glm4", "helium", "gpt_neox",
                  "exaone4", "smollm3", "seed_oss", "apertus", "arcee", "nemotron")
EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "hunyuan_v1_moe",
                   "glm4_moe", "flex_olmo", "dots1", "gpt_oss", "deepseek_v3", "minimax", "ernie4_5_moe")
FAMILIES = DENSE_FAMILIES + EXPERT_FAMILIES


def build(family: str, where: Path, seed: int = 0):
    """``save_pretrained`` of a tiny ``family`` model into ``where``; returns the model (eval)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**BASE, **VARIANTS.get(family, {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family in BF16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(where)
    return model


def shapes(where: Path) -> tuple[dict, dict]:
    """(config.json, {file key: shape}) of a directory ``build`` wrote."""
    from safetensors import safe_open

    raw = json.loads((where / "config.json").read_text())
    out = {}
    for f in sorted(where.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return raw, out
