"""Per-expert <-> stacked expert tensors, at load: ``job.experts=stack`` reads a checkpoint with
one key per expert (``...experts.<e>.w1.weight``, as Mixtral and Qwen-MoE store them) into
stacked ``[experts, ...]`` tensors (``...experts.w1.weight``, as torchtitan's grouped experts
hold them) and ``unstack`` does the reverse. Neither copies: the per-expert load targets are views
of this rank's stacked shard (stack), or the stacked load target is made of the per-expert
tensors themselves (unstack), so the engine reads each byte straight into place.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import torch

from .dcp import ConfigError, FusedShard, LocalShard, Metadata, ShardPieces
from .dcp.tools import (TENSOR_LEAVES, Box, flatten_state_dict, leaf_shape_dtype, local_pieces, new_key_path,
                        set_element)

PER_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<suf>.+)$")
STACKED = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)(?P<suf>(?!\d+\.).+)$")


def stack_plan(tensors: Mapping[str, Any]) -> dict[str, list[str]]:
    """{stacked key: [per-expert keys, expert 0 first]} for every group of per-expert tensors
    (``tensors``: key -> metadata with ``shape``/``dtype``). Experts 0..E-1 must all be there,
    with one shape and dtype: a gap or a mismatch is an error naming the group."""
    groups: dict[str, dict[int, str]] = {}
    for k in tensors:
        m = PER_EXPERT.match(k)
        if m:
            groups.setdefault(m["pre"] + m["suf"], {})[int(m["e"])] = k
    out = {}
    for stacked, by_e in sorted(groups.items()):
        if stacked in tensors:
            raise ConfigError(f"job.experts=stack: {stacked!r} exists already, so the experts {sorted(by_e)} of "
                              f"{by_e[min(by_e)]!r} cannot be stacked under that name")
        if sorted(by_e) != list(range(len(by_e))):
            missing = sorted(set(range(max(by_e) + 1)) - set(by_e))
            raise ConfigError(f"job.experts=stack: {stacked!r}: experts {missing} are missing (have {sorted(by_e)})")
        keys = [by_e[e] for e in range(len(by_e))]
        kinds = {(tuple(tensors[k].shape), tensors[k].dtype) for k in keys}
        if len(kinds) != 1:
            raise ConfigError(f"job.experts=stack: the experts of {stacked!r} differ in shape or dtype: {sorted(kinds)}")
        out[stacked] = keys
    if not out:
        raise ConfigError("job.experts=stack: the checkpoint has no per-expert keys (...experts.<n>.<name>)")
    return out


def unstack_plan(tensors: Mapping[str, Any]) -> dict[str, list[str]]:
    """{stacked key: [the per-expert keys it becomes]} for every ``...experts.<name>`` tensor of
    at least one dimension (its dim 0 counts the experts)."""
    out = {}
    for k, t in sorted(tensors.items()):
        m = STACKED.match(k)
        if m and len(t.shape) >= 1:
            names = [f"{m['pre']}{e}.{m['suf']}" for e in range(t.shape[0])]
            clash = [n for n in names if n in tensors]
            if clash:
                raise ConfigError(f"job.experts=unstack: {k!r} would become {clash[0]!r}, which the checkpoint has")
            out[k] = names
    if not out:
        raise ConfigError("job.experts=unstack: the checkpoint has no stacked expert tensors (...experts.<name>)")
    return out


def expert_views(stacked: Any, shape: tuple[int, ...], count: int) -> list[Any]:
    """Per expert: the load target that is its part of this rank's shard of a stacked tensor
    (a view, so loading it fills the stacked shard), or None where this rank holds none of it."""
    out: list[Any] = [None] * count
    if isinstance(stacked, FusedShard):
        if stacked.dim == 0:
            raise ConfigError("job.experts=stack: a stacked tensor's parts must not be on dim 0 (the experts)")
        b0 = stacked.boxes[0]
        for e in range(b0.offsets[0], b0.offsets[0] + b0.sizes[0]):
            boxes = [Box(b.offsets[1:], b.sizes[1:]) for b in stacked.boxes]
            out[e] = FusedShard(stacked.local[e - b0.offsets[0]], shape[1:], boxes, stacked.dim - 1)
        return out
    pieces = local_pieces(stacked)
    if len(pieces) != 1:
        raise ConfigError(f"job.experts=stack: a stacked target of {len(pieces)} pieces per rank is not supported")
    box, t = pieces[0]
    plain = type(stacked) is torch.Tensor  # replicated plain tensors stay plain
    for e in range(box.offsets[0], box.offsets[0] + box.sizes[0]):
        view = t[e - box.offsets[0]]
        out[e] = view if plain else LocalShard(view, box.offsets[1:], shape[1:])
    return out


def stacked_carrier(per_expert: list[Any], shape: tuple[int, ...]) -> ShardPieces | None:
    """The load target of a stacked tensor made of this rank's per-expert targets (None entries:
    experts it does not hold): each piece is one expert's box, one leading dim deeper."""
    pieces = []
    for e, v in enumerate(per_expert):
        if v is None:
            continue
        for box, t in local_pieces(v):
            pieces.append((Box((e,) + box.offsets, (1,) + box.sizes), t.unsqueeze(0)))
    return ShardPieces(shape, pieces) if pieces else None


def restacked_metadata(md: Metadata, plan: Mapping[str, list[str]], mode: str) -> Metadata:
    """``md`` as the output will hold it (to build and place the target from): per-expert
    tensors replaced by their stacked ones (stack), or the reverse (unstack)."""
    tensors = dict(md.tensors)
    for stacked, keys in plan.items():
        if mode == "stack":
            first = tensors[keys[0]]
            for k in keys:
                del tensors[k]
            tensors[stacked] = dataclasses.replace(first, shape=(len(keys),) + tuple(first.shape), chunks=(),
                                                   path=new_key_path(first.path, stacked))
        else:
            t = tensors.pop(stacked)
            for k in keys:
                tensors[k] = dataclasses.replace(t, shape=tuple(t.shape[1:]), chunks=(), path=new_key_path(t.path, k))
    return dataclasses.replace(md, tensors=tensors)


def load_state_for(target: Any, plan: Mapping[str, list[str]], mode: str, md_out: Metadata) -> dict[str, Any]:
    """The state to load the source into, sharing storage with ``target`` (the output's state):
    per-expert views of the stacked shards (stack), or stacked carriers made of the per-expert
    tensors (unstack). Keyed flat by the source's keys; other leaves are ``target``'s own."""
    flat, _ = flatten_state_dict(target)
    out: dict[str, Any] = {}
    for stacked, keys in plan.items():
        if mode == "stack":
            leaf = flat.pop(stacked, None)
            if leaf is None:
                continue
            for k, v in zip(keys, expert_views(leaf, leaf_shape_dtype(leaf)[0], len(keys))):
                if v is not None:
                    out[k] = v
        else:
            shape = (len(keys),) + tuple(md_out.tensors[keys[0]].shape)
            carrier = stacked_carrier([flat.pop(k, None) for k in keys], shape)
            if carrier is not None:
                out[stacked] = carrier
    out.update(flat)
    return out


def copy_objects(loaded: Mapping[str, Any], target: Any) -> None:
    """The non-tensor values a load put into ``loaded`` (flat), put at their place in ``target``."""
    _, paths = flatten_state_dict(target)
    for k, v in loaded.items():
        if k in paths and not isinstance(v, TENSOR_LEAVES):
            set_element(target, paths[k], v)
