"""Shared reads, run: one rank reads a chunk's union of parts, each other member gets its part.

Point-to-point over a gloo group of the load's ranks, whatever the destinations' device: the
union is read into host memory (where storage reads land anyway) and a part bound for a GPU is
copied there by its receiver. Every member runs its ops in one global order (round, then
sequence): a source reads the round's unions, then posts every send of the round; a receiver
waits for each part's one-element status before it posts the part's receive, so a failed read
never fills a destination, and nobody waits for a message that will not come. Sends are posted
before any wait of the same op, so by induction over the order every wait ends. A read failure
is re-raised after every op has run (the load's agreement then fails on every rank).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..core.geometry import Box
from ..format.metadata import dtype_from_name
from ..planning.shared_reads import SharedRead
from .failures import collective_error

_TAG_SPACE = 1 << 30


def _tag(op: SharedRead, k: int, kind: int) -> int:
    """A message tag (gloo matches by source and tag): the op, the receiver's k-th part of it
    and status/data, folded into gloo's range (a repeat only ever meets a message long
    delivered: one pair's messages are sent and received in the same order)."""
    return ((op.seq * 256 + k % 256) * 2 + kind) % _TAG_SPACE


def piece(union: torch.Tensor, ubox: Box, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The part at ``offsets``/``sizes`` (global coordinates) of the union tensor covering
    ``ubox``: a view."""
    if not ubox.sizes:
        return union
    return union[tuple(slice(o - u, o - u + s) for o, u, s in zip(offsets, ubox.offsets, sizes))]


def run_shared_reads(ops: Sequence[SharedRead], *, rank: int, group: Any, to_global: Callable[[int], int],
                     read: Callable[[list[SharedRead], list[torch.Tensor], Callable[[int], None]], None],
                     deliver: Callable[[SharedRead, tuple, torch.Tensor], None], counters: Any,
                     max_in_flight: int, world_size: int) -> None:
    """Run this rank's shared reads (in ``planning.shared_reads.by_rank`` order).

    ``read(ops, buffers, on_done)`` reads each op's union into its buffer (``on_done(k)`` once
    buffer k is filled); ``deliver(op, part, data)`` copies a part (an entry of ``op.parts``)
    into this rank's destination. ``group``: a gloo group of the load's ranks; ``to_global`` maps a load rank
    to the global rank the point-to-point calls take.
    """
    error: BaseException | None = None
    rounds: dict[int, list[SharedRead]] = {}
    for op in ops:
        rounds.setdefault(op.round, []).append(op)

    def wait(work: Any) -> None:
        try:
            work.wait()
        except Exception as e:
            raise collective_error("a shared read's transfer", rank, world_size, e) from None

    for rnd in sorted(rounds):
        batch = rounds[rnd]
        mine = [op for op in batch if op.src == rank]
        buffers = [torch.empty(op.union.sizes, dtype=dtype_from_name(op.dtype)) for op in mine]
        done: set[int] = set()
        try:
            read(mine, buffers, done.add)
        except BaseException as e:  # the statuses tell the receivers; raised after the last op
            error = error or e
        held = {id(op): (buf, k in done) for k, (op, buf) in enumerate(zip(mine, buffers))}
        sends: list[tuple[Any, torch.Tensor]] = []
        inflight: deque = deque()
        for op in batch:
            if op.src == rank:
                buf, ok = held[id(op)]
                nth: dict[int, int] = {}
                for p in op.parts:
                    r = p[0]
                    k = nth[r] = nth.get(r, -1) + 1
                    part = piece(buf, op.union, p[2], p[3])
                    if r == rank:
                        if ok:
                            deliver(op, p, part)
                        continue
                    status = torch.tensor([1 if ok else 0], dtype=torch.int64)
                    sends.append((dist.isend(status, dst=to_global(r), group=group, tag=_tag(op, k, 0)), status))
                    if ok:
                        data = part.contiguous()
                        sends.append((dist.isend(data, dst=to_global(r), group=group, tag=_tag(op, k, 1)), data))
                        counters.bump("shared_bytes_sent", data.numel() * data.element_size())
                counters.bump("shared_reads")
                continue
            for k, p in enumerate(op.parts):  # (this rank's own parts only)
                status = torch.zeros(1, dtype=torch.int64)
                wait(dist.irecv(status, src=to_global(op.src), group=group, tag=_tag(op, k, 0)))
                if not status.item():
                    continue
                while len(inflight) >= max_in_flight:
                    _finish(inflight.popleft(), wait, deliver)
                data = torch.empty(p[3], dtype=dtype_from_name(op.dtype))
                inflight.append((dist.irecv(data, src=to_global(op.src), group=group, tag=_tag(op, k, 1)), op, p, data))
                counters.bump("bytes_received", data.numel() * data.element_size())
        while inflight:
            _finish(inflight.popleft(), wait, deliver)
        for work, _ in sends:
            wait(work)
    if error is not None:
        raise error


def _finish(entry: tuple, wait: Callable[[Any], None], deliver: Callable) -> None:
    work, op, part, data = entry
    wait(work)
    deliver(op, part, data)
