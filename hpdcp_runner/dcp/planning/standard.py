"""Standard planners: dedup of replicated chunks on save, chunk intersection on load."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import torch

from ..format import objects as objcodec
from ..core.utils import byte_view
from ..format.safetensors_io import digest
from .save_dedup import CompactPlan, GlobalSavePlan, assign_owners
from ..core.errors import CoverageError, MetadataError, ShapeMismatchError, StateDictError
from ..core.geometry import Box, BoxIndex, dtensor_local_box, intersect, narrow, relative, whole
from ..format.chunk_index import ChunkIndex
from ..format.checksums import BLOCK_BYTES
from ..format.metadata import (IndexedChunks, Metadata, ObjectMeta, TensorMeta, WrittenChunks, dtype_name,
                               overlapping_chunks)
from .interfaces import OBJECT, TENSOR, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from ..core.ragged import FlatShard, FusedShard, LocalShard, ShardPieces
from .load_replicas import BroadcastOp, CompactShards, ShardSummary, plan_replica_reads
from ..core.utils import TENSOR_LEAVES, flatten_state_dict, set_element

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch built without distributed
    DTensor = Shard = ()  # type: ignore[assignment,misc]


def is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, TENSOR_LEAVES)


def leaf_shape_dtype(v: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(v, (FlatShard, FusedShard, LocalShard, ShardPieces)):
        return v.global_shape, v.dtype
    return tuple(int(d) for d in v.shape), v.dtype


def local_pieces(v: Any) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor this rank holds, each with a detached view of its data."""
    if isinstance(v, DTensor):
        box = dtensor_local_box(v)
        return [] if box is None else [(box, v.to_local().detach())]
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
    if not isinstance(v, DTensor) or v.device_mesh.size() != world_size:
        return False
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
                for i, (box, t) in enumerate(pieces):
                    csum = digest(byte_view(contiguous_cpu(t))) if self.verify_replicas else None
                    items.append(WriteItem(fqn, TENSOR, box, dtype_name(dt), shape, t.numel() * t.element_size(), i, csum))
            else:
                enc = objcodec.encode(v, key=fqn, allow_pickle=self.allow_pickle)
                self._encoded[fqn] = enc
                text = json.dumps(enc, separators=(",", ":"))
                items.append(WriteItem(fqn, OBJECT, None, None, None, len(text),
                                       0, digest(text.encode()) if self.verify_replicas else None))
        return SavePlan(self.rank, tuple(items), dict(self.paths))

    def create_global_plan(self, plans: Sequence[CompactPlan]) -> GlobalSavePlan:
        return assign_owners(plans, self.policy, verify_replicas=self.verify_replicas)

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
                if is_tensor_leaf(v):
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
        unique = {fqn for fqn in {it.fqn for it in items} if _held_by_one_rank(self.flat.get(fqn), self.world_size)}
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
            found = overlapping_chunks(chunks, box, index)
            for c in found:
                ov = intersect(box, chunks[c].box)
                out.append(ReadItem(fqn, d, box, c, ov))
                covered += ov.numel
            if isinstance(chunks, IndexedChunks):  # v2: this rank checks the tiling of what it reads
                if covered != box.numel:
                    chunks.check_all()  # names a bad row of the index, if that is the cause
                chunks.check_disjoint(box, found)
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
        set_element(self.state_dict, self.paths[fqn], value)


class MinimumRankLoadPlanner(StandardLoadPlanner):
    """Every replicated shard is read by its lowest-ranked holder."""

    policy = "minimum_rank"


def build_metadata(gplan: GlobalSavePlan, written: Sequence[WrittenChunks], world_size: int,
                   extra: Mapping[str, Any] | None = None) -> Metadata:
    """Combine the global plan with what every rank wrote (pure; runs on the coordinator) into
    format-v2 metadata. Vectorised end to end: the owned rows (in write order) and the ranks'
    columns (in the same order) are checked to line up and joined as tensors, and
    ``ChunkIndex.build`` groups and sorts them; Python touches objects and tensors, never chunks."""
    keys = gplan.keys
    files = {f.name: f for w in written for f in w.files}
    file_names = sorted(files)
    name_id = {n: i for i, n in enumerate(file_names)}
    tensor_keys = sorted((i for i, k in enumerate(keys) if k.kind == TENSOR), key=lambda i: keys[i].fqn)
    tid_of = torch.full((max(len(keys), 1),), -1, dtype=torch.int64)
    tid_of[torch.tensor(tensor_keys, dtype=torch.int64)] = torch.arange(len(tensor_keys))
    ndim = max([keys[i].ndim for i in tensor_keys] + [1])
    owned = gplan.owned
    d = (owned.shape[1] - 2) // 2
    items = torch.cat(list(gplan.write_idx)) if gplan.write_idx else torch.empty(0, dtype=torch.int64)
    if len(items) != len(owned):  # (a plan built before owned rows were kept in write order)
        raise MetadataError(f"global plan: {len(owned)} owned rows but {len(items)} written items")
    is_tensor = tid_of[owned[:, 0]] >= 0
    sizes = owned[:, 2 + d:]
    sel = is_tensor & (sizes != 0).all(1)  # empty chunks are not stored
    by_rank = {w.rank: w for w in written}
    objects: dict[str, ObjectMeta] = {}
    for kid, rank in owned[~is_tensor, :2].tolist():
        key = keys[kid]
        file, csum = by_rank[rank].objects[key.fqn]
        objects[key.fqn] = ObjectMeta(file, csum, key.path)
    ranks = sorted(by_rank)
    got_rank = torch.cat([torch.full((len(by_rank[r].items),), r, dtype=torch.int64) for r in ranks]) if ranks \
        else torch.empty(0, dtype=torch.int64)
    got_item = torch.cat([by_rank[r].items for r in ranks]) if ranks else torch.empty(0, dtype=torch.int64)
    want_rank, want_item = owned[sel, 1], items[sel]
    if not (torch.equal(got_rank, want_rank) and torch.equal(got_item, want_item)):
        n = min(len(got_item), len(want_item))
        bad = torch.nonzero((got_rank[:n] != want_rank[:n]) | (got_item[:n] != want_item[:n])).flatten()
        at = int(bad[0]) if len(bad) else n
        got = (int(got_rank[at]), int(got_item[at])) if at < len(got_item) else "nothing"
        want = (int(want_rank[at]), int(want_item[at])) if at < len(want_item) else "nothing"
        raise MetadataError(f"save: the written chunks do not match the plan at chunk {at}: (rank, item) {got} "
                            f"written, {want} planned")

    def cat(name: str) -> torch.Tensor:
        parts = [getattr(by_rank[r], name) for r in ranks]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    file_of = torch.cat([torch.tensor([name_id[f.name] for f in by_rank[r].files] or [0], dtype=torch.int64)
                         for r in ranks]) if ranks else torch.zeros(1, dtype=torch.int64)
    base = torch.tensor([0] + [max(len(by_rank[r].files), 1) for r in ranks], dtype=torch.int64).cumsum(0)
    local = cat("file")
    rank_pos = torch.searchsorted(torch.tensor(ranks, dtype=torch.int64), got_rank) if ranks else got_rank
    file = file_of[base[rank_pos] + local] if len(local) else local
    count = cat("block_count")
    start = count.cumsum(0) - count
    rows = owned[sel]
    index = ChunkIndex.build(len(tensor_keys), torch.tensor([keys[i].ndim for i in tensor_keys], dtype=torch.int64),
                             tid_of[rows[:, 0]], file, cat("byte_offset"), cat("checksum"),
                             rows[:, 2:2 + ndim], rows[:, 2 + d:2 + d + ndim], start, count, cat("blocks"))
    file_list = [files[n] for n in file_names]
    tmetas = {}
    for tid, i in enumerate(tensor_keys):
        k = keys[i]
        tmetas[k.fqn] = TensorMeta(k.dtype, tuple(k.shape),
                                   IndexedChunks(index, tid, k.fqn, tuple(k.shape), k.dtype, file_list, BLOCK_BYTES),
                                   k.path)
    return Metadata(world_size, tmetas, objects, files, 2, extra=dict(extra or {}), block_bytes=BLOCK_BYTES,
                    index=index)
