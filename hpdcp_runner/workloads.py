"""Deterministic reference state dicts: a synthetic transformer-like parameter set, the peer
benchmark's tensor mix, and a small real nn.Module with AdamW state.

Contents are a cheap function of (key, element index), identical on every rank and every run,
so any loaded shard can be checked against its reference without collectives.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def content(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic values in [-2, 2) that differ per key and per element."""
    n = math.prod(shape)
    salt = (zlib.crc32(key.encode()) + seed * 7919) % 1000003
    idx = torch.arange(n, dtype=torch.int64)
    vals = ((idx * 2654435761 + salt) % 1021).to(torch.float32) / 256.0 - 2.0
    return vals.to(dtype).reshape(shape)


def transformer_shapes(m: Any) -> dict[str, tuple[int, ...]]:
    h, f, v = m.hidden, m.ffn, m.vocab
    shapes = {"embed.weight": (v, h)}
    for i in range(m.layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "attn.qkv.weight": (3 * h, h), p + "attn.out.weight": (h, h),
                       p + "mlp_norm.weight": (h,), p + "mlp.up.weight": (f, h), p + "mlp.down.weight": (h, f),
                       p + "mlp.down.bias": (h,)})
    shapes.update({"final_norm.weight": (h,), "head.weight": (v, h)})
    return shapes


def peer_shapes(m: Any) -> dict[str, tuple[int, ...]]:
    """peer_baseline.md §4: 15 x 4096x4096 + 64 x 512x512 + 2000 x 1024 (1.008 GiB in fp32)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(15):
        shapes[f"big.{i}"] = (m.big_rows, 4096)
    for i in range(64):
        shapes[f"mid.{i}"] = (512, 512)
    for i in range(2000):
        shapes[f"small.{i}"] = (1024,)
    return shapes


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def reference_state(m: Any) -> dict[str, Any]:
    """The full (unsharded) reference state dict for a model config."""
    dtype = MODEL_DTYPES[m.dtype]
    if m.kind == "mlp_adamw":
        return mlp_adamw_state(m)
    shapes = transformer_shapes(m) if m.kind == "transformer" else peer_shapes(m)
    model = {k: content(k, s, dtype, m.seed) for k, s in shapes.items()}
    return {"model": _nested(model) if m.kind == "transformer" else model,
            "meta": {"step": 100, "model": m.name, "seed": m.seed}}


def mlp_adamw_state(m: Any) -> dict[str, Any]:
    """A real 2-layer MLP after two deterministic AdamW steps, with FQN-keyed optimizer state."""
    g = torch.Generator().manual_seed(m.seed)
    net = torch.nn.Sequential(torch.nn.Linear(m.hidden, m.ffn), torch.nn.GELU(), torch.nn.Linear(m.ffn, m.hidden))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(8, m.hidden, generator=g)
    for _ in range(2):
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    names = {id(p): n for n, p in net.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        state[names[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
    groups = [{k: v for k, v in grp.items() if k != "params"} | {"params": [names[id(p)] for p in grp["params"]]}
              for grp in opt.param_groups]
    dtype = MODEL_DTYPES[m.dtype]
    model = {n: p.detach().to(dtype).clone() for n, p in net.named_parameters()}
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "meta": {"step": 2, "model": m.name}}


def zeros_like_state(sd: Any) -> Any:
    """A load target with the same structure: tensors zeroed, other leaves neutral."""
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, (bool, int, float, str)):
        return type(sd)()
    return None
