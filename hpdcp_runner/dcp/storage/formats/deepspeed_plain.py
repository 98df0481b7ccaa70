"""DeepSpeed checkpoints saved without ZeRO (``zero_optimization.stage`` 0, DeepSpeed's default):
no optimizer-states files, everything in ``mp_rank_00_model_states.pt``.

That file holds the module's own weights (``module``: its state dict; a tied parameter under each of
its names, one storage: read under its first name, as a safetensors file keeps it) and the optimizer's state dict (``optimizer``): torch's own (``state`` and
``param_groups``, by parameter position) for fp32 training, or, under fp16/bf16, DeepSpeed's
``FP16_Optimizer``'s: torch's state dict of the fp32 copies (``optimizer_state_dict``) beside those
copies themselves (``fp32_groups``, per group in the same order). Unlike ZeRO's files, it records
no parameter names (``param_shapes`` is None): a position is the module's parameter at that
position (``model.parameters()``: each tied parameter once, buffers left out), the order DeepSpeed's
engine hands the optimizer unless the training script built its own groups. So the optimizer's
state is named only where that is sure: one parameter group holding exactly the module's
parameters, each position's moments of that parameter's shape. Otherwise its moments (and fp16
masters) are not read, and the reader says why; the module's weights always are.

bf16 without ZeRO under the pipeline engine uses ``BF16_Optimizer`` instead (DeepSpeed 0.19.8; BLOOM's
training ran it): ZeRO-1's files (``bf16_zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt``, the fp32 weights
and moments as flat partitions across the data-parallel ranks), whose model states record no
``param_shapes`` either. Each rank's ``param_slice_mappings`` name the parameters its partition
holds, in order, with the elements of each it holds (:func:`mapped_sizes`); their shapes are the
module's (the layer files' under the pipeline engine). Read as ZeRO 1 then.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ...core.errors import MetadataError
from ...format.metadata import ChunkMeta, ObjectMeta, TensorMeta, dtype_name
from .torch_archive import ArchiveIndex, Record, TensorRef

log = logging.getLogger(__name__)


def whole_tensor(a: ArchiveIndex, fname: str, key: str, t: TensorRef, path: tuple[str, ...]) -> TensorMeta:
    """A tensor of archive ``a`` (file ``fname``) as one chunk, with its zip CRC-32 when it fills its
    storage."""
    off, _ = a.flat(t, key)
    return TensorMeta(dtype_name(t.dtype), t.size, (ChunkMeta((0,) * len(t.size), t.size, fname, key, off,
                                                              a.crc_of(t)),), path)


def module_parameters(module: dict, buffers: set[str]) -> tuple[list[tuple[str, TensorRef]], dict[str, str]]:
    """The module's parameters in ``parameters()`` order (a state dict's order, buffers left out,
    a tensor sharing another's storage and place, a tied parameter, under its first name only),
    and each such alias's first name."""
    params, aliases, seen = [], {}, {}
    for name, t in module.items():
        if not isinstance(t, TensorRef) or name in buffers:
            continue
        place = (t.storage, t.offset, t.size, t.stride)
        if place in seen:
            aliases[name] = seen[place]
            continue
        seen[place] = name
        params.append((name, t))
    return params, aliases


def named_positions(optim: dict, params: list[tuple[str, TensorRef]], where: str) -> list[str] | None:
    """The parameter name of each position of torch's optimizer state dict ``optim``, or None
    (with the reason logged) where the checkpoint does not tell it for sure."""
    groups = optim.get("param_groups")
    state = optim.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise MetadataError(f"{where}: the optimizer's state dict has no state and param_groups")
    order = [i for g in groups if isinstance(g, dict) for i in (g.get("params") or [])]
    why = None
    if len(groups) != 1:
        why = f"{len(groups)} parameter groups (a training script's own)"
    elif order != list(range(len(params))):
        why = f"{len(order)} parameters in its group, the module has {len(params)}"
    else:
        for i, (name, t) in enumerate(params):
            held = state.get(i) if isinstance(state.get(i), dict) else {}
            m = held.get("exp_avg")
            if isinstance(m, TensorRef) and tuple(m.size) != tuple(t.size):
                why = f"position {i}'s moments have the shape {list(m.size)}, its parameter {name} {list(t.size)}"
                break
    if why:
        log.warning("%s: the optimizer's state is not read: a checkpoint saved without ZeRO names no parameter "
                    "of it, and here the positions cannot be told for sure (%s)", where, why)
        return None
    return [name for name, _ in params]


def describe_plain(model: ArchiveIndex, fname: str, weights: str,
                   scalar: Callable[[Any, str], float | None]) -> tuple[dict, dict, dict, dict]:
    """(tensors, objects, step values, facts) of a checkpoint saved without ZeRO: the module's
    weights (``weights=fp32`` under fp16/bf16: the optimizer's fp32 copies), the moments and
    steps where their parameters can be named (see the module docstring)."""
    module = model.tree.get("module")
    dims = model.tree.get("checkpoint_parallel_dimensions")
    if module is None and isinstance(dims, dict) and dims.get("pp_degree", 1) != 1:
        raise MetadataError(f"{model.where}: a pipeline stage saved without ZeRO and without bf16 is not read: its "
                            f"model states name none of its parameters (the pipeline engine's checkpoints under "
                            f"bf16 or ZeRO 1 are)")
    if not isinstance(module, dict):
        raise MetadataError(f"{model.where}: no module weights (module is {type(module).__name__})")
    opt = model.tree.get("optimizer")
    if not isinstance(opt, dict):
        raise MetadataError(f"{model.where}: no optimizer state (a DeepSpeed checkpoint without ZeRO keeps it here)")
    torch_sd = opt.get("optimizer_state_dict", opt)
    masters = opt.get("fp32_groups")
    params, aliases = module_parameters(module, {str(b) for b in (model.tree.get("buffer_names") or [])})
    names = named_positions(torch_sd, params, model.where)
    tensors = {str(k): whole_tensor(model, fname, str(k), t, (str(k),)) for k, t in module.items()
               if isinstance(t, TensorRef) and k not in aliases}  # (a tied parameter once, as a safetensors file has it)
    if masters is not None and weights == "fp32":
        flat = [t for g in masters if isinstance(g, list) for t in g]
        if names is None or len(flat) != len(names) or not all(isinstance(t, TensorRef) for t in flat):
            raise MetadataError(f"{model.where}: the fp32 copies of the weights (fp32_groups) cannot be told "
                                f"apart by parameter; read the module's own weights (weights=module)")
        for name, t in zip(names, flat):
            tensors[name] = whole_tensor(model, fname, name, t, (name,))
    objects, steps = {}, {}
    state = torch_sd.get("state") or {}
    for i, name in enumerate(names or []):
        held = state.get(i) if isinstance(state.get(i), dict) else {}
        for m in ("exp_avg", "exp_avg_sq"):
            if isinstance(held.get(m), TensorRef):
                key = f"optim.state.{name}.{m}"
                tensors[key] = whole_tensor(model, fname, key, held[m], ("optim", "state", name, m))
        value = scalar(held.get("step"), f"optimizer/state/{i}/step")
        if value is not None:
            key = f"optim.state.{name}.step"
            objects[key] = ObjectMeta(fname, "", ("optim", "state", name, "step"))
            steps[key] = value
    facts = {"zero_stage": 0, "world_size": int(model.tree.get("dp_world_size") or 1),
             "optimizer_read": names is not None, "tied": aliases}
    return tensors, objects, steps, facts


def mapped_sizes(ranks: list[ArchiveIndex]) -> list[dict[str, int]]:
    """Per parameter group, each parameter's name and element count, in the order of the flat
    buffers, from the ranks' ``param_slice_mappings`` (rank R's: the fragments its partition holds,
    ``fragment_address(numel, start)``; a parameter cut between two ranks appears in both)."""
    groups: list[dict[str, int]] = []
    for a in ranks:
        maps = (a.tree.get("optimizer_state_dict") or {}).get("param_slice_mappings") if isinstance(a.tree, dict) else None
        if not isinstance(maps, list) or not all(isinstance(m, dict) for m in maps):
            raise MetadataError(f"{a.where}: no param_slice_mappings, and the model states record no param_shapes: "
                                f"the parameters of its flat buffers cannot be named")
        for g, m in enumerate(maps):
            while len(groups) <= g:
                groups.append({})
            for name, frag in m.items():
                numel = frag.state.get("numel") if isinstance(frag, Record) and isinstance(frag.state, dict) else None
                if not isinstance(numel, int) or numel < 0:
                    raise MetadataError(f"{a.where}: param_slice_mappings[{g}][{str(name)[:200]!r}] is {frag!r}, not a "
                                        f"fragment_address(numel, start)")
                groups[g][str(name)] = groups[g].get(str(name), 0) + numel
    return groups
