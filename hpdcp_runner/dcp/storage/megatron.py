"""Megatron-Core ``torch_dist`` checkpoints read in place, under Hugging Face names.

Megatron-Core's ``dist_checkpointing.save`` (backend ``torch_dist``) writes a torch DCP directory
(``.metadata`` + ``__<rank>_<n>.distcp``) plus a ``metadata.json`` naming the backend; a training
run keeps one per iteration (``iter_0000002``) and names the newest in
``latest_checkpointed_iteration.txt``. Its GPT model's keys are stacked over layers
(``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[layers, rows, hidden]``), the
norms are kept beside the linear they precede (``linear_qkv.layer_norm_weight``), the fused QKV
rows are interleaved per query group (that group's query heads, then its key head, then its value
head) and SwiGLU's ``fc1`` is all gate rows, then all up rows.

Read through :class:`~.foreign.TorchDcpReader` (so every record's bytes are located and checked
as for any torch DCP checkpoint), then described under Hugging Face's Llama names when the model's
``config.json`` is given (``hf_config``): each layer's slice of a stacked tensor, each query
group's q, k and v rows and fc1's gate and up halves become chunks of the Hugging Face tensors
that point straight at their bytes in the ``.distcp`` files (a row range of a record is contiguous).
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

from ..core.errors import CheckpointNotFoundError, ConfigError, MetadataError
from ..format.metadata import ChunkMeta, Metadata, TensorMeta, dtype_from_name
from .foreign import TorchDcpReader
from .format_marks import MEGATRON_MARKER as MARKER, MEGATRON_TRACKER as TRACKER, backend_of

if TYPE_CHECKING:
    from .checkpoint_files import CheckpointFiles
    from .location import Location

_LAYER = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")


def step_directory(loc: "Location", options: object = None) -> "Location":
    """``loc`` when it is an iteration directory, else the one its tracker file names
    (``iter_<7 digits>`` or ``release``), checked to be Megatron's ``torch_dist``."""
    from .location import locate
    from .uri import join

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
    if backend != "torch_dist":
        raise MetadataError(f"{join(loc.url, MARKER)}: a Megatron-Core checkpoint of backend {backend!r}; only "
                            f"'torch_dist' (torch DCP files) is read (re-save it with --ckpt-format torch_dist)")
    return loc


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the mapping needs of the model: heads, key/value groups, head size, layers, MLP width."""

    heads: int
    groups: int
    head_dim: int
    layers: int
    ffn: int

    @classmethod
    def from_config(cls, cfg: dict, where: str) -> "Shape":
        try:
            heads = int(cfg["num_attention_heads"])
            groups = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            return cls(heads, groups, head_dim, int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: a Llama-style config.json is needed to name a Megatron GPT checkpoint's "
                              f"weights (missing or bad {e})") from None


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


def _select(tm: TensorMeta, key: str, layer: int | None, rows: list[tuple[int, int]] | None) -> TensorMeta:
    """The tensor made of rows ``rows`` (in order; None: all) of layer ``layer`` (None: the tensor
    is not stacked) of ``tm``: chunks pointing into ``tm``'s chunks' bytes."""
    dt = dtype_from_name(tm.dtype)
    esize = torch.empty((), dtype=dt).element_size()
    shape = tuple(tm.shape[1:]) if layer is not None else tuple(tm.shape)
    rows = rows if rows is not None else [(0, shape[0] if shape else 1)]
    out_rows = sum(b - a for a, b in rows)
    out_shape = (out_rows, *shape[1:]) if shape else ()
    chunks = []
    for c in tm.chunks:
        offs, sizes, base = tuple(c.offsets), tuple(c.sizes), c.byte_offset
        if layer is not None:
            if not offs[0] <= layer < offs[0] + sizes[0]:
                continue
            base += (layer - offs[0]) * math.prod(sizes[1:]) * esize
            offs, sizes = offs[1:], sizes[1:]
        if not shape:
            chunks.append(ChunkMeta((), (), c.file, key, base, c.checksum if layer is None else ""))
            continue
        at = 0
        for a, b in rows:
            x, y = max(a, offs[0]), min(b, offs[0] + sizes[0])
            if x < y:
                row_bytes = math.prod(sizes[1:]) * esize
                whole = layer is None and (x, y) == (offs[0], offs[0] + sizes[0])
                chunks.append(ChunkMeta((at + x - a, *offs[1:]), (y - x, *sizes[1:]), c.file, key,
                                        base + (x - offs[0]) * row_bytes, c.checksum if whole else ""))
            at += b - a
    return TensorMeta(tm.dtype, out_shape, tuple(chunks), (key,))


def to_hf(md: Metadata, shape: Shape, where: str) -> Metadata:
    """``md`` (a Megatron GPT checkpoint described as torch DCP) under Hugging Face Llama names."""
    out: dict[str, TensorMeta] = {}
    unknown = []

    def put(name: str, tm: TensorMeta) -> None:
        if name in out:
            raise MetadataError(f"{where}: two Megatron tensors map to {name!r}")
        out[name] = tm

    for key, tm in sorted(md.tensors.items()):
        if key in _WHOLE:
            put(_WHOLE[key], _select(tm, _WHOLE[key], None, None))
            continue
        m = _LAYER.fullmatch(key)
        if m is None:
            unknown.append(key)
            continue
        fixed, rest = m.group(1), m.group(2)
        layers = [int(fixed)] if fixed is not None else list(range(tm.shape[0]))
        if fixed is None and tm.shape[0] != shape.layers:
            raise MetadataError(f"{where}: {key!r} stacks {tm.shape[0]} layers; config.json says {shape.layers}")
        for i in layers:
            layer = None if fixed is not None else i
            prefix = f"model.layers.{i}."
            if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                rows = (shape.heads + 2 * shape.groups) * shape.head_dim
                got = tm.shape[1] if fixed is None else tm.shape[0]
                if got != rows:
                    raise MetadataError(f"{where}: {key!r} has {got} rows; config.json's {shape.heads} heads in "
                                        f"{shape.groups} groups of size {shape.head_dim} make {rows}")
                what = rest.rsplit(".", 1)[1]
                for part, sel in _qkv_rows(shape).items():
                    put(f"{prefix}self_attn.{part}.{what}", _select(tm, f"{prefix}self_attn.{part}.{what}", layer, sel))
            elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
                got = tm.shape[1] if fixed is None else tm.shape[0]
                if got != 2 * shape.ffn:
                    raise MetadataError(f"{where}: {key!r} has {got} rows; a SwiGLU MLP of config.json's "
                                        f"intermediate_size {shape.ffn} has {2 * shape.ffn}")
                what = rest.rsplit(".", 1)[1]
                for part, sel in (("gate_proj", [(0, shape.ffn)]), ("up_proj", [(shape.ffn, 2 * shape.ffn)])):
                    put(f"{prefix}mlp.{part}.{what}", _select(tm, f"{prefix}mlp.{part}.{what}", layer, sel))
            elif rest in _PER_LAYER:
                put(prefix + _PER_LAYER[rest], _select(tm, prefix + _PER_LAYER[rest], layer, None))
            else:
                unknown.append(key)
                break
    if unknown:
        raise MetadataError(f"{where}: {len(unknown)} Megatron tensor(s) have no Hugging Face name in the GPT (Llama) "
                            f"mapping, e.g. {unknown[:3]} (mixture-of-experts and other modules are not mapped yet); "
                            f"leave job.hf_files_from unset to read the checkpoint under Megatron's own names")
    extra = dict(md.extra, source_format="megatron", megatron={"names": "hf", "layers": shape.layers})
    return Metadata(md.world_size, out, {}, md.files, extra=extra)


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
