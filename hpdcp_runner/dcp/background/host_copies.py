"""Host copies of an async save's state, reused between saves: the thread mode's buffers, and the
base of the process mode's shared-memory ones (``process.SharedHostCopies``)."""

from __future__ import annotations

import contextlib

import torch


class HostCopies:
    """Host buffers reused across saves, keyed by the leaf's path; pinned when the source is CUDA."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0

    def buffer(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        """The host buffer for ``src`` at ``key``: the last save's when shape and dtype match."""
        buf = self._bufs.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            if buf is not None:
                self.nbytes -= buf.numel() * buf.element_size()
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._bufs[key] = buf
            self.nbytes += buf.numel() * buf.element_size()
        return buf

    def copy(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self.buffer(key, src)
        buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        return buf

    def clear(self) -> None:
        self._bufs.clear()
        self.nbytes = 0


class DeferredCopies:
    """Stands in for ``HostCopies`` while a state is staged in the background: ``copy``
    hands out the buffer now (so the staged structure exists at once) and only records the copy;
    ``run`` makes them all later, in another thread. CUDA sources are copied on a stream of
    their own, after an event recorded where ``async_save`` was called (every write the caller
    queued before it is in the copy), and ``run`` returns once they landed."""

    def __init__(self, bufs: HostCopies) -> None:
        self.bufs = bufs
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.event = None
        self.device = None

    def copy(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self.bufs.buffer(key, src)
        self.pending.append((buf, src.detach()))
        return buf

    def mark(self) -> None:
        """In the caller's thread, once staged: where on its CUDA stream the copies start (the
        device of the first CUDA source; a rank's state lives on one device)."""
        self.device = next((src.device for _, src in self.pending if src.device.type == "cuda"), None)
        if self.device is not None:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.device))

    def run(self) -> None:
        """Make every recorded copy."""
        stream = None
        if self.event is not None:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_event(self.event)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for buf, src in self.pending:
                cuda = src.device.type == "cuda"
                if cuda:
                    src.record_stream(stream)  # the caching allocator must not reuse it before the copy
                buf.copy_(src, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()
        self.pending.clear()
