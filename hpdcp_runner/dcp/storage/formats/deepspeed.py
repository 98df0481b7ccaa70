"""DeepSpeed ZeRO checkpoints read in place: no ``zero_to_fp32``, no conversion step.

A DeepSpeed save (``engine.save_checkpoint``) is a step directory (``global_step<N>``, named by the
run directory's ``latest`` file) of ``torch.save`` archives:

* ``mp_rank_00_model_states.pt`` (ZeRO 1/2) or ``zero_pp_rank_<R>_mp_rank_00_model_states.pt``
  (ZeRO 3): the module's state dict (ZeRO 3: empty placeholders), ``param_shapes`` (per parameter
  group, every parameter's name and shape in the order of the flat buffers), buffers;
* ``[bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt``, one per data-parallel rank: that rank's
  partition of the fp32 master weights and of the Adam moments, as flat buffers per group.
  ZeRO 1/2 (``single_partition_of_fp32_groups``): a group's flat buffer is cut in equal pieces
  across ranks, parameters lie one after another in it. ZeRO 3 (``fp32_flat_groups``): every
  parameter is cut in ``ceil(numel / world)`` pieces, rank R's piece of each parameter lying one
  after another in R's flat buffer.

This reader describes each parameter (its fp32 master weight, the default, or the module's own
weight, ``weights="module"``) and its optimizer moments (``optim.state.<name>.exp_avg``,
``exp_avg_sq``, ``step``) as our metadata: a parameter's elements are segments of the rank files'
flat buffers, and each segment of a row-major tensor is a few boxes (a partial row, whole rows, a
partial row), each contiguous in its file. So every load, reshard, partial read and export works
on it unchanged, reading only the bytes of the slices it keeps.

Nothing in these files is unpickled as code. Their ``data.pkl`` is read by the restricted
unpickler of ``torch_archive`` that admits torch's tensor rebuild, storage types, ``torch.Size`` and the three
DeepSpeed classes these files hold (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``), each
turned into plain data; any other class is refused with the file and the class named.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from ...core.errors import CheckpointNotFoundError, MetadataError
from ...core.ragged import decompose_flat_interval
from ...format.metadata import ChunkMeta, FileMeta, Metadata, ObjectMeta, TensorMeta, check_file_name, dtype_name
from .format_marks import (DS_OPTIM as _OPTIM, DS_TRACKER as TRACKER, DS_UNIVERSAL_TRACKER as UNIVERSAL_TRACKER,
                           is_deepspeed_step, is_deepspeed_universal)
from .deepspeed_plain import describe_plain, mapped_sizes, whole_tensor
from .deepspeed_pipe import join_pipeline, layer_files, layer_name, parallel_dimensions
from .deepspeed_tp import join_model_parallel
from .foreign import _DescribedReader
from .torch_archive import Archive, ArchiveFiles, ArchiveIndex, Record, TensorRef

if TYPE_CHECKING:
    from ..checkpoint_files import CheckpointFiles
    from ..location import Location

WEIGHTS = ("fp32", "module")


def step_directory(loc: "Location", options: object = None) -> "Location":
    """``loc`` itself when it is a step directory, else the step its ``latest`` file names (a run
    directory), checked to be a plain name inside it."""
    from ..location import locate
    from ..uri import join

    names = set(loc.files())
    name = TRACKER if TRACKER in names else UNIVERSAL_TRACKER  # (a run's own step first)
    if is_deepspeed_step(names) or is_deepspeed_universal(names) or name not in names:
        return loc
    tracker = join(loc.url, name)
    tag = (loc.read_small(name, 4096) or b"").decode("utf-8", "replace").strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or len(tag) > 255:
        raise MetadataError(f"{tracker}: names {tag!r}, not a step directory inside {loc.url}")
    step = locate(join(loc.url, tag), options=options)
    held = set(step.files()) if step.is_dir() else set()
    if not (is_deepspeed_step(held) or is_deepspeed_universal(held)):
        raise CheckpointNotFoundError(f"{tracker} names {tag!r}, but {step.url} holds no DeepSpeed model and "
                                      f"optimizer states")
    return step


# -- the classes DeepSpeed's archives hold, as plain data ------------------------------------------

class LossScaler(Record):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (and its dynamic kind), as data."""


class FragmentAddress(Record):
    """``deepspeed.utils.tensor_fragment.fragment_address``, as data."""


class _DeepSpeedArchive(Archive):
    ADMITTED = {("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
                ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): LossScaler,
                ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
                ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int}
    ADMITS = "tensors, plain data and DeepSpeed's LossScaler, ZeroStageEnum and fragment_address"


def _get(tree: Any, where: str, *path: Any) -> Any:
    node = tree
    for p in path:
        if not isinstance(node, (dict, list)) or (isinstance(node, dict) and p not in node) or \
                (isinstance(node, list) and not (isinstance(p, int) and 0 <= p < len(node))):
            raise MetadataError(f"{where}: no {'/'.join(map(str, path))} (not a DeepSpeed ZeRO checkpoint this "
                                f"reader knows)")
        node = node[p]
    return node


# -- where each parameter's elements are -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements [start, start + count) of a parameter, stored at ``offset`` in ``file``."""

    file: str
    offset: int
    start: int
    count: int


def _chunks(key: str, shape: tuple[int, ...], dtype: torch.dtype, segments: list[Segment]) -> tuple[ChunkMeta, ...]:
    esize = torch.empty((), dtype=dtype).element_size()
    out = []
    for s in segments:
        if not shape:  # a scalar: its one element
            out.append(ChunkMeta((), (), s.file, key, s.offset, ""))
            continue
        first = s.start  # the boxes, in order, hold the segment's elements one after another
        for box in decompose_flat_interval(shape, s.start, s.start + s.count):
            out.append(ChunkMeta(box.offsets, box.sizes, s.file, key, s.offset + (first - s.start) * esize, ""))
            first += math.prod(box.sizes)
    return tuple(out)


def _zero12_segments(flats: list[tuple[str, int, int]], numels: list[int], esize: int) -> list[list[Segment]]:
    """ZeRO 1/2: a group's flat buffer is the ranks' pieces end to end (``flats``: file, offset,
    elements per rank, of ``esize`` bytes); its parameters (``numels``) lie one after another in it."""
    bounds, at = [], 0
    for f, off, n in flats:
        bounds.append((at, at + n, f, off))
        at += n
    out, pos = [], 0
    for numel in numels:
        segs = []
        for lo, hi, f, off in bounds:
            a, b = max(lo, pos), min(hi, pos + numel)
            if a < b:
                segs.append(Segment(f, off + (a - lo) * esize, a - pos, b - a))
        if sum(s.count for s in segs) != numel:
            raise MetadataError(f"the ranks' flat buffers hold {at} elements, too few for the parameters recorded "
                                f"({sum(numels)})")
        out.append(segs)
        pos += numel
    return out


def _zero3_segments(flats: list[tuple[str, int, int]], numels: list[int], esize: int) -> list[list[Segment]]:
    """ZeRO 3: each parameter cut in ``ceil(numel / world)`` pieces, rank R's piece of each
    parameter one after another in R's flat buffer."""
    world = len(flats)
    out, pos = [], 0
    for numel in numels:
        part = -(-numel // world)
        segs = []
        for r, (f, off, n) in enumerate(flats):
            a, b = r * part, min(numel, (r + 1) * part)
            if pos + part > n:
                raise MetadataError(f"{f}: its flat buffer ({n} elements) is too short for the parameters recorded")
            if a < b:
                segs.append(Segment(f, off + pos * esize, a, b - a))
        out.append(segs)
        pos += part
    return out


class DeepSpeedReader(ArchiveFiles, _DescribedReader):
    """A DeepSpeed ZeRO 1/2/3 step directory (see the module docstring)."""

    format_name = "deepspeed"
    UNPICKLER = _DeepSpeedArchive

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", *, names: "list[str] | None" = None,
                 weights: str = "fp32", **kwargs: Any) -> None:
        """``names``: the files of the step directory (its listing); read from ``files`` when it
        is a local path."""
        kwargs.pop("allow_pickle", None)
        if names is None:
            if not isinstance(files, (str, os.PathLike)):
                raise TypeError("DeepSpeedReader over CheckpointFiles needs names=")
            names = sorted(os.listdir(files)) if os.path.isdir(files) else []
        self._names = set(names)
        self._param_names: set[str] = set()  # the parameters every model-parallel rank's description named
        self._layer_archives: dict[str, ArchiveIndex] = {}  # a pipeline's layer files, indexed once
        super().__init__(files, **kwargs)
        if weights not in WEIGHTS:
            raise MetadataError(f"DeepSpeed weights {weights!r}: one of {', '.join(WEIGHTS)}")
        self.weights = weights


    def describe(self) -> Metadata:
        self.files.require_directory()
        mps = sorted({int(m.group(3)) for n in self._names if (m := _OPTIM.fullmatch(n))})
        if not mps:
            raise CheckpointNotFoundError(f"{self.path}: no zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt (not a "
                                          f"DeepSpeed ZeRO step directory)")
        if mps != list(range(len(mps))):
            missing = sorted(set(range(mps[-1] + 1)) - set(mps))
            raise CheckpointNotFoundError(f"{self.path}: the states of model-parallel rank(s) {missing} are missing "
                                          f"(zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt)")
        parts = [self._describe_mp(mp) for mp in mps]
        said = parts[0][1].tree.get("mp_world_size") if isinstance(parts[0][1].tree, dict) else None
        if isinstance(said, int) and said > len(parts):
            raise CheckpointNotFoundError(f"{self.path}: the states of model-parallel rank(s) "
                                          f"{list(range(len(parts), said))} are missing ({parts[0][1].where} says "
                                          f"{said} model-parallel ranks saved)")
        pp, tp = parallel_dimensions(parts[0][1].tree, parts[0][1].where)
        if pp > 1:
            return self._join_stages(parts, pp, tp)
        if len(parts) == 1:
            return parts[0][0]
        return join_model_parallel([md for md, _ in parts], parts[0][1], self.path)

    def _join_stages(self, parts: list[tuple[Metadata, ArchiveIndex]], pp: int, tp: int) -> Metadata:
        """A pipeline-parallel checkpoint (``deepspeed_pipe``): the stages' parameters as one
        model, the layer files giving the module's own weights (``weights=module``) and whatever
        else the layers hold (buffers, frozen parameters)."""
        if tp > 1:
            raise MetadataError(f"{self.path}: pipeline stages ({pp}) cut by tensor parallelism ({tp}) are not read "
                                f"(only one of the two is)")
        if len(parts) != pp:
            raise CheckpointNotFoundError(f"{self.path}: {parts[0][1].where} says {pp} pipeline stages, "
                                          f"{len(parts)} are here")
        md = join_pipeline([m for m, _ in parts], self.path)
        params = set(self._param_names)  # (every stage's, as its description named them)
        buffers = {str(b) for _, model in parts for b in (model.tree.get("buffer_names") or [])}
        tensors, files = dict(md.tensors), dict(md.files)
        for idx, fname in sorted(layer_files(self._names).items()):
            a = self._layer_archive(fname)
            if not isinstance(a.tree, dict):
                raise MetadataError(f"{a.where}: not a layer's state dict (name -> tensor)")
            for key, t in a.tree.items():
                name = layer_name(idx, str(key), params | buffers, a.where)
                if not isinstance(t, TensorRef) or name in tensors or (name in params and self.weights == "fp32"):
                    continue  # (a tied layer: every stage holding it wrote it; the first is read)
                tensors[name] = whole_tensor(a, fname, name, t, (name,))
                files[fname] = FileMeta(fname, self._size_of(fname), "", 0)
        missing = sorted(params - set(tensors))
        if missing:
            raise CheckpointNotFoundError(f"{self.path}: no layer_<NN>-model_states.pt holds {missing[:3]}"
                                          f"{' and more' if len(missing) > 3 else ''} (the module's weights of a "
                                          f"pipeline-parallel checkpoint)")
        return Metadata(md.world_size, tensors, md.objects, files, extra=md.extra)

    def _describe_mp(self, mp: int) -> tuple[Metadata, ArchiveIndex]:
        """Model-parallel rank ``mp``'s parameters (their local slices) and its model states."""
        optim, ranks, stage = self._rank_files(mp)
        model_name = f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt" if stage == 3 else \
            f"mp_rank_{mp:02d}_model_states.pt"
        if model_name not in self._names:
            raise CheckpointNotFoundError(f"{self.full(model_name)} is missing (the model states of a ZeRO-{stage} "
                                          f"checkpoint)")
        model = self._archive(model_name)
        shapes = _get(model.tree, model.where, "param_shapes")
        if shapes is None:  # (BF16_Optimizer: bf16 without ZeRO, in ZeRO-1's files)
            shapes = self._mapped_shapes(ranks, model)
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise MetadataError(f"{model.where}: param_shapes is not a list of name -> shape per group")
        self._param_names.update(str(k) for g in shapes for k in g)
        said = ((model.tree.get("ds_config") or {}).get("zero_optimization") or {}).get("stage")
        tensors: dict[str, TensorMeta] = {}
        objects: dict[str, ObjectMeta] = {}
        steps: dict[str, float] = {}
        for g, group in enumerate(shapes):
            self._group(g, [(str(k), tuple(int(x) for x in v)) for k, v in group.items()], stage, optim, ranks,
                        tensors, objects, steps)
        self._module_tensors(model, model_name, stage, tensors)
        files = {n: FileMeta(n, self._size_of(n), "", r) for r, n in optim}
        files[model_name] = FileMeta(model_name, self._size_of(model_name), "", 0)
        extra = {"source_format": "deepspeed", "deepspeed": {"zero_stage": said if said in (0, 1, 2, 3) else int(stage),
                                                             "world_size": len(optim),
                                                             "weights": self.weights,
                                                             "version": str(model.tree.get("ds_version", "")),
                                                             "steps": steps}}
        return Metadata(len(optim), tensors, objects, files, extra=extra), model

    def _mapped_shapes(self, ranks: list[ArchiveIndex], model: ArchiveIndex) -> list[dict[str, tuple[int, ...]]]:
        """``param_shapes`` where the model states record none (``deepspeed_plain.mapped_sizes``):
        the names and sizes the ranks' mappings give, the shapes the module's weights give (its
        model states', or a pipeline stage's layer files)."""
        sizes = mapped_sizes(ranks)
        known = {n for g in sizes for n in g}
        module = model.tree.get("module")
        if isinstance(module, dict):
            held = {str(k): tuple(t.size) for k, t in module.items() if isinstance(t, TensorRef)}
        else:
            held = {}
            for idx, fname in sorted(layer_files(self._names).items()):
                a = self._layer_archive(fname)
                for key, t in (a.tree.items() if isinstance(a.tree, dict) else ()):
                    if isinstance(t, TensorRef):
                        held.setdefault(layer_name(idx, str(key), known, a.where), tuple(t.size))
        out = []
        for group in sizes:
            shapes = {}
            for name, numel in group.items():
                shape = held.get(name)
                if shape is None or math.prod(shape) != numel:
                    raise MetadataError(f"{model.where}: the optimizer holds {numel} elements of {name!r}, but "
                                        f"{'no module weight is named so' if shape is None else f'its weight has the shape {list(shape)}'}")
                shapes[name] = shape
            out.append(shapes)
        return out

    def _layer_archive(self, fname: str) -> ArchiveIndex:
        """A pipeline layer file, indexed once (every stage's description reads them)."""
        if fname not in self._layer_archives:
            self._layer_archives[fname] = self._archive(fname)
        return self._layer_archives[fname]

    def _describe_plain(self, model: ArchiveIndex, model_name: str) -> Metadata:
        """A checkpoint saved without ZeRO (``deepspeed_plain``): one file, the module's weights
        and the optimizer's state dict."""
        tensors, objects, steps, facts = describe_plain(model, model_name, self.weights,
                                                        lambda t, what: self._scalar(model, model_name, t, what))
        extra = {"source_format": "deepspeed", "deepspeed": {**facts, "weights": self.weights, "steps": steps,
                                                             "version": str(model.tree.get("ds_version", ""))}}
        files = {model_name: FileMeta(model_name, self._size_of(model_name), "", 0)}
        return Metadata(facts["world_size"], tensors, objects, files, extra=extra)  # (rank 0 wrote the one file)

    def _rank_files(self, mp: int = 0) -> tuple[list[tuple[int, str]], list[ArchiveIndex], int]:
        """The optimizer-states file of every data-parallel rank of model-parallel rank ``mp``
        (all there), each indexed, and the ZeRO stage they say."""
        optim = sorted((int(m.group(2)), n) for n in self._names
                       if (m := _OPTIM.fullmatch(n)) and int(m.group(3)) == mp)
        if not optim:
            raise CheckpointNotFoundError(f"{self.path}: no zero_pp_rank_<R>_mp_rank_{mp:02d}_optim_states.pt (not a "
                                          f"DeepSpeed ZeRO step directory)")
        world = len(optim)
        if [r for r, _ in optim] != list(range(world)):
            missing = sorted(set(range(max(r for r, _ in optim) + 1)) - {r for r, _ in optim})
            raise CheckpointNotFoundError(f"{self.path}: the optimizer states of rank(s) {missing} are missing "
                                          f"(zero_pp_rank_<R>_mp_rank_{mp:02d}_optim_states.pt)")
        ranks = [self._archive(n) for _, n in optim]
        first = ranks[0]
        osd = _get(first.tree, first.where, "optimizer_state_dict")
        stage = osd.get("zero_stage")
        if stage is None:
            stage = 3 if "fp32_flat_groups" in osd else 2
        pc = osd.get("partition_count")
        counts = pc if isinstance(pc, list) else [pc]
        wanted = max((c for c in counts if isinstance(c, int)), default=world)
        if wanted > world:
            prefix = optim[0][1].split("zero_pp_rank_")[0]
            raise CheckpointNotFoundError(f"{self.path}: the optimizer states of rank(s) {list(range(world, wanted))} are "
                                          f"missing ({prefix}zero_pp_rank_<R>_mp_rank_{mp:02d}_optim_states.pt; "
                                          f"{first.where} says {wanted} ranks saved)")
        if any(isinstance(c, int) and c != world for c in counts):
            raise MetadataError(f"{first.where}: partition_count {pc} but {world} rank files are here")
        return optim, ranks, int(stage)

    def _group(self, g: int, params: list[tuple[str, tuple[int, ...]]], stage: int, optim: list[tuple[int, str]],
               ranks: list[ArchiveIndex], tensors: dict, objects: dict, steps: dict) -> None:
        """Parameter group ``g``: each parameter's master weight and moments located in the
        ranks' flat buffers, its step count read."""
        numels = [math.prod(s) for _, s in params]
        layout = _zero3_segments if stage == 3 else _zero12_segments
        first = ranks[0]

        def segments(*path: Any) -> tuple[torch.dtype, list[list[Segment]]]:
            """Where each parameter's elements of the flat buffers at ``path`` lie, and their dtype
            (fp32 master weights and moments, or whatever the optimizer kept)."""
            flats, dtypes = [], set()
            for (_, n), a in zip(optim, ranks):
                t = _get(a.tree, a.where, *path)
                off, count = a.flat(t, "/".join(map(str, path)))
                flats.append((n, off, count))
                dtypes.add(t.dtype)
            if len(dtypes) != 1:
                raise MetadataError(f"{self.path}: the ranks' {'/'.join(map(str, path))} have different dtypes {dtypes}")
            dtype = dtypes.pop()
            return dtype, layout(flats, numels, torch.empty((), dtype=dtype).element_size())

        inner = ("optimizer_state_dict", "optimizer_state_dict") if stage == 3 else \
            ("optimizer_state_dict", "base_optimizer_state")
        master = segments("optimizer_state_dict", "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups", g)
        state = _get(first.tree, first.where, *inner, "state")
        held = state.get(g) if isinstance(state, dict) else None
        held = held if isinstance(held, dict) else {}  # (an optimizer that has not stepped keeps none)
        moments = {m: segments(*inner, "state", g, m) for m in ("exp_avg", "exp_avg_sq") if m in held}
        step_value = self._scalar(first, optim[0][1], held.get("step"), f"state/{g}/step")
        for i, (name, shape) in enumerate(params):
            if self.weights == "fp32":
                dt, segs = master
                tensors[name] = TensorMeta(dtype_name(dt), shape, _chunks(name, shape, dt, segs[i]), (name,))
            for m, (dt, segs) in moments.items():
                key = f"optim.state.{name}.{m}"
                tensors[key] = TensorMeta(dtype_name(dt), shape, _chunks(key, shape, dt, segs[i]),
                                          ("optim", "state", name, m))
            if step_value is not None:  # one step per group: an object per parameter, as torch keeps it
                key = f"optim.state.{name}.step"
                objects[key] = ObjectMeta(optim[0][1], "", ("optim", "state", name, "step"))
                steps[key] = step_value

    def _module_tensors(self, model: ArchiveIndex, model_name: str, stage: int, tensors: dict) -> None:
        """``weights=module``: the module's own weights; else the buffers the module saved."""
        module = _get(model.tree, model.where, "module")
        if module is None and parallel_dimensions(model.tree, model.where)[0] > 1:
            return  # (a pipeline stage: the module's weights are in the layer files, read with every stage's)
        if self.weights == "module" and stage == 3:
            raise MetadataError(f"{model.where}: a ZeRO-3 checkpoint keeps no module weights (its parameters "
                                f"are partitioned); read its fp32 master weights (weights=fp32)")
        wanted = list(module) if self.weights == "module" else list(_get(model.tree, model.where, "buffer_names") or [])
        for name in wanted:
            t = module.get(name) if isinstance(module, dict) else None
            if isinstance(t, TensorRef) and name not in tensors:
                tensors[name] = whole_tensor(model, model_name, name, t, (name,))

    def _scalar(self, archive: ArchiveIndex, name: str, t: Any, what: str) -> float | None:
        """The value of a one-element tensor of ``archive`` (a step count), or a plain number."""
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return float(t)
        if not isinstance(t, TensorRef) or t.numel != 1:
            return None
        off, _ = archive.flat(t, what)
        f = self._random_access(name)
        try:
            raw = f.pread(t.dtype.itemsize, off)
        finally:
            f.close()
        return float(torch.frombuffer(bytearray(raw), dtype=t.dtype)[0])

    def read_objects(self, wanted: Any, *, allow_pickle: bool) -> dict[str, Any]:
        """The step counts, read when the checkpoint was described, as numbers (torch's Adam
        makes its step tensor of a number when it loads a state)."""
        steps = ((self.metadata.extra.get("deepspeed") or {}).get("steps") if self.metadata else None) or {}
        missing = sorted(set(wanted) - set(steps))
        if missing:
            raise MetadataError(f"{self.path}: no value recorded for {missing[:3]}")
        return {k: float(steps[k]) for k in wanted}


class DeepSpeedUniversalReader(DeepSpeedReader):
    """A universal checkpoint (``ds_to_universal``'s output, the form DeepSpeed resumes at another
    parallelism from): every parameter whole, ``zero/<name>/fp32.pt``, ``exp_avg.pt`` and
    ``exp_avg_sq.pt`` (a tensor, or ``{"param": tensor, "cat_dim": ...}``; flat for ZeRO 3) and its
    step count in ``step.pt``, beside the model states copied from the step it was made from,
    whose ``param_shapes`` name the parameters and shapes. Each file is one chunk read in place."""

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def describe(self) -> Metadata:
        self.files.require_directory()
        model_name = next((n for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
                           if n in self._names), None)
        if model_name is None:
            raise CheckpointNotFoundError(f"{self.path}: no mp_rank_00_model_states.pt (a DeepSpeed universal "
                                          f"checkpoint keeps the model states beside zero/)")
        stage = 3 if model_name.startswith("zero_pp_rank_") else 2
        model = self._archive(model_name)
        if model.tree.get("param_shapes") is None and isinstance(model.tree.get("optimizer"), dict):
            return self._describe_plain(model, model_name)  # saved without ZeRO: a step, not a universal checkpoint
        shapes = _get(model.tree, model.where, "param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise MetadataError(f"{model.where}: param_shapes is not a list of name -> shape per group")
        params = [(str(k), tuple(int(x) for x in v)) for g in shapes for k, v in g.items()]
        for name, _ in params:  # each names a directory: a plain name, nothing that leaves zero/
            try:
                check_file_name(name)
            except MetadataError:
                raise MetadataError(f"{model.where}: parameter {name[:200]!r} cannot name a directory of zero/") \
                    from None
        if params and not self.files.exists(f"zero/{params[0][0]}/fp32.pt"):
            raise CheckpointNotFoundError(f"{self.full(f'zero/{params[0][0]}/fp32.pt')} is missing: {self.path} holds "
                                          f"DeepSpeed model states but no optimizer states (a ZeRO step) and no "
                                          f"zero/<param>/ (a universal checkpoint)")
        tensors: dict[str, TensorMeta] = {}
        objects: dict[str, ObjectMeta] = {}
        steps: dict[str, float] = {}
        files: dict[str, FileMeta] = {model_name: FileMeta(model_name, self._size_of(model_name), "", 0)}
        with cf.ThreadPoolExecutor(8, thread_name_prefix="hpdcp-ds-universal") as pool:  # (a store: small reads)
            for t, o, sv, f in pool.map(self._parameter, params):
                tensors.update(t)
                objects.update(o)
                steps.update(sv)
                files.update(f)
        self._module_tensors(model, model_name, stage, tensors)
        extra = {"source_format": "deepspeed", "deepspeed": {"universal": True, "zero_stage": stage,
                                                             "weights": self.weights,
                                                             "version": str(model.tree.get("ds_version", "")),
                                                             "steps": steps}}
        return Metadata(1, tensors, objects, files, extra=extra)

    def _parameter(self, param: tuple[str, tuple[int, ...]]) -> tuple[dict, dict, dict, dict]:
        """One parameter's files: its fp32 weight (``weights=fp32``), moments and step."""
        name, shape = param
        tensors, objects, steps, files = {}, {}, {}, {}
        for what in (("fp32",) if self.weights == "fp32" else ()) + self.MOMENTS:
            fname = f"zero/{name}/{what}.pt"
            if what != "fp32" and not self.files.exists(fname):
                continue  # (an optimizer without moments; fp32 missing is named by the read)
            a = self._archive(fname)
            t = a.tree.get("param") if isinstance(a.tree, dict) else a.tree
            off, count = a.flat(t, "param")
            if count != math.prod(shape):
                if len(t.size) != len(shape) or t.numel != count:
                    raise MetadataError(f"{a.where}: holds {count} elements, but the model states give {name} the "
                                        f"shape {list(shape)}")
                # (made of a tensor-parallel run: the model states give one model-parallel rank's slice,
                # the universal tensor is whole)
                shape = tuple(t.size)
            key, path = (name, (name,)) if what == "fp32" else (f"optim.state.{name}.{what}",
                                                                 ("optim", "state", name, what))
            tensors[key] = TensorMeta(dtype_name(t.dtype), shape, (ChunkMeta((0,) * len(shape), shape, fname, key,
                                                                             off, a.crc_of(t)),), path)
            files[fname] = FileMeta(fname, self._size_of(fname), "", 0)
        fname = f"zero/{name}/step.pt"
        if self.files.exists(fname):
            a = self._archive(fname)
            value = self._scalar(a, fname, a.tree, "step")
            if value is not None:
                key = f"optim.state.{name}.step"
                objects[key] = ObjectMeta(fname, "", ("optim", "state", name, "step"))
                steps[key] = value
                files[fname] = FileMeta(fname, self._size_of(fname), "", 0)
        return tensors, objects, steps, files
