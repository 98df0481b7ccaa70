"""Megatron-Core ``torch_dist`` checkpoints read in place, under Hugging Face names.

Megatron-Core's ``dist_checkpointing.save`` (backend ``torch_dist``) writes a torch DCP directory
(``.metadata`` + ``__<rank>_<n>.distcp``) plus a ``metadata.json`` naming the backend; a training
run keeps one per iteration (``iter_0000002``) and names the newest in
``latest_checkpointed_iteration.txt``. Its GPT model's keys are stacked over layers
(``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[layers, rows, hidden]``), the
norms are kept beside the linear they precede (``linear_qkv.layer_norm_weight``), the fused QKV
rows are interleaved per query group (that group's query heads, then its key head, then its value
head) and SwiGLU's ``fc1`` is all gate rows, then all up rows. A mixture of experts stacks its
experts too (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape ``[layers, experts,
2 * width, hidden]``) beside its router (``mlp.router.weight``) and, in Qwen2-MoE's shape, a shared
expert and its gate (``mlp.shared_experts.*``); a model mixing dense and expert layers writes
per-layer keys (``decoder.layers.<i>.``) instead of stacked ones.

Read through :class:`~.foreign.TorchDcpReader` (so every record's bytes are located and checked
as for any torch DCP checkpoint), then described under Hugging Face's Llama names when the model's
``config.json`` is given (``hf_config``): each layer's slice of a stacked tensor, each query
group's q, k and v rows and fc1's gate and up halves become chunks of the Hugging Face tensors
that point straight at their bytes in the ``.distcp`` files (a row range of a record is contiguous);
experts take the names of the family ``config.json``'s ``model_type`` says (``_MOE_NAMES``).
Nothing is copied or converted; a load, a reshard or an export reads only what it keeps. Without
a configuration the checkpoint reads as the torch DCP checkpoint it is, under Megatron's names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import TYPE_CHECKING, Any

import torch

from ...core.errors import CheckpointNotFoundError, ConfigError, MetadataError
from ...format.metadata import ChunkMeta, Metadata, TensorMeta, dtype_from_name
from .foreign import TorchDcpReader
from .format_marks import MEGATRON_MARKER as MARKER, MEGATRON_TRACKER as TRACKER, backend_of, megatron_rank_dirs

if TYPE_CHECKING:
    from ..checkpoint_files import CheckpointFiles
    from ..location import Location

_LAYER = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")


def step_directory(loc: "Location", options: object = None) -> "tuple[Location, list[str]]":
    """``loc`` when it is an iteration directory, else the one its tracker file names
    (``iter_<7 digits>`` or ``release``), and its legacy rank directories (``mp_rank_*``; none
    for a ``torch_dist`` checkpoint, the only other backend read)."""
    from ..location import locate
    from ..uri import join

    names = set(loc.files())
    if TRACKER in names and MARKER not in names:
        text = (loc.read_small(TRACKER, 256) or b"").decode("utf-8", "replace").strip()
        if text == "release":
            tag = "release"
        elif text.isdigit():
            tag = f"iter_{int(text):07d}"
        else:
            raise MetadataError(f"{join(loc.url, TRACKER)}: holds {text[:40]!r}, not an iteration number or 'release'")
        step = locate(join(loc.url, tag), options=options)
        if not step.is_dir():
            raise CheckpointNotFoundError(f"{join(loc.url, TRACKER)} names iteration {text}, but {step.url} is missing")
        loc, names = step, set(step.files())
    backend = backend_of(loc, names)
    if backend is None and MARKER not in names and (rank_dirs := megatron_rank_dirs(loc.dirs())):
        return loc, rank_dirs
    if backend != "torch_dist":
        raise MetadataError(f"{join(loc.url, MARKER)}: a Megatron-Core checkpoint of backend {backend!r}; only "
                            f"'torch_dist' (torch DCP files) and the legacy 'torch' format (mp_rank_* directories) "
                            f"are read (re-save it with --ckpt-format torch_dist)")
    return loc, []


#: A mixture of experts' Hugging Face names, per family: (the block holding the router ``gate``
#: and ``experts.<e>``, the experts' gate, up and down projections). Only families whose names
#: and layout were checked against transformers (their own checkpoints load with no key missing).
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the mapping needs of the model: heads, key/value groups, head size, layers, MLP width,
    and for a mixture of experts its family, expert count, expert and shared-expert widths."""

    heads: int
    groups: int
    head_dim: int
    layers: int
    ffn: int
    family: str = "llama"
    experts: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_config(cls, cfg: dict, where: str) -> "Shape":
        try:
            heads = int(cfg["num_attention_heads"])
            groups = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            family = str(cfg.get("model_type") or "llama")
            experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
            expert_ffn = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0
            return cls(heads, groups, head_dim, int(cfg["num_hidden_layers"]), int(cfg.get("intermediate_size") or 0),
                       family, experts, expert_ffn, int(cfg.get("shared_expert_intermediate_size") or 0))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: a Llama-style config.json is needed to name a Megatron GPT checkpoint's "
                              f"weights (missing or bad {e})") from None

    def moe_names(self, where: str, key: str) -> tuple[str, str, str, str]:
        """The family's names for a mixture of experts (see ``_MOE_NAMES``), or a one-line refusal."""
        if self.family not in _MOE_NAMES or not self.experts:
            raise MetadataError(f"{where}: {key!r} is a mixture of experts; config.json's model_type "
                                f"{self.family!r} {'has no experts' if not self.experts else 'is not mapped'} "
                                f"(mapped: {', '.join(sorted(_MOE_NAMES))})")
        return _MOE_NAMES[self.family]


# (Megatron name after ``decoder.layers.[<i>.]``, Hugging Face name after ``model.layers.<i>.``, parts)
# parts: [(hf suffix, which rows)]; "qkv" and "fc1" are cut as the module docstring says
_PER_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# Qwen2-MoE's shared expert (beside the routed ones; its fc1 is cut as a dense MLP's) and the
# sigmoid gate that scales it
_SHARED = {"mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
           "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
_WHOLE = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
          "output_layer.weight": "lm_head.weight",
          "decoder.final_layernorm.weight": "model.norm.weight"}


def _qkv_rows(s: Shape) -> dict[str, list[tuple[int, int]]]:
    """The rows of a fused QKV weight (or bias) that make q, k and v, in Hugging Face's order."""
    per = s.heads // s.groups
    span = (per + 2) * s.head_dim
    out: dict[str, list[tuple[int, int]]] = {"q_proj": [], "k_proj": [], "v_proj": []}
    for g in range(s.groups):
        base = g * span
        out["q_proj"].append((base, base + per * s.head_dim))
        out["k_proj"].append((base + per * s.head_dim, base + (per + 1) * s.head_dim))
        out["v_proj"].append((base + (per + 1) * s.head_dim, base + span))
    return out


def _select(tm: TensorMeta, key: str, index: tuple[int, ...], rows: list[tuple[int, int]] | None) -> TensorMeta:
    """The tensor made of rows ``rows`` (in order; None: all) of ``tm[index]`` (``index`` fixes the
    leading stacked axes: a layer, then an expert; empty: the tensor is not stacked): chunks
    pointing into ``tm``'s chunks' bytes."""
    dt = dtype_from_name(tm.dtype)
    esize = torch.empty((), dtype=dt).element_size()
    n = len(index)
    shape = tuple(tm.shape[n:])
    rows = rows if rows is not None else [(0, shape[0] if shape else 1)]
    out_rows = sum(b - a for a, b in rows)
    out_shape = (out_rows, *shape[1:]) if shape else ()
    chunks = []
    for c in tm.chunks:
        offs, sizes, base = tuple(c.offsets), tuple(c.sizes), c.byte_offset
        if any(not o <= i < o + z for i, o, z in zip(index, offs, sizes)):
            continue
        if n:  # the element of the chunk's leading axes that is tm[index]: row-major offset
            flat = 0
            for i, o, z in zip(index, offs, sizes):
                flat = flat * z + (i - o)
            base += flat * math.prod(sizes[n:]) * esize
            offs, sizes = offs[n:], sizes[n:]
        if not shape:
            chunks.append(ChunkMeta((), (), c.file, key, base, c.checksum if not n else ""))
            continue
        at = 0
        for a, b in rows:
            x, y = max(a, offs[0]), min(b, offs[0] + sizes[0])
            if x < y:
                row_bytes = math.prod(sizes[1:]) * esize
                whole = not n and (x, y) == (offs[0], offs[0] + sizes[0])
                chunks.append(ChunkMeta((at + x - a, *offs[1:]), (y - x, *sizes[1:]), c.file, key,
                                        base + (x - offs[0]) * row_bytes, c.checksum if whole else ""))
            at += b - a
    return TensorMeta(tm.dtype, out_shape, tuple(chunks), (key,))


def _layers_held(tm: TensorMeta) -> list[int]:
    """The layers a layer-stacked tensor has chunks for: a model that mixes dense and expert layers
    stacks each kind over all layers and writes only the layers of its kind."""
    return sorted({i for c in tm.chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])})


def _rows_of(tm: TensorMeta, n: int) -> int:
    return tm.shape[n] if len(tm.shape) > n else 0


class _HfNames:
    """The Hugging Face description built record by record; a name given twice is refused."""

    def __init__(self, shape: Shape, where: str) -> None:
        self.shape, self.where = shape, where
        self.out: dict[str, TensorMeta] = {}

    def put(self, name: str, tm: TensorMeta, index: tuple[int, ...] = (),
            rows: list[tuple[int, int]] | None = None) -> None:
        if name in self.out:
            raise MetadataError(f"{self.where}: two Megatron tensors map to {name!r}")
        self.out[name] = _select(tm, name, index, rows)

    def halves(self, tm: TensorMeta, key: str, index: tuple[int, ...], ffn: int, names: list[str]) -> None:
        """SwiGLU's fc1: all gate rows, then all up rows (``ffn`` each), as ``names``' weights."""
        got = _rows_of(tm, len(index))
        if got != 2 * ffn:
            raise MetadataError(f"{self.where}: {key!r} has {got} rows; a SwiGLU MLP of config.json's width {ffn} "
                                f"has {2 * ffn}")
        for name, sel in zip(names, ([(0, ffn)], [(ffn, 2 * ffn)])):
            self.put(name, tm, index, sel)

    def experts(self, tm: TensorMeta, key: str, layer: tuple[int, ...]) -> int:
        held = tm.shape[len(layer)] if len(tm.shape) > len(layer) else 0
        if held != self.shape.experts:
            raise MetadataError(f"{self.where}: {key!r} holds {held} experts; config.json says {self.shape.experts}")
        return held

    def layer(self, key: str, rest: str, tm: TensorMeta, i: int, layer: tuple[int, ...]) -> bool:
        """Layer ``i``'s part of record ``key`` (``rest``: its name after ``decoder.layers.``)
        under Hugging Face names; False when the mapping has no name for it."""
        shape, prefix = self.shape, f"model.layers.{i}."
        what = rest.rsplit(".", 1)[1]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            rows = (shape.heads + 2 * shape.groups) * shape.head_dim
            if _rows_of(tm, len(layer)) != rows:
                raise MetadataError(f"{self.where}: {key!r} has {_rows_of(tm, len(layer))} rows; config.json's "
                                    f"{shape.heads} heads in {shape.groups} groups of size {shape.head_dim} make {rows}")
            for part, sel in _qkv_rows(shape).items():
                self.put(f"{prefix}self_attn.{part}.{what}", tm, layer, sel)
        elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            self.halves(tm, key, layer, shape.ffn, [f"{prefix}mlp.gate_proj.{what}", f"{prefix}mlp.up_proj.{what}"])
        elif rest == "mlp.router.weight":
            block = shape.moe_names(self.where, key)[0]
            self.experts(tm, key, layer)
            self.put(f"{prefix}{block}.gate.weight", tm, layer)
        elif rest in ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"):
            block, gate, up, down = shape.moe_names(self.where, key)
            for e in range(self.experts(tm, key, layer)):
                at = f"{prefix}{block}.experts.{e}."
                if rest.endswith("fc1.weight"):
                    self.halves(tm, key, (*layer, e), shape.expert_ffn, [f"{at}{gate}.weight", f"{at}{up}.weight"])
                else:
                    self.put(f"{at}{down}.weight", tm, (*layer, e))
        elif rest == "mlp.shared_experts.linear_fc1.weight" and shape.family == "qwen2_moe":
            self.halves(tm, key, layer, shape.shared_ffn, [f"{prefix}mlp.shared_expert.gate_proj.weight",
                                                           f"{prefix}mlp.shared_expert.up_proj.weight"])
        elif rest in _SHARED and shape.family == "qwen2_moe":
            self.put(prefix + _SHARED[rest], tm, layer)
        elif rest in _PER_LAYER:
            self.put(prefix + _PER_LAYER[rest], tm, layer)
        else:
            return False
        return True


def to_hf(md: Metadata, shape: Shape, where: str) -> Metadata:
    """``md`` (a Megatron GPT checkpoint described as torch DCP) under Hugging Face names: Llama's,
    Qwen2's, or a mixture of experts' family's (see the module docstring)."""
    names = _HfNames(shape, where)
    unknown = []
    for key, tm in sorted(md.tensors.items()):
        if key in _WHOLE:
            names.put(_WHOLE[key], tm)
            continue
        m = _LAYER.fullmatch(key)
        if m is None:
            unknown.append(key)
            continue
        fixed, rest = m.group(1), m.group(2)
        if fixed is None and tm.shape[0] != shape.layers:
            raise MetadataError(f"{where}: {key!r} stacks {tm.shape[0]} layers; config.json says {shape.layers}")
        for i in [int(fixed)] if fixed is not None else _layers_held(tm):
            if not names.layer(key, rest, tm, i, () if fixed is not None else (i,)):
                unknown.append(key)
                break
    if unknown:
        raise MetadataError(f"{where}: {len(unknown)} Megatron tensor(s) have no Hugging Face name in the GPT "
                            f"mapping, e.g. {unknown[:3]} (mapped: Llama, Qwen2 and the experts of "
                            f"{', '.join(sorted(_MOE_NAMES))}); "
                            f"leave job.hf_files_from unset to read the checkpoint under Megatron's own names")
    extra = dict(md.extra, source_format="megatron", megatron={"names": "hf", "layers": shape.layers})
    return Metadata(md.world_size, names.out, {}, md.files, extra=extra)


class MegatronReader(TorchDcpReader):
    """A Megatron-Core ``torch_dist`` iteration directory (see the module docstring)."""

    format_name = "megatron"

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", *, hf_config: dict | None = None,
                 config_source: str = "config.json", **kwargs: Any) -> None:
        super().__init__(files, **kwargs)
        self.hf_config, self.config_source = hf_config, config_source

    def describe(self) -> Metadata:
        md = super().describe()
        if self.hf_config is None:
            return Metadata(md.world_size, md.tensors, md.objects, md.files,
                            extra=dict(md.extra, source_format="megatron", megatron={"names": "megatron"}))
        return to_hf(md, Shape.from_config(self.hf_config, self.config_source), self.path)
