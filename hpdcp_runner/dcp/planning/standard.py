"""Standard planners: dedup of replicated chunks on save, chunk intersection on load."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import torch

from ..format import objects as objcodec
from ..core.utils import byte_view
from ..format.safetensors_io import digest
from .save_dedup import CompactPlan, GlobalSavePlan, SaveLayouts, assign_layouts, assign_owners  # noqa: F401
from ..core.errors import CoverageError, MetadataError, ShapeMismatchError, StateDictError
from ..core.geometry import Box, BoxIndex, dtensor_local_box, narrow, relative, whole
from ..format.chunk_index import BLOCK_COUNT as BLOCK_COUNT_COL, BLOCK_START as BLOCK_START_COL, FILE as FILE_COL, \
    TENSOR as TENSOR_COL, ChunkIndex
from ..format.checksums import BLOCK_BYTES
from ..format.metadata import (FileMeta, IndexedChunks, Metadata, ObjectMeta, ReportedRows, TensorMeta, WriteResult,
                               WrittenRows, chunk_key, chunk_overlaps, dtype_name)
from ..core.geometry import tiling_problem
from .interfaces import OBJECT, TENSOR, KeyInfo, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from ..core.ragged import FlatShard, FusedShard, LocalShard, ShardPieces
from .load_replicas import BroadcastOp, CompactShards, ShardSummary, plan_replica_reads
from ..core.utils import TENSOR_LEAVES, flatten_state_dict, is_dtensor, set_element


def is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, TENSOR_LEAVES)


def leaf_shape_dtype(v: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(v, (FlatShard, FusedShard, LocalShard, ShardPieces)):
        return v.global_shape, v.dtype
    return tuple(int(d) for d in v.shape), v.dtype


def local_pieces(v: Any) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor this rank holds, each with a detached view of its data."""
    if is_dtensor(v):
        with torch.no_grad():  # then to_local is the local tensor itself (~0.1 us), not an autograd call (~5)
            local = v.to_local()
        box = dtensor_local_box(v, local)
        return [] if box is None else [(box, local.detach())]
    if isinstance(v, FlatShard):
        return [(p.box, v.piece_view(p).detach()) for p in v.pieces]
    if isinstance(v, LocalShard):
        return [(v.box, v.local.detach())]
    if isinstance(v, FusedShard):
        return [(b, t.detach()) for b, t in v.pieces()]
    if isinstance(v, ShardPieces):
        return [(b, t.detach()) for b, t in v.pieces]
    return [(whole(v.shape), v.detach())]


def _held_by_one_rank(v: Any, world_size: int) -> bool:
    """True for a DTensor whose mesh spans the whole group and whose every placement is a Shard:
    each rank's box is its own. A mesh smaller than the group (TP inside each data-parallel
    replica), a Replicate dimension, plain tensors and explicit shards may be held twice."""
    if not is_dtensor(v) or v.device_mesh.size() != world_size:
        return False
    from torch.distributed.tensor import Shard

    return all(isinstance(p, Shard) for p in v.placements)


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


class StandardSavePlanner(SavePlanner):
    """Each chunk held by several ranks is written once, by the holder with the fewest bytes so far
    (largest chunks first: a longest-processing-time greedy), so replicas share the writing."""

    policy = "balanced"

    def __init__(self) -> None:
        self.flat: dict[str, Any] = {}
        self.paths: dict[str, tuple] = {}
        self.rank = 0
        self.allow_pickle = False
        self.verify_replicas = False
        self._pieces: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self._encoded: dict[str, Any] = {}

    def configure(self, state_dict: Mapping[str, Any], *, rank: int, world_size: int,
                  allow_pickle: bool = False, verify_replicas: bool = False) -> None:
        self.flat, self.paths = flatten_state_dict(state_dict)
        self.rank, self.world_size = rank, world_size
        self.allow_pickle, self.verify_replicas = allow_pickle, verify_replicas

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, v in self.flat.items():
            if is_tensor_leaf(v):
                shape, dt = leaf_shape_dtype(v)
                try:
                    dtype_name(dt)
                except MetadataError as e:
                    raise StateDictError(f"key {fqn!r}: {e}") from None
                pieces = local_pieces(v)
                self._pieces[fqn] = pieces
                unique = _held_by_one_rank(v, self.world_size)  # its chunk skips the coordinator's dedup
                for i, (box, t) in enumerate(pieces):
                    csum = digest(byte_view(contiguous_cpu(t))) if self.verify_replicas else None
                    items.append(WriteItem(fqn, TENSOR, box, dtype_name(dt), shape, t.numel() * t.element_size(), i, csum,
                                           unique))
            else:
                enc = objcodec.encode(v, key=fqn, allow_pickle=self.allow_pickle)
                self._encoded[fqn] = enc
                text = json.dumps(enc, separators=(",", ":"))
                items.append(WriteItem(fqn, OBJECT, None, None, None, len(text),
                                       0, digest(text.encode()) if self.verify_replicas else None))
        return SavePlan(self.rank, tuple(items), dict(self.paths))

    def create_global_plan(self, layouts: SaveLayouts) -> GlobalSavePlan:
        return assign_layouts(layouts, self.policy, verify_replicas=self.verify_replicas)

    def resolve_data(self, item: WriteItem) -> Any:
        if item.kind == OBJECT:
            return self._encoded[item.fqn]
        return contiguous_cpu(self._pieces[item.fqn][item.piece][1])


class MinimumRankSavePlanner(StandardSavePlanner):
    """Every replicated chunk is written by its lowest-ranked holder (predictable file contents)."""

    policy = "minimum_rank"


class StandardLoadPlanner(LoadPlanner):
    """Intersects every local destination piece with every saved chunk; a shard held by several
    ranks is read by one of them (balanced by bytes) and broadcast to the others."""

    policy = "balanced"

    def __init__(self) -> None:
        self.state_dict: Mapping[str, Any] = {}
        self.flat: dict[str, Any] = {}
        self.paths: dict[str, tuple] = {}
        self._pieces: dict[str, list[tuple[Box, torch.Tensor]]] = {}

    def configure(self, state_dict: Mapping[str, Any], metadata: Metadata, *, rank: int, world_size: int,
                  allow_cast: bool = False, sendable: frozenset[str] = frozenset()) -> None:
        self.state_dict = state_dict
        self.flat, self.paths = flatten_state_dict(state_dict)
        self.metadata, self.rank, self.world_size, self.allow_cast = metadata, rank, world_size, allow_cast
        self.sendable = sendable

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata
        items: list[ReadItem] = []
        objs, missing, requested = [], [], set()
        for fqn, v in self.flat.items():
            if fqn in md.tensors:
                requested.add(fqn)
                items.extend(self._tensor_reads(fqn, v))
            elif fqn in md.objects:
                if is_tensor_leaf(v) and not _scalar_target(v):
                    raise StateDictError(f"key {fqn!r} is a non-tensor object in the checkpoint but a "
                                         f"{type(v).__name__} in the target; loading would replace the tensor")
                requested.add(fqn)
                objs.append(fqn)
            else:
                missing.append(fqn)
        return LoadPlan(self.rank, tuple(items), tuple(objs), tuple(missing), frozenset(requested),
                        self._summaries(items))

    def _summaries(self, items: Sequence[ReadItem]) -> tuple[ShardSummary, ...]:
        """The destination shards another rank may hold too (the replica plan's input): a DTensor
        split along every dimension of a mesh as large as the group is held by no other rank,
        so it is left out and the coordinator's replica plan grows with the replicated shards
        only (at 8,192 ranks x 2,000 tensors, 1.6M rows instead of 16.4M)."""
        seen: dict[tuple, ShardSummary] = {}
        verdicts: dict[tuple, bool] = {}  # per (mesh, placements): an LLM's ~1,000 DTensors share a few

        def held_by_one(v: Any) -> bool:
            if not is_dtensor(v):
                return False
            k = (id(v.device_mesh), v.placements)
            if k not in verdicts:
                verdicts[k] = _held_by_one_rank(v, self.world_size)
            return verdicts[k]
        unique = {fqn for fqn in {it.fqn for it in items} if held_by_one(self.flat.get(fqn))}
        for it in items:
            k = (it.fqn, it.dest)
            if it.fqn not in unique and k not in seen:
                box, t = self._pieces[it.fqn][it.dest]
                seen[k] = ShardSummary(it.fqn, box.offsets, box.sizes, t.numel() * t.element_size(),
                                       dtype_name(t.dtype),
                                       t.device.type if t.device.type in self.sendable else "none")
        return tuple(seen.values())

    def _tensor_reads(self, fqn: str, v: Any) -> list[ReadItem]:
        tm = self.metadata.tensors[fqn]
        if not is_tensor_leaf(v):
            raise StateDictError(f"key {fqn!r} is a tensor in the checkpoint but a {type(v).__name__} in the target")
        shape, dt = leaf_shape_dtype(v)
        if tuple(shape) != tm.shape:
            raise ShapeMismatchError(f"key {fqn!r}: checkpoint shape {list(tm.shape)} != target shape {list(shape)}")
        if dtype_name(dt) != tm.dtype and not self.allow_cast:
            raise ShapeMismatchError(f"key {fqn!r}: checkpoint dtype {tm.dtype} != target dtype {dtype_name(dt)} "
                                     f"(pass allow_cast=True to convert)")
        pieces = local_pieces(v)
        self._pieces[fqn] = pieces
        out = []
        chunks = tm.chunks
        index = BoxIndex([c.box for c in chunks]) if len(chunks) > 8 and not isinstance(chunks, IndexedChunks) else None
        for d, (box, _) in enumerate(pieces):
            covered = 0
            found = chunk_overlaps(chunks, box, index)
            for c, ov in found:
                out.append(ReadItem(fqn, d, box, c, ov))
                covered += ov.numel
            if isinstance(chunks, IndexedChunks):  # v2: this rank checks the tiling of what it reads
                if covered != box.numel:
                    chunks.check_all()  # names a bad row of the index, if that is the cause
                chunks.check_disjoint(box, [c for c, _ in found])
            if covered != box.numel:
                raise CoverageError(f"key {fqn!r}: saved chunks cover {covered} of the {box.numel} elements of the "
                                    f"destination at offsets {list(box.offsets)} sizes {list(box.sizes)}")
        return out

    def create_global_plan(self, shards: Sequence[CompactShards], *, mode: str, nodes: Sequence[str],
                           slow_storage: bool) -> list[BroadcastOp]:
        return plan_replica_reads(shards, mode=mode, nodes=nodes, slow_storage=slow_storage, policy=self.policy)

    def destination(self, key: tuple) -> torch.Tensor:
        fqn, offsets, sizes = key
        for box, t in self._pieces[fqn]:
            if box.offsets == tuple(offsets) and box.sizes == tuple(sizes):
                return t
        raise StateDictError(f"no local destination shard {key!r}")

    def acquire_tensor(self, item: ReadItem) -> torch.Tensor:
        return narrow(self._pieces[item.fqn][item.dest][1], relative(item.overlap, item.dest_box),
                      item.overlap.sizes)

    def apply_object(self, fqn: str, value: Any) -> None:
        target = self.flat.get(fqn)
        if target is not None and _scalar_target(target):  # a number saved as an object (an optimizer's step)
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)) or \
                    (isinstance(value, torch.Tensor) and value.numel() != 1):
                raise StateDictError(f"key {fqn!r}: the checkpoint holds {type(value).__name__} {str(value)[:40]!r} "
                                     f"where the target has a one-element tensor; only a number loads into it")
            with torch.no_grad():
                target.copy_(torch.as_tensor(value).reshape(target.shape))
            return
        set_element(self.state_dict, self.paths[fqn], value)


def _scalar_target(v: Any) -> bool:
    """A plain one-element tensor of the target (an optimizer's ``step``): a number saved as an
    object (older torch optimizers, DeepSpeed's per-group step) is copied into it."""
    return type(v) in (torch.Tensor, torch.nn.Parameter) and v.numel() == 1 and v.dim() == 0


class MinimumRankLoadPlanner(StandardLoadPlanner):
    """Every replicated shard is read by its lowest-ranked holder."""

    policy = "minimum_rank"


def build_metadata(gplan: GlobalSavePlan, reported: ReportedRows, world_size: int,
                   extra: Mapping[str, Any] | None = None,
                   on_sorted: Callable[[torch.Tensor], None] | None = None) -> Metadata:
    """The checkpoint's metadata from the global plan's key tables and what every rank wrote
    (pure; runs on the coordinator). The ranks' rows become the chunk index after a few column
    operations (their key, file and block numbering made global) and one sort; every tensor's
    chunks must then tile it (``tiling_problem``, over a bounded block of tensors at a time).
    Python touches keys, files and ranks, never chunks. ``reported.rows`` is consumed.
    ``on_sorted``: given each block of the index's sorted rows, in file order, as soon as it is
    gathered and before it is checked (the coordinator streams the index file meanwhile)."""
    keys = gplan.keys
    files: dict[str, FileMeta] = {}
    for fs in reported.files:
        for f in fs:
            if f.name in files:
                raise MetadataError(f"save: ranks {files[f.name].rank} and {f.rank} both wrote {f.name}")
            files[f.name] = f
    file_names = sorted(files)
    name_id = {n: i for i, n in enumerate(file_names)}
    tensor_keys = sorted((i for i, k in enumerate(keys) if k.kind == TENSOR), key=lambda i: keys[i].fqn)
    tid_of = torch.full((max(len(keys), 1),), -1, dtype=torch.int64)
    if tensor_keys:
        tid_of[torch.tensor(tensor_keys, dtype=torch.int64)] = torch.arange(len(tensor_keys))
    ndims = torch.tensor([keys[i].ndim for i in tensor_keys], dtype=torch.int64)
    d = gplan.ndim
    rows = reported.rows
    if rows.dim() != 2 or rows.shape[1] != 6 + 2 * d:
        raise MetadataError(f"save: ranks reported rows of width {list(rows.shape)[1:]}, not {6 + 2 * d}")
    if sum(reported.row_counts) != len(rows) or sum(reported.block_counts) != reported.blocks.numel():
        raise MetadataError(f"save: ranks reported {sum(reported.row_counts)} rows and "
                            f"{sum(reported.block_counts)} block digests, but {len(rows)} and "
                            f"{reported.blocks.numel()} arrived")
    _renumber_rows(rows, reported, gplan, tid_of, name_id)
    objects: dict[str, ObjectMeta] = {}
    for r in range(reported.world_size):
        for fqn, (file, csum) in reported.objects[r].items():
            objects[fqn] = ObjectMeta(file, csum, ())
    gkey = {k.fqn: k for k in keys}
    for fqn, o in list(objects.items()):
        k = gkey.get(fqn)
        if k is None or k.kind == TENSOR:
            raise MetadataError(f"save: object {fqn!r} was written but is not an object of any rank's plan")
        objects[fqn] = ObjectMeta(o.file, o.checksum, k.path)
    missing = sorted(k.fqn for k in keys if k.kind != TENSOR and k.fqn not in objects)
    if missing:
        raise MetadataError(f"save: no rank wrote the object(s) {missing[:5]}")
    check = _tiling_check([keys[i] for i in tensor_keys])

    def on_block(t0: int, t1: int, part: torch.Tensor) -> None:
        if on_sorted is not None:
            on_sorted(part)
        check(t0, t1, part)

    index = ChunkIndex.from_rows(len(tensor_keys), ndims, rows, reported.blocks, on_block=on_block,
                                 block_rows=_CHECK_ROWS)
    del rows
    file_list = [files[n] for n in file_names]
    tmetas = {}
    for tid, i in enumerate(tensor_keys):
        k = keys[i]
        tmetas[k.fqn] = TensorMeta(k.dtype, tuple(k.shape),
                                   IndexedChunks(index, tid, k.fqn, tuple(k.shape), k.dtype, file_list, BLOCK_BYTES),
                                   k.path)
    return Metadata(world_size, tmetas, objects, files, 2, extra=dict(extra or {}), block_bytes=BLOCK_BYTES,
                    index=index)


_RENUMBER_ROWS = 1 << 16  # rows renumbered at a time (~5 MiB of 2-D rows: the columns stay in cache)
_CHECK_ROWS = 1 << 17  # sorted rows gathered and tiling-checked at a time (measured ~10% faster than 1M at 8,192 ranks)


def _renumber_rows(rows: torch.Tensor, reported: ReportedRows, gplan: GlobalSavePlan, tid_of: torch.Tensor,
                   name_id: Mapping[str, int]) -> None:
    """Make every rank's rows global in place: its key-table index becomes the tensor id, its file
    index the global file id, its block start an offset into all blocks. Vectorised over groups
    of consecutive ranks of ~64k rows (a rank per row via ``repeat_interleave``), so 8,192 ranks
    cost a few hundred steps of column arithmetic, not 8,192 Python iterations; every value a
    rank sent is bounds-checked and a bad one names that rank."""
    world = reported.world_size
    counts = torch.tensor(reported.row_counts, dtype=torch.int64)
    nblocks = torch.tensor(reported.block_counts, dtype=torch.int64)
    block_at = torch.cumsum(nblocks, 0) - nblocks
    luts = [tid_of[m] if m.numel() else m.to(torch.int64) for m in gplan.table_maps]
    lut_all = torch.cat(luts + [torch.empty(0, dtype=torch.int64)])
    lut_len = torch.tensor([len(x) for x in luts] + [0], dtype=torch.int64)
    lut_off = torch.cumsum(lut_len, 0) - lut_len
    table = gplan.table_of[:world].to(torch.int64).clone() if len(gplan.table_of) else torch.zeros(0, dtype=torch.int64)
    if len(table) < world:
        table = torch.cat([table, torch.full((world - len(table),), -1, dtype=torch.int64)])
    table[(table < 0) | (table >= len(luts))] = len(luts)  # no table: the empty one at the end
    r_lut_off, r_lut_len = lut_off[table], lut_len[table]
    fmap = torch.tensor([name_id[f.name] for fs in reported.files for f in fs] or [-1], dtype=torch.int64)
    nfiles = torch.tensor([len(fs) for fs in reported.files], dtype=torch.int64)
    r_file_off = torch.cumsum(nfiles, 0) - nfiles
    r0 = at = 0
    while r0 < world:
        r1, n = r0, 0
        while r1 < world and (r1 == r0 or n + reported.row_counts[r1] <= _RENUMBER_ROWS):
            n += reported.row_counts[r1]
            r1 += 1
        if n:
            part = rows[at:at + n]
            rank = torch.repeat_interleave(torch.arange(r0, r1), counts[r0:r1])
            local, file = part[:, TENSOR_COL], part[:, FILE_COL]
            bstart, bcount = part[:, BLOCK_START_COL], part[:, BLOCK_COUNT_COL]
            bad = (local < 0) | (local >= r_lut_len[rank]) | (file < 0) | (file >= nfiles[rank]) \
                | (bstart < 0) | (bcount < 0) | (bstart + bcount > nblocks[rank])
            if not bad.any():
                gid = lut_all[r_lut_off[rank] + local]
                bad = gid < 0
            if bad.any():
                r = int(rank[int(torch.nonzero(bad)[0])])
                raise MetadataError(f"save: rank {r} reported a chunk of no tensor of its key table, of no file it "
                                    f"wrote, or beyond its block digests")
            local.copy_(gid)
            file.copy_(fmap[r_file_off[rank] + file])
            bstart.add_(block_at[rank])
        at += n
        r0 = r1


def written_rows(plan: SavePlan, written: Sequence[int], res: WriteResult, ndim: int) -> WrittenRows:
    """What a rank reports after writing items ``written`` of ``plan`` (tensor chunks only, in
    write order): for tools that write every rank's files in one process (imports)."""
    key_of = CompactPlan.from_plan(plan).item_key.tolist()
    return WrittenRows.from_result(res, [(key_of[i], plan.items[i].box, chunk_key(plan.items[i].fqn,
                                                                                   plan.items[i].box.offsets))
                                         for i in written], ndim)


def _tiling_check(keys: Sequence[KeyInfo]) -> Callable[[int, int, torch.Tensor], None]:
    """Every tensor's chunks in the sorted index cover it exactly once, checked per block of whole
    tensors as the sort produces them (``ChunkIndex.from_rows(on_block=)``), so the check's
    temporaries stay small and it runs beside the sort's row gather."""
    def check(t0: int, t1: int, part: torch.Tensor) -> None:
        found = tiling_problem([k.shape for k in keys[t0:t1]], part[:, 6:], part[:, TENSOR_COL] - t0)
        if found is not None:
            i, problem = found
            k = keys[t0 + i]
            raise CoverageError(f"key {k.fqn!r}: the ranks' chunks do not tile shape {list(k.shape)}: {problem}")
    return check
