"""Many byte ranges of one file read straight into destination memory, few system calls.

A reshard reads part of a stored chunk: one run of bytes per kept row (a Shard(0) -> Shard(1)
split of a 2048-wide bf16 matrix over 2 ranks keeps 2 KiB of every 4 KiB row). ``read_ranges``
has the kernel copy each run into the destination tensor's own memory: one ``preadv`` covers a
stretch of the file whose iovecs point alternately at destination runs and at a discard buffer
for the gaps, so there is no scratch slab and no second copy; a gap longer than
``call_s * bytes_per_s`` splits the request instead (never read). Whether that, one request per
run, or cache-sized slabs and a strided copy is cheapest for a given part is
:class:`ReadCostModel`'s choice, measured on the machine.

The iovec arrays are built as int64 tensors (no Python object per run) and passed to libc's
``preadv`` through ctypes; where libc has none the same requests go through ``os.preadv``.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
        return _preadv_ptr(fd, table.data_ptr(), table.shape[0], offset)
    views = [memoryview((ctypes.c_char * ln).from_address(a)).cast("B") for a, ln in table.tolist()]
    return os.preadv(fd, views, offset)


SCRATCH_WINDOW = 2 << 20  # slab reads go through a window this size: it stays in the CPU cache for the copy


@dataclass(frozen=True)
class ReadCostModel:
    """What reading part of a chunk costs on this machine, measured (``measured_cost_model``):

    * ``call_s``: one read request (system call and the Python around it);
    * ``run_s``: one more run in a vectored request (its iovec and the gap's iovec after it);
    * ``bytes_per_s``: bytes delivered by the storage (page cache, or a throttle/network cap);
    * ``copy_bytes_per_s``: a strided copy out of a cache-warm scratch window.

    Three ways to read ``n`` runs of ``run`` bytes spread over ``span`` bytes (:meth:`choose`):
    ``exact`` (one request per run, only the kept bytes), ``through`` (vectored requests into the
    destination, gaps read into a discard buffer) and ``slab`` (whole windows into a scratch
    buffer, then one strided copy). A gap inside ``through`` is read when cheaper than a request
    (:attr:`gap_bytes`)."""

    call_s: float
    run_s: float
    bytes_per_s: float
    copy_bytes_per_s: float

    @property
    def gap_bytes(self) -> int:
        return max(0, int(self.call_s * self.bytes_per_s))

    def capped(self, bytes_per_s: float | None) -> "ReadCostModel":
        """The same calls against storage that delivers at most ``bytes_per_s`` (a throttle, a
        network link): bytes cost more, so fewer gaps are worth reading."""
        if not bytes_per_s or bytes_per_s >= self.bytes_per_s:
            return self
        return dataclasses.replace(self, bytes_per_s=float(bytes_per_s))

    def costs(self, n: int, run: int, span: int) -> dict[str, float]:
        kept = n * run
        per_request = (IOV_MAX - 2) // 2
        return {"exact": n * self.call_s + kept / self.bytes_per_s,
                "through": -(-n // per_request) * self.call_s + n * self.run_s + span / self.bytes_per_s,
                "slab": -(-span // SCRATCH_WINDOW) * self.call_s + span / self.bytes_per_s
                + kept / self.copy_bytes_per_s}

    def choose(self, n: int, run: int, span: int) -> str:
        c = self.costs(n, run, span)
        return min(c, key=c.__getitem__)


_MEASURED: ReadCostModel | None = None


def measured_cost_model() -> ReadCostModel:
    """Measured once per process (~50 ms) on a scratch file in the page cache, through the same
    read path the loads use: small requests, a large one, vectored runs against one iovec, and
    the strided copy out of a window."""
    global _MEASURED
    if _MEASURED is None:
        _MEASURED = _measure()
    return _MEASURED


def _measure(big: int = 16 << 20) -> ReadCostModel:
    """Each strategy timed on a pattern of its own through ``read_ranges`` (the loads' path),
    destinations larger than the CPU cache; the best of a few tries of each."""
    dest = torch.empty(big, dtype=torch.uint8)
    dest.fill_(0)  # touched: page faults are not a read cost
    sink = Sink()
    with tempfile.TemporaryFile() as f:
        f.write(bytes(big))
        f.flush()
        fd = f.fileno()
        whole = torch.tensor([[dest.data_ptr(), big]], dtype=torch.int64)
        _preadv_table(fd, whole, 0)  # in the page cache from here on
        bytes_per_s = big / max(min(_timed(lambda: _preadv_table(fd, whole, 0)) for _ in range(3)), 1e-9)

        def ranges(run: int, n: int, gap_bytes: int) -> float:
            offs = torch.arange(n, dtype=torch.int64) * 2 * run
            addrs = dest.data_ptr() + torch.arange(n, dtype=torch.int64) * run
            return min(_timed(lambda: read_ranges(fd, offs, run, addrs, gap_bytes=gap_bytes, sink=sink, name="",
                                                  what="", file_size=big)) for _ in range(3))
        n = 256  # exact: 4 KiB runs, each its own request
        call_s = max((ranges(4096, n, 0) - n * 4096 / bytes_per_s) / n, 1e-7)
        n = big // 1024  # through: 512-byte runs and gaps over the whole file
        calls = -(-n // ((IOV_MAX - 2) // 2))
        run_s = max((ranges(512, n, 1 << 20) - big / bytes_per_s - calls * call_s) / n, 1e-9)
    # slab: the strided copy of half of each 2-KiB row out of a cache-warm window into a big destination
    win = torch.zeros(SCRATCH_WINDOW, dtype=torch.uint8).view(-1, 2048)
    out = dest.view(-1, 1024)

    def copies() -> None:
        for i in range(0, out.shape[0], win.shape[0]):
            out[i:i + win.shape[0]].copy_(win[:, :1024])
    copy_bytes_per_s = big / max(min(_timed(copies) for _ in range(3)), 1e-9)
    return ReadCostModel(call_s, run_s, bytes_per_s, copy_bytes_per_s)


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
    base = table.data_ptr()
    for a, e0, e1, total in zip(offs[starts].tolist(), entry_start.tolist(), entry_stop.tolist(), spans.tolist()):
        done = _preadv_ptr(fd, base + 16 * e0, e1 - e0, a)
        if done < total:
            _finish_request(fd, table[e0:e1], a, total, done, name, what)
        stats.calls += 1
        stats.bytes_read += total
    return stats


def _preadv_ptr(fd: int, ptr: int, count: int, offset: int) -> int:
    """``preadv`` of ``count`` iovecs at address ``ptr`` (rows of an int64 table)."""
    if _PREADV is not None:
        while True:
            n = _PREADV(fd, ptr, count, offset)
            if n >= 0:
                return n
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise OSError(e, os.strerror(e))
    table = torch.frombuffer((ctypes.c_int64 * (2 * count)).from_address(ptr), dtype=torch.int64).view(count, 2)
    return _preadv_table(fd, table, offset)


def _finish_request(fd: int, table: torch.Tensor, offset: int, total: int, done: int, name: str, what: str) -> None:
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
