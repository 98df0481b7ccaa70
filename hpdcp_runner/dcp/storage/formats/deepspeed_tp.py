"""DeepSpeed checkpoints saved under tensor parallelism (AutoTP training, Megatron-DeepSpeed): each
model-parallel rank's slices of a parameter joined into the whole, where they lie.

Such a step directory holds one set of files per model-parallel rank (``mp_rank_<M>_model_states.pt``,
``zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt``), each describing that rank's slices as a plain
ZeRO checkpoint does (``deepspeed.DeepSpeedReader`` reads each). How a parameter was cut is in the
model states' ``universal_checkpoint_info`` (what ``ds_to_universal`` merges by):

* ``affine_map`` (AutoTP): per parameter its whole shape and, per rank, the pieces of its slice,
  each a box of the slice (``dest``) that is a box of the whole (``source``), and the ranks holding
  the same piece (``locations``: a replicated parameter is one piece every rank holds);
* else the patterns: ``tp_replicated_parameter_patterns`` (the same on every rank),
  ``parameter_with_row_parallelism_patterns`` (cut by columns), ``vocabulary_parameter_patterns``
  (cut by rows, padded past ``original_vocab_size``), every other parameter cut by rows.

Each slice's chunks become chunks of the whole parameter (split where a piece takes part of a
chunk's rows); its optimizer moments are cut as it is. Nothing is copied.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

from ...core.errors import MetadataError
from ...core.geometry import row_major_strides
from ...format.metadata import ChunkMeta, Metadata, TensorMeta, element_size
from .torch_archive import ArchiveIndex

_MOMENT = re.compile(r"optim\.state\.(.+)\.(exp_avg|exp_avg_sq)")


def _offsets(spec: Any, shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """A piece's ``[offset, strides]`` in a row-major tensor of ``shape``, as a box's corner."""
    try:
        offset, strides = int(spec[0]), tuple(int(x) for x in spec[1])
    except (TypeError, ValueError, IndexError):
        raise MetadataError(f"{what}: a piece's place {spec!r} is not [offset, strides]") from None
    if strides != row_major_strides(shape) or not 0 <= offset < max(1, math.prod(shape)):
        raise MetadataError(f"{what}: a piece at {spec!r} of a tensor of shape {list(shape)} is not a box of it "
                            f"(strides other than row-major are not read)")
    out = []
    for st in strides:
        out.append(offset // st)
        offset %= st
    return tuple(out)


def _translate(c: ChunkMeta, key: str, dest: tuple[int, ...], size: tuple[int, ...], source: tuple[int, ...],
               esize: int) -> list[ChunkMeta]:
    """The part of chunk ``c`` (a box of the slice) inside the piece at ``dest`` of the slice,
    placed at ``source`` in the whole: contiguous boxes of it (the rows it cuts, when a piece
    takes part of a row)."""
    if not c.sizes:
        return [ChunkMeta((), (), c.file, key, c.byte_offset, c.checksum)]
    lo = [max(o, d) for o, d in zip(c.offsets, dest)]
    hi = [min(o + n, d + p) for o, n, d, p in zip(c.offsets, c.sizes, dest, size)]
    if any(a >= b for a, b in zip(lo, hi)):
        return []
    part = [b - a for a, b in zip(lo, hi)]
    cut = [j for j in range(len(part)) if part[j] != c.sizes[j]]
    k = cut[-1] if cut else 0  # every dim after k is whole: a run over dim k is contiguous
    strides = row_major_strides(tuple(c.sizes))
    out = []
    for head in itertools.product(*(range(lo[j], hi[j]) for j in range(k))):
        start = (*head, *lo[k:])
        sizes = (*(1,) * k, *part[k:])
        at = c.byte_offset + esize * sum((s - o) * st for s, o, st in zip(start, c.offsets, strides))
        placed = tuple(s + (x - d) for s, x, d in zip(source, start, dest))
        out.append(ChunkMeta(placed, sizes, c.file, key, at, c.checksum if not cut else ""))
    return out


class _Cuts:
    """How ``universal_checkpoint_info`` says each parameter was cut (see the module docstring)."""

    def __init__(self, info: dict, where: str) -> None:
        self.where = where
        affine = info.get("affine_map") if isinstance(info.get("affine_map"), dict) else {}
        self.affine = [(re.compile(p), e) for p, e in (affine.get("params") or {}).items()]
        self.patterns = {k: [re.compile(p) for p in (info.get(k) or [])]
                         for k in ("tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                                   "vocabulary_parameter_patterns", "parameter_with_sub_params")}
        self.vocab = info.get("original_vocab_size")

    def _is(self, kind: str, name: str) -> bool:
        return any(p.match(name) for p in self.patterns[kind])

    def join(self, key: str, name: str, slices: list[TensorMeta]) -> TensorMeta:
        entry = next((e for p, e in self.affine if p.match(name)), None)
        if entry is not None:
            return self._affine(key, name, entry, slices)
        if self._is("parameter_with_sub_params", name):
            raise MetadataError(f"{self.where}: {name!r} holds fused sub-parameters cut separately, which are read "
                                f"only with an affine_map")
        local = tuple(slices[0].shape)
        if self._is("tp_replicated_parameter_patterns", name) or not local:
            if any(tuple(t.shape) != local for t in slices):
                raise MetadataError(f"{self.where}: the replicated {key!r} differs in shape across model-parallel "
                                    f"ranks {sorted({tuple(t.shape) for t in slices})}")
            return slices[0]
        dim = 1 if self._is("parameter_with_row_parallelism_patterns", name) else 0
        if dim >= len(local) or any(len(t.shape) != len(local) or
                                    any(a != b for j, (a, b) in enumerate(zip(t.shape, local)) if j != dim)
                                    for t in slices):
            raise MetadataError(f"{self.where}: the model-parallel slices of {key!r} (shapes "
                                f"{[list(t.shape) for t in slices]}) do not join along dimension {dim}")
        whole = list(local)
        whole[dim] = sum(t.shape[dim] for t in slices)  # (a slice may be a row shorter: an odd vocabulary)
        if self._is("vocabulary_parameter_patterns", name) and isinstance(self.vocab, int) and 0 < self.vocab <= whole[0]:
            whole[0] = self.vocab  # (the padding rows past the vocabulary are left out)
        esize = element_size(slices[0].dtype)
        chunks, at_dim = [], 0
        for t in slices:
            at = tuple(at_dim if j == dim else 0 for j in range(len(local)))
            size = tuple(min(n, w - a) for n, w, a in zip(t.shape, whole, at))
            at_dim += t.shape[dim]
            if all(n > 0 for n in size):
                for c in t.chunks:
                    chunks += _translate(c, key, (0,) * len(local), size, at, esize)
        return TensorMeta(slices[0].dtype, tuple(whole), tuple(chunks), slices[0].path)

    def _affine(self, key: str, name: str, entry: dict, slices: list[TensorMeta]) -> TensorMeta:
        what = f"{self.where}: {name!r}"
        try:
            whole = tuple(int(x) for x in entry["logical_shape"])
            ranks = entry["ranks"]
        except (KeyError, TypeError, ValueError):
            raise MetadataError(f"{what}: its affine_map entry has no logical_shape and ranks") from None
        esize = element_size(slices[0].dtype)
        chunks: list[ChunkMeta] = []
        for r, t in enumerate(slices):
            rank = ranks.get(r) if isinstance(ranks, dict) else None
            if rank is None or tuple(rank.get("shard_shape", ())) != tuple(t.shape):
                raise MetadataError(f"{what}: the affine_map says nothing of model-parallel rank {r}'s slice of shape "
                                    f"{list(t.shape)}")
            for piece in rank.get("pieces") or []:
                if min(piece.get("locations") or [r]) != r:
                    continue  # (a piece several ranks hold: read from the first)
                size = tuple(int(x) for x in piece["shape"])
                dest = _offsets(piece["dest"], tuple(t.shape), what)
                source = _offsets(piece["source"], whole, what)
                for c in t.chunks:
                    chunks += _translate(c, key, dest, size, source, esize)
        if sum(math.prod(c.sizes) for c in chunks) != math.prod(whole):
            raise MetadataError(f"{what}: the pieces of its slices hold {sum(math.prod(c.sizes) for c in chunks)} "
                                f"elements, its shape {list(whole)} has {math.prod(whole)}")
        return TensorMeta(slices[0].dtype, whole, tuple(chunks), slices[0].path)


def join_model_parallel(parts: list[Metadata], model: ArchiveIndex, where: str) -> Metadata:
    """The checkpoint of every model-parallel rank (``parts``, each as its own ZeRO checkpoint of
    its slices) as one: each parameter and its moments whole (see the module docstring)."""
    info = model.tree.get("universal_checkpoint_info") if isinstance(model.tree, dict) else None
    if not isinstance(info, dict):
        raise MetadataError(f"{model.where}: a checkpoint of {len(parts)} model-parallel ranks that records no "
                            f"universal_checkpoint_info: how its parameters were cut cannot be told")
    cuts = _Cuts(info, model.where)
    shapes = model.tree.get("param_shapes")
    params = {str(k) for g in (shapes if isinstance(shapes, list) else []) if isinstance(g, dict) for k in g}
    tensors = {}
    for key in parts[0].tensors:
        held = [p.tensors.get(key) for p in parts]
        if any(t is None for t in held):
            raise MetadataError(f"{where}: {key!r} is missing from model-parallel rank {held.index(None)}")
        m = _MOMENT.fullmatch(key)
        name = m[1] if m else key
        if name in params:
            tensors[key] = cuts.join(key, name, held)  # type: ignore[arg-type]
        elif len({tuple(t.shape) for t in held}) == 1:  # type: ignore[union-attr]
            tensors[key] = held[0]  # a buffer (not a parameter: tensor parallelism cuts none), every rank's copy
        else:
            raise MetadataError(f"{where}: the buffer {key!r} differs in shape across model-parallel ranks")
    files = {}
    for p in parts:
        files.update(p.files)
    extra = dict(parts[0].extra)
    extra["deepspeed"] = dict(extra.get("deepspeed") or {}, model_parallel=len(parts))
    return Metadata(sum(p.world_size for p in parts), tensors, parts[0].objects, files, extra=extra)
