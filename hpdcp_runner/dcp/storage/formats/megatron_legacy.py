"""Megatron-LM's legacy checkpoints (``--ckpt-format torch``) read in place, under Megatron-Core's
names or Hugging Face's.

Megatron-LM's training loop, asked for its legacy format, saves each model-parallel rank's own
``model.state_dict()`` (with the run's ``args``, the RNG states and, unless ``--no-save-optim``,
the optimizer) as one ``torch.save`` archive: ``iter_<N>/mp_rank_<TP>[_<PP>][_<EP>]/model_optim_rng.pt``
(the pipeline rank is there when pipeline-parallel, the expert rank when expert-parallel; a name
with two numbers says which by the ``args`` it holds). Each archive holds that rank's slices under
the module's local names: layers numbered from 0 within a pipeline stage, experts from 0 within an
expert-parallel rank, the column-parallel linears (fused QKV, ``fc1``, the vocabulary-parallel
embedding and output layer) cut by rows, the row-parallel ones (``linear_proj``, ``fc2``) by
columns, and a SwiGLU ``fc1`` holding that rank's gate rows, then its up rows.

This reader describes the whole model under Megatron-Core's per-layer names with global numbering
(``decoder.layers.<i>.mlp.linear_fc1.weight``, all gate rows then all up rows, as the ``torch_dist``
format has it; a layer's experts stacked as ``mlp.experts.experts.linear_fc1.weight``), each tensor
a set of chunks pointing at its slices' bytes in the rank archives; with the model's
``config.json`` the same Hugging Face mapping as the ``torch_dist`` reader applies
(``megatron.to_hf``). Nothing is copied; a load reads only the slices it keeps.

The archives are read by the restricted unpickler of ``torch_archive``: it admits, besides tensors
and plain data, what a Megatron-LM save records (``argparse.Namespace``, the enums of
``megatron.core``, ``signal.Signals``, NumPy's RNG state arrays, ``_codecs.encode`` for bytes),
each as plain data; any other class is refused naming the file and the class.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import pickle
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from ...core.errors import CheckpointNotFoundError, MetadataError
from ...core.utils import get_logger
from ...format.metadata import ChunkMeta, FileMeta, Metadata, TensorMeta, dtype_name
from .foreign import _DescribedReader
from .format_marks import MEGATRON_RANK_DIR, MEGATRON_RANK_FILE
from .megatron import Shape, to_hf
from .torch_archive import Archive, ArchiveFiles, ArchiveIndex, Record, TensorRef

if TYPE_CHECKING:
    from ..checkpoint_files import CheckpointFiles

log = get_logger(__name__)

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
EXPERTS = "mlp.experts.experts."  # (the stacked name a layer's experts take, as in torch_dist)
#: how tensor parallelism cut each tensor (by its name after the layer prefix, or whole); every
#: other tensor is the same on every tensor-parallel rank
_ROWS = {"embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv.bias"}
_FC1 = {"mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.shared_experts.linear_fc1.weight",
        f"{EXPERTS}linear_fc1.weight", f"{EXPERTS}linear_fc1.bias"}
_COLUMNS = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight",
            f"{EXPERTS}linear_fc2.weight"}
#: the tensors every tensor-parallel rank holds whole: under tensor parallelism any other name (an
#: older Megatron-LM's ``language_model.*``) is refused, never read as one rank's slice
_SAME = re.compile(r"(decoder\.final_layernorm|embedding\.position_embeddings)\.(weight|bias)|"
                   r"(input_layernorm|pre_mlp_layernorm|self_attention\.(q|k)_layernorm)\.(weight|bias)|"
                   r"(self_attention\.linear_qkv|mlp\.linear_fc1|mlp\.shared_experts\.linear_fc1)\.layer_norm_(weight|bias)|"
                   r"(self_attention\.linear_proj|mlp\.linear_fc2|mlp\.experts\.experts\.linear_fc2|"
                   r"mlp\.shared_experts\.linear_fc2)\.bias|mlp\.router\.(weight|expert_bias)|mlp\.shared_experts\.gate_weight")


class Namespace(Record):
    """``argparse.Namespace`` (the run's arguments), as data: ``state`` is its attributes."""

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default) if isinstance(self.state, dict) else default


class EnumValue(Record):
    """An enum member (Megatron's, ``signal.Signals``), as its value."""


class NumpyArray(Record):
    """A NumPy array or dtype (the RNG state Megatron records), as data; NumPy is never called."""


def _encode(text: Any, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode``: how protocol 2 pickles bytes, done here for the text codecs only."""
    if not isinstance(text, str) or encoding.lower().replace("-", "") not in ("latin1", "utf8", "ascii"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode(encoding)


class _MegatronArchive(Archive):
    ADMITTED = {("argparse", "Namespace"): Namespace, ("signal", "Signals"): EnumValue,
                ("numpy._core.multiarray", "_reconstruct"): NumpyArray,
                ("numpy.core.multiarray", "_reconstruct"): NumpyArray,
                ("numpy", "ndarray"): NumpyArray, ("numpy", "dtype"): NumpyArray,
                ("_codecs", "encode"): _encode, ("io", "BytesIO"): Record, ("_io", "BytesIO"): Record}
    ADMITTED_MODULES = {"megatron.core.transformer.enums": lambda name: EnumValue,
                        "megatron.core.enums": lambda name: EnumValue}
    ADMITS = ("tensors, plain data and what a Megatron-LM save records: argparse.Namespace, megatron.core's "
              "enums, signal.Signals, NumPy arrays")


@dataclasses.dataclass(frozen=True)
class RankFile:
    """One model chunk of a model-parallel rank's archive: its tensor-, pipeline- and
    expert-parallel ranks, and where its layers come in the model (``stage``: the pipeline rank;
    with interleaved stages, chunk ``v`` of pipeline rank ``p`` of ``P`` is virtual stage ``v * P + p``)."""

    name: str
    tp: int
    pp: int
    ep: int
    archive: ArchiveIndex
    chunk: str = "model"  # (``model<v>`` with interleaved pipeline stages)
    stage: int = 0

    @property
    def model(self) -> dict:
        return self.archive.tree[self.chunk]


def model_chunks(a: ArchiveIndex) -> list[str]:
    """The model state dicts of an archive: ``model``, or one per virtual pipeline stage
    (``model0``, ``model1``...: ``--num-layers-per-virtual-pipeline-stage``), all there."""
    if not isinstance(a.tree, dict):
        raise MetadataError(f"{a.where}: not a Megatron-LM checkpoint (no state dict)")
    if isinstance(a.tree.get("model"), dict):
        return ["model"]
    held = sorted((int(m[1]), k) for k in a.tree if (m := re.fullmatch(r"model(\d+)", str(k))))
    if not held or [i for i, _ in held] != list(range(len(held))) or not all(isinstance(a.tree[k], dict)
                                                                            for _, k in held):
        raise MetadataError(f"{a.where}: no 'model' state dict, nor model0, model1... (one per virtual pipeline "
                            f"stage; held: {sorted(map(str, a.tree))[:8]})")
    said = _arg(a, "virtual_pipeline_model_parallel_size")
    if isinstance(said, int) and said != len(held):
        raise MetadataError(f"{a.where}: holds {len(held)} model chunks, its args say {said} virtual pipeline stages")
    return [k for _, k in held]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One rank's slice of a tensor: where it lies and what it is."""

    tp: int
    expert: int | None
    file: str
    offset: int
    ref: TensorRef
    crc: str  # the zip's CRC-32 of its storage, when it fills it (checked when read whole)


def rank_dir_numbers(name: str) -> tuple[int, int | None, int | None]:
    m = MEGATRON_RANK_DIR.fullmatch(name)
    if m is None:
        raise MetadataError(f"{name!r} is not a Megatron rank directory (mp_rank_<TP>[_<PP>][_<EP>])")
    return int(m[1]), (int(m[2]) if m[2] is not None else None), (int(m[3]) if m[3] is not None else None)


class MegatronLegacyReader(ArchiveFiles, _DescribedReader):
    """A Megatron-LM legacy iteration directory (see the module docstring)."""

    format_name = "megatron"
    UNPICKLER = _MegatronArchive

    def __init__(self, files: "CheckpointFiles | str | os.PathLike", *, rank_dirs: list[str] | None = None,
                 hf_config: dict | None = None, config_source: str = "config.json", **kwargs: Any) -> None:
        """``rank_dirs``: the iteration directory's ``mp_rank_*`` directories (read from ``files``
        when it is a local path)."""
        kwargs.pop("allow_pickle", None)  # (nothing here needs it: the archives are read as data)
        if rank_dirs is None:
            if not isinstance(files, (str, os.PathLike)):
                raise TypeError("MegatronLegacyReader over CheckpointFiles needs rank_dirs=")
            rank_dirs = sorted(d for d in os.listdir(files) if MEGATRON_RANK_DIR.fullmatch(d)) \
                if os.path.isdir(files) else []
        self.rank_dirs = sorted(rank_dirs)
        super().__init__(files, **kwargs)
        self.hf_config, self.config_source = hf_config, config_source

    def describe(self) -> Metadata:
        self.files.require_directory()
        ranks = self._rank_files()
        swiglu = _swiglu(ranks)
        pieces, shapes = _pieces(ranks)
        tensors = {name: _tensor(name, ps, max(r.tp for r in ranks) + 1, swiglu, shapes[name])
                   for name, ps in pieces.items()}
        names = list(dict.fromkeys(r.name for r in ranks))  # (an archive holds one model chunk per virtual stage)
        files = {n: FileMeta(n, self._size_of(n), "", i) for i, n in enumerate(names)}
        args = ranks[0].archive.tree.get("args")
        optim = list(dict.fromkeys(r.archive.where for r in ranks if "optimizer" in r.archive.tree))
        if optim:
            log.warning("%s: the optimizer state Megatron-LM saved beside the weights (%d archive(s), e.g. %s) is not "
                        "read; the model's weights are", self.path, len(optim), optim[0])
        extra = {"source_format": "megatron",
                 "megatron": {"names": "megatron", "format": "torch", "iteration": ranks[0].archive.tree.get("iteration"),
                              "swiglu": swiglu, "version": ranks[0].archive.tree.get("checkpoint_version"),
                              "args": isinstance(args, Namespace), "optimizer_read": False}}
        md = Metadata(len(names), tensors, {}, files, extra=extra)
        if self.hf_config is None:
            return md
        return to_hf(md, Shape.from_config(self.hf_config, self.config_source), self.path)

    def _rank_files(self) -> list[RankFile]:
        """Every rank's archive, indexed, with its ranks; all there, one model each."""
        if not self.rank_dirs:
            raise CheckpointNotFoundError(f"{self.path}: no mp_rank_<TP>[_<PP>][_<EP>] directories (not a Megatron-LM "
                                          f"legacy iteration directory)")
        names = [f"{d}/{MEGATRON_RANK_FILE}" for d in self.rank_dirs]
        for n in names:
            if not self.files.exists(n):
                raise CheckpointNotFoundError(f"{self.full(n)} is missing")
        with cf.ThreadPoolExecutor(min(8, len(names)), thread_name_prefix="hpdcp-megatron") as pool:
            archives = list(pool.map(self._archive, names))
        chunks = [model_chunks(a) for a in archives]
        if len({len(c) for c in chunks}) != 1:
            raise MetadataError(f"{self.path}: the archives hold different numbers of model chunks "
                                f"({sorted({len(c) for c in chunks})}: virtual pipeline stages)")
        numbers = [rank_dir_numbers(d) for d in self.rank_dirs]
        second = _second_number(archives, numbers, chunks)
        ranks = [RankFile(n, tp, (a if second == "pp" else b) or 0, (a if second == "ep" else b) or 0, arc)
                 for n, (tp, a, b), arc in zip(names, numbers, archives)]
        _check_complete(self.path, ranks)
        stages = max(r.pp for r in ranks) + 1
        return [dataclasses.replace(r, chunk=c, stage=v * stages + r.pp)
                for r, held in zip(ranks, chunks) for v, c in enumerate(held)]


def _arg(archive: ArchiveIndex, name: str) -> Any:
    args = archive.tree.get("args")
    return args.get(name) if isinstance(args, Namespace) else None


def _second_number(archives: list[ArchiveIndex], numbers: list[tuple], chunks: list[list[str]]) -> str:
    """What the second number of ``mp_rank_<TP>_<N>`` is: ``pp`` or ``ep`` (three numbers: TP,
    PP, EP). The run's args say; without them, a pipeline stage is known by lacking the final
    norm (only the last stage has it)."""
    if any(b is not None for _, _, b in numbers) or all(a is None for _, a, _ in numbers):
        return "pp"
    pp, ep = _arg(archives[0], "pipeline_model_parallel_size"), _arg(archives[0], "expert_model_parallel_size")
    if isinstance(pp, int) and pp > 1:
        return "pp"
    if isinstance(ep, int) and ep > 1:
        return "ep"
    return "ep" if all(any("decoder.final_layernorm.weight" in a.tree[c] for c in held)
                       for a, held in zip(archives, chunks)) else "pp"


def _check_complete(path: str, ranks: list[RankFile]) -> None:
    """Every (TP, PP, EP) combination there once, as many as the run's args say: a missing rank
    is named, never read as a smaller model."""
    held = {(r.tp, r.pp, r.ep) for r in ranks}
    said = [_arg(ranks[0].archive, f"{what}_model_parallel_size") for what in ("tensor", "pipeline", "expert")]
    sizes = [max([x[i] + 1 for x in held] + ([said[i]] if isinstance(said[i], int) else [])) for i in range(3)]
    for tp in range(sizes[0]):
        for pp in range(sizes[1]):
            for ep in range(sizes[2]):
                if (tp, pp, ep) not in held:
                    raise CheckpointNotFoundError(f"{path}: the archive of tensor-parallel rank {tp}, pipeline rank "
                                                  f"{pp}, expert rank {ep} is missing (saved by {sizes[0]} x "
                                                  f"{sizes[1]} x {sizes[2]} ranks)")


def _swiglu(ranks: list[RankFile]) -> bool:
    """Whether ``fc1`` holds gate and up rows (``--swiglu``): from the run's args. Only a
    tensor-parallel checkpoint needs to know (its ranks' halves interleave)."""
    value = _arg(ranks[0].archive, "swiglu")
    if value is None and max(r.tp for r in ranks) > 0 and \
            any(k.endswith("linear_fc1.weight") for k in ranks[0].model):
        raise MetadataError(f"{ranks[0].archive.where}: records no args.swiglu, so whether its tensor-parallel "
                            f"fc1 slices hold gate and up halves cannot be told")
    return bool(value)


def _pieces(ranks: list[RankFile]) -> tuple[dict[str, list[Piece]], dict[str, tuple[int, ...]]]:
    """Every rank's slices by global name (layers numbered across pipeline stages, virtual ones
    included, experts across expert ranks), and each slice's local shape (the same on every rank,
    checked)."""
    stage_layers: dict[int, set[int]] = defaultdict(set)
    local_experts: dict[tuple[int, int], int] = {}
    for r in ranks:
        for key in r.model:
            m = _LAYER.fullmatch(str(key))
            if m:
                stage_layers[r.stage].add(int(m[1]))
                e = _EXPERT.fullmatch(m[2])
                if e:
                    at = (r.stage, int(m[1]))
                    local_experts[at] = max(local_experts.get(at, 0), int(e[1]) + 1)
    offsets, at = {}, 0
    for p in sorted(stage_layers) or [0]:
        offsets[p] = at
        at += len(stage_layers.get(p, ()))
    pieces: dict[str, list[Piece]] = defaultdict(list)
    shapes: dict[str, tuple[int, ...]] = {}
    for r in ranks:
        for key, ref in r.model.items():
            key = str(key)
            if key.endswith("._extra_state") or not isinstance(ref, TensorRef):
                continue
            name, expert = key, None
            m = _LAYER.fullmatch(key)
            if m:
                rest, local = m[2], int(m[1])
                e = _EXPERT.fullmatch(rest)
                if e:
                    expert = r.ep * local_experts[(r.stage, local)] + int(e[1])
                    rest = EXPERTS + e[2]
                elif r.ep:
                    continue  # (the dense parts are the same on every expert rank)
                name = f"decoder.layers.{offsets[r.stage] + local}.{rest}"
            elif r.ep:
                continue
            off, _ = r.archive.flat(ref, key)
            if shapes.setdefault(name, ref.size) != ref.size:
                raise MetadataError(f"{r.archive.where}: {key!r} has shape {list(ref.size)}, another rank's slice "
                                    f"{list(shapes[name])}")
            pieces[name].append(Piece(r.tp, expert, r.name, off, ref, r.archive.crc_of(ref)))
    return pieces, shapes


def _kind(name: str) -> str:
    rest = m[2] if (m := _LAYER.fullmatch(name)) else name
    return "rows" if rest in _ROWS else "fc1" if rest in _FC1 else "columns" if rest in _COLUMNS else "same"


def _tensor(name: str, pieces: list[Piece], tp: int, swiglu: bool, local: tuple[int, ...]) -> TensorMeta:
    """The global tensor ``name`` made of its slices (see the module docstring)."""
    kind = _kind(name)
    if kind == "fc1" and not swiglu:
        kind = "rows"
    rest = m[2] if (m := _LAYER.fullmatch(name)) else name
    if kind == "same" and tp > 1 and not _SAME.fullmatch(rest):
        raise MetadataError(f"{pieces[0].file}: {name!r} is not a Megatron-Core GPT tensor this reader knows how "
                            f"tensor parallelism cut (an older Megatron-LM model's language_model.* names are not "
                            f"read)")
    if kind == "same" or tp == 1:
        pieces = [p for p in pieces if p.tp == 0]
    experts = sorted({p.expert for p in pieces}) if pieces[0].expert is not None else []
    seen = {(p.expert, p.tp) for p in pieces}
    wanted = {(e, t) for e in (experts or [None]) for t in (range(tp) if kind != "same" and tp > 1 else [0])}
    if seen != wanted or len(seen) != len(pieces) or (experts and experts != list(range(len(experts)))):
        raise MetadataError(f"{pieces[0].file}: the slices of {name!r} do not make a whole tensor (held: "
                            f"{sorted(seen, key=str)[:8]})")
    split = tp if kind != "same" else 1
    if kind == "columns" and len(local) < 2:
        raise MetadataError(f"{pieces[0].file}: {name!r} is {len(local)}-D; a row-parallel weight is 2-D")
    if kind in ("rows", "fc1") and (not local or (kind == "fc1" and local[0] % 2)):
        raise MetadataError(f"{pieces[0].file}: {name!r} of shape {list(local)} cannot be cut by rows here")
    shape = list(local)
    if kind in ("rows", "fc1"):
        shape[0] *= split
    elif kind == "columns":
        shape[1] *= split
    lead = (len(experts),) if experts else ()
    esize = torch.empty((), dtype=pieces[0].ref.dtype).element_size()
    chunks = []
    for p in sorted(pieces, key=lambda p: (p.expert or 0, p.tp)):
        at, one = ((p.expert,), (1,)) if experts else ((), ())
        zeros = (0,) * len(local)
        if kind == "fc1":  # this rank's gate rows, then its up rows
            half = local[0] // 2
            row = esize * (int(torch.Size(local[1:]).numel()) if len(local) > 1 else 1)
            box = (half, *local[1:])
            chunks.append(ChunkMeta((*at, p.tp * half, *zeros[1:]), (*one, *box), p.file, name, p.offset, ""))
            chunks.append(ChunkMeta((*at, tp * half + p.tp * half, *zeros[1:]), (*one, *box), p.file, name,
                                    p.offset + half * row, ""))
            continue
        offs = list(zeros)
        if kind == "rows":
            offs[0] = p.tp * local[0]
        elif kind == "columns":
            offs[1] = p.tp * local[1]
        chunks.append(ChunkMeta((*at, *offs), (*one, *local), p.file, name, p.offset, p.crc))
    return TensorMeta(dtype_name(pieces[0].ref.dtype), (*lead, *shape), tuple(chunks), (name,))
