"""Control-plane collectives: JSON all-gather/gather/scatter/broadcast over gloo, with agreed failures.

Plans and outcomes travel as JSON bytes in uint8 tensors (no pickle; a plan's integer columns as
raw bytes beside the JSON: ``core.columns.encode_frame``), always over a gloo group
(a dedicated one when the caller's group is NCCL or a per-call ``timeout`` is asked for), so a
dead or hung rank becomes a ``CollectiveTimeoutError`` instead of a hang. ``agree`` runs a
local step on every rank and makes any rank's failure the same error on all ranks.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import gc
import json
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..core import errors as errmod
from ..core.errors import CollectiveTimeoutError, DistributedError, HpdcpError
from ..core.utils import get_logger
from ..core.columns import decode_frame, encode_frame
from .failures import collective_error
from .groups import WeakGroups

log = get_logger(__name__)
_GROUP_CACHE = WeakGroups()


def forget_groups() -> None:
    """Drop this process's references to the groups the engine created (they are weak already:
    see :class:`WeakGroups`), then collect garbage while the runtime is whole: a reference
    cycle in the user's script (a DeviceMesh and its DTensors) otherwise frees its group during
    interpreter teardown. Registered at exit."""
    _GROUP_CACHE.clear()
    from .broadcast import GROUPS

    GROUPS.owned.clear()
    gc.collect()


atexit.register(forget_groups)


def _as_timedelta(timeout: float | _dt.timedelta | None) -> _dt.timedelta | None:
    if timeout is None or isinstance(timeout, _dt.timedelta):
        return timeout
    if timeout <= 0:
        raise errmod.ConfigError(f"timeout must be positive seconds, got {timeout}")
    return _dt.timedelta(seconds=float(timeout))


def gloo_group(group: Any, timeout: float | _dt.timedelta | None, purpose: str) -> Any:
    """A gloo group over ``group``'s ranks, created once per (ranks, timeout, purpose): the
    control plane of NCCL jobs ("control"), or the background writer's own group ("async").
    Every member must ask for it in the same order (group creation is collective)."""
    td = _as_timedelta(timeout)
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.group.WORLD), ranks, td, purpose)
    g = _GROUP_CACHE.get(key)
    if g is None:
        kwargs = {"timeout": td} if td is not None else {}
        # Over the default group every rank is here: torch's global naming, which (unlike local
        # synchronisation's) does not assume every rank created the same number of groups so far,
        # e.g. after a collective new_group([0, 1]) that rank 2 is not a member of.
        local = group is not dist.group.WORLD
        try:
            g = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=local, **kwargs)
        except Exception as e:
            raise CollectiveTimeoutError(
                f"creating the gloo {purpose} group of ranks {list(ranks)} failed on rank {dist.get_rank(group)} of {len(ranks)}: {e}. A peer "
                f"rank probably died, hung or did not call the same checkpoint function") from e
        _GROUP_CACHE[key] = g
    return g


class Comm:
    """A process group's rank/size plus the gloo group used for control messages."""

    def __init__(self, group: Any, rank: int, world_size: int, control: Any, timeout: Any = None) -> None:
        self.group, self.rank, self.world_size, self.control = group, rank, world_size, control
        self.timeout = timeout

    @classmethod
    def create(cls, process_group: Any = None, timeout: float | _dt.timedelta | None = None) -> "Comm":
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise errmod.ConfigError("process_group was given but torch.distributed is not initialized")
            return cls(None, 0, 1, None)
        group = process_group or dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise errmod.ConfigError(f"global rank {dist.get_rank()} is not a member of the given process group")
        td = _as_timedelta(timeout)
        if td is None and dist.get_backend(group) == "gloo":
            return cls(group, rank, size, group, td)
        control = gloo_group(group, td, "control")
        return cls(group, rank, size, control, td)

    # -- raw JSON collectives ---------------------------------------------------------------
    def _run(self, phase: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except HpdcpError:
            raise
        except Exception as e:  # gloo raises RuntimeError on timeouts and closed peers
            raise collective_error(phase, self.rank, self.world_size, e) from None

    def all_gather_json(self, obj: Any, phase: str = "all_gather") -> list[Any]:
        payload = json.dumps(obj, separators=(",", ":")).encode()
        if self.world_size == 1:
            return [json.loads(payload)]

        def go() -> list[Any]:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.control)
            n = int(max(s.item() for s in sizes))
            bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(bufs, _padded(payload, n), group=self.control)
            return [json.loads(_tensor_bytes(b, int(s.item()))) for b, s in zip(bufs, sizes)]

        return self._run(phase, go)

    def all_gather_bytes(self, data: bytes, phase: str = "all_gather") -> torch.Tensor:
        """Every rank's ``data`` (the same length on every rank) as the rows of a uint8 tensor:
        fixed-size messages need no size exchange and no decoding (a plan digest per rank)."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if self.world_size == 1:
            return mine[None].clone()

        def go() -> torch.Tensor:
            out = torch.empty((self.world_size, len(data)), dtype=torch.uint8)
            dist.all_gather(list(out.unbind(0)), mine, group=self.control)
            return out

        return self._run(phase, go)

    def broadcast_bytes(self, data: bytes | None, phase: str = "broadcast") -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        if self.world_size == 1:
            return data or b""
        src = self._root()

        def go() -> bytes:
            payload = (data or b"") if self.rank == 0 else b""
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, src=src, group=self.control)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if self.rank == 0 and payload:
                buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(buf, src=src, group=self.control)
            return _tensor_bytes(buf, buf.numel())

        return self._run(phase, go)

    def broadcast_json(self, obj: Any, phase: str = "broadcast") -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        payload = json.dumps(obj, separators=(",", ":")).encode() if self.rank == 0 else None
        return json.loads(self.broadcast_bytes(payload, phase))

    def _root(self) -> int:
        return dist.get_global_rank(self.control, 0) if self.control is not dist.group.WORLD else 0

    def gather_frames(self, obj: Any, phase: str = "gather") -> list[Any] | None:
        """Every rank's ``obj`` (JSON values and int/bool tensors: ``encode_frame``) on rank 0,
        None elsewhere: the coordinator's inbox. Columns arrive as raw bytes and are viewed in
        place, never base64-decoded. Only rank 0 holds all N payloads; the others exchange N
        sizes."""
        payload = encode_frame(obj)
        if self.world_size == 1:
            return [decode_frame(payload)]

        def go() -> list[Any] | None:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.control)
            n = int(max(s.item() for s in sizes))
            buf = _padded(payload, n)
            if self.rank != 0:
                dist.gather(buf, None, dst=self._root(), group=self.control)
                return None
            bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.gather(buf, bufs, dst=self._root(), group=self.control)
            return [decode_frame(b[:int(s.item())]) for b, s in zip(bufs, sizes)]

        return self._run(phase, go)

    def scatter_frames(self, objs: list[Any] | None, phase: str = "scatter") -> Any:
        """Rank 0's ``objs[r]`` on rank r (frames, as ``gather_frames``): each rank receives only
        its own part; an object repeated in the list is encoded once."""
        if self.world_size == 1:
            return decode_frame(encode_frame(objs[0]))

        def go() -> Any:
            sizes = torch.empty(2, dtype=torch.int64)
            bufs = None
            if self.rank == 0:
                payloads = encode_each(objs)
                n = max(len(p) for p in payloads)
                meta = [torch.tensor([len(p), n], dtype=torch.int64) for p in payloads]
                padded: dict[int, torch.Tensor] = {}
                for p in payloads:  # a reply shared by many ranks is padded once
                    if id(p) not in padded:
                        padded[id(p)] = _padded(p, n)
                bufs = [padded[id(p)] for p in payloads]
                dist.scatter(sizes, meta, src=self._root(), group=self.control)
            else:
                dist.scatter(sizes, None, src=self._root(), group=self.control)
            own, n = (int(v) for v in sizes.tolist())
            buf = torch.empty(n, dtype=torch.uint8)
            dist.scatter(buf, bufs, src=self._root(), group=self.control)
            return decode_frame(buf[:own])

        return self._run(phase, go)

    def gather_rows(self, mine: torch.Tensor, counts: list[int] | None, phase: str = "gather rows") -> torch.Tensor | None:
        """Every rank's int64 rows (``[n_r, W]``, the same W everywhere) on rank 0, received in
        place into one ``[sum n_r, W]`` tensor in rank order (None elsewhere). ``counts`` (rank 0
        only): each rank's n_r, known from an earlier message. Point-to-point, so no rank's rows
        are padded to the largest and nothing is copied after it arrives: the coordinator's
        chunk index is filled as ranks report."""
        mine = mine.contiguous()
        if self.world_size == 1:
            return mine
        width = mine.shape[1] if mine.dim() == 2 else 1

        def go() -> torch.Tensor | None:
            if self.rank != 0:
                if mine.numel():
                    dist.send(mine, dst=self._root(), group=self.control)
                return None
            if counts is None or len(counts) != self.world_size:
                raise errmod.ConfigError(f"{phase}: rank 0 needs every rank's row count ({self.world_size}), got "
                                         f"{None if counts is None else len(counts)}")
            out = torch.empty((sum(counts), width), dtype=mine.dtype)
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + c)
            works = []
            for r in range(1, self.world_size):
                if counts[r]:
                    src = dist.get_global_rank(self.control, r) if self.control is not dist.group.WORLD else r
                    works.append(dist.irecv(out[starts[r]:starts[r + 1]], src=src, group=self.control))
            if counts[0]:
                out[:counts[0]] = mine.view(counts[0], width)
            for w in works:
                w.wait()
            return out

        return self._run(phase, go)

    # -- agreement --------------------------------------------------------------------------
    def agree(self, phase: str, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn`` here, gather every rank's value; if any rank failed, raise on all ranks."""
        payload, local_exc = _attempt(phase, fn)
        try:
            gathered = self.all_gather_json(payload, phase)
        except CollectiveTimeoutError as timeout:
            if local_exc is None:
                raise
            # this rank's own failure is the news, not that the peers (busy elsewhere) never came
            kind, message, attrs = payload["err"]
            err = agreed_error(phase, {self.rank: [kind, f"{message} (the other ranks did not reach '{phase}' "
                                                         f"to hear of it: {str(timeout).split(': ', 1)[-1][:200]})",
                                                   attrs]})
            err.partial = True
            raise err from local_exc
        failures = {r: g["err"] for r, g in enumerate(gathered) if "err" in g}
        if failures:
            raise agreed_error(phase, failures) from local_exc
        return [g["ok"] for g in gathered]

    def coordinate(self, phase: str, fn: Callable[[], Any], root: Callable[[list[Any]], list[Any]]) -> Any:
        """Run ``fn`` on every rank; rank 0 receives every value and ``root(values)`` returns one
        reply per rank, which only that rank receives. A failure of any rank's ``fn`` or of
        ``root`` is raised as the same error on every rank. The coordinator pattern: per-rank
        cost stays with the rank's own share, the global work happens once."""
        payload, local_exc = _attempt(phase, fn)
        gathered = self.gather_frames(payload, phase)
        replies = None
        if self.rank == 0:
            failures = [[r, *g["err"]] for r, g in enumerate(gathered) if "err" in g]
            if not failures:
                planned, root_exc = _attempt(phase, lambda: root([g["ok"] for g in gathered]))
                if root_exc is None:
                    boxed: dict[int, dict] = {}  # one envelope per distinct reply: encoded once
                    replies = [boxed.setdefault(id(v), {"ok": v}) for v in planned["ok"]]
                else:
                    local_exc = root_exc
                    failures = [[0, *planned["err"]]]
            del gathered
            if failures:
                replies = [{"err": failures}] * self.world_size
        reply = self.scatter_frames(replies, phase)
        if "err" in reply:
            raise agreed_error(phase, {r: rest for r, *rest in reply["err"]}) from local_exc
        return reply["ok"]

    def agree_root(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and give its value (or its failure) to every rank."""
        payload, local_exc = _attempt(phase, fn) if self.rank == 0 else (None, None)
        got = self.broadcast_json(payload, phase)
        if "err" in got:
            raise agreed_error(phase, {0: got["err"]}) from local_exc
        return got["ok"]


def encode_each(objs: list[Any]) -> list[bytes]:
    """Each object as a frame; an object repeated in the list (the same reply for every rank,
    e.g. a cached save plan's "use your list") is encoded once and returned as the same bytes."""
    done: dict[int, bytes] = {}
    out = []
    for o in objs:
        b = done.get(id(o))
        if b is None:
            b = done[id(o)] = encode_frame(o)
        out.append(b)
    return out


def _attempt(phase: str, fn: Callable[[], Any]) -> tuple[dict, BaseException | None]:
    """Run one rank's step: ({"ok": value}, None) or ({"err": [type name, message, attributes]},
    exception); attributes: the error's ``wire_attrs`` (e.g. a KeyMismatchError's key lists)."""
    try:
        return {"ok": fn()}, None
    except Exception as e:
        log.debug("%s failed here:\n%s", phase, traceback.format_exc())
        attrs = {a: getattr(e, a) for a in getattr(e, "wire_attrs", ()) if hasattr(e, a)}
        return {"err": [type(e).__name__, _describe(e), attrs]}, e


def _padded(payload: bytes, n: int) -> torch.Tensor:
    """``payload`` in a zero-padded uint8 tensor of ``n`` bytes (collectives need equal sizes)."""
    buf = torch.zeros(n, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf


def _tensor_bytes(t: torch.Tensor, n: int) -> bytes:
    from ..core.utils import byte_view

    return bytes(byte_view(t)[:n]) if n else b""


def _describe(e: BaseException) -> str:
    text = str(e)
    return text if isinstance(e, HpdcpError) else f"{type(e).__name__}: {text}"


def agreed_error(phase: str, failures: dict[int, list]) -> HpdcpError:
    """The error every rank raises: the type of the lowest failing rank when it is one of ours."""
    first = failures[min(failures)]
    cls = getattr(errmod, first[0], None)
    messages = {r: f[1] for r, f in failures.items()}
    if not (isinstance(cls, type) and issubclass(cls, HpdcpError)) or cls is DistributedError:
        return DistributedError(phase, messages)
    text = DistributedError(phase, messages).args[0]
    err = cls.__new__(cls)
    Exception.__init__(err, text)
    err.phase, err.failures = phase, dict(sorted(messages.items()))
    # the lowest failing rank's attributes (JSON-carried), so callers can still read e.g. .missing
    for name, value in (first[2] if len(first) > 2 and isinstance(first[2], dict) else {}).items():
        if name in getattr(cls, "wire_attrs", ()):
            setattr(err, name, value)
    return err
