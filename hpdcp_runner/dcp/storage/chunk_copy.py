"""How one read request's bytes get from a checkpoint file into its destination: the part of
``CheckpointReader`` that copies and verifies (the reader plans the reads, keeps the open files
and the pin; this is handed an open handle and a request).

A whole chunk goes straight into a contiguous destination and is verified against its checksum.
Part of a chunk: with checksums on, the blocks it touches are read window by window into a
cache-sized scratch buffer, verified, and the part copied out; with checksums off (or a format
without them) the measured cost model picks exact runs or vectored requests straight into the
destination (``vectored.read_ranges``, where the storage has descriptors), or slabs."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch

from ..core.errors import CorruptCheckpointError
from ..core.geometry import Box, flat_span, row_major_strides, run_dim, run_starts, runs_contiguous_in
from ..core.utils import byte_view
from ..format.metadata import element_size
from ..format.safetensors_io import digest
from .checkpoint_files import CheckpointFiles
from .interfaces import IOCounters, ReadRequest
from .vectored import SCRATCH_WINDOW, ReadCostModel, Sink, check_destination, measured_cost_model, read_ranges


class ChunkCopier:
    """Copies requests out of open files of one checkpoint (``files``), counting into the
    reader's ``counters`` and paced by its ``throttle``."""

    def __init__(self, files: CheckpointFiles, counters: IOCounters, *, throttle: Any, verify_checksums: bool,
                 read_gap_bytes: int | None, max_request_bytes: int, block_bytes: Callable[[], int]) -> None:
        """``block_bytes``: the attached metadata's block size (asked when a request needs it)."""
        self.files, self.counters, self.throttle = files, counters, throttle
        self.verify_checksums = verify_checksums
        self.read_gap_bytes, self.max_request_bytes = read_gap_bytes, max_request_bytes
        self.block_bytes = block_bytes
        self._sink = Sink()
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def full(self, name: str) -> str:
        """The file ``name`` of this checkpoint as errors name it."""
        return f"{self.files.url.rstrip('/')}/{name}"

    def copy(self, fd: Any, name: str, offset: int, nbytes: int, r: ReadRequest, dt: torch.dtype) -> None:
        """One request from the open file ``fd``: ``offset``/``nbytes`` is the flat span of its
        part in the file."""
        if not self.verify_checksums:
            self._read_unverified(fd, name, r, dt)
            return
        whole_chunk = r.sub.sizes == r.chunk.sizes
        dest = r.dest
        direct = whole_chunk and dest.device.type == "cpu" and dest.dtype == dt and dest.is_contiguous()
        hexes = r.chunk.blocks
        if direct:  # the whole chunk into its destination, then its checksum
            view = byte_view(dest)
            self.check_bounds(fd, name, r, offset, nbytes)
            self.pread(fd, offset, view, name=name)
            self.count(nbytes, 1)
            self.verify(name, r, view)
        elif hexes:
            self._read_windows(fd, name, r, dt, hexes)
        else:  # a chunk of one block (or written before block digests): read whole, verify, copy
            chunk_bytes = r.chunk.box.numel * element_size(r.dtype)
            self.check_bounds(fd, name, r, r.chunk.byte_offset, chunk_bytes)
            buf = self.scratch_view(chunk_bytes)
            view = byte_view(buf)
            self.pread(fd, r.chunk.byte_offset, view, name=name)
            self.count(chunk_bytes, 1)
            self.verify(name, r, view)
            start = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)[0]
            dest.copy_(buf.view(dt).as_strided(r.sub.sizes, row_major_strides(r.chunk.sizes), start))

    def scratch_view(self, nbytes: int) -> torch.Tensor:
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def pread(self, fd: Any, offset: int, view: memoryview, *, name: str) -> None:
        """Fill ``view`` from the file ``fd`` (a handle the reader opened) at ``offset``: the one
        place bytes come from."""
        self.files.pread_into(fd, offset, view, name)

    def file_size(self, fd: Any) -> int:
        return self.files.size(fd)

    def count(self, nbytes: int, calls: int) -> None:
        self.counters.bytes_read += nbytes
        self.counters.reads += calls
        if self.throttle:
            self.throttle.take(nbytes)

    def check_bounds(self, fd: int, name: str, r: ReadRequest, offset: int, nbytes: int) -> None:
        size = self.file_size(fd)
        if offset < 0 or offset + nbytes > size:
            raise CorruptCheckpointError(f"{self.full(name)}: chunk {r.chunk.key!r}: a read at offset "
                                         f"{offset} of {nbytes} bytes would end past the file's {size} bytes "
                                         f"(truncated file or bad metadata)")

    def verify(self, name: str, r: ReadRequest, view: memoryview) -> None:
        if digest(view) != r.chunk.checksum:
            raise CorruptCheckpointError(f"checkpoint file {self.full(name)}: key {r.chunk.key!r} "
                                         f"fails its checksum (corrupted data)")
        self.counters.chunks_verified += 1

    def cost_model(self) -> ReadCostModel:
        """The measured read costs of this machine, bytes capped at the throttle's rate."""
        return measured_cost_model().capped(self.throttle.rate if self.throttle else None)

    def strategy(self, n: int, run: int, span: int) -> tuple[str, int]:
        """How to read ``n`` runs of ``run`` bytes over ``span`` bytes: ``exact``, ``through`` (with
        the largest gap read through) or ``slab`` (see ``vectored.ReadCostModel``). An explicit
        ``read_gap_bytes`` decides alone: 0 is exact, more is through."""
        if n <= 1:
            return "exact", 0
        if self.read_gap_bytes is not None:
            return ("exact", 0) if self.read_gap_bytes == 0 else ("through", self.read_gap_bytes)
        model = self.cost_model()
        how = model.choose(n, run, span)
        return how, model.gap_bytes if how == "through" else 0

    def _read_unverified(self, fd: int, name: str, r: ReadRequest, dt: torch.dtype) -> None:
        """Checksums off, or a format without them: the cheapest of exact runs, vectored requests
        reading short gaps through, or cache-sized slabs and a strided copy, by the measured cost
        model. Exact and through land in the destination itself; destinations they cannot land in
        (another dtype or device, runs not contiguous there) take slabs."""
        esize = element_size(r.dtype)
        dest = r.dest
        nd = len(r.chunk.sizes)
        k = run_dim(r.sub.sizes, r.chunk.sizes) if nd else 0
        strides = row_major_strides(r.chunk.sizes)
        run = (r.sub.sizes[k] * strides[k] if nd else 1) * esize
        n = r.sub.numel * esize // run if run else 0
        start, stop = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)
        vfd = self.files.vectored_fd(fd)  # (a storage without descriptors reads slabs)
        how, gap = self.strategy(n, run, (stop - start) * esize) if vfd is not None else ("slab", 0)
        into = dest.device.type == "cpu" and dest.dtype == dt and runs_contiguous_in(dest, k)
        if how == "slab" or not into:
            self.counters.bump("partial_reads_slab", 1)
            self._read_windows(fd, name, r, dt, "")
            return
        self.counters.bump(f"partial_reads_{how}", 1)
        starts = run_starts(r.sub.offsets, r.sub.sizes, strides, k)
        what = f"chunk {r.chunk.key!r}"
        full = self.full(name)
        addrs = check_destination(dest, run_starts((0,) * nd, r.sub.sizes, dest.stride(), k) * esize, run,
                                  name=full, what=what)
        st = read_ranges(vfd, r.chunk.byte_offset + starts * esize, run, addrs, gap_bytes=gap, sink=self._sink,
                         name=full, what=what, file_size=self.file_size(fd),
                         max_request_bytes=self.max_request_bytes)
        self.count(st.bytes_read, st.calls)

    def _windows(self, r: ReadRequest, esize: int) -> Iterator[tuple[Box, torch.Tensor]]:
        """The sub-box in slices of whole dim-0 indices whose span in the chunk is at most a
        scratch window (``SCRATCH_WINDOW``, or ``max_request_bytes`` if smaller; at least one
        index), each with its part of the destination: what bounds the scratch buffer and keeps
        it in the CPU cache for the copy out."""
        if not r.sub.sizes:
            yield r.sub, r.dest
            return
        per = max(1, math.prod(r.chunk.sizes[1:]) * esize)
        step = max(1, min(SCRATCH_WINDOW, self.max_request_bytes) // per)
        o0, n0 = r.sub.offsets[0], r.sub.sizes[0]
        for i in range(0, n0, step):
            m = min(step, n0 - i)
            yield Box((o0 + i, *r.sub.offsets[1:]), (m, *r.sub.sizes[1:])), r.dest.narrow(0, i, m)

    def _read_windows(self, fd: int, name: str, r: ReadRequest, dt: torch.dtype, hexes: str) -> None:
        """Window by window (:meth:`_windows`): read the window's span into the scratch buffer,
        then copy its part out (one strided copy, casting or moving to the destination's device
        as needed). With ``hexes`` (the chunk's block digests) every byte copied is verified:
        the read covers the whole blocks the window touches and each block is read and checked
        once (a block two windows share stays in the scratch buffer). That costs the blocks'
        extra bytes: up to a block at each end of a row range, the whole chunk for a column
        split."""
        esize = element_size(r.dtype)
        chunk_bytes = r.chunk.box.numel * esize
        block = self.block_bytes() if hexes else 0
        strides = row_major_strides(r.chunk.sizes)
        full = self.full(name)
        parts = list(self._windows(r, esize))
        spans = [flat_span(p.offsets, p.sizes, r.chunk.sizes) for p, _ in parts]
        cap = max((stop - start) * esize for start, stop in spans) + 2 * block
        scratch = self.scratch_view(min(cap, chunk_bytes))  # one buffer for every window
        have_lo = have_hi = 0  # the chunk bytes the scratch holds (verified when ``block``)
        for (part, view), (start, stop) in zip(parts, spans):
            lo, hi = start * esize, stop * esize
            if block:
                lo, hi = lo // block * block, min(-(-hi // block) * block, chunk_bytes)
            keep = min(max(0, have_hi - lo), hi - lo) if lo >= have_lo else 0  # the last window's (verified) tail
            if keep:
                scratch[:keep].copy_(scratch[lo - have_lo:have_hi - have_lo].clone())
            if hi > lo + keep:
                self.check_bounds(fd, name, r, r.chunk.byte_offset + lo + keep, hi - lo - keep)
                self.pread(fd, r.chunk.byte_offset + lo + keep, byte_view(scratch[keep:hi - lo]), name=name)
                self.count(hi - lo - keep, 1)
            if block:
                bview = byte_view(scratch[:hi - lo])
                for b in range((lo + keep) // block, -(-hi // block)):
                    piece = bview[b * block - lo:min((b + 1) * block, hi) - lo]
                    if digest(piece) != hexes[16 * b:16 * b + 16]:
                        raise CorruptCheckpointError(
                            f"checkpoint file {full}: key {r.chunk.key!r} fails the checksum of its block {b} (bytes "
                            f"{r.chunk.byte_offset + b * block}..{r.chunk.byte_offset + b * block + len(piece)}; "
                            f"corrupted data)")
                self.counters.chunks_verified += 1
            have_lo, have_hi = lo, hi
            view.copy_(scratch[:hi - lo].view(dt).as_strided(part.sizes, strides, start - lo // esize))
