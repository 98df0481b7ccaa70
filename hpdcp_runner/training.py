"""A small GPT-like model trained deterministically under any layout and world size.

Parameters are placed by the same layout rules as the synthetic workloads (DTensors on a mesh,
or plain replicated tensors) and have the same names as ``workloads.transformer_shapes``. One
step works like ZeRO-3 made reproducible:

1. every rank gathers the full parameters (``DTensor.full_tensor``);
2. the global batch is ``units`` fixed micro-batches; unit ``u`` is computed by rank ``u % W``,
   its gradient written into row ``u`` of a ``[units, numel]`` buffer (zeros elsewhere);
3. one all-reduce of that buffer (each row has one non-zero contributor, so the sum is exact) and
   a sum over rows in unit order: the gradient is bitwise the same at every world size;
4. each rank keeps its shard of the gradient and steps AdamW on its shards.

Randomness is global, not per rank: the data sampler and the dropout seeds come from one
``torch.Generator`` that every rank advances identically, so it is checkpointed once and
restores at any world size. The per-rank torch RNG is checkpointed per rank (see
``jobs/train.py`` for what happens when the world size changes).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layouts import Placer
from .workloads import MODEL_DTYPES, transformer_shapes


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def build_model(m: Any, placer: Placer) -> torch.nn.Module:
    """An ``nn.Module`` whose parameters carry the transformer FQNs, placed by ``placer``.

    Initialisation is a function of ``m.seed`` alone (every rank builds the same full tensors
    and keeps its own pieces), so any layout starts from the same model.
    """
    g = torch.Generator().manual_seed(m.seed)
    root = torch.nn.Module()
    for fqn, shape in transformer_shapes(m).items():
        if fqn.endswith("norm.weight"):
            full = torch.ones(shape)
        elif fqn.endswith(".bias"):
            full = torch.zeros(shape)
        else:
            full = torch.randn(shape, generator=g) * (0.02 if "embed" in fqn or "head" in fqn else 1 / math.sqrt(shape[-1]))
        mod = root
        *parents, leaf = fqn.split(".")
        for name in parents:
            if not hasattr(mod, name):
                mod.add_module(name, torch.nn.Module())
            mod = getattr(mod, name)
        mod.register_parameter(leaf, torch.nn.Parameter(placer.place(fqn, full.to(MODEL_DTYPES[m.dtype]))))
    return root


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Leaf tensors holding each parameter's full value (the unshard step), requiring grad."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if _is_dtensor(p) else p
        out[name] = full.detach().clone().requires_grad_(True)
    return out


def _sinusoid(seq: int, hidden: int) -> torch.Tensor:
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    i = torch.arange(0, hidden, 2, dtype=torch.float64)
    ang = pos / (10000 ** (i / hidden))
    pe = torch.zeros(seq, hidden, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(ang)
    pe[:, 1::2] = torch.cos(ang)[:, : hidden // 2]
    return pe.to(torch.float32)


def _dropout(x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    if p <= 0:
        return x
    keep = torch.rand(x.shape, generator=gen) >= p
    return x * keep.to(x.device, x.dtype) / (1 - p)


def forward_loss(P: dict[str, torch.Tensor], tokens: torch.Tensor, m: Any, heads: int, dropout: float,
                 gen: torch.Generator) -> torch.Tensor:
    """Causal LM loss of one micro-batch ``tokens`` [b, seq+1] under full parameters ``P``."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    b, t = inp.shape
    h = m.hidden
    x = P["embed.weight"][inp] + _sinusoid(t, h).to(P["embed.weight"])
    mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    for i in range(m.layers):
        pre = f"layers.{i}."
        y = F.layer_norm(x, (h,), P[pre + "attn_norm.weight"])
        q, k, v = (y @ P[pre + "attn.qkv.weight"].T).split(h, dim=-1)
        q, k, v = (z.reshape(b, t, heads, h // heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(h // heads)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, h)
        x = x + _dropout(y @ P[pre + "attn.out.weight"].T, dropout, gen)
        y = F.layer_norm(x, (h,), P[pre + "mlp_norm.weight"])
        y = F.gelu(y @ P[pre + "mlp.up.weight"].T) @ P[pre + "mlp.down.weight"].T + P[pre + "mlp.down.bias"]
        x = x + _dropout(y, dropout, gen)
    x = F.layer_norm(x, (h,), P["final_norm.weight"])
    logits = x @ P["head.weight"].T
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))


class Corpus:
    """A deterministic token stream with learnable structure (a noisy affine recurrence)."""

    def __init__(self, vocab: int, length: int = 8192, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        noise = torch.randint(0, 3, (length,), generator=g)
        toks = torch.empty(length, dtype=torch.int64)
        toks[0] = 1
        for i in range(1, length):
            toks[i] = (toks[i - 1] * 5 + 3 + noise[i]) % vocab
        self.tokens = toks

    def batch(self, starts: torch.Tensor, seq: int) -> torch.Tensor:
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        return self.tokens[idx]


class Trainer:
    """One rank's view of the reproducible data-parallel x sharded training loop."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, m: Any, *, units: int,
                 micro_batch: int, heads: int, seq_len: int, dropout: float, rank: int, world_size: int,
                 seed: int) -> None:
        self.model, self.opt, self.m = model, optimizer, m
        self.units, self.micro_batch, self.heads, self.seq = units, micro_batch, heads, seq_len
        self.dropout, self.rank, self.world_size = dropout, rank, world_size
        self.corpus = Corpus(m.vocab)
        self.rng = torch.Generator().manual_seed(seed)  # global: identical on every rank
        self.step = 0
        self.data_position = 0  # samples consumed, globally
        #: called once per step just before the optimizer changes the parameters and its state:
        #: where a save staged in the background must have copied them
        self.before_update: Callable[[], None] | None = None

    def train_step(self) -> float:
        P = full_params(self.model)
        names = list(P)
        numel = sum(t.numel() for t in P.values())
        starts = torch.randint(0, self.corpus.tokens.numel() - self.seq - 1,
                               (self.units, self.micro_batch), generator=self.rng)
        seeds = torch.randint(0, 2**62, (self.units,), generator=self.rng)
        device = next(iter(P.values())).device
        G = torch.zeros(self.units, numel, dtype=torch.float32, device=device)
        losses = torch.zeros(self.units, dtype=torch.float32, device=device)
        for u in range(self.rank, self.units, self.world_size):
            gen = torch.Generator().manual_seed(int(seeds[u]))
            loss = forward_loss(P, self.corpus.batch(starts[u], self.seq).to(device), self.m, self.heads,
                                self.dropout, gen)
            grads = torch.autograd.grad(loss, [P[n] for n in names])
            G[u] = torch.cat([g.reshape(-1).float() for g in grads])
            losses[u] = loss.detach()
        if self.world_size > 1:
            dist.all_reduce(G)
            dist.all_reduce(losses)
        flat = G.sum(0) / self.units
        self._apply_grads(flat, names, P)
        if self.before_update is not None:
            self.before_update()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.data_position += self.units * self.micro_batch
        return float(losses.sum() / self.units)

    def _apply_grads(self, flat: torch.Tensor, names: list[str], P: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        from .dcp.tools import dtensor_local_box, narrow

        params = dict(self.model.named_parameters())
        pos = 0
        for n in names:
            full = flat[pos: pos + P[n].numel()].view(P[n].shape).to(P[n].dtype)
            pos += P[n].numel()
            p = params[n]
            if _is_dtensor(p):
                box = dtensor_local_box(p)
                local = narrow(full, box.offsets, box.sizes)
                p.grad = DTensor.from_local(local.contiguous(), p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad = full.clone()
