"""The save and load protocols: typed messages and the steps that exchange them.

Every message is a frozen dataclass with its own wire form: JSON with integer columns as raw bytes
beside it (``core.columns.encode_frame``); no pickle crosses ranks. A step
runs on every rank (``local``) or on the coordinator only (``coordinate``); ``Comm`` carries the
wire forms and turns a failure anywhere into the same error everywhere. Call sequence::

    save:  SaveSteps.summarize: all-gather of 81-byte SaveSummary (ranks that disagree on the checkpoint id or options: one error); all as cached -> cached write lists
           else SaveSteps.local_plan  --table + shared items, from the lowest rank of each digest-->
                SaveSteps.global_plan  --SaveReply-->  every rank
           SaveSteps.write  --envelope (files, objects, counts)-->  coordinator
           SaveSteps.report  --WrittenRows, point to point, into the index's rows-->  coordinator
           SaveSteps.commit (coordinator: build_metadata, write)  --metadata text-->  every rank
    load:  LoadSteps.read_metadata (coordinator)  --MetadataMsg-->  every rank parses + checks
           LoadSteps.local_plan  --LoadPlanMsg-->  LoadSteps.global_plan  --LoadReply-->  every rank
           LoadSteps.transfer (reads + replica broadcasts, then shared reads' parts, agreed)
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from .storage.uri import join
from .comm.broadcast import BroadcastOptions, group_sets, node_id, run_load_transfers, sendable_devices
from .comm.collectives import Comm, gloo_group
from .comm.shared_reads import run_shared_reads
from .core import faults
from .core.errors import ConfigError, KeyMismatchError, MetadataError
from .core.geometry import Box, relative
from .format.chunk_index import INDEX_FILE
from .format.metadata import METADATA_FILE, Metadata, ReportedRows, WrittenRows, chunk_key, element_size
from .format.safetensors_io import IndexStream
from .format.renames import rename_keys
from .planning.interfaces import TENSOR, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from .planning.load_replicas import Batch, CompactShards, batch_ops
from .planning.plans import CompactPlan, GlobalSavePlan, parse_table
from .planning.shared_reads import AMPLIFIED, CompactParts, Part, SharedRead, by_rank, plan_shared_reads
from .planning.save_dedup import SaveLayouts
from .planning.standard import build_metadata
from .storage.interfaces import ReadRequest, StorageReader, StorageWriter


# -- messages -------------------------------------------------------------------------------------

SUMMARY_BYTES = 1 + 16 * 3 + 8 + 16 + 8  # flag, plan, table, shared-items digests, unique bytes, inputs, cache
PLAN_BYTES = (0, 17)  # the flag and the plan digest: what a cached plan compares
TABLE_BYTES = (17, 33)  # ranks with equal bytes here have one key table
LAYOUT_BYTES = (17, 49)  # ... and here, one key table and the same shared items
SHARED_BYTES = (33, 49)  # zero: no shared items
UNIQUE_BYTES = (49, 57)
ID_BYTES = (57, 65)  # the checkpoint id's digest
OPTIONS_BYTES = (65, 73)  # the digest of every other input the commit depends on
CACHE_BYTES = (73, 81)  # the digest of the rank's cached plan for this group (zero: none)


def plan_digest(plan: CompactPlan) -> str:
    """The structure of a rank's save plan: keys, kinds, dtypes, shapes, paths, boxes, sizes (not
    the data): equal digests mean the same write lists apply."""
    return hashlib.blake2b((plan.table_digest() + plan.columns_digest()).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class SaveSummary:
    """Rank -> every rank, fixed size (one all-gather of ``SUMMARY_BYTES`` per rank): what a rank
    must say before anything else travels. Its key table and shared items are sent only by the
    lowest rank with the same digest, so the coordinator reads each distinct layout once; its
    unique chunks are summed into ``unique_bytes`` (the balanced choice counts them) and never
    sent."""

    ok: bool
    plan: str
    table: str
    shared: str
    unique_bytes: int
    inputs: bytes = bytes(16)  # ID_BYTES and OPTIONS_BYTES: what every rank must agree on
    cached: bytes = bytes(8)  # CACHE_BYTES: which cached plan this rank holds, so all decide alike

    def encode(self) -> bytes:
        if not self.ok:
            return bytes(SUMMARY_BYTES)
        return (b"\x01" + bytes.fromhex(self.plan) + bytes.fromhex(self.table) + bytes.fromhex(self.shared)
                + struct.pack("<q", self.unique_bytes) + self.inputs + self.cached)


def _digest8(value: Any) -> bytes:
    return hashlib.blake2b(json.dumps(value, sort_keys=True, default=str).encode(), digest_size=8).digest()


def disagreeing(summaries: torch.Tensor, lo: int, hi: int) -> list[list[int]]:
    """The groups of ranks (of those whose summary is valid) with different bytes [lo, hi), or []
    when they all agree (``first_with`` groups them, vectorised)."""
    valid = torch.nonzero(summaries[:, 0] == 1).flatten()
    if valid.numel() < 2:
        return []
    first = first_with(summaries[valid], lo, hi)
    if bool((first == first[0]).all()):
        return []
    groups: dict[int, list[int]] = {}
    for r, f in zip(valid.tolist(), first.tolist()):
        groups.setdefault(f, []).append(r)
    return list(groups.values())


def first_with(summaries: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per rank, the lowest rank whose summary bytes [lo, hi) equal its own (itself if none lower):
    the rank that sends what they share."""
    col = summaries[:, lo:hi]
    _, inverse = torch.unique(col, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1 if len(inverse) else 0,), len(inverse), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(inverse)), "amin")
    return first[inverse]


@dataclass(frozen=True, eq=False)
class SaveReply:
    """Coordinator -> one rank: its shared items it writes (indices into its shared items), the
    staging token and the chunk index's D (the width of the rows it reports)."""

    writes: torch.Tensor
    token: str
    ndim: int

    def to_wire(self) -> dict:
        return {"writes": self.writes, "token": self.token, "ndim": self.ndim}

    @classmethod
    def from_wire(cls, w: Mapping) -> "SaveReply":
        return cls(w["writes"].clone(), w["token"], int(w["ndim"]))


# Cached save plans (``save(cache_plan=True)``): per (process group, planner), every rank's plan
# digest (as all-gathered) and this rank's write list; on the coordinator also the global plan.
_PLAN_CACHE: dict[tuple, dict] = {}
STREAM_INDEX_BYTES = 64 << 20  # a chunk index this large is written while it is built (IndexStream)
PLAN_CACHE_STATS = {"hits": 0, "misses": 0}


def _cache_key(comm: Comm, planner: SavePlanner) -> tuple:
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(comm.group)) if comm.world_size > 1 else (0,)
    return ranks, type(planner).__qualname__, getattr(planner, "policy", None)


@dataclass(frozen=True)
class MetadataMsg:
    """Coordinator -> every rank: the metadata text it read and the identity of what it read."""

    text: str
    pin: Any

    def to_wire(self) -> dict:
        return {"text": self.text, "pin": self.pin}

    @classmethod
    def from_wire(cls, w: Mapping) -> "MetadataMsg":
        return cls(w["text"], w["pin"])


@dataclass(frozen=True)
class LoadPlanMsg:
    """Rank -> coordinator: keys it lacks, keys it asked for (a bitmap over the checkpoint's
    sorted keys), its destination shards (columnar; empty when broadcasts are off), its node,
    whether its storage is slow, and the parts of chunks it would read at a cost well above
    their bytes (columnar; empty when reads are not shared)."""

    missing: tuple[str, ...]
    requested: str
    shards: CompactShards
    node: str
    slow: bool
    parts: CompactParts

    def to_wire(self) -> dict:
        return {"missing": list(self.missing), "requested": self.requested, "shards": self.shards.to_wire(),
                "node": self.node, "slow": self.slow, "parts": self.parts.to_wire()}

    @classmethod
    def from_wire(cls, w: Mapping, tables: dict | None = None) -> "LoadPlanMsg":
        return cls(tuple(w["missing"]), w["requested"], CompactShards.from_wire(w["shards"], tables), w["node"],
                   bool(w["slow"]), CompactParts.from_wire(w["parts"]))


@dataclass(frozen=True)
class LoadReply:
    """Coordinator -> one rank: the key verdict (missing per rank, unrequested keys), the broadcast
    batches this rank takes part in, the rank sets whose groups the load needs, the shared
    reads this rank takes part in (in the order it runs them) and whether the load has any
    (every rank then joins the group they travel on)."""

    missing_by_rank: Mapping[int, tuple[str, ...]]
    unexpected: tuple[str, ...]
    batches: tuple[Batch, ...]
    groups: Any
    shared: tuple[SharedRead, ...] = ()
    any_shared: bool = False

    def to_wire(self) -> dict:
        return {"missing": sorted([r, list(ks)] for r, ks in self.missing_by_rank.items()),
                "unexpected": list(self.unexpected), "batches": [b.to_wire() for b in self.batches],
                "groups": self.groups, "shared": [o.to_wire() for o in self.shared], "any_shared": self.any_shared}

    @classmethod
    def from_wire(cls, w: Mapping) -> "LoadReply":
        return cls({int(r): tuple(ks) for r, ks in w["missing"]}, tuple(w["unexpected"]),
                   tuple(Batch.from_wire(b) for b in w["batches"]), w["groups"],
                   tuple(SharedRead.from_wire(o) for o in w["shared"]), bool(w["any_shared"]))


def key_bitmap(keys: Sequence[str], requested: frozenset[str]) -> str:
    bits = bytearray((len(keys) + 7) // 8)
    for i, k in enumerate(keys):
        if k in requested:
            bits[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(bits)).decode()


def unrequested(keys: Sequence[str], bitmaps: Sequence[str]) -> list[str]:
    union = bytearray((len(keys) + 7) // 8)
    for b in bitmaps:
        for i, byte in enumerate(base64.b64decode(b)):
            union[i] |= byte
    return [k for i, k in enumerate(keys) if not union[i // 8] >> (i % 8) & 1]


def metadata_source(reader: StorageReader, path: Any) -> str:
    """What a metadata error names: our metadata.json, or the foreign checkpoint directory."""
    if reader.format_name != "hpdcp" and reader.checkpoint_id:
        return f"{reader.checkpoint_id} (as {reader.format_name})"
    return join(os.fspath(path), METADATA_FILE) if path else METADATA_FILE


# -- save -----------------------------------------------------------------------------------------

@dataclass
class SaveSteps:
    """The state one save shares between its steps (instead of closures over ``nonlocal``)."""

    state_dict: Mapping[str, Any]
    comm: Comm
    writer: StorageWriter
    planner: SavePlanner
    path: str | None
    overwrite: bool
    allow_pickle: bool
    verify_replicas: bool
    extra: Mapping[str, Any] | None
    cache_plan: bool = False
    format_version: int = 2
    token: str | None = None
    own: SavePlan | None = None
    compact: CompactPlan | None = None
    shared: CompactPlan | None = None
    shared_idx: torch.Tensor | None = None
    digest: str = ""
    gplan: GlobalSavePlan | None = None
    reply: SaveReply | None = None
    writes: torch.Tensor | None = None  # plan items this rank writes (unique and assigned), in order
    written: WrittenRows | None = None
    envelopes: list | None = None  # coordinator: every rank's write report (files, objects, counts)
    reported: ReportedRows | None = None
    committed: Metadata | None = None
    digests: torch.Tensor | None = None  # every rank's SaveSummary, from summarize

    @property
    def _cache(self) -> dict | None:
        return _PLAN_CACHE.get(_cache_key(self.comm, self.planner)) if self.cache_plan else None

    def _prepare(self) -> None:
        """This rank's plan, in compact form, its shared part and its digests (once per save)."""
        if self.own is None:
            faults.point("save.plan", rank=self.comm.rank, path=self.path)
            self.planner.configure(self.state_dict, rank=self.comm.rank, world_size=self.comm.world_size,
                                   allow_pickle=self.allow_pickle, verify_replicas=self.verify_replicas)
            self.own = self.planner.create_local_plan()
            self.compact = CompactPlan.from_plan(self.own)
            self.shared, self.shared_idx = self.compact.shared()
            self.digest = plan_digest(self.compact)

    def _summary(self) -> SaveSummary:
        c = self.compact
        shared = self.shared.columns_digest() if self.shared_idx.numel() else "00" * 16
        extra = {k: v for k, v in (self.extra or {}).items() if k != "committed_at_ns"}  # (each rank's clock)
        options = [self.overwrite, self.allow_pickle, self.verify_replicas, self.cache_plan, self.format_version,
                   self.writer.protocol_kind, extra]
        inputs = _digest8(str(self.path or self.writer.checkpoint_id)) + _digest8(options)
        cached = self._cache
        return SaveSummary(True, self.digest, c.table_digest(), shared, c.unique_bytes(), inputs,
                           cached["tag"] if cached is not None else bytes(8))

    def _check_inputs(self) -> None:
        """Every rank saves the same checkpoint with the same options, checked before anything is
        written: two ranks given different ids once both returned normally, rank 0 committing a
        checkpoint without the other's file. The same decision on every rank (same summaries)."""
        for (lo, hi), what in ((ID_BYTES, "checkpoint ids"),
                               (OPTIONS_BYTES, "save options (overwrite, allow_pickle, format_version, extra...)")):
            groups = disagreeing(self.digests, lo, hi)
            if groups:
                shown = "; ".join("ranks " + ", ".join(map(str, g)) for g in groups)
                raise ConfigError(f"the ranks do not save one checkpoint: they give different {what} ({shown}; this "
                                  f"is rank {self.comm.rank}, saving {self.path or self.writer.checkpoint_id}); every "
                                  f"rank must pass the same; nothing was written")

    def summarize(self) -> bool:
        """Every rank's fixed-size ``SaveSummary``, all-gathered (N x 81 bytes, nothing decoded).
        With ``cache_plan``, a repeated structure stops here: when every rank holds the same
        cached plan (its digest in the summary) and every plan digest equals that save's, each
        rank reuses its cached write list and rank 0 opens the staging area (returns True). Any
        difference (a rank without the cached plan: another planner, a cache it dropped), or a
        failure while planning on any rank, goes to the full plan round, which plans it (or
        reports the failure) on every rank. Every rank sees the same summaries, so every rank
        decides the same way."""
        try:
            self._prepare()
            row = self._summary().encode()
        except Exception:  # raised again, and agreed, by the full round's local_plan
            row = bytes(SUMMARY_BYTES)
        self.digests = self.comm.all_gather_bytes(row, "save: plan digests")
        self._check_inputs()
        if not self.cache_plan:
            return False
        cached = self._cache
        tags = self.digests[:, slice(*CACHE_BYTES)]
        if cached is None or not bool((tags == tags[0]).all()) or not torch.equal(
                self.digests[:, slice(*PLAN_BYTES)], cached["digests"]):
            return False
        self.token = self.comm.agree_root("save: begin", lambda: self.writer.begin(overwrite=self.overwrite))
        if self.comm.rank == 0:
            self.gplan = cached["gplan"]
        self.reply = SaveReply(cached["writes"], self.token, cached["ndim"])
        self.writes = cached["items"]
        PLAN_CACHE_STATS["hits"] += 1
        return True

    def local_plan(self) -> dict:
        """What this rank sends the coordinator: its key table and shared items only if it is the
        lowest rank with them (the others' are equal), as raw columns."""
        if self.comm.rank == 0:
            self.token = self.writer.begin(overwrite=self.overwrite)
        self._prepare()
        me = self.comm.rank
        send_table = int(first_with(self.digests, *TABLE_BYTES)[me]) == me
        send_shared = bool(self.shared_idx.numel()) and int(first_with(self.digests, *LAYOUT_BYTES)[me]) == me
        return {"token": self.token, "table": self.compact.table_text() if send_table else None,
                "shared": self.shared.to_frame() if send_shared else None}

    def global_plan(self, gathered: list) -> list:
        """Coordinator: the distinct tables and shared layouts -> each rank's write list."""
        layouts = layouts_from(self.digests, gathered, self.comm.world_size)
        self.gplan = self.planner.create_global_plan(layouts)
        token = gathered[0]["token"]
        replies: dict[int, dict] = {}
        out = []
        for w in self.gplan.write_idx:  # ranks writing nothing shared share one reply
            key = id(w) if w.numel() else -1
            if key not in replies:
                replies[key] = SaveReply(w, token, self.gplan.ndim).to_wire()
            out.append(replies[key])
        return out

    def accept(self, wire: dict) -> None:
        """Take the coordinator's reply; with cached plans, remember it for the next save of this
        structure (every rank: the digests and its write list; rank 0: the global plan)."""
        self.reply = reply = SaveReply.from_wire(wire)
        self.token = reply.token
        self.writes = torch.sort(torch.cat([self.shared_idx[reply.writes], self.compact.unique_items()])).values
        PLAN_CACHE_STATS["misses"] += 1
        if self.cache_plan and not self.verify_replicas:
            digests = self.digests[:, slice(*PLAN_BYTES)].clone()
            entry = {"digests": digests, "writes": reply.writes, "ndim": reply.ndim, "items": self.writes,
                     "tag": hashlib.blake2b(digests.numpy().tobytes(), digest_size=8).digest()}
            if self.comm.rank == 0:
                entry["gplan"] = self.gplan
            _PLAN_CACHE[_cache_key(self.comm, self.planner)] = entry

    def write(self) -> dict:
        """Write this rank's chunks; report the small part (files, objects, counts) here and keep
        the rows for ``report``."""
        self.writer.attach(self.token, rank=self.comm.rank, world_size=self.comm.world_size)
        faults.point("save.write", rank=self.comm.rank, path=self.path)
        tensors, objs, items = [], {}, []
        for i in self.writes.tolist():
            it = self.own.items[i]
            if it.kind == "object":
                objs[it.fqn] = self.planner.resolve_data(it)
            elif it.box.numel:
                key = chunk_key(it.fqn, it.box.offsets)
                tensors.append((key, self.planner.resolve_data(it)))
                items.append((int(self.compact.item_key[i]), it.box, key))
        self.writer.counters.expected_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
        result = self.writer.write(tensors, objs)
        faults.point("save.written", rank=self.comm.rank, path=self.path)
        self.written = WrittenRows.from_result(result, items, self.reply.ndim)
        return self.written.envelope()

    def keep_envelopes(self, envs: list) -> list:
        """Coordinator: every rank wrote; its counts say how many rows will arrive from each."""
        self.envelopes = envs
        return [None] * self.comm.world_size

    def report(self) -> None:
        """Every rank's rows to the coordinator, received in place (point to point, no padding):
        the chunk index's rows as ranks report them."""
        counts = blocks = None
        if self.comm.rank == 0:
            counts, blocks = ReportedRows.envelopes(self.envelopes)
        rows = self.comm.gather_rows(self.written.rows, counts, "save: report rows")
        digests = self.comm.gather_rows(self.written.blocks.view(-1, 1), blocks, "save: report blocks")
        if self.comm.rank == 0:
            self.reported = ReportedRows.from_envelopes(self.envelopes, rows, digests)
            self.envelopes = None

    def build_metadata(self) -> bool:
        """Coordinator: the checkpoint's metadata from the global plan and the rows ranks wrote.
        True when its chunk index was streamed into staging as it was built (``IndexStream``)."""
        reported, self.reported = self.reported, None  # its rows are consumed (sorted into the index)
        stream = self._index_stream(reported)
        try:
            self.committed = build_metadata(self.gplan, reported, self.comm.world_size, self.extra,
                                            on_sorted=stream.put if stream is not None else None)
            if stream is not None:
                stream.finish(self.committed.index)
        except BaseException:
            if stream is not None:
                stream.abort()
            raise
        if self.format_version == 1:
            self.committed = self.committed.as_v1()
        return stream is not None

    def _index_stream(self, reported: ReportedRows) -> IndexStream | None:
        """A format-v2 index of ``STREAM_INDEX_BYTES`` or more is written while it is built, into
        the writer's ``open_sink`` (a writer without one commits it whole, as a smaller one is)."""
        if self.format_version == 1:
            return None
        counts = (sum(1 for k in self.gplan.keys if k.kind == TENSOR), len(reported.rows), self.gplan.ndim,
                  reported.blocks.numel())
        size = IndexStream.size(*counts)
        if size < STREAM_INDEX_BYTES:
            return None
        try:
            sink = self.writer.open_sink(INDEX_FILE, size)
        except NotImplementedError:
            return None
        return IndexStream(sink, *counts)

    def commit(self) -> str:
        streamed = self.build_metadata()
        faults.point("save.commit", rank=self.comm.rank, path=self.path)
        if streamed:  # the index is in staging already: metadata.json last, then visible
            self.writer.commit_copy(self.committed, self.committed.to_json().encode())
        else:
            self.writer.commit(self.committed)
        return self.committed.to_json() if self.comm.world_size > 1 else ""


def layouts_from(summaries: torch.Tensor, gathered: Sequence[Mapping], world_size: int) -> SaveLayouts:
    """The coordinator's ``SaveLayouts`` from every rank's summary and the payloads of the ranks
    that sent a table or shared items (the lowest of each digest)."""
    table_first = first_with(summaries, *TABLE_BYTES)
    shared_first = first_with(summaries, *LAYOUT_BYTES)
    has_shared = (summaries[:, slice(*SHARED_BYTES)] != 0).any(1)
    tables: list = []
    table_id: dict[int, int] = {}
    for r in torch.unique(table_first).tolist():
        text = gathered[r]["table"]
        if text is None:
            raise MetadataError(f"save: rank {r} was to send its key table and did not")
        table_id[r] = len(tables)
        tables.append(parse_table(text))
    table_of = torch.tensor([table_id[f] for f in table_first.tolist()], dtype=torch.int64)
    plans: list[CompactPlan] = []
    layout_id: dict[int, int] = {}
    for r in torch.unique(shared_first[has_shared]).tolist():
        w = gathered[r]["shared"]
        if w is None:
            raise MetadataError(f"save: rank {r} was to send its shared items and did not")
        layout_id[r] = len(plans)
        plans.append(CompactPlan.from_frame(w, tables[int(table_of[r])]))
    layout_of = torch.tensor([layout_id[f] if h else -1 for f, h in zip(shared_first.tolist(), has_shared.tolist())],
                             dtype=torch.int64)
    unique_bytes = summaries[:, slice(*UNIQUE_BYTES)].flatten().clone().view(torch.int64)  # fresh: aligned
    return SaveLayouts(world_size, tuple(tables), table_of, tuple(plans), layout_of, unique_bytes)


# -- load -----------------------------------------------------------------------------------------

@dataclass
class LoadSteps:
    state_dict: Mapping[str, Any]
    comm: Comm
    reader: StorageReader
    planner: LoadPlanner
    path: str | None
    options: BroadcastOptions
    allow_cast: bool
    allow_pickle: bool
    rename: Sequence[Any]
    md: Metadata | Exception | None = None
    own: LoadPlan | None = None
    reply: LoadReply | None = None

    def read_metadata(self) -> dict:
        return MetadataMsg(self.reader.read_metadata_text(), self.reader.pin()).to_wire()

    def parse_metadata(self, wire: dict) -> None:
        """Every rank parses and validates in parallel; a failure here is reported in the plan
        agreement (``local_plan`` raises it), so every rank raises it."""
        msg = MetadataMsg.from_wire(wire)
        try:
            self.reader.attach_pin(msg.pin)  # (the v2 index parsing opens is the coordinator's checkpoint's)
            md = Metadata.from_json(msg.text, source=metadata_source(self.reader, self.path),
                                    open_file=self.reader.open_file)
            self.reader.attach_metadata(md, pin=msg.pin)
            self.md = rename_keys(md, self.rename, source=self.path or "checkpoint")
        except Exception as e:
            self.md = e

    def local_plan(self) -> dict:
        if isinstance(self.md, Exception):
            raise self.md
        md = self.md
        self.planner.configure(self.state_dict, md, rank=self.comm.rank, world_size=self.comm.world_size,
                               allow_cast=self.allow_cast, sendable=sendable_devices())
        own = self.own = self.planner.create_local_plan()
        # every file this rank may read exists, is regular and has its recorded size, checked
        # here (an agreed step) before any data moves into the caller's tensors
        self.reader.check_reads(sorted({md.tensors[it.fqn].chunks[it.chunk].file for it in own.items}
                                       | {md.objects[f].file for f in own.objects}), self._chunk_spans)
        # no broadcasts without replicas to share: the coordinator need not see shards
        sharing = self.options.mode != "never"
        shards = CompactShards.from_summaries(own.shards if sharing else ())
        parts = CompactParts.from_parts(self._amplified_parts() if sharing and self.options.share_reads else ())
        return LoadPlanMsg(own.missing, key_bitmap(md.keys(), own.requested), shards, node_id(),
                           bool(self.reader.slow_storage), parts).to_wire()

    def _chunk_spans(self) -> dict[str, list[tuple[int, int]]]:
        """The bytes of each file this rank's plan reads from: every chunk it reads a part of,
        whole (a shared read's source reads other members' parts of the same chunks)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for it in self.own.items:
            tm = self.md.tensors[it.fqn]
            chunk = tm.chunks[it.chunk]
            out.setdefault(chunk.file, []).append(
                (chunk.byte_offset, chunk.byte_offset + chunk.box.numel * element_size(tm.dtype)))
        return out

    def _amplified_parts(self) -> list[Part]:
        """This rank's reads that would fetch ``AMPLIFIED`` times their bytes or more (a part of
        each row of a chunk, say): the candidates for a shared read."""
        out = []
        for it in self.own.items:
            tm = self.md.tensors[it.fqn]
            chunk = tm.chunks[it.chunk]
            if it.overlap.sizes == chunk.sizes:  # the whole chunk: read at its own bytes
                continue
            need = it.overlap.numel * element_size(tm.dtype)
            cost = self.reader.read_bytes(chunk, tm.dtype, Box(relative(it.overlap, chunk.box), it.overlap.sizes))
            if need and cost >= AMPLIFIED * need:
                out.append(Part(it.fqn, tm.dtype, it.chunk, it.dest_box, it.overlap))
        return out

    def global_plan(self, gathered: list) -> list:
        """Coordinator: key checks, and who reads/broadcasts each replicated shard; every rank
        receives the key verdict and just the broadcast batches it takes part in."""
        tables: dict = {}
        msgs = [LoadPlanMsg.from_wire(g, tables) for g in gathered]
        missing = {r: m.missing for r, m in enumerate(msgs) if m.missing}
        unexpected = tuple(unrequested(self.md.keys(), [m.requested for m in msgs]))
        ops = self.planner.create_global_plan([m.shards for m in msgs], mode=self.options.mode,
                                              nodes=[m.node for m in msgs], slow_storage=msgs[0].slow)
        batches = batch_ops(ops, self.options.batch_bytes)
        per_rank: list[list[Batch]] = [[] for _ in msgs]
        for b in batches:
            for r in b.ranks:
                per_rank[r].append(b)
        needed = group_sets(batches)
        not_read = frozenset((r, op.key[0], op.key[1]) for op in ops for r in op.ranks if r != op.src)
        shared = plan_shared_reads([m.parts for m in msgs], enabled=self.options.share_reads,
                                   mode=self.options.mode, nodes=[m.node for m in msgs], slow_storage=msgs[0].slow,
                                   not_read=not_read)
        shared_of = by_rank(shared, len(msgs))
        return [LoadReply(missing, unexpected, tuple(mine), needed, tuple(shared_of[r]), bool(shared)).to_wire()
                for r, mine in enumerate(per_rank)]

    def accept(self, wire: dict, strict: bool) -> None:
        reply = self.reply = LoadReply.from_wire(wire)
        if strict and (reply.missing_by_rank or reply.unexpected):
            raise key_error(reply.missing_by_rank, list(reply.unexpected))
        sources = {(op.key[0], op.key[1]): op.src for b in reply.batches for op in b.ops}
        self.own = dataclasses.replace(self.own, sources=sources)

    def transfer(self) -> None:
        """The shared reads first (their parts may be shards this rank broadcasts), then storage
        reads of this rank's own shares, overlapped with the replica broadcasts. A shared read's
        failure is raised after the broadcasts, so no rank waits for this one."""
        comm, md, own, batches = self.comm, self.md, self.own, self.reply.batches
        batch_of = {op.key: i for i, b in enumerate(batches) for op in b.ops if b.src == comm.rank}
        shared = self._shared_parts()
        reads: list[tuple[int | None, ReadRequest]] = []  # (batch this rank sources, request)
        for it in own.items:
            src = own.sources.get((it.fqn, it.dest_box.offsets))
            if src is not None and src != comm.rank:
                continue  # another holder reads it and broadcasts it here
            if (it.fqn, it.chunk, it.dest_box.offsets, it.overlap.offsets, it.overlap.sizes) in shared:
                continue  # a shared read's part: read once by its source, sent here
            tm = md.tensors[it.fqn]
            chunk = tm.chunks[it.chunk]
            req = ReadRequest(chunk, tm.dtype, Box(relative(it.overlap, chunk.box), it.overlap.sizes),
                              self.planner.acquire_tensor(it))
            reads.append((batch_of.get((it.fqn, it.dest_box.offsets, it.dest_box.sizes)), req))
        received = sum(b.nbytes for b in batches if comm.rank in b.ranks and b.src != comm.rank)
        self.reader.counters.expected_bytes += received + sum(r.dest.numel() * r.dest.element_size() for _, r in reads) \
            + sum(d.numel() * d.element_size() for its in shared.values() for d in map(self.planner.acquire_tensor, its))
        delivered: set[tuple] = set()
        failure: BaseException | None = None
        if self.reply.any_shared:
            try:
                self._run_shared(shared, delivered)
            except BaseException as e:  # noqa: BLE001 - raised below, once the broadcasts ran
                failure = e
        filled: dict[int, bool] = {}  # batches this rank sources with parts that came by shared reads
        for key, its in shared.items():
            for it in its:
                i = batch_of.get((it.fqn, it.dest_box.offsets, it.dest_box.sizes))
                if i is not None:
                    filled[i] = filled.get(i, True) and key in delivered
        run_load_transfers(list(batches), rank=comm.rank, group=comm.group, control=comm.control,
                           timeout=comm.timeout, options=self.options, destination=self.planner.destination,
                           counters=self.reader.counters, reads=reads, read=self.reader.read_tensors,
                           needed=self.reply.groups, filled=filled)
        if failure is not None:
            raise failure
        values = self.reader.read_objects({f: md.objects[f] for f in own.objects}, allow_pickle=self.allow_pickle)
        for fqn, value in values.items():
            self.planner.apply_object(fqn, value)

    def _shared_parts(self) -> dict[tuple, list]:
        """(fqn, chunk, destination offsets, overlap) of each part this rank gets from a shared
        read -> its read items (one, unless two destination pieces overlap)."""
        mine = {(op.fqn, op.chunk, *p[1:]) for op in self.reply.shared for p in op.parts if p[0] == self.comm.rank}
        out: dict[tuple, list] = {}
        for it in self.own.items:
            key = (it.fqn, it.chunk, it.dest_box.offsets, it.overlap.offsets, it.overlap.sizes)
            if key in mine:
                out.setdefault(key, []).append(it)
        return out

    def _run_shared(self, shared: Mapping[tuple, list], delivered: set) -> None:
        comm, md = self.comm, self.md
        pg = gloo_group(comm.group, comm.timeout, "shared reads")
        everyone = pg is dist.group.WORLD

        def read(ops: list[SharedRead], buffers: list[torch.Tensor], on_done) -> None:
            requests = []
            for op, buf in zip(ops, buffers):
                tm = md.tensors[op.fqn]
                chunk = tm.chunks[op.chunk]
                requests.append(ReadRequest(chunk, tm.dtype, Box(relative(op.union, chunk.box), op.union.sizes), buf))
            self.reader.read_tensors(requests, on_done=on_done)

        def deliver(op: SharedRead, part: tuple, data: torch.Tensor) -> None:
            key = (op.fqn, op.chunk, *part[1:])
            for it in shared.get(key, ()):
                self.planner.acquire_tensor(it).copy_(data)
            delivered.add(key)

        run_shared_reads(self.reply.shared, rank=comm.rank, group=pg,
                         to_global=(lambda r: r) if everyone else (lambda r: dist.get_global_rank(pg, r)),
                         read=read, deliver=deliver, counters=self.reader.counters,
                         max_in_flight=self.options.max_in_flight, world_size=comm.world_size)


def key_error(missing_by_rank: Mapping[int, Sequence[str]], unexpected: list[str]) -> KeyMismatchError:
    parts = []
    all_missing = sorted({k for ks in missing_by_rank.values() for k in ks})
    if all_missing:
        where = ", ".join(f"rank {r}" for r in sorted(missing_by_rank))
        parts.append(f"{len(all_missing)} key(s) missing from the checkpoint ({where}): {_short(all_missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint key(s) not in any rank's state dict: {_short(unexpected)}")
    return KeyMismatchError("strict load: " + "; ".join(parts) + " (pass strict=False to load the common keys)",
                            all_missing, unexpected)


def _short(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
