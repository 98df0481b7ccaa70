"""Single-process conversions between our checkpoints and other formats, in bounded memory.

* ``merge_to_hf``: our checkpoint (any layout, any world size) -> a Hugging Face directory
  (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``),
  with a shard size cap, an optional dtype cast of floating tensors, regex renames and filters.
  Each tensor is assembled from its chunks into one reused buffer and written before the next:
  peak memory is the largest tensor (plus its cast copy) and a 1 MiB write buffer, whatever the
  checkpoint size.
* ``import_checkpoint``: a Hugging Face directory, one ``.safetensors``, a ``.pt`` file
  (``weights_only``), a torch DCP or a hyper-parallel checkpoint -> our format, split into
  ``world_size`` rank files by a ``boxes`` rule (Shard(0) by default, or a runner layout), so it
  loads directly under that layout. Region reads keep memory at one tensor.
* ``export_torch_dcp``: our checkpoint -> ``torch.distributed.checkpoint`` format (full tensors,
  one file). torch's writer takes one in-memory state dict, so this one holds the whole
  checkpoint in memory.

Outputs appear under their final name only when complete (staging directory + rename).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Iterable, Sequence

import torch

from ..format import objects as objcodec
from ..core.errors import ConfigError
from ..storage.location import locate, resolve
from ..storage.outputs import open_output
from ..storage.uri import join
from ..storage.posix.filesystem import FileSystemReader, FileSystemWriter
from ..core.geometry import Box, split_piece, whole
from .inspection import iter_full_tensors
from .model_weights import describe_split, split_model_weights
from .side_files import check_side_dir, read_side_files, resolve_side_dir
from ..format.metadata import METADATA_FILE, Metadata, dtype_from_name, element_size
from .sources import HF_INDEX, HF_SINGLE, TensorSource, open_source
from ..planning.interfaces import OBJECT, TENSOR, SavePlan, WriteItem
from ..format.metadata import ReportedRows, chunk_key
from ..planning.standard import assign_owners, build_metadata, written_rows
from ..core.utils import get_logger

log = get_logger(__name__)
Progress = Callable[[Iterable, int, str], Iterable]
BoxRule = Callable[[str, tuple, int], Sequence[Box]]


def _no_progress(it: Iterable, total: int, desc: str) -> Iterable:
    return it


def select_keys(keys: Iterable[str], *, include: str | None = None, exclude: str | None = None,
                rename: Sequence[tuple[str, str]] = (), names: dict[str, str] | None = None) -> dict[str, str]:
    """``{source key: output key}`` after the filters (``re.search`` on the source key) and the
    renames (``re.sub``, applied in order to ``names[key]``, default the key). Two keys renamed to
    one name are an error."""
    try:
        inc = re.compile(include) if include else None
        exc = re.compile(exclude) if exclude else None
        rules = [(re.compile(p), r) for p, r in rename]
    except re.error as e:
        raise ConfigError(f"bad regular expression in include/exclude/rename: {e}") from None
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for k in keys:
        if (inc and not inc.search(k)) or (exc and exc.search(k)):
            continue
        name = k if names is None else names[k]
        for pat, rep in rules:
            name = pat.sub(rep, name)
        if name in seen:
            raise ConfigError(f"rename maps both {seen[name]!r} and {k!r} to {name!r}")
        seen[name] = k
        out[k] = name
    return out


def _read_our_metadata(src: str | os.PathLike) -> tuple[FileSystemReader, Metadata]:
    from ..storage.checkpoint_io import open_reader

    reader = open_reader(src, "hpdcp")
    md = Metadata.from_json(reader.read_metadata_text(), source=join(reader.path, METADATA_FILE),
                            open_file=reader.open_file)
    reader.attach_metadata(md)
    return reader, md


def plan_hf_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Greedy in key order: a new shard starts when adding a tensor would pass the cap; a tensor
    larger than the cap gets a shard of its own."""
    shards: list[list[str]] = []
    cur, cur_bytes = [], 0
    for key, n in sizes:
        if cur and cur_bytes + n > max_shard_size:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(key)
        cur_bytes += n
    if cur:
        shards.append(cur)
    return shards


def merge_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int = 5 * 10**9,
                dtype: str | None = None, rename: Sequence[tuple[str, str]] = (), include: str | None = None,
                exclude: str | None = None, single_file: bool = False, overwrite: bool = False,
                fsync: bool = True, progress: Progress | None = None, model_only: bool = True,
                files_from: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write our checkpoint ``src`` as a Hugging Face safetensors directory ``dst`` (either may be
    in any store; the output is made visible as its storage allows, see ``storage.outputs``).
    ``model_only``: of a model+optimizer checkpoint, only the model's weights under the model's
    own names (``model_weights.split_model_weights``; the result's ``left_out`` says what was
    not written). ``files_from``: a Hugging Face directory whose config/tokenizer files are copied."""
    if max_shard_size <= 0:
        raise ConfigError(f"max_shard_size must be positive, got {max_shard_size}")
    cast = dtype_from_name(dtype) if dtype else None
    reader, md = _read_our_metadata(src)
    reader.close()
    split = split_model_weights(md.tensors) if model_only else None
    base = split.names if split is not None else {k: k for k in md.tensors}
    names = select_keys(sorted(base), include=include, exclude=exclude, rename=rename, names=base)
    if not names:
        raise ConfigError(f"{src}: no tensor is left after include={include!r} exclude={exclude!r}")
    if split is not None and split.split:
        log.warning("%s: %s (model_only=False writes every tensor)", src, describe_split(split))
    side_dir = resolve_side_dir(files_from, None)
    check_side_dir(side_dir)
    side = read_side_files(side_dir) if side_dir else {}
    reserved = sorted(k for k, name in names.items() if name == "__metadata__")
    if reserved:
        raise ConfigError(f"{src}: tensor {reserved[0]!r} would be named '__metadata__' in the output, a name the "
                          f"safetensors format reserves; rename it (transform.rename)")

    def out_dtype(key: str) -> str:
        d = md.tensors[key].dtype
        return dtype if cast is not None and dtype_from_name(d).is_floating_point else d

    sizes = [(k, math.prod(md.tensors[k].shape) * element_size(out_dtype(k))) for k in names]
    shards = [list(names)] if single_file else plan_hf_shards(sizes, max_shard_size)
    n = len(shards)
    files = [HF_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = files + ([HF_INDEX] if n > 1 else []) + sorted(side)
    out = open_output(dst, overwrite, source=resolve(src), fsync=fsync)
    out.begin()
    total = sum(s for _, s in sizes)
    try:
        for name, data in side.items():  # first: in a store, the weights' arrival makes it usable
            out.put(name, data)
        reuse = not out.holds_written_buffers  # a store's upload holds the bytes it was given until done
        tensors = iter_full_tensors(src, [k for shard in shards for k in shard], reuse_buffer=reuse)
        cast_buf = torch.empty(max(s for k, s in sizes) if cast is not None and reuse else 0, dtype=torch.uint8)
        for fname, shard in zip(files, shards):
            w = out.stream_safetensors(fname, [(names[k], out_dtype(k), md.tensors[k].shape) for k in shard],
                                       {"format": "pt"})
            try:
                for key, full in (progress or _no_progress)(_take(tensors, len(shard)), len(shard), f"merge {fname}"):
                    if cast is not None and full.is_floating_point():
                        full = cast_buf[:full.numel() * element_size(dtype)].view(cast).view(full.shape).copy_(full) \
                            if reuse else full.to(cast)
                    w.append(names[key], full)
                    del full
            except BaseException:
                w.abort()
                raise
            w.close()
            out.check_safetensors(fname)  # what we write must be what the real reader accepts
        if n > 1:  # last: it names shards all written by now
            weight_map = {names[k]: fname for fname, shard in zip(files, shards) for k in shard}
            doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            out.put(HF_INDEX, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
        out.commit(written)
    except BaseException:
        out.abort(written)
        raise
    skipped = sorted(md.objects)
    if not any(name == "config.json" for name in side):
        log.warning("%s has no config.json: from_pretrained needs one; pass files_from=<the model's Hugging Face "
                    "directory>", dst)
    return {"dst": out.url, "files": files, "tensors": len(names), "total_size": total,
            "skipped_objects": skipped, "copied": sorted(side),
            "left_out": describe_split(split) if split is not None and split.split else None}


def _take(it: Iterable, n: int) -> Iterable:
    for _ in range(n):
        yield next(it)


def shard_dim0(world_size: int) -> BoxRule:
    """The default import layout: Shard(0) over ``world_size`` ranks (torch.chunk sizes);
    0-d tensors whole on every rank (written once)."""

    def boxes(fqn: str, shape: tuple, rank: int) -> list[Box]:
        if not shape:
            return [whole(shape)]
        start, size = split_piece(shape[0], world_size, rank)
        return [Box((start,) + (0,) * (len(shape) - 1), (size,) + tuple(shape[1:]))]

    return boxes


def import_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, source_format: str = "auto",
                      world_size: int = 1, boxes: BoxRule | None = None, allow_pickle: bool = False,
                      rename: Sequence[tuple[str, str]] = (), include: str | None = None,
                      exclude: str | None = None, overwrite: bool = False, fsync: bool = True,
                      progress: Progress | None = None) -> Metadata:
    """Convert ``src`` into our checkpoint ``dst`` with ``world_size`` rank files laid out by
    ``boxes(fqn, shape, rank) -> boxes that rank holds`` (chunks held by several ranks are
    written once, by the lowest rank). Returns the committed metadata."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    out = locate(dst)
    source = open_source(src, source_format, allow_pickle=allow_pickle)
    args = (world_size, boxes or shard_dim0(world_size), allow_pickle, rename, include, exclude)
    try:
        if out.capabilities.atomic_rename:  # rank files written in place, the directory renamed into view
            return _import(source, out.url, *args, overwrite, fsync, progress or _no_progress)
        return _import_to_store(source, out.url, args, overwrite, progress or _no_progress)
    finally:
        source.close()


def _import_to_store(source: TensorSource, uri: str, args: tuple, overwrite: bool, progress: Progress) -> Metadata:
    """An import into a store: the rank files are written in a local scratch directory (``TMPDIR``),
    then uploaded unchanged under a new save of ``uri`` and committed as a save commits. An
    existing checkpoint is refused before any work, and stays loadable until the commit."""
    import tempfile

    from ..storage.checkpoint_io import open_writer

    writer = open_writer(uri)
    writer.attach(writer.begin(overwrite=overwrite), rank=0, world_size=args[0])
    try:
        with tempfile.TemporaryDirectory(prefix="hpdcp-import-") as tmp:
            local = os.path.join(tmp, "checkpoint")
            md = _import(source, local, *args, False, False, progress)
            for name in sorted(md.files):
                writer.upload_file(name, os.path.join(local, name))  # type: ignore[attr-defined]
            writer.commit(md)
        return md
    except BaseException:
        writer.abort()
        raise


def _import(source: TensorSource, dst: Any, world_size: int, boxes: BoxRule, allow_pickle: bool,
            rename: Sequence[tuple[str, str]], include: str | None, exclude: str | None, overwrite: bool,
            fsync: bool, progress: Progress) -> Metadata:
    names = select_keys(sorted(source.specs), include=include, exclude=exclude, rename=rename)
    src_paths = source.paths()
    all_objects = source.objects()
    objects = {k: all_objects[k] for k in select_keys(all_objects, include=include, exclude=exclude)}
    encoded = {k: objcodec.encode(v, key=k, allow_pickle=allow_pickle) for k, v in objects.items()}
    paths = {names[k]: (src_paths.get(k, (k,)) if names[k] == k else tuple(names[k].split("."))) for k in names}
    paths.update({k: src_paths.get(k, (k,)) for k in encoded})
    plans = []
    for r in range(world_size):
        items: list[WriteItem] = []
        for k, out_key in names.items():
            dtype, shape = source.specs[k]
            for piece, box in enumerate(boxes(out_key, tuple(shape), r)):
                items.append(WriteItem(out_key, TENSOR, box, dtype, tuple(shape), box.numel * element_size(dtype), piece))
        if r == 0:
            items += [WriteItem(k, OBJECT, None, None, None, len(json.dumps(v)), 0) for k, v in encoded.items()]
        plans.append(SavePlan(r, tuple(items), paths))
    gplan = assign_owners(plans, "minimum_rank")
    back = {v: k for k, v in names.items()}
    writer = FileSystemWriter(dst, fsync=fsync)
    writer.attach(writer.begin(overwrite=overwrite), rank=0, world_size=world_size)
    streams: dict = {}  # rank -> the writer's RankFile: the same file writing as a save
    try:
        jobs: dict[str, list[tuple[int, WriteItem]]] = {}
        rank_of_key = {k: i for i, k in enumerate(names.values())}
        for r, (plan, idxs) in enumerate(zip(gplan.plans, gplan.writes)):
            mine = [plan.items[i] for i in idxs if plan.items[i].kind == TENSOR and plan.items[i].box.numel]
            mine.sort(key=lambda it: (rank_of_key[it.fqn], it.piece))
            for it in mine:
                jobs.setdefault(it.fqn, []).append((r, it))
            if mine:
                streams[r] = writer.open_rank_file(r, [(chunk_key(it.fqn, it.box.offsets), it.dtype, it.box.sizes)
                                                       for it in mine])
        for out_key in progress(list(names.values()), len(names), "import"):
            for r, it in jobs.get(out_key, []):  # each source tensor read once, its pieces to every rank file
                streams[r].append(chunk_key(out_key, it.box.offsets), source.read(back[out_key], it.box))
        results = []
        for r, (plan, idxs) in enumerate(zip(gplan.plans, gplan.writes)):
            res = writer.finish_rank(r, streams.pop(r, None), encoded if r == 0 else {})
            written = [i for i in idxs if plan.items[i].kind == TENSOR and plan.items[i].box.numel]
            results.append(written_rows(plan, written, res, gplan.ndim))
        md = build_metadata(gplan, ReportedRows.from_written(results, world_size, gplan.ndim), world_size,
                            {"imported_from": source.path, "source_format": type(source).__name__})
        writer.commit(md)
        return md
    except BaseException:
        for s in streams.values():
            s.abort()
        writer.abort()
        raise


def export_torch_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, rename: Sequence[tuple[str, str]] = (),
                     include: str | None = None, exclude: str | None = None, allow_pickle: bool = False,
                     overwrite: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Write our checkpoint as a ``torch.distributed.checkpoint`` directory (full tensors,
    loadable by ``torch.distributed.checkpoint.load`` under any sharding). Holds the whole
    checkpoint in memory: torch's writer takes a single state dict."""
    import torch.distributed.checkpoint as tdcp

    reader, md = _read_our_metadata(src)
    names = select_keys(sorted(md.tensors), include=include, exclude=exclude, rename=rename)
    onames = select_keys(sorted(md.objects), include=include, exclude=exclude, rename=rename)
    try:
        objs = reader.read_objects({k: md.objects[k] for k in onames}, allow_pickle=allow_pickle)
    finally:
        reader.close()
    sd: dict[str, Any] = {onames[k]: v for k, v in objs.items()}
    progress = progress or _no_progress
    for key, full in progress(iter_full_tensors(src, list(names)), len(names), "export"):
        sd[names[key]] = full
    out = open_output(dst, overwrite, source=resolve(src))
    out.begin()
    written: list[str] = []
    try:
        # torch writes through its own FileSystemWriter; into a store its files go up with .metadata last
        out.write_local(lambda directory: tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(directory), no_dist=True),
                        written, last=(".metadata",))
        out.commit(written)
    except BaseException:
        out.abort(written)
        raise
    return {"dst": out.url, "tensors": len(names), "objects": len(onames),
            "total_size": sum(md.tensors[k].nbytes for k in names)}


__all__ = ["merge_to_hf", "import_checkpoint", "export_torch_dcp", "select_keys", "plan_hf_shards", "shard_dim0",
           "open_source"]
