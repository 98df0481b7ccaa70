"""Any checkpoint -> a Hugging Face directory ``from_pretrained`` opens, written by every rank at
once: the output files are split among the ranks by bytes, each rank loads the whole tensors of
its files (the distributed load: partial reads, replica broadcast) and writes them, and the
coordinator copies ``config.json``/tokenizer files, writes the index and commits the directory as
its storage allows (``storage.outputs``: one rename locally, the index last in a store). Memory
per rank: one batch of tensors (``EXPORT_BATCH_BYTES``, or the largest tensor) streamed into its
file, never a whole file or the whole model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..api import Timeout, load
from ..protocol import metadata_source
from ..comm.collectives import Comm
from ..core.memory import check_together
from ..core.errors import ConfigError
from .side_files import check_side_dir, read_side_files, resolve_side_dir
from ..storage.location import resolve
from ..storage.outputs import DirectoryOutput, open_output
from ..storage.formats.foreign import HF_INDEX, HF_SINGLE
from ..storage.checkpoint_io import open_reader
from ..format.metadata import Metadata, dtype_from_name, dtype_name, element_size
from .model_weights import describe_split, split_model_weights
from .transforms import plan_hf_shards, select_keys
from ..format.renames import rename_keys
from ..storage.interfaces import StorageReader
from ..core.utils import get_logger

log = get_logger(__name__)


def natural_key(key: str) -> list:
    """``layers.10`` after ``layers.9``: files hold consecutive layers, as Hugging Face writes them."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", key)]


def assign_files(nbytes: Sequence[int], world_size: int) -> list[int]:
    """The writing rank of each file: largest first onto the least-loaded rank (pure)."""
    load_, owner = [0] * world_size, [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        r = min(range(world_size), key=lambda r: (load_[r], r))
        owner[i] = r
        load_[r] += nbytes[i]
    return owner


def export_hf(checkpoint_id: str | os.PathLike, output: str | os.PathLike, *, format: str = "auto",
              rename: Sequence[Any] = (), allow_pickle: bool = False, max_shard_size: int = 5 * 10**9,
              files_from: str | os.PathLike | None = None, overwrite: bool = False, fsync: bool = True,
              process_group: Any = None, timeout: Timeout = None,
              reader_factory: Callable[[], StorageReader] | None = None,
              load_kwargs: dict | None = None, model_only: bool = True, include: str | None = None,
              exclude: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Write the tensors of ``checkpoint_id`` (ours, Hugging Face or torch DCP; ``rename`` applied)
    as a Hugging Face directory at ``output``. Collective: every rank of ``process_group`` calls
    it. ``files_from``: the directory whose config/tokenizer files are copied (default: the
    source when it is a Hugging Face directory). Objects (non-tensor values) are not written.
    ``model_only``: of a model+optimizer checkpoint, only the model's weights under the model's
    own names (``model_weights.split_model_weights``; ``left_out`` in the result says what was
    not written). ``include``/``exclude``: regexes on the keys (after ``rename``); ``dtype``:
    floating tensors cast to it."""
    if max_shard_size <= 0:
        raise ConfigError(f"max_shard_size must be positive, got {max_shard_size}")
    src, dst = resolve(checkpoint_id), resolve(output)
    comm = Comm.create(process_group, timeout)
    # one reader per rank for every round: a foreign checkpoint is described once, not per round
    source_reader = reader_factory() if reader_factory else open_reader(src, format, allow_pickle=allow_pickle)
    kind, where = source_reader.format_name, metadata_source(source_reader, src)

    def describe() -> str:
        try:
            return source_reader.read_metadata_text()
        finally:
            source_reader.close()

    text = comm.agree_root("export_hf: metadata", describe)
    md = rename_keys(Metadata.from_json(text, source=where, open_file=source_reader.open_file), rename, source=src)
    plan = _plan(md, src, comm, max_shard_size, model_only, include, exclude, dtype)
    _check_before_reading(comm, source_reader, md, plan, src)
    side_dir = resolve_side_dir(files_from, src if kind == "hf" else None)
    out = open_output(dst, overwrite, source=src, fsync=fsync)

    def begin() -> Any:
        check_side_dir(side_dir)
        token = out.begin()
        side = _with_recorded_config(read_side_files(side_dir) if side_dir else {}, md)
        for name, data in side.items():  # first: the weights' arrival makes a store's directory usable
            out.put(name, data)
        return {"token": token, "copied": sorted(side)}

    began = comm.agree_root("export_hf: begin", begin)
    if comm.rank != 0:
        out.adopt(began["token"])
    weights = plan.files + ([HF_INDEX] if len(plan.files) > 1 else [])
    try:
        counters = _write_rounds(comm, out, source_reader, md, plan, process_group, allow_pickle, timeout, rename,
                                 load_kwargs)

        def commit() -> None:
            if len(plan.files) > 1:  # last: it names shards all written by now
                doc = {"metadata": {"total_size": sum(s for _, s in plan.sizes)},
                       "weight_map": {plan.out_name[k]: plan.files[i] for i, sh in enumerate(plan.shards) for k in sh}}
                out.put(HF_INDEX, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
            out.commit(weights + began["copied"])

        comm.agree_root("export_hf: commit", commit)
    except BaseException:
        if comm.rank == 0:
            out.abort(weights)
        raise
    copied = began["copied"]
    if comm.rank == 0 and "config.json" not in copied:
        log.warning("%s has no config.json (the source is not a Hugging Face directory): from_pretrained needs "
                    "one; pass files_from=<a Hugging Face model directory>", dst)
    return {"output": dst, "files": plan.files, "tensors": len(plan.names),
            "total_size": sum(s for _, s in plan.sizes), "files_written_here": [plan.files[i] for i in plan.mine],
            "copied": copied, "skipped_objects": sorted(md.objects), "left_out": plan.left_out,
            "names": plan.out_name, "counters": counters}


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes and who writes it (the same on every rank)."""

    names: list[str]  # tensor keys in output order
    out_name: dict[str, str]  # key -> name in the output
    sizes: list[tuple[str, int]]  # (key, bytes in the output dtype)
    shards: list[list[str]]  # the keys of each output file
    files: list[str]
    owners: list[int]  # the writing rank of each file
    mine: list[int]  # the files this rank writes
    rounds: int  # writing rounds: the most files any rank writes
    cast: torch.dtype | None
    left_out: str | None


def _plan(md: Metadata, src: str, comm: Comm, max_shard_size: int, model_only: bool, include: str | None,
          exclude: str | None, dtype: str | None) -> ExportPlan:
    split = split_model_weights(md.tensors) if model_only else None
    base = split.names if split is not None else {k: k for k in md.tensors}
    out_name = _output_names(select_keys(sorted(base), include=include, exclude=exclude, names=base), src)
    left_out = describe_split(split) if split is not None and split.split else None
    if left_out and comm.rank == 0:
        log.warning("%s: %s (model_only=False writes every tensor)", src, left_out)
    cast = dtype_from_name(dtype) if dtype else None

    def out_dtype(key: str) -> str:
        d = md.tensors[key].dtype
        return dtype if cast is not None and dtype_from_name(d).is_floating_point else d  # type: ignore[return-value]

    names = sorted(out_name, key=lambda k: natural_key(out_name[k]))
    sizes = [(k, math.prod(md.tensors[k].shape) * element_size(out_dtype(k))) for k in names]
    shards = plan_hf_shards(sizes, max_shard_size)
    n = len(shards)
    files = [HF_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    size_of = dict(sizes)
    owners = assign_files([sum(size_of[k] for k in s) for s in shards], comm.world_size)
    mine = [i for i in range(n) if owners[i] == comm.rank]
    rounds = max(owners.count(r) for r in range(comm.world_size))
    return ExportPlan(names, out_name, sizes, shards, files, owners, mine, rounds, cast, left_out)


def _check_before_reading(comm: Comm, source_reader: StorageReader, md: Metadata, plan: ExportPlan, src: str) -> None:
    """Before a byte is allocated: the files hold what the metadata claims (rank 0, once), and
    every rank has memory for the largest file it writes."""

    def check_claims() -> None:
        if hasattr(source_reader, "check_claims"):  # a custom reader checks its own
            try:
                source_reader.check_claims(md)
            finally:
                source_reader.close()

    comm.agree_root("export_hf: sizes", check_claims)
    size_of = dict(plan.sizes)
    nbytes = _source_bytes(md, plan.names)
    # loaded in the source's dtypes a batch at a time, then cast one tensor at a time
    batches = [(plan.files[i], b) for i in plan.mine for b in _batches(plan.shards[i], nbytes, EXPORT_BATCH_BYTES)]
    name, big = max(batches, key=lambda fb: sum(nbytes[k] for k in fb[1])) if batches else ("nothing", [])
    held = sum(nbytes[k] for k in big) + (max(size_of[k] for k in big) if plan.cast is not None and big else 0)
    check_together(comm, held, "cpu", f"export_hf of {src} (writing {name}: a batch of {len(big)} tensor(s))",
                   "each rank holds one batch of tensors (about 256 MiB, or the largest tensor) at a time: "
                   "a single tensor larger than memory cannot be exported")


#: what one rank holds of a file it writes: tensors are loaded in batches of about this many bytes
#: (a batch is at least one tensor) and streamed into the file, so memory is a batch, not a file
EXPORT_BATCH_BYTES = 256 << 20


def _batches(keys: Sequence[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """``keys`` in order, cut into runs of at most ``limit`` bytes (a larger tensor alone) (pure)."""
    out: list[list[str]] = []
    held = limit
    for k in keys:
        if held + nbytes[k] > limit or not out:
            out.append([])
            held = 0
        out[-1].append(k)
        held += nbytes[k]
    return out


def _source_bytes(md: Metadata, keys: Sequence[str]) -> dict[str, int]:
    return {k: math.prod(md.tensors[k].shape) * element_size(md.tensors[k].dtype) for k in keys}


def _write_rounds(comm: Comm, out: DirectoryOutput, source_reader: StorageReader, md: Metadata, plan: ExportPlan,
                  process_group: Any, allow_pickle: bool, timeout: Timeout, rename: Sequence[Any],
                  load_kwargs: dict | None, batch_bytes: int | None = None) -> dict[str, int]:
    """Every rank writes one of its files per round, streamed: its tensors are loaded a batch at
    a time (a collective load per batch; every rank takes part in as many as the rank with the
    most batches, from the plan every rank holds) and appended to the file as they arrive.
    Returns the reader's counters (cumulative over the rounds)."""
    counters: dict[str, int] = {}
    nbytes = _source_bytes(md, plan.names)
    batch_bytes = batch_bytes or EXPORT_BATCH_BYTES
    for r in range(plan.rounds):
        files = {q: _owned(plan, q)[r] for q in range(comm.world_size) if r < len(_owned(plan, q))}
        cuts = {q: _batches(plan.shards[i], nbytes, batch_bytes) for q, i in files.items()}
        steps = max((len(c) for c in cuts.values()), default=0)
        i = files.get(comm.rank)
        mine = cuts.get(comm.rank, [])
        writer = [None]

        def open_file(i: int | None = i) -> None:
            if i is not None:
                writer[0] = out.stream_safetensors(plan.files[i], [
                    (plan.out_name[k], dtype_name(plan.cast) if plan.cast is not None and
                     dtype_from_name(md.tensors[k].dtype).is_floating_point else md.tensors[k].dtype,
                     tuple(md.tensors[k].shape)) for k in plan.shards[i]], {"format": "pt"})

        comm.agree(f"export_hf: open round {r}", open_file)
        try:
            for step in range(steps):
                keys = mine[step] if step < len(mine) else []
                state = {k: torch.empty(md.tensors[k].shape, dtype=dtype_from_name(md.tensors[k].dtype)) for k in keys}
                res = load(state, storage_reader=source_reader, process_group=process_group, strict=False,
                           allow_pickle=allow_pickle, timeout=timeout, rename=rename, **(load_kwargs or {}))
                counters = dict(res.counters)

                def append(keys: list = keys, state: dict = state) -> None:
                    for k in keys:  # one tensor at a time: cast, written, dropped
                        t = state.pop(k)
                        if plan.cast is not None and t.is_floating_point():
                            t = t.to(plan.cast)
                        writer[0].append(plan.out_name[k], t)  # type: ignore[union-attr]

                comm.agree(f"export_hf: write round {r} batch {step}", append)
                state = append = None  # type: ignore[assignment]  # this batch goes before the next is allocated

            def close(i: int | None = i) -> None:
                if i is not None:
                    writer[0].close()  # type: ignore[union-attr]
                    writer[0] = None
                    out.check_safetensors(plan.files[i])

            comm.agree(f"export_hf: close round {r}", close)
        except BaseException:
            if writer[0] is not None:
                writer[0].abort()
            raise
    return counters


def _owned(plan: ExportPlan, rank: int) -> list[int]:
    """The files ``rank`` writes, in the order of its rounds (as ``plan.mine`` is for this rank)."""
    return [i for i in range(len(plan.files)) if plan.owners[i] == rank]


RECORDED_SIDE_FILES = {"config.json": "model_config", "generation_config.json": "generation_config"}


def _with_recorded_config(side: dict[str, bytes], md: Any) -> dict[str, bytes]:
    """The side files plus ``config.json`` and ``generation_config.json`` from the checkpoint's
    ``extra.model_config`` / ``extra.generation_config`` (what a writer that knew the model
    recorded, e.g. a reshard of a Hugging Face directory) when no side directory gave them: a
    round trip through our format stays ``from_pretrained``-ready, generation settings included."""
    extra = getattr(md, "extra", {}) or {}
    out = dict(side)
    if "config.json" in side:  # a side directory was given: its files, not what we recorded
        return out
    for name, field in RECORDED_SIDE_FILES.items():
        recorded = extra.get(field)
        if isinstance(recorded, dict):
            out[name] = (json.dumps(recorded, indent=2, sort_keys=True) + "\n").encode()
    return out


def _output_names(names: dict[str, str], src: str) -> dict[str, str]:
    """{tensor key: name in the output}, checked: something is left, and no name is the one the
    safetensors header reserves."""
    if not names:
        raise ConfigError(f"{src}: no tensor left to export (include/exclude left none)")
    reserved = [k for k, name in names.items() if name == "__metadata__"]
    if reserved:
        raise ConfigError(f"{src}: tensor {reserved[0]!r} would be named '__metadata__' in the output, a "
                          f"name the safetensors format reserves; rename it")
    return names
