"""The reader of a checkpoint's files, on any storage: planning of reads, partial-chunk windows,
checksum verification and the open-file LRU, with the bytes coming from a ``CheckpointFiles``
(a pinned local directory, a prefix in a store) that the reader holds, not inherits."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..core import faults
from ..core.errors import ConfigError, CorruptCheckpointError
from ..core.geometry import Box, flat_span
from ..core.rafile import RandomAccessFile
from ..core.utils import rank_of_env
from ..format import jsondoc
from ..format import objects as objcodec
from ..format.metadata import (DEFAULT_MAX_METADATA_BYTES, METADATA_FILE, ChunkMeta, Metadata, ObjectMeta,
                               dtype_from_name, element_size)
from ..format.safetensors_io import digest
from .checkpoint_files import CheckpointFiles
from .interfaces import IOCounters, ReadRequest, StorageReader
from .chunk_copy import ChunkCopier
from .vectored import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_FILES_KEPT = 8


class _TokenBucket:
    """Caps throughput at ``rate`` bytes/s with a one-second burst."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self.tokens, self.last = self.rate, time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


@dataclass(frozen=True)
class ReaderOptions:
    """The reader's knobs (every format, every store), validated once (the runner builds one from
    its config); ``open_reader(path, fmt, **options.kwargs())``."""

    files_kept: int = DEFAULT_FILES_KEPT
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
    verify_checksums: bool = True
    shared_storage: bool = False
    max_read_bytes_per_s: int | None = None
    read_gap_bytes: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.files_kept < 1:
            raise ConfigError(f"files_kept must be >= 1, got {self.files_kept}")
        if self.max_read_bytes_per_s is not None and self.max_read_bytes_per_s <= 0:
            raise ConfigError(f"max_read_bytes_per_s must be positive, got {self.max_read_bytes_per_s}")
        if self.read_gap_bytes is not None and self.read_gap_bytes < 0:
            raise ConfigError(f"read_gap_bytes must be >= 0, got {self.read_gap_bytes}")
        if self.max_request_bytes < 4096:
            raise ConfigError(f"max_request_bytes must be >= 4096, got {self.max_request_bytes}")
        if self.max_metadata_bytes < 1:
            raise ConfigError(f"max_metadata_bytes must be >= 1, got {self.max_metadata_bytes}")

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


class CheckpointReader(StorageReader):
    """Reads into preallocated destinations from a checkpoint's files on any storage
    (``files``: a ``CheckpointFiles``, by composition): each request copied and verified by the
    ``copier`` (``chunk_copy.ChunkCopier``: whole chunks straight into their destination, parts
    window by window or by vectored runs). Reads are sorted by file and offset; open files live
    in an LRU. A storage that fetches ahead (a store) is read in
    rounds: the round's ranges fetched concurrently, then the same logic served from memory."""

    format_name = "hpdcp"

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.path

    def __init__(self, files: CheckpointFiles, *, files_kept: int = DEFAULT_FILES_KEPT,
                 max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES, verify_checksums: bool = True,
                 shared_storage: bool = False, max_read_bytes_per_s: int | None = None,
                 read_gap_bytes: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        ReaderOptions(files_kept, max_metadata_bytes, verify_checksums, shared_storage, max_read_bytes_per_s,
                      read_gap_bytes, max_request_bytes)  # the checks, in one place
        self.files = files
        self.path = files.url
        # A per-process token bucket that models network storage on one machine.
        self.throttle = _TokenBucket(max_read_bytes_per_s) if max_read_bytes_per_s else None
        self.slow_storage = shared_storage or files.shared or self.throttle is not None
        self.files_kept = files_kept
        self.read_gap_bytes = read_gap_bytes
        self.max_request_bytes = max_request_bytes
        self.max_metadata_bytes = max_metadata_bytes
        self.verify_checksums = verify_checksums
        self.counters = IOCounters()
        files.counters = self.counters
        self.metadata: Metadata | None = None
        self._fds: OrderedDict[str, Any] = OrderedDict()  # open handles, least recently used first
        self.copier = ChunkCopier(files, self.counters, throttle=self.throttle, verify_checksums=verify_checksums,
                                  read_gap_bytes=read_gap_bytes, max_request_bytes=max_request_bytes,
                                  block_bytes=lambda: self.metadata.block_bytes)

    # -- which checkpoint: the storage's pin ----------------------------------------------------
    def read_metadata_text(self) -> str:
        return self.files.metadata_text(METADATA_FILE, self.max_metadata_bytes)

    def pin(self) -> Any:
        """The identity of the checkpoint whose metadata was read, for the other ranks."""
        return self.files.pin()

    def attach_pin(self, pin: Any) -> None:
        self.files.attach(pin)

    def attach_metadata(self, metadata: Metadata, pin: Any = None) -> None:
        """``pin``: the coordinator's :meth:`pin`; this rank must read the same checkpoint."""
        self.metadata = metadata
        self.files.attach(pin)

    def full(self, name: str) -> str:
        """The file ``name`` of this checkpoint as errors name it."""
        return f"{self.path.rstrip('/')}/{name}"

    def _expected_size(self, name: str) -> int | None:
        return self.metadata.files[name].size if self.metadata and name in self.metadata.files else None

    def _fd(self, name: str) -> Any:
        """The open handle of ``name`` (opened checked against its recorded size; an LRU)."""
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        fd = self.files.open_handle(name, self._expected_size(name))
        self.counters.files_opened += 1
        self._fds[name] = fd
        while len(self._fds) > self.files.handles_kept(self.files_kept):
            self.files.close_handle(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            self.files.close_handle(self._fds.popitem()[1])
        self.files.close()

    def __del__(self) -> None:  # a reader dropped without close() must not leak descriptors
        try:
            self.close()
        except Exception:
            pass

    def open_file(self, name: str) -> RandomAccessFile:
        """A file of the pinned checkpoint for reads by range (a format-v2 chunk index)."""
        return self.files.open_random(name)

    def read_metadata_once(self) -> Metadata:
        """Read, validate and attach the metadata (the v2 index stays open, its directory not),
        then release the directory (one-shot callers)."""
        try:
            md = Metadata.from_json(self.read_metadata_text(), source=self.full(METADATA_FILE),
                                    open_file=self.open_file)
        finally:
            self.close()
        self.metadata = md
        return md

    def read_tensors(self, requests: Sequence[ReadRequest], on_done: Callable[[int], None] | None = None,
                     keep_order: bool = False) -> None:
        """Reads are sorted by (file, offset); ``keep_order`` keeps the caller's order instead (the
        order broadcasts need the data) when every file fits in the open-file LRU anyway. A
        storage that fetches ahead is read in rounds of at most ``files.round_bytes``."""
        budget = self.files.round_bytes
        if budget is None:
            self._read_round(requests, on_done, keep_order)
            return
        order = list(range(len(requests)))
        if not keep_order:
            order.sort(key=lambda k: (requests[k].chunk.file, requests[k].chunk.byte_offset))
        spans = {k: self._span(requests[k]) for k in order}
        i = 0
        while i < len(order):
            j, total = i, 0
            while j < len(order) and (j == i or total + spans[order[j]][1] - spans[order[j]][0] <= budget):
                total += spans[order[j]][1] - spans[order[j]][0]
                j += 1
            round_ = order[i:j]
            names = {requests[k].chunk.file for k in round_}
            self.files.fetch([(requests[k].chunk.file, *spans[k]) for k in round_],
                             {name: self._fd(name) for name in names})
            try:
                self._read_round([requests[k] for k in round_],
                                 None if on_done is None else (lambda m, rr=round_: on_done(rr[m])), keep_order=True)
            finally:
                self.files.release()
            i = j

    def _span(self, r: ReadRequest) -> tuple[int, int]:
        """The bytes of its file a request will read (the blocks it touches when verified)."""
        return self._file_span(r.chunk, r.dtype, r.sub)

    def _file_span(self, chunk: ChunkMeta, dtype: str, sub: Box) -> tuple[int, int]:
        esize = element_size(dtype)
        chunk_bytes = chunk.box.numel * esize
        start, stop = flat_span(sub.offsets, sub.sizes, chunk.sizes)
        lo, hi = start * esize, stop * esize
        if self.verify_checksums and sub.sizes != chunk.sizes:
            block = self.metadata.block_bytes if chunk.blocks else 0
            lo, hi = (lo // block * block, min(-(-hi // block) * block, chunk_bytes)) if block else (0, chunk_bytes)
        return chunk.byte_offset + lo, chunk.byte_offset + hi

    def read_bytes(self, chunk: ChunkMeta, dtype: str, sub: Box) -> int:
        """The span that covers the part (whole blocks when verified): what a partial read
        fetches, short gaps read through; at least the part's own bytes."""
        lo, hi = self._file_span(chunk, dtype, sub)
        return max(hi - lo, sub.numel * element_size(dtype))

    def _read_round(self, requests: Sequence[ReadRequest], on_done: Callable[[int], None] | None,
                    keep_order: bool) -> None:
        plans = []
        for k, r in enumerate(requests):
            dt = dtype_from_name(r.dtype)
            esize = element_size(r.dtype)
            start, stop = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)
            plans.append((r.chunk.file, r.chunk.byte_offset + start * esize, (stop - start) * esize, r, dt, k))
        if not (keep_order and len({p[0] for p in plans}) <= self.files_kept):
            plans.sort(key=lambda p: (p[0], p[1]))
        for name, offset, nbytes, r, dt, k in plans:
            if nbytes:
                self._read_one(name, offset, nbytes, r, dt)
            if on_done is not None:
                on_done(k)

    def bytes_moved(self) -> int:
        return max(self.files.bytes_arrived(), self.counters.bytes_read)

    def check_claims(self, md: Metadata) -> None:
        """Before anything is allocated from ``md``: every file it lists is here at its recorded
        size, and its tensors claim no more bytes than those files hold (chunks tile each
        tensor and never share bytes, so a valid checkpoint's tensor bytes fit in its files). A
        tiny file claiming a 1 TiB tensor fails here, naming the file or the tensor."""
        before, self.metadata = self.metadata, md
        try:
            self.check_files(sorted(md.files))
        finally:
            self.metadata = before
        have = sum(f.size for f in md.files.values())
        claimed = md.total_tensor_bytes
        if claimed > have:
            big = max(md.tensors.items(), key=lambda kv: kv[1].nbytes)
            raise CorruptCheckpointError(f"{self.path}: the metadata claims {claimed} bytes of tensors (e.g. "
                                         f"{big[0]!r}: {big[1].dtype} {list(big[1].shape)}, {big[1].nbytes} bytes) "
                                         f"but its files hold {have} bytes (damaged or hostile metadata)")

    def check_files(self, names: Iterable[str]) -> None:
        """Check these files now (each a regular file of its recorded size, in the pinned
        checkpoint) without reading them: a load checks every file it needs before any data
        moves, and callers that allocate from metadata shapes first make sure the bytes are
        really there."""
        todo = [n for n in names if n not in self._fds]
        expected = {n: s for n in todo if (s := self._expected_size(n)) is not None}
        self.files.check_sizes(todo, expected)

    def _read_one(self, name: str, offset: int, nbytes: int, r: ReadRequest, dt: torch.dtype) -> None:
        """One request: ``offset``/``nbytes`` is the flat span of its part in the file."""
        if faults.is_armed("load.read"):
            faults.point("load.read", rank=rank_of_env(), path=self.path, file=name)
        self.copier.copy(self._fd(name), name, offset, nbytes, r, dt)

    def read_objects(self, wanted: Mapping[str, ObjectMeta], *, allow_pickle: bool) -> dict[str, Any]:
        by_file: dict[str, list[str]] = {}
        for fqn, om in wanted.items():
            by_file.setdefault(om.file, []).append(fqn)
        out: dict[str, Any] = {}
        for name, fqns in sorted(by_file.items()):
            fd = self._fd(name)
            size = self.copier.file_size(fd)
            body = bytearray(size)
            self.copier.pread(fd, 0, memoryview(body), name=name)
            self.counters.bytes_read += size
            self.counters.bump("object_bytes_read", size)
            full = self.full(name)
            if self.metadata and digest(body) != self.metadata.files[name].checksum:
                raise CorruptCheckpointError(f"checkpoint file {full} fails its checksum (corrupted data)")
            doc = jsondoc.parse(body, f"checkpoint file {full}", CorruptCheckpointError)
            for fqn in fqns:
                if not isinstance(doc, dict) or fqn not in doc:
                    raise CorruptCheckpointError(f"checkpoint file {full} lacks object {fqn!r}")
                out[fqn] = objcodec.decode(doc[fqn], key=fqn, source=full, allow_pickle=allow_pickle)
        return out
