"""DeepSpeed checkpoints saved under pipeline parallelism (``deepspeed.pipe.PipelineModule``: what
Megatron-DeepSpeed, GPT-NeoX and BLOOM's training ran): every stage's parameters as one model.

Such a step directory holds, per pipeline stage ``S`` (its model-parallel rank ``M``: the stage
times the tensor-parallel size plus the tensor-parallel rank), ``mp_rank_<M>_model_states.pt`` (no
module weights, ``module: None``; ``param_shapes`` names the stage's parameters as the
PipelineModule does: ``<layer index>.<name in the layer>``, and ``tied_modules.<key>.<name>`` for a
layer tied across stages, e.g. an embedding reused as the output head) and the ZeRO 0/1 optimizer
files of its data-parallel ranks (``[bf16_]zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt``). The
module's weights are in one file per layer, ``layer_<NN>[-model_<TT>]-model_states.pt`` (the
layer's own state dict, written by the stage that holds it; a tied layer by every stage that
holds it).

Each stage reads as a ZeRO checkpoint of its own parameters (``deepspeed.DeepSpeedReader``); the
stages' names are disjoint but for tied layers, which every stage holding one keeps (the same
values: their gradients are summed across those stages before each step). The first stage's copy
is read.
"""

from __future__ import annotations

import re
from typing import Any

from ...core.errors import MetadataError
from ...format.metadata import Metadata, TensorMeta

LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
_TIED = "tied_modules."


def parallel_dimensions(tree: Any, where: str) -> tuple[int, int]:
    """(pipeline stages, tensor-parallel size) the model states record (1, 1 when they say none)."""
    dims = tree.get("checkpoint_parallel_dimensions") if isinstance(tree, dict) else None
    if not isinstance(dims, dict):
        return 1, 1
    pp, tp = dims.get("pp_degree", 1), dims.get("tp_degree", 1)
    if not (isinstance(pp, int) and isinstance(tp, int) and pp >= 1 and tp >= 1):
        raise MetadataError(f"{where}: checkpoint_parallel_dimensions {dims!r} are not positive integers")
    return pp, tp


def layer_files(names: set[str]) -> dict[int, str]:
    """The layer files of a pipeline step directory, by layer index (tensor-parallel slices are
    refused by the caller: only ``-model_00`` or no model rank is read)."""
    out: dict[int, str] = {}
    for n in sorted(names):
        m = LAYER_FILE.fullmatch(n)
        if m and int(m[2] or 0) == 0:
            out[int(m[1])] = n
    return out


def layer_name(index: int, key: str, known: set[str], where: str) -> str:
    """The PipelineModule's name of ``key`` of layer ``index``: ``<index>.<key>``, or the tied
    module's (``tied_modules.<tie>.<key>``) when the stages' parameters name no such layer entry
    and exactly one tied module holds ``key``."""
    own = f"{index}.{key}"
    if own in known:
        return own
    tied = sorted({n for n in known if n.startswith(_TIED) and n.split(".", 2)[-1] == key})
    if len(tied) > 1:
        raise MetadataError(f"{where}: {key!r} of layer {index} could be any of the tied parameters {tied}")
    return tied[0] if tied else own


def join_pipeline(parts: list[Metadata], where: str) -> Metadata:
    """Every stage's checkpoint (``parts``, in stage order) as one model: the union of their
    tensors and step counts, a tied parameter taken from the first stage that holds it (the same
    shape on every stage that holds it, else refused)."""
    tensors: dict[str, TensorMeta] = {}
    objects, files, steps = {}, {}, {}
    for s, p in enumerate(parts):
        for key, t in p.tensors.items():
            held = tensors.get(key)
            if held is None:
                tensors[key] = t
            elif tuple(held.shape) != tuple(t.shape) or held.dtype != t.dtype:
                raise MetadataError(f"{where}: {key!r} is held by several pipeline stages as different tensors "
                                    f"({list(held.shape)} {held.dtype} and, on stage {s}, {list(t.shape)} {t.dtype})")
        for key, o in p.objects.items():
            objects.setdefault(key, o)
        files.update(p.files)
        for key, v in ((p.extra.get("deepspeed") or {}).get("steps") or {}).items():
            steps.setdefault(key, v)
    extra = dict(parts[0].extra)
    extra["deepspeed"] = dict(extra.get("deepspeed") or {}, pipeline_stages=len(parts), steps=steps,
                              world_size=sum(p.world_size for p in parts))
    return Metadata(sum(p.world_size for p in parts), tensors, objects, files, extra=extra)
