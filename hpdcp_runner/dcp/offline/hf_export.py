"""Any checkpoint -> a Hugging Face directory ``from_pretrained`` opens, written by every rank at
once: the output files are split among the ranks by bytes, each rank loads the whole tensors of
its files (the distributed load: partial reads, replica broadcast) and writes them, and the
coordinator writes the index, copies ``config.json``/tokenizer files and commits the directory in
one rename. Memory per rank: one output file (``max_shard_size``), never the whole model.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Sequence

import torch

from ..api import Timeout, load
from ..protocol import metadata_source
from ..format.safetensors_io import write_file
from ..comm.collectives import Comm
from ..core.memory import check_together
from ..core.errors import ConfigError
from .side_files import check_side_dir, read_side_files, resolve_side_dir
from ..storage.object_checkpoint import ObjectDirectoryOutput
from ..storage.uri import is_uri, normalize
from ..storage.commit import StagedDir
from ..storage.foreign import HF_INDEX, HF_SINGLE
from ..storage.locations import open_reader
from ..format.metadata import Metadata, dtype_from_name, element_size
from .model_weights import describe_split, split_model_weights
from .transforms import check_with_safetensors, plan_hf_shards, select_keys
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
    remote = is_uri(output)  # a store: see storage.object_checkpoint.ObjectDirectoryOutput
    src = normalize(checkpoint_id) if is_uri(checkpoint_id) else os.path.abspath(os.fspath(checkpoint_id))
    dst = normalize(output) if remote else os.path.abspath(os.fspath(output))
    comm = Comm.create(process_group, timeout)

    def reader() -> StorageReader:
        return reader_factory() if reader_factory else open_reader(src, format, allow_pickle=allow_pickle)

    # one reader per rank for every round: a foreign checkpoint is described once, not per round
    source_reader = reader()
    kind, where = source_reader.format_name, metadata_source(source_reader, src)

    def describe() -> str:
        try:
            return source_reader.read_metadata_text()
        finally:
            source_reader.close()

    text = comm.agree_root("export_hf: metadata", describe)
    md = rename_keys(Metadata.from_json(text, source=where, open_file=source_reader.open_file), rename, source=src)
    split = split_model_weights(md.tensors) if model_only else None
    base = split.names if split is not None else {k: k for k in md.tensors}
    out_name = _output_names(select_keys(sorted(base), include=include, exclude=exclude, names=base), src)
    left_out = describe_split(split) if split is not None and split.split else None
    if left_out and comm.rank == 0:
        log.warning("%s: %s (model_only=False writes every tensor)", src, left_out)
    cast = dtype_from_name(dtype) if dtype else None

    def out_dtype(key: str) -> str:
        d = md.tensors[key].dtype
        return dtype if cast is not None and dtype_from_name(d).is_floating_point else d

    names = sorted(out_name, key=lambda k: natural_key(out_name[k]))
    sizes = [(k, math.prod(md.tensors[k].shape) * element_size(out_dtype(k))) for k in names]
    shards = plan_hf_shards(sizes, max_shard_size)
    n = len(shards)
    files = [HF_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    size_of = dict(sizes)
    owners = assign_files([sum(size_of[k] for k in s) for s in shards], comm.world_size)
    mine = [i for i in range(n) if owners[i] == comm.rank]
    rounds = max(owners.count(r) for r in range(comm.world_size))

    def check_claims() -> None:
        """Before a byte is allocated: the files hold what the metadata claims (rank 0, once)."""
        if hasattr(source_reader, "check_claims"):  # a custom reader checks its own
            try:
                source_reader.check_claims(md)
            finally:
                source_reader.close()

    comm.agree_root("export_hf: sizes", check_claims)
    big = max(mine, key=lambda i: sum(size_of[k] for k in shards[i])) if mine else None
    # loaded in the source's dtypes, then cast one tensor at a time
    held = sum(math.prod(md.tensors[k].shape) * element_size(md.tensors[k].dtype) for k in shards[big]) + \
        (max(size_of[k] for k in shards[big]) if cast is not None else 0) if mine else 0
    check_together(comm, held, "cpu",
                   f"export_hf of {src} (writing {files[big] if mine else 'nothing'})",
                   "each rank holds one whole output shard at a time: use more hosts or a smaller max_shard_size "
                   "(a single tensor larger than memory cannot be exported)")
    side_dir = resolve_side_dir(files_from, src if kind == "hf" else None)
    store_out = ObjectDirectoryOutput(dst, overwrite, source=src if is_uri(src) else None) if remote else None
    weights = files + ([HF_INDEX] if n > 1 else [])

    def begin() -> Any:
        check_side_dir(side_dir)
        if store_out is None:
            return StagedDir(dst, overwrite).tmp
        before = store_out.begin()
        side = _with_recorded_config(read_side_files(side_dir) if side_dir else {}, md)
        for name, data in side.items():  # first: the weights' arrival makes the directory usable
            store_out.put(name, data)
        return {"before": before, "copied": sorted(side)}

    began = comm.agree_root("export_hf: begin", begin)
    staging = began if store_out is None else None
    out = StagedDir.adopt(dst, staging, overwrite) if store_out is None else None  # rank 0 commits or aborts it
    counters: dict[str, int] = {}
    try:
        for r in range(rounds):
            i = mine[r] if r < len(mine) else None
            keys = shards[i] if i is not None else []
            state = {k: torch.empty(md.tensors[k].shape, dtype=dtype_from_name(md.tensors[k].dtype)) for k in keys}
            res = load(state, storage_reader=source_reader, process_group=process_group, strict=False,
                       allow_pickle=allow_pickle, timeout=timeout, rename=rename, **(load_kwargs or {}))
            counters = dict(res.counters)  # the reader's counters: cumulative over the rounds

            def write(i: int | None = i, keys: list = keys, state: dict = state) -> None:
                for k in keys:  # one tensor at a time: the shard is never held twice
                    if cast is not None and state[k].is_floating_point():
                        state[k] = state[k].to(cast)
                pairs = [(out_name[k], state[k]) for k in keys]
                if i is not None and store_out is not None:
                    write_file(f"{dst}/{files[i]}", pairs, meta={"format": "pt"}, sink=store_out.sink(files[i]))
                elif i is not None:
                    path = os.path.join(staging, files[i])
                    write_file(path, pairs, meta={"format": "pt"}, fsync=fsync)
                    check_with_safetensors(path)  # what we publish is what the real reader accepts

            comm.agree(f"export_hf: write round {r}", write)
            state = write = None  # this round's tensors go before the next round allocates

        def commit() -> list[str]:
            if n > 1:
                doc = {"metadata": {"total_size": sum(s for _, s in sizes)},
                       "weight_map": {out_name[k]: files[i] for i, s in enumerate(shards) for k in s}}
                text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
                if store_out is not None:
                    store_out.put(HF_INDEX, text.encode())  # last: it names shards all uploaded by now
                else:
                    with open(os.path.join(staging, HF_INDEX), "w") as f:
                        f.write(text)
            if store_out is not None:
                store_out.finish(began["before"], weights + began["copied"])
                return began["copied"]
            side = _with_recorded_config(read_side_files(side_dir) if side_dir else {}, md)
            for name, data in side.items():  # the bytes read from the checked descriptor
                with open(os.path.join(staging, name), "xb") as f:
                    f.write(data)
            copied = sorted(side)
            out.commit(fsync=fsync)
            return copied

        copied = comm.agree_root("export_hf: commit", commit)
    except BaseException:
        if comm.rank == 0 and out is not None:
            out.abort()
        elif comm.rank == 0:
            store_out.abort(weights)
        raise
    if comm.rank == 0 and not any(name == "config.json" for name in copied):
        log.warning("%s has no config.json (the source is not a Hugging Face directory): from_pretrained needs "
                    "one; pass files_from=<a Hugging Face model directory>", dst)
    return {"output": dst, "files": files, "tensors": len(names), "total_size": sum(s for _, s in sizes),
            "files_written_here": [files[i] for i in mine], "copied": copied, "skipped_objects": sorted(md.objects),
            "left_out": left_out, "names": out_name, "counters": counters}


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
