"""What a rank may allocate: targets built from a checkpoint's metadata (a load of a user's
checkpoint, Hugging Face export) are sized by the checkpoint, so the claim is checked against
the machine before memory is taken, and the error says what to change instead of the
allocator's raw ``RuntimeError`` (or the kernel's OOM killer)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from .errors import InsufficientMemoryError


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process can still allocate on ``device``: CUDA's free memory, or the host's
    ``MemAvailable`` (Linux; None where unknown, which skips the check)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_allocation(nbytes: int, device: str | torch.device, what: str, advice: str = "") -> None:
    """Refuse to allocate ``nbytes`` on ``device`` when it has less available; ``what`` names
    the allocation (rank, checkpoint, tensors), ``advice`` what the user can change."""
    have = available_bytes(device)
    if have is not None and nbytes > have:
        raise InsufficientMemoryError(f"{what} needs {_gib(nbytes)} ({nbytes} bytes) on {device}, which has "
                                      f"{_gib(have)} available{'; ' + advice if advice else ''}")


def check_together(comm: Any, nbytes: int, device: str | torch.device, what: str, advice: str = "") -> None:
    """:func:`check_allocation` for every rank of ``comm`` at once, counting the ranks that
    share a host's memory (or a device) together: eight ranks on one host each asking for a
    third of its memory do not fit. A failure is raised on every rank (``comm.agree``)."""
    dev = torch.device(device)
    where = f"{socket.gethostname()}:{dev.type}:{dev.index if dev.type == 'cuda' else ''}"
    needs = comm.agree("memory: gather", lambda: [where, int(nbytes)])

    def check() -> None:
        here = [n for w, n in needs if w == where]
        total = sum(here)
        if total > nbytes:  # the others on this host/device count too
            extra = f" ({len(here)} ranks share it; {_gib(total)} together)"
            have = available_bytes(dev)
            if have is not None and total > have:
                raise InsufficientMemoryError(f"{what} needs {_gib(nbytes)} on {dev}{extra}, which has {_gib(have)} "
                                              f"available{'; ' + advice if advice else ''}")
        check_allocation(nbytes, dev, what, advice)

    comm.agree("memory: check", check)
