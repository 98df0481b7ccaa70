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
from ..core.errors import ConfigError, HpdcpError
from ..core.rafile import open_regular_file
from ..storage.object_checkpoint import ObjectDirectoryOutput
from ..storage.uri import is_uri, normalize
from ..storage.commit import StagedDir
from ..storage.foreign import HF_INDEX, HF_SINGLE
from ..storage.locations import open_reader
from ..format.metadata import Metadata, dtype_from_name, element_size
from .transforms import check_with_safetensors, plan_hf_shards
from ..format.renames import rename_keys
from ..storage.interfaces import StorageReader
from ..core.utils import get_logger

log = get_logger(__name__)
# weights and checkpoint metadata never travel as side files; everything else small does
_NOT_SIDE_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|distcp|ckpt|h5|msgpack)|\..*|metadata\.json|"
                             r".*\.index\.json")
MAX_SIDE_FILE_BYTES = 256 << 20


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


def side_files(directory: str) -> list[str]:
    """The regular files of a model directory that are not weights: config, generation config,
    tokenizer, chat template, custom code (copied, never run)."""
    return sorted(_read_side_files(directory, names_only=True))


def export_hf(checkpoint_id: str | os.PathLike, output: str | os.PathLike, *, format: str = "auto",
              rename: Sequence[Any] = (), allow_pickle: bool = False, max_shard_size: int = 5 * 10**9,
              files_from: str | os.PathLike | None = None, overwrite: bool = False, fsync: bool = True,
              process_group: Any = None, timeout: Timeout = None,
              reader_factory: Callable[[], StorageReader] | None = None,
              load_kwargs: dict | None = None) -> dict[str, Any]:
    """Write the tensors of ``checkpoint_id`` (ours, Hugging Face or torch DCP; ``rename`` applied)
    as a Hugging Face directory at ``output``. Collective: every rank of ``process_group`` calls
    it. ``files_from``: the directory whose config/tokenizer files are copied (default: the
    source when it is a Hugging Face directory). Objects (non-tensor values) are not written."""
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
    names = sorted(md.tensors, key=natural_key)
    if "__metadata__" in names:
        raise ConfigError(f"{src}: a tensor named '__metadata__' cannot be written to safetensors; rename it")
    sizes = [(k, math.prod(md.tensors[k].shape) * element_size(md.tensors[k].dtype)) for k in names]
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
    check_together(comm, sum(size_of[k] for k in shards[big]) if mine else 0, "cpu",
                   f"export_hf of {src} (writing {files[big] if mine else 'nothing'})",
                   "each rank holds one whole output shard at a time: use more hosts or a smaller max_shard_size "
                   "(a single tensor larger than memory cannot be exported)")
    side_dir = (normalize(files_from) if is_uri(files_from) else os.path.abspath(os.fspath(files_from))) \
        if files_from else (src if kind == "hf" else None)
    if side_dir is not None and not is_uri(side_dir) and os.path.isfile(side_dir):
        side_dir = os.path.dirname(side_dir)
    if side_dir is not None and is_uri(side_dir) and side_dir.endswith(".safetensors"):
        side_dir = side_dir.rsplit("/", 1)[0]
    store_out = ObjectDirectoryOutput(dst, overwrite) if remote else None
    weights = files + ([HF_INDEX] if n > 1 else [])

    def begin() -> Any:
        if side_dir is not None and not is_uri(side_dir) and not os.path.isdir(side_dir):
            raise ConfigError(f"{side_dir}: the directory to copy config/tokenizer files from does not exist")
        if store_out is None:
            return StagedDir(dst, overwrite).tmp
        before = store_out.begin()
        side = _read_side_files(side_dir) if side_dir else {}
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
                if i is not None and store_out is not None:
                    write_file(f"{dst}/{files[i]}", [(k, state[k]) for k in keys], meta={"format": "pt"},
                               sink=store_out.sink(files[i]))
                elif i is not None:
                    path = os.path.join(staging, files[i])
                    write_file(path, [(k, state[k]) for k in keys], meta={"format": "pt"}, fsync=fsync)
                    check_with_safetensors(path)  # what we publish is what the real reader accepts

            comm.agree(f"export_hf: write round {r}", write)
            state = write = None  # this round's tensors go before the next round allocates

        def commit() -> list[str]:
            if n > 1:
                doc = {"metadata": {"total_size": sum(s for _, s in sizes)},
                       "weight_map": {k: files[i] for i, s in enumerate(shards) for k in s}}
                text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
                if store_out is not None:
                    store_out.put(HF_INDEX, text.encode())  # last: it names shards all uploaded by now
                else:
                    with open(os.path.join(staging, HF_INDEX), "w") as f:
                        f.write(text)
            if store_out is not None:
                store_out.finish(began["before"], weights + began["copied"])
                return began["copied"]
            side = _read_side_files(side_dir) if side_dir else {}
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
            "counters": counters}


def _read_side_files(where: str, names_only: bool = False) -> dict[str, bytes]:
    """The side files of a local directory or of a directory in a store, read whole: they are
    small (config, tokenizer), and a store has no copy across buckets. Locally each is opened
    inside the directory without following links and checked on the descriptor, then read from
    it: a link swapped in after the listing is refused, never followed (what is copied is what
    was checked)."""
    if not is_uri(where):
        out = {}
        dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            for name in sorted(os.listdir(dfd)):
                if _NOT_SIDE_FILES.fullmatch(name):
                    continue
                try:
                    f = open_regular_file(os.path.join(where, name), dfd, what="side file")
                except (FileNotFoundError, HpdcpError):
                    continue  # a link, a directory, a device, or gone: not copied
                with f:
                    if os.fstat(f.fileno()).st_size > MAX_SIDE_FILE_BYTES:
                        log.warning("not copying %s: over %d bytes", os.path.join(where, name), MAX_SIDE_FILE_BYTES)
                        continue
                    out[name] = b"" if names_only else f.read(MAX_SIDE_FILE_BYTES + 1)[:MAX_SIDE_FILE_BYTES]
        finally:
            os.close(dfd)
        return out
    from ..storage.object_store import Bucket

    bucket = Bucket(where)
    out = {}
    for o in bucket.list_dir(bucket.root)[1]:
        name = o["path"].rsplit("/", 1)[-1]
        if _NOT_SIDE_FILES.fullmatch(name) or o["size"] > MAX_SIDE_FILE_BYTES:
            continue
        got = bucket.get(o["path"], max_bytes=MAX_SIDE_FILE_BYTES)
        if got is not None:
            out[name] = got[0]
    return out
