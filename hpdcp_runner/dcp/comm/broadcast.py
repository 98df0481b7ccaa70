"""Replica-shard broadcast: subgroups, batching of small shards, a cap on broadcasts in flight.

While the readers read (in a thread), each replicated shard goes from its reader to the other
holders, batch by batch once the batch is read, over a subgroup of exactly those ranks. CPU tensors
travel over gloo, CUDA tensors over NCCL. Shards below ``batch_bytes`` are packed per (group,
source, dtype) into one flat buffer; larger ones go straight from/to their destination buffer.
At most ``max_in_flight`` async broadcasts are outstanding.

Defaults, measured here (2 cores, gloo, ws=2, 0.3 GiB of the peer tensor mix replicated,
``scripts/bench_broadcast.py --sweep``, medians of 2): no packing (batch_bytes=0) 2.9-3.1 s;
1 MiB 1.17-1.37 s; 4 MiB 1.19-1.42 s; 8 MiB 1.09-1.27 s; 16 MiB 1.01-1.22 s; 64 MiB 1.51-1.77 s,
with max_in_flight 1/4/8 inside the noise at 4-16 MiB. This agrees with peer_baseline.md §3
(4-16 MiB and 4 in flight best; 2000 x 4 KiB one by one 0.01 GB/s vs packed 0.28 GB/s). We use
8 MiB and 4.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..core.errors import CollectiveTimeoutError, ConfigError
from ..format.metadata import dtype_from_name
from ..planning.load_replicas import MODES, Batch
from ..core.utils import get_logger
from .failures import collective_error
from .groups import WeakGroups

log = get_logger(__name__)
DEFAULT_BATCH_BYTES = 8 << 20
DEFAULT_MAX_IN_FLIGHT = 4


@dataclass(frozen=True)
class BroadcastOptions:
    """``mode``: always | never | auto. ``groups`` maps a tuple of group ranks to a caller-owned
    process group to use for that replica set (never destroyed by us). ``share_reads``: a chunk
    that several ranks each need a part of is read once and the parts sent (under the same
    ``mode``: see ``planning.shared_reads``)."""

    mode: str = "auto"
    batch_bytes: int = DEFAULT_BATCH_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    groups: Mapping[tuple[int, ...], Any] | None = None
    share_reads: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"broadcast mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.batch_bytes < 0:
            raise ConfigError(f"broadcast batch_bytes must be >= 0, got {self.batch_bytes}")
        if self.max_in_flight < 1:
            raise ConfigError(f"broadcast max_in_flight must be >= 1, got {self.max_in_flight}")


def node_id() -> str:
    """This process's node: torchrun's node rank (GROUP_RANK) with the host name, so two agents
    on one machine (``--nnodes=2``) count as two nodes."""
    return f"{socket.gethostname()}#{os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))}"


def sendable_devices() -> frozenset[str]:
    """The device types a broadcast here can carry: 'cpu' with gloo, 'cuda' with NCCL. Handed to
    the load planner as data (the planning layer never asks the communication layer)."""
    return frozenset(d for d, ok in (("cpu", dist.is_gloo_available()), ("cuda", dist.is_nccl_available())) if ok)


class GroupCache:
    """Subgroups keyed by (global ranks, backend): created collectively (by their members, in one
    global order) on first use, reused by later loads, destroyed by :meth:`destroy_owned`."""

    def __init__(self) -> None:
        self.owned = WeakGroups()  # alive while torch's registry holds them (see WeakGroups)
        self.created = 0

    def get(self, global_ranks: tuple[int, ...], backend: str, timeout: Any, purpose: str = "data",
            everyone: bool = False) -> Any:
        """``everyone``: every rank of the default group calls this in the same order (members
        or not), so the group is created with torch's global naming; otherwise only the members
        call it (local synchronisation, whose group names assume every member has created the
        same number of groups before)."""
        key = (id(dist.group.WORLD), global_ranks, backend, purpose)
        pg = self.owned.get(key)
        if pg is None:
            kwargs = {"timeout": timeout} if timeout is not None else {}
            try:
                pg = dist.new_group(list(global_ranks), backend=backend, use_local_synchronization=not everyone,
                                    **kwargs)
            except Exception as e:
                raise CollectiveTimeoutError(f"creating the broadcast group {list(global_ranks)} ({backend}) failed "
                                             f"on rank {dist.get_rank()}: {e}") from e
            self.owned[key] = pg
            self.created += 1
        return pg

    def destroy_owned(self) -> None:
        for pg in self.owned.values():
            if not self._is_member(pg):
                continue
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # already gone with the default group
                log.debug("destroying a broadcast group failed: %s", e)
        self.owned.clear()

    def _is_member(self, pg: Any) -> bool:
        return pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER


GROUPS = GroupCache()


def release_broadcast_groups() -> None:
    """Destroy the broadcast subgroups this process created (caller-passed groups are kept)."""
    GROUPS.destroy_owned()


def _synchronize(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


class _Reads:
    """Reads this rank's storage work in a background thread (one pass: in broadcast order where the
    reader allows, else by file and offset), so reading overlaps broadcasting; ``ready[i]`` is set
    once batch i's shards are in. ``filled``: batches whose shards came in before (shared reads),
    wholly (no reads here) or in part: False when some of it failed to come."""

    def __init__(self, reads: Sequence[tuple[int | None, Any]], read: Callable[..., None],
                 filled: Mapping[int, bool]) -> None:
        ordered = sorted(reads, key=lambda br: (br[0] is None, br[0] or 0))  # broadcast order, local last
        self.requests = [r for _, r in ordered]
        self.batch_of = [b for b, _ in ordered]
        self.left = Counter(b for b in self.batch_of if b is not None)
        self.read = read
        self.ready = {i: threading.Event() for i in self.left}
        self.done: set[int] = set()
        self.failed = {i for i, ok in filled.items() if not ok}
        for i in filled:
            if i not in self.left:
                self.ready[i] = threading.Event()
                self._complete(i)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hpdcp-load-reads", daemon=True)

    def _complete(self, i: int) -> None:
        if i not in self.failed:
            self.done.add(i)
        self.ready[i].set()

    def _one_done(self, k: int) -> None:
        i = self.batch_of[k]
        if i is not None:
            self.left[i] -= 1
            if self.left[i] == 0:
                self._complete(i)

    def _run(self) -> None:
        try:
            self.read(self.requests, on_done=self._one_done, keep_order=True)
        except BaseException as e:  # reported after the broadcasts, identically on every rank
            self.error = e
        finally:
            for ev in self.ready.values():
                ev.set()


def group_sets(batches: Sequence[Batch]) -> list[list]:
    """The distinct (ranks, device) of ``batches`` in first-use order: the groups a load needs."""
    seen: dict[tuple, None] = {}
    for b in batches:
        seen.setdefault((b.ranks, b.device), None)
    return [[list(r), d] for r, d in seen]


def run_load_transfers(batches: Sequence[Batch], *, rank: int, group: Any, control: Any, timeout: Any,
                       options: BroadcastOptions, destination: Callable[[tuple], torch.Tensor], counters: Any,
                       reads: Sequence[tuple[int | None, Any]], read: Callable[..., None],
                       needed: Sequence[Sequence] = (), filled: Mapping[int, bool] | None = None) -> None:
    """Read this rank's shards (in a thread) and run its part of the replica broadcasts.

    ``batches`` are (at least) those this rank takes part in, in the global order; ``needed``
    lists every group of the load (``group_sets`` of all batches), the same on every rank.
    Before each batch the source broadcasts a one-element status: receivers post the data
    broadcast only for a batch that was read successfully, so a failed read never fills a
    destination and never leaves a rank waiting. A read failure is re-raised after all batches.
    ``filled``: batches this rank sources whose shards (some or all) came in before, by shared
    reads: True when they all came, False when some failed (the batch is then not sent).
    """
    mine = [(i, b) for i, b in enumerate(batches) if rank in b.ranks]
    size = dist.get_world_size(group) if group is not None else 1
    everyone = group is dist.group.WORLD
    to_global = (lambda r: r) if group is None or everyone else (lambda r: dist.get_global_rank(group, r))
    data_pgs, status_pgs = _groups(mine, needed, everyone, to_global, size, control, options, timeout)
    reads = _Reads(reads, read, filled or {})
    reads.thread.start()
    inflight: deque = deque()
    statuses: list = []

    def wait(work: Any) -> None:
        try:
            work.wait()
        except Exception as e:
            raise collective_error("a replica broadcast", rank, size, e) from None

    try:
        for i, b in mine:
            pg, spg = data_pgs[(b.ranks, "nccl" if b.device == "cuda" else "gloo")], status_pgs[b.ranks]
            src, is_src = to_global(b.src), rank == b.src
            status = torch.zeros(1, dtype=torch.int64)
            if is_src:
                reads.ready[i].wait()
                status.fill_(1 if i in reads.done else 0)
                statuses.append((dist.broadcast(status, src=src, group=spg, async_op=True), status))
                ok = i in reads.done
            else:
                wait(dist.broadcast(status, src=src, group=spg, async_op=True))
                ok = bool(status.item())
            if not ok:
                continue
            while len(inflight) >= options.max_in_flight:
                work, finish = inflight.popleft()
                wait(work)
                finish()
            if b.packed:
                tensor, finish = _packed(b, is_src, destination)
                counters.bump("shards_packed", len(b.ops))
            else:
                tensor, finish = _direct(b, is_src, destination)
            inflight.append((dist.broadcast(tensor, src=src, group=pg, async_op=True), finish))
            counters.bump("broadcasts")
            if not is_src:
                counters.bump("bytes_received", b.nbytes)
        while inflight:
            work, finish = inflight.popleft()
            wait(work)
            finish()
        for work, _ in statuses:
            wait(work)
    finally:
        reads.thread.join()
    if mine:
        _synchronize(mine[0][1].device)
    counters.extra["groups_created"] = GROUPS.created
    if reads.error is not None:
        raise reads.error


def _groups(mine: list, needed: Sequence[Sequence], everyone: bool, to_global: Callable[[int], int], size: int,
            control: Any, options: BroadcastOptions, timeout: Any) -> tuple[dict, dict]:
    """(data groups by (ranks, backend), status groups by ranks) of this rank's broadcasts."""
    # Data and per-batch statuses travel on different communicators: gloo runs one group's ops in
    # order, so a status queued behind the data in flight would serialise the pipeline.
    data_pgs: dict[tuple, Any] = {}
    status_pgs: dict[tuple, Any] = {}
    # Create every needed group first, in the global order. When the load runs on the default
    # group, every rank creates every group (torch's global naming; a rank that is a member of
    # fewer replica sets than its peers would otherwise derive different group names).
    todo = [(tuple(r), d) for r, d in needed] if everyone else [(b.ranks, b.device) for _, b in mine]
    for ranks, device in todo:
        backend = "nccl" if device == "cuda" else "gloo"
        granks = tuple(to_global(r) for r in ranks)
        if (ranks, backend) not in data_pgs:
            given = (options.groups or {}).get(ranks)
            data_pgs[(ranks, backend)] = given if given is not None else GROUPS.get(granks, backend, timeout,
                                                                                    everyone=everyone)
        if ranks not in status_pgs:
            whole = len(ranks) == size and control is not None
            status_pgs[ranks] = control if whole else GROUPS.get(granks, "gloo", timeout, "status", everyone=everyone)
    return data_pgs, status_pgs


def _packed(b: Batch, is_src: bool, destination: Callable[[tuple], torch.Tensor]):
    dt = dtype_from_name(b.dtype)
    dests = [destination(op.key) for op in b.ops]
    total = sum(d.numel() for d in dests)
    buf = torch.empty(total, dtype=dt, device=dests[0].device)
    spans, pos = [], 0
    for d in dests:
        spans.append((pos, pos + d.numel()))
        pos += d.numel()
    if is_src:
        for d, (a, z) in zip(dests, spans):
            buf[a:z].view(d.shape).copy_(d)
        return buf, lambda: None

    def finish() -> None:
        for d, (a, z) in zip(dests, spans):
            d.copy_(buf[a:z].view(d.shape))

    return buf, finish


def _direct(b: Batch, is_src: bool, destination: Callable[[tuple], torch.Tensor]):
    d = destination(b.ops[0].key)
    if d.is_contiguous():
        return d, lambda: None
    tmp = d.contiguous() if is_src else torch.empty(d.shape, dtype=d.dtype, device=d.device)
    return tmp, (lambda: None) if is_src else (lambda: d.copy_(tmp))
