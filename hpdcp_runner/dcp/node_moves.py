"""Files moving between the nodes' leaders of a node-local tier (``node_tier``): in blocks over
the job's process group, or read from the durable tier's copy; each verified as it arrives, or
only the byte ranges a node's ranks read; every pair of nodes at once.

Both sides keep one block in flight while they work on the next (two buffers each): the sender
reads block i+1 while block i is sent, the receiver writes and hashes block i while block i+1
arrives. The receiver computes the file's checksum from the blocks as they pass, so a file is
verified without being read again once it has landed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from .comm.collectives import Comm
from .core.errors import CorruptCheckpointError, HpdcpError, MetadataError
from .core.rafile import as_random_access
from .format.metadata import METADATA_FILE, check_file_name
from .format.stream_digest import FileDigest
from .storage.posix.commit import fsync_dir

BLOCK = 8 << 20
RANGES_SUFFIX = ".ranges"


def _blocks(size: int, spans: Iterable[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """(offset, length) of each block that moves: the whole file, or only ``spans`` of it."""
    return [(pos, min(BLOCK, hi - pos)) for lo, hi in (spans if spans is not None else [(0, size)])
            for pos in range(lo, min(hi, size), BLOCK)]


def send_file(path: str, size: int, dst: int, group: Any, spans: Any = None) -> None:
    """Send ``size`` bytes of ``path`` (or its ``spans``) in blocks. A file that cannot be read
    to its end still sends every block (zeros for what is missing: the receiver's checksum
    refuses them) and then raises, so the two sides never fall out of step and leave the peer
    waiting for a timeout."""
    err: BaseException | None = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        fd, err = None, e
    blocks = _blocks(size, spans)
    bufs = [torch.empty(max((n for _, n in blocks), default=0), dtype=torch.uint8) for _ in range(min(2, len(blocks)))]
    sending = None
    try:
        for i, (pos, n) in enumerate(blocks):
            view = bufs[i % 2][:n]  # read into, sent from: no copy between
            got = 0
            if err is None:
                try:
                    got = os.preadv(fd, [memoryview(view.numpy())], pos)
                    if got < n:
                        err = CorruptCheckpointError(f"{path}: ended at {pos + got} of {size} bytes while being sent")
                except OSError as e:
                    err = e
            if got < n:
                view[got:].zero_()
            if sending is not None:
                sending.wait()
            sending = dist.isend(view, dst=dst, group=group)
        if sending is not None:
            sending.wait()
    finally:
        if fd is not None:
            os.close(fd)
    if err is not None:
        raise err


class _Sha256:
    """``metadata.json``'s checksum in ``_expected``: its SHA-256, as the coordinator wrote it."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, block: Any) -> None:
        self._h.update(block)

    def hexdigest(self) -> str:
        return "sha256:" + self._h.hexdigest()


def checker(name: str, size: int) -> Any:
    return _Sha256() if name == METADATA_FILE else FileDigest(name, size)


def recv_file(path: str | None, size: int, src: int, group: Any, check: Any = None, fsync: bool = False,
               spans: Any = None) -> None:
    """Receive ``size`` bytes (or ``spans`` of them, each at its offset in a file of ``size``
    bytes, holes between) into the new file ``path`` (None: discard them), each block given to
    ``check.update`` as it arrives (``fsync``: the file synced once whole). Every block is
    received even when writing fails (the error is raised at the end), as in ``send_file``."""
    err: BaseException | None = None
    f = None
    if path is not None:
        try:
            f = open(path, "xb")
        except OSError as e:
            err = e
    blocks = _blocks(size, spans)
    bufs = [torch.empty(max((n for _, n in blocks), default=0), dtype=torch.uint8) for _ in range(min(2, len(blocks)))]
    try:
        coming = dist.irecv(bufs[0][:blocks[0][1]], src=src, group=group) if blocks else None
        for i, (pos, n) in enumerate(blocks):
            coming.wait()
            if i + 1 < len(blocks):
                coming = dist.irecv(bufs[(i + 1) % 2][:blocks[i + 1][1]], src=src, group=group)
            data = memoryview(bufs[i % 2][:n].numpy())
            if f is not None and err is None:
                try:
                    if spans is not None:
                        f.seek(pos)
                    f.write(data)
                    if check is not None:
                        check.update(data)
                except (OSError, HpdcpError) as e:
                    err = e
        if f is not None and err is None:
            if spans is not None:
                f.truncate(size)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
    if err is not None:
        raise err


def ranges_name(name: str) -> str:
    """Where a node-local restore keeps the ranges of ``name`` its ranks read (a hidden name: a
    file with holes is never under the checkpoint's name, and never counts as held)."""
    return f".{check_file_name(name)}{RANGES_SUFFIX}"


def land(directory: str, name: str, size: int, checksum: str, receive: Any, fsync: bool,
          ranged: bool = False) -> None:
    """Receive one file into ``directory`` under a hidden name (``receive(path, check)`` writes it,
    giving every byte to ``check``), compare its checksum with the recorded one, then give it its
    name: a file that differs never takes it. ``ranged``: only some ranges of it were received;
    there is no whole file to check, it takes ``ranges_name(name)`` (each chunk in it is checked
    as the load reads it)."""
    part = os.path.join(directory, f".{name}.part-{uuid.uuid4().hex[:8]}")
    try:
        check = None if ranged else checker(name, size)
        receive(part, check)
        got = check.hexdigest() if check is not None else checksum
        if got != checksum:
            what = "the metadata.json agreed" if name == METADATA_FILE else "metadata.json"
            raise CorruptCheckpointError(f"{os.path.join(directory, name)}: checksum {got} of the copy received "
                                         f"differs from the {checksum} {what} records; not kept")
        os.rename(part, os.path.join(directory, ranges_name(name) if ranged else check_file_name(name)))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise
    if fsync:
        fsync_dir(directory)


@dataclass(frozen=True)
class Move:
    """One file moving to a node: sent by rank ``src`` (a node's leader; None: read from the
    durable copy) to rank ``dst`` (``spans``: only those byte ranges of it)."""

    name: str
    src: int | None
    dst: int
    spans: tuple[tuple[int, int], ...] | None = None


def run_moves(comm: Comm, moves: Sequence[Move], send: Any, receive: Any, phase: str) -> None:
    """Every move of ``moves`` (the same list, in the same order, on every rank): this rank sends
    its moves in a thread of its own while it receives its own, so every pair of nodes moves at
    once, each in the list's order (the earliest unfinished move always has both ends ready: no
    wait can close a cycle). A file this rank receives and sends on is sent once it has landed.
    A failed file does not stop the rest (both ends still move every block); the first failure
    is raised on every rank, once all have run."""
    outgoing = [m for m in moves if m.src == comm.rank]
    incoming = [m for m in moves if m.dst == comm.rank]
    landed = {m.name: threading.Event() for m in incoming}
    errors: list[BaseException] = []

    def sending() -> None:
        for m in outgoing:
            if m.name in landed:
                landed[m.name].wait()
            try:
                send(m)
            except BaseException as e:  # (kept for the agreement: this thread must not die silently)
                errors.append(e)

    def run() -> None:
        thread = threading.Thread(target=sending, name="hpdcp-node-send", daemon=True) if outgoing else None
        if thread is not None:
            thread.start()
        try:
            for m in incoming:
                try:
                    receive(m)
                except (HpdcpError, OSError) as e:
                    errors.append(e)
                finally:
                    landed[m.name].set()
        finally:
            if thread is not None:
                thread.join()
        if errors:
            raise errors[0]

    comm.agree(phase, run)


def copy_from(durable: Any, name: str, size: int, dest: str, check: Any, spans: Any = None) -> None:
    """The durable copy's file ``name`` (or its ``spans``, at their offsets) into ``dest``."""
    if durable is None:
        raise MetadataError(f"{name}: no node holds it and there is no durable copy to read it from")
    raf = as_random_access(durable.open_file(name))
    try:
        with open(dest, "xb") as f:
            for pos, n in _blocks(size, spans):
                block = raf.pread(n, pos)
                if len(block) != n:
                    raise CorruptCheckpointError(f"{durable.checkpoint_id}/{name}: ended at {pos + len(block)} of "
                                                 f"{size} bytes")
                f.seek(pos)
                f.write(block)
                if check is not None:
                    check.update(block)
            f.truncate(size)
    finally:
        raf.close()
