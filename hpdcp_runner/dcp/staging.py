"""Host staging buffers for async saves, reused between saves (the thread mode's, and the base of
the process mode's shared-memory staging in ``persister.py``)."""

from __future__ import annotations

import torch


class StagingBuffers:
    """Host buffers reused across saves, keyed by the leaf's path; pinned when the source is CUDA."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0

    def copy(self, key: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            if buf is not None:
                self.nbytes -= buf.numel() * buf.element_size()
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._bufs[key] = buf
            self.nbytes += buf.numel() * buf.element_size()
        buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        return buf

    def clear(self) -> None:
        self._bufs.clear()
        self.nbytes = 0
