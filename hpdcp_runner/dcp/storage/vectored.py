"""Many byte ranges of one file read straight into destination memory, few system calls.

A reshard reads part of a stored chunk: one run of bytes per kept row (a Shard(0) -> Shard(1)
split of a 2048-wide bf16 matrix over 2 ranks keeps 2 KiB of every 4 KiB row). Each run is
copied by the kernel into the destination tensor's own memory: one ``preadv`` covers a stretch
of the file whose iovecs point alternately at destination runs and at a discard buffer for the
gaps between them, so there is no scratch slab and no second copy. Whether a gap is read through
(one request, its bytes discarded) or the request split there (one more call, the gap's bytes
never read) is a cost model measured on the machine: reading through costs ``gap / bytes_per_s``,
splitting costs ``call_s``; gaps up to ``call_s * bytes_per_s`` are read through.

The iovec arrays are built as int64 tensors (no Python object per run) and passed to libc's
``preadv`` through ctypes; where libc has none the same requests go through ``os.preadv``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from ..core.errors import CorruptCheckpointError

IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # the most one read request carries (bounds outstanding read bytes)


def _libc_preadv():
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_longlong) != 8:
        return None  # the iovec table below is two 64-bit words per entry
    try:
        fn = ctypes.CDLL(None, use_errno=True).preadv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
    fn.restype = ctypes.c_ssize_t
    return fn


_PREADV = _libc_preadv()


def _preadv_table(fd: int, table: torch.Tensor, offset: int) -> int:
    """One ``preadv`` of the iovecs in ``table`` (an ``[n, 2]`` int64 tensor of address, length)."""
    if _PREADV is not None:
        while True:
            n = _PREADV(fd, table.data_ptr(), table.shape[0], offset)
            if n >= 0:
                return n
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise OSError(e, os.strerror(e))
    views = [memoryview((ctypes.c_char * ln).from_address(a)).cast("B") for a, ln in table.tolist()]
    return os.preadv(fd, views, offset)


@dataclass(frozen=True)
class ReadCostModel:
    """What one read request costs on this machine: ``call_s`` per request (system call and
    Python around it) plus ``1 / bytes_per_s`` per byte. A gap between two wanted ranges is read
    through when reading it is cheaper than another request."""

    call_s: float
    bytes_per_s: float

    @property
    def gap_bytes(self) -> int:
        return max(0, int(self.call_s * self.bytes_per_s))

    def capped(self, bytes_per_s: float | None) -> "ReadCostModel":
        """The same calls against storage that delivers at most ``bytes_per_s`` (a throttle, a
        network link): bytes cost more, so fewer gaps are worth reading."""
        if not bytes_per_s or bytes_per_s >= self.bytes_per_s:
            return self
        return ReadCostModel(self.call_s, float(bytes_per_s))


_MEASURED: ReadCostModel | None = None


def measured_cost_model() -> ReadCostModel:
    """Measured once per process (~20 ms) on a scratch file in the page cache: many small reads
    against a few large ones through the same read path the loads use."""
    global _MEASURED
    if _MEASURED is None:
        _MEASURED = _measure()
    return _MEASURED


def _measure(small: int = 4096, count: int = 256, big: int = 16 << 20) -> ReadCostModel:
    buf = torch.empty(big, dtype=torch.uint8)
    with tempfile.TemporaryFile() as f:
        f.write(bytes(big))
        f.flush()
        fd = f.fileno()
        whole = torch.tensor([[buf.data_ptr(), big]], dtype=torch.int64)
        _preadv_table(fd, whole, 0)  # in the page cache from here on
        best_big = min(_timed(lambda: _preadv_table(fd, whole, 0)) for _ in range(4))
        tables = [torch.tensor([[buf.data_ptr() + i * small, small]], dtype=torch.int64) for i in range(count)]

        def smalls() -> None:
            for i, t in enumerate(tables):
                _preadv_table(fd, t, 2 * i * small)
        best_small = min(_timed(smalls) for _ in range(3))
    bytes_per_s = big / max(best_big, 1e-9)
    call_s = max(best_small / count - small / bytes_per_s, 1e-7)
    return ReadCostModel(call_s, bytes_per_s)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class ReadStats:
    bytes_read: int = 0  # bytes the kernel delivered, discarded gaps included
    calls: int = 0


def read_ranges(fd: int, file_offsets: torch.Tensor, length: int, addrs: torch.Tensor, *, gap_bytes: int,
                sink: "Sink", name: str, what: str, file_size: int,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> ReadStats:
    """Read ``length`` bytes at each of ``file_offsets`` (ascending, non-overlapping) into the
    memory at ``addrs``; gaps up to ``gap_bytes`` are read through into ``sink``. Requests carry
    at most ``IOV_MAX`` iovecs and about ``max_request_bytes``. ``what`` names the chunk in errors.

    The caller guarantees ``addrs[i] .. addrs[i] + length`` is memory it owns (see
    :func:`check_destination`); the file side is checked here."""
    stats = ReadStats()
    n = file_offsets.numel()
    if n == 0 or length == 0:
        return stats
    offs = file_offsets.to(torch.int64)
    addrs = addrs.to(torch.int64)
    lens = torch.full((n,), length, dtype=torch.int64)
    piece = max(1, max_request_bytes // 2)
    if length > piece:  # one range longer than a request: split it
        parts = -(-length // piece)
        step = torch.arange(parts, dtype=torch.int64) * piece
        offs = (offs[:, None] + step).flatten()
        addrs = (addrs[:, None] + step).flatten()
        lens = torch.minimum(torch.full_like(step, piece), length - step).repeat(n)
        n = offs.numel()
    ends = offs + lens
    if int(offs[0]) < 0 or int(ends[-1]) > file_size:
        bad = int(offs[0]) if int(offs[0]) < 0 else int(offs[(ends > file_size).nonzero()[0, 0]])
        raise CorruptCheckpointError(f"{name}: {what}: a read at offset {bad} would end past the file's "
                                     f"{file_size} bytes (truncated file or bad metadata)")
    gaps = offs[1:] - ends[:-1]
    if n > 1 and int(gaps.min()) < 0:
        k = int((gaps < 0).nonzero()[0, 0])
        raise CorruptCheckpointError(f"{name}: {what}: read ranges overlap or are out of order at offset "
                                     f"{int(offs[k + 1])}")
    # batches: split at gaps not worth reading, and so that no request exceeds IOV_MAX iovecs
    # (each range brings at most itself and one gap) or ~max_request_bytes
    split = torch.zeros(n, dtype=torch.bool)
    split[0] = True
    if n > 1:
        split[1:] = gaps > gap_bytes
    group = torch.cumsum(split.to(torch.int64), 0)
    first_of_group = torch.nonzero(split).flatten()
    idx_in_group = torch.arange(n) - first_of_group[group - 1]
    base_of_group = offs[first_of_group][group - 1]
    key = (idx_in_group // ((IOV_MAX - 2) // 2), (offs - base_of_group) // piece)
    new = split.clone()
    if n > 1:
        new[1:] |= (key[0][1:] != key[0][:-1]) | (key[1][1:] != key[1][:-1])
    starts = torch.nonzero(new).flatten()
    stops = torch.cat([starts[1:], torch.tensor([n])])
    last = torch.zeros(n, dtype=torch.bool)
    last[stops - 1] = True
    gap_after = torch.zeros(n, dtype=torch.int64)
    if n > 1:
        gap_after[:-1] = gaps
    gap_after[last] = 0
    sink_addr = sink.address(int(gap_after.max()))
    table = torch.empty((n, 2, 2), dtype=torch.int64)
    table[:, 0, 0], table[:, 0, 1] = addrs, lens
    table[:, 1, 0], table[:, 1, 1] = sink_addr, gap_after
    table = table.view(2 * n, 2)
    keep = table[:, 1] > 0
    table = table[keep].contiguous()
    entry_start = (torch.cumsum(keep.to(torch.int64), 0) - keep.to(torch.int64))[2 * starts]
    entry_stop = torch.cat([entry_start[1:], torch.tensor([table.shape[0]])])
    spans = ends[stops - 1] - offs[starts]
    for a, e0, e1, total in zip(offs[starts].tolist(), entry_start.tolist(), entry_stop.tolist(), spans.tolist()):
        _read_request(fd, table[e0:e1], a, total, name, what)
        stats.calls += 1
        stats.bytes_read += total
    return stats


def _read_request(fd: int, table: torch.Tensor, offset: int, total: int, name: str, what: str) -> None:
    done = _preadv_table(fd, table, offset)
    while done < total:  # a short read: EOF (a damaged file) or an interrupted call; go on from there
        cum = torch.cumsum(table[:, 1], 0)
        i = int(torch.searchsorted(cum, done, right=True))
        rest = table[i:].clone()
        used = done - (int(cum[i - 1]) if i else 0)
        rest[0, 0] += used
        rest[0, 1] -= used
        more = _preadv_table(fd, rest, offset + done)
        if more == 0:
            raise CorruptCheckpointError(f"{name}: {what}: unexpected end of file at offset {offset + done} "
                                         f"reading {total} bytes from offset {offset} (truncated?)")
        table, total, offset, done = rest, total - done, offset + done, more


class Sink:
    """The discard buffer gaps are read into (shared by every gap of a request: their bytes are
    never used), grown on demand and kept by the reader."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def address(self, nbytes: int) -> int:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf.data_ptr()


def check_destination(dest: torch.Tensor, rel_offsets: torch.Tensor, length: int, *, name: str,
                      what: str) -> torch.Tensor:
    """Absolute addresses of ``dest``'s runs (byte offsets ``rel_offsets`` from its first
    element), refused unless every run lies inside ``dest``'s own storage: a read never writes
    memory the destination does not own."""
    storage = dest.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    addrs = dest.data_ptr() + rel_offsets.to(torch.int64)
    if addrs.numel() and (int(addrs.min()) < lo or int(addrs.max()) + length > hi):
        raise CorruptCheckpointError(f"{name}: {what}: the read ranges do not fit the destination tensor "
                                     f"({addrs.numel()} runs of {length} bytes)")
    return addrs
