"""Loading a checkpoint from an object store: ours (the save a commit object names, see
``object_checkpoint``; or a directory uploaded as it is), and Hugging Face and torch DCP
checkpoints read in place. The filesystem reader's planning of reads, partial-chunk windows and
checksum verification run unchanged; only where the bytes come from differs: ranged GETs fetched
ahead concurrently."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from ..core.errors import CheckpointChangedError, CheckpointNotFoundError, CorruptCheckpointError, MetadataError
from ..core.geometry import flat_span
from ..format.metadata import DEFAULT_MAX_METADATA_BYTES, METADATA_FILE, Metadata, check_file_name, element_size
from .filesystem import DEFAULT_FILES_KEPT, FileSystemReader
from .interfaces import ReadRequest
from .object_checkpoint import SAVE_PREFIX, check_commit_matches, read_commit
from .object_store import Bucket, ObjectStoreOptions, RemoteFile


class ObjectStoreReader(FileSystemReader):
    """Loads a checkpoint from an object store: the filesystem reader's planning of reads,
    partial-chunk windows and checksum verification, with its bytes coming from ranged GETs
    fetched ahead concurrently (``concurrency`` in flight, ranges closer than ``coalesce_bytes``
    merged) in rounds of at most ``read_buffer_bytes``, then copied into the destinations."""

    format_name = "hpdcp"

    def __init__(self, uri: str, *, options: ObjectStoreOptions | None = None,
                 files_kept: int = DEFAULT_FILES_KEPT, max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
                 verify_checksums: bool = True, shared_storage: bool = True, max_read_bytes_per_s: int | None = None,
                 read_gap_bytes: int | None = None, max_request_bytes: int = 16 << 20) -> None:
        super().__init__("/", files_kept=files_kept, max_metadata_bytes=max_metadata_bytes,
                         verify_checksums=verify_checksums, shared_storage=True,
                         max_read_bytes_per_s=max_read_bytes_per_s, read_gap_bytes=read_gap_bytes,
                         max_request_bytes=max_request_bytes)
        self.path = uri.rstrip("/")
        self.bucket = Bucket(self.path, options)
        self.name_key = self.bucket.root
        self.data: str | None = None  # the pinned save prefix ("" for an uploaded directory)
        self._sizes: dict[str, int] | None = None
        self._fetched: dict[str, list[tuple[int, int, Any]]] = {}
        self._samples: list[tuple[int, float]] = []  # (bytes, seconds) of this reader's requests: the cost model
        self._arrived = 0  # bytes of ranged GETs completed (progress: they lead what was copied out)
        self._arrived_lock = threading.Lock()

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.path

    def _data_key(self, name: str) -> str:
        return "/".join(p for p in (self.name_key, self.data, name) if p)

    # -- metadata and pinning ---------------------------------------------------------------
    def read_metadata_text(self) -> str:
        t0 = time.perf_counter()
        got = read_commit(self.bucket, self.name_key)
        self._observe(0, time.perf_counter() - t0)  # a small request: the store's latency
        if got is not None:
            self.data = got[0]["data"]
        elif self.bucket.head(f"{self.name_key}/{METADATA_FILE}") is not None:
            self.data = ""  # a checkpoint directory uploaded as it is
        else:
            raise self._not_found()
        commit = got
        got = self.bucket.get(self._data_key(METADATA_FILE), max_bytes=self.max_metadata_bytes)
        if got is None:
            raise self._changed("its metadata.json disappeared")
        if commit is not None:
            check_commit_matches(commit[0], got[0], self.bucket.url(self._data_key(METADATA_FILE)))
        return got[0].decode("utf-8", errors="replace")

    def _not_found(self) -> CheckpointNotFoundError:
        dirs, objs = self.bucket.list_dir(self.name_key)
        names = {o["path"].rsplit("/", 1)[-1] for o in objs}
        hint = ""
        if any(d.startswith(SAVE_PREFIX) for d in dirs):
            hint = " (only an uncommitted or abandoned save is there)"
        if names & {"model.safetensors", "model.safetensors.index.json"}:
            hint = "; it looks like a Hugging Face model directory (read it with format='hf' or 'auto')"
        elif ".metadata" in names:
            hint = "; it looks like a torch.distributed.checkpoint directory (format='torch_dcp' or 'auto')"
        return CheckpointNotFoundError(f"no committed checkpoint at {self.path}{hint}")

    def _pin_directory(self) -> None:
        if self.data is None:
            got = read_commit(self.bucket, self.name_key)
            if got is None and self.bucket.head(f"{self.name_key}/{METADATA_FILE}") is None:
                raise self._not_found()
            self.data = got[0]["data"] if got else ""

    def pin(self) -> Any:
        return self.data

    def attach_metadata(self, metadata: Metadata, pin: Any = None) -> None:
        self.metadata = metadata
        if pin is not None:
            self.data = pin
        self._pin_directory()

    def _changed(self, how: str) -> CheckpointChangedError:
        return CheckpointChangedError(f"checkpoint {self.path} changed during the load ({how}: overwritten or deleted "
                                      f"by another process); nothing loaded from it can be trusted")

    def _missing_file(self, name: str) -> Exception:
        got = read_commit(self.bucket, self.name_key) if self.data else None
        if self.data and (got is None or got[0]["data"] != self.data):
            return self._changed("the save it names was replaced")
        return CheckpointNotFoundError(f"checkpoint file {self.path}/{name} is missing (listed in {METADATA_FILE})")

    def check_files(self, names: Iterable[str]) -> None:
        """One listing of the pinned save: every file there, of its recorded size."""
        self._pin_directory()
        if self._sizes is None:
            base = self._data_key("")
            if self.data:
                self._sizes = {o["path"][len(base) + 1:]: o["size"] for o in self.bucket.list(base)}
            else:
                self._sizes = {o["path"].rsplit("/", 1)[-1]: o["size"] for o in self.bucket.list_dir(base)[1]}
        for name in names:
            check_file_name(name)
            if name not in self._sizes:
                raise self._missing_file(name)
            expected = self.metadata.files[name].size if self.metadata and name in self.metadata.files else None
            if expected is not None and self._sizes[name] != expected:
                raise CorruptCheckpointError(f"checkpoint file {self.path}/{name} is {self._sizes[name]} bytes but "
                                             f"{METADATA_FILE} records {expected} (truncated or modified)")

    def open_file(self, name: str) -> RemoteFile:
        check_file_name(name)
        self._pin_directory()
        return RemoteFile(self.bucket, self._data_key(name), None, lambda: self._missing_file(name), self.counters)

    def _fd(self, name: str) -> Any:
        check_file_name(name)
        self._pin_directory()
        size = self.metadata.files[name].size if self.metadata and name in self.metadata.files else None
        self.counters.files_opened += name not in self._fds
        self._fds[name] = 0
        return RemoteFile(self.bucket, self._data_key(name), size, lambda: self._missing_file(name), self.counters)

    def close(self) -> None:
        self._fds.clear()
        self._fetched.clear()

    # -- bytes ------------------------------------------------------------------------------
    def _file_size(self, fd: Any) -> int:
        return fd.size()

    def _pread(self, fd: Any, offset: int, view: memoryview, *, name: str) -> None:
        """From the ranges fetched ahead when they hold it, else one ranged GET."""
        n = len(view)
        pieces = self._fetched.get(name, ())
        k = bisect.bisect_right(pieces, (offset, float("inf"))) - 1  # the piece holding ``offset``
        at = offset
        while 0 <= k < len(pieces) and at < offset + n and pieces[k][0] <= at < pieces[k][1]:
            lo, hi, buf = pieces[k]
            take = min(hi, offset + n) - at
            view[at - offset:at - offset + take] = memoryview(buf)[at - lo:at - lo + take]
            at += take
            k += 1
        if at == offset + n:
            return
        data = fd.pread(n, offset)
        if len(data) != n:
            raise CorruptCheckpointError(f"{self.path}/{name}: short read of {n} bytes at offset {offset} (truncated?)")
        view[:] = data

    def strategy(self, n: int, run: int, span: int) -> tuple[str, int]:
        return "slab", 0  # the span was fetched whole; windows copy out of memory

    def _span(self, r: ReadRequest) -> tuple[int, int]:
        """The bytes of its file a request will read (the blocks it touches when verified)."""
        esize = element_size(r.dtype)
        chunk_bytes = r.chunk.box.numel * esize
        start, stop = flat_span(r.sub.offsets, r.sub.sizes, r.chunk.sizes)
        lo, hi = start * esize, stop * esize
        if self.verify_checksums and r.sub.sizes != r.chunk.sizes:
            block = self.metadata.block_bytes if r.chunk.blocks else 0
            lo, hi = (lo // block * block, min(-(-hi // block) * block, chunk_bytes)) if block else (0, chunk_bytes)
        return r.chunk.byte_offset + lo, r.chunk.byte_offset + hi

    def read_tensors(self, requests: Sequence[ReadRequest], on_done: Callable[[int], None] | None = None,
                     keep_order: bool = False) -> None:
        """In rounds of at most ``read_buffer_bytes``: fetch every range the round needs
        concurrently (coalesced), then let the filesystem logic verify and copy out."""
        o = self.bucket.options
        order = list(range(len(requests)))
        if not keep_order:
            order.sort(key=lambda k: (requests[k].chunk.file, requests[k].chunk.byte_offset))
        spans = {k: self._span(requests[k]) for k in order}
        i = 0
        while i < len(order):
            j, total = i, 0
            while j < len(order) and (j == i or total + spans[order[j]][1] - spans[order[j]][0] <= o.read_buffer_bytes):
                total += spans[order[j]][1] - spans[order[j]][0]
                j += 1
            round_ = order[i:j]
            self._fetch([(requests[k].chunk.file, *spans[k]) for k in round_])
            try:
                super().read_tensors([requests[k] for k in round_],
                                     None if on_done is None else (lambda m, rr=round_: on_done(rr[m])), keep_order=True)
            finally:
                self._fetched.clear()
            i = j

    def _fetch(self, ranges: list[tuple[str, int, int]]) -> None:
        """Coalesce the ranges per file and GET them ``concurrency`` at a time."""
        o = self.bucket.options
        merged: list[tuple[str, int, int]] = []
        for name, lo, hi in sorted(ranges):
            if hi <= lo:
                continue
            if merged and merged[-1][0] == name and lo - merged[-1][2] <= self.coalesce_bytes():
                if hi > merged[-1][2]:
                    merged[-1] = (name, merged[-1][1], hi)
            else:
                merged.append((name, lo, hi))
        # then cut into pieces of at most part_size fetched concurrently: a store serves one
        # connection at a bounded rate (S3: tens of MB/s), many at once in parallel
        step = o.part_size
        merged = [(name, a, min(a + step, hi)) for name, lo, hi in merged for a in range(lo, hi, step)]
        handles = {name: self._fd(name) for name, _, _ in ranges}
        for name, lo, hi in merged:
            if hi > handles[name].size():
                raise CorruptCheckpointError(f"{self.path}/{name}: a read of bytes {lo}..{hi} would end past the "
                                             f"file's {handles[name].size()} bytes (truncated file or bad metadata)")

        def get(item: tuple[str, int, int]) -> tuple[str, int, int, Any]:
            name, lo, hi = item
            t0 = time.perf_counter()
            try:
                buf = self.bucket.get_range(handles[name].key, lo, hi)
            except CheckpointNotFoundError:
                raise self._missing_file(name) from None
            self._observe(hi - lo, time.perf_counter() - t0)
            with self._arrived_lock:
                self._arrived += hi - lo
            return name, lo, hi, buf

        if len(merged) == 1:
            results = [get(merged[0])]
        else:
            with cf.ThreadPoolExecutor(max_workers=min(o.concurrency, len(merged)),
                                       thread_name_prefix="hpdcp-get") as pool:
                results = list(pool.map(get, merged))
        for name, lo, hi, buf in results:
            if len(memoryview(buf)) != hi - lo:
                raise CorruptCheckpointError(f"{self.path}/{name}: short read of bytes {lo}..{hi} (truncated?)")
            self._fetched.setdefault(name, []).append((lo, hi, buf))
            self.counters.bump("store_requests")
            self.counters.bump("bytes_requested", hi - lo)
        for pieces in self._fetched.values():
            pieces.sort(key=lambda p: p[0])

    def bytes_moved(self) -> int:
        return max(self._arrived, self.counters.bytes_read)

    # -- the cost model: measured on this reader's own requests -------------------------------
    _DEFAULT_LATENCY_S = 0.01
    _DEFAULT_BANDWIDTH = 100e6  # bytes/s of one connection, until a large GET says otherwise

    def _observe(self, nbytes: int, seconds: float) -> None:
        self._samples.append((nbytes, seconds))  # (list.append is atomic: fetch threads call it)

    def cost_model_now(self) -> tuple[float, float]:
        """(latency s, bytes/s of one connection): latency from the fastest small request (a
        commit object, a metadata read), bandwidth from the large GETs net of that latency."""
        samples = self._samples
        small = [t for n, t in samples if n <= 256 << 10]
        lat = min(small) if small else self._DEFAULT_LATENCY_S
        rates = sorted(n / (t - lat) for n, t in samples if n >= 1 << 20 and t > lat)
        bw = rates[len(rates) // 2] if rates else self._DEFAULT_BANDWIDTH
        return lat, bw

    def coalesce_bytes(self) -> int:
        """Gaps up to this are read through: ``coalesce_bytes``, or measured (latency x bandwidth)."""
        o = self.bucket.options
        if o.coalesce_bytes is not None:
            return o.coalesce_bytes
        lat, bw = self.cost_model_now()
        return int(min(max(lat * bw, 64 << 10), o.part_size))

    def _count(self, nbytes: int, calls: int) -> None:
        self.counters.bytes_read += nbytes
        self.counters.reads += calls


# -- checkpoints of other formats read in place from a store ------------------------------------

class _RemoteDescribed:
    """What a reader of a foreign format (its files described as our metadata, see
    ``foreign._DescribedReader``) needs of a store: one listing of the directory, small objects
    whole, files by ranges. Mixed in before the format's reader and ``ObjectStoreReader``."""

    def _init_remote(self, uri: str, kwargs: dict) -> None:
        self.check_crc = kwargs.get("verify_checksums", True)  # see foreign._DescribedReader
        ObjectStoreReader.__init__(self, uri, **{**kwargs, "verify_checksums": False})
        self._described = None
        self.data = ""
        self._listing: dict[str, int] | None = None

    def _names(self) -> dict[str, int]:
        if self._listing is None:
            self._listing = {o["path"].rsplit("/", 1)[-1]: o["size"] for o in self.bucket.list_dir(self.name_key)[1]}
        return self._listing

    def _exists(self, name: str) -> bool:
        return name in self._names()

    def _size_of(self, name: str) -> int:
        if name not in self._names():
            raise CheckpointNotFoundError(f"{self.path}/{name} is missing")
        return self._names()[name]

    def _read_small(self, name: str) -> bytes:
        got = self.bucket.get(self._data_key(name), max_bytes=64 << 20)
        if got is None:
            raise CheckpointNotFoundError(f"{self.path}/{name} is missing")
        return got[0]

    def _random_access(self, name: str) -> "RemoteFile":
        return RemoteFile(self.bucket, self._data_key(name), self._size_of(name), counters=self.counters)

    def _header_of(self, name: str) -> list:
        from ..format.safetensors_io import parse_header
        from .foreign import MAX_ENTRIES_PER_FILE

        f = self._random_access(name)
        return parse_header(f"{self.path}/{name}", f.size(), f.pread, MAX_ENTRIES_PER_FILE)[1]

    def read_metadata_text(self) -> str:
        if self._described is None:
            if not self._names():
                raise CheckpointNotFoundError(f"no checkpoint at {self.path} (nothing is stored under it)")
            self._described = self.describe().to_json()
        return self._described

    def _pin_directory(self) -> None:
        self.data = ""


def _foreign_reader(fmt: str, uri: str, allow_pickle: bool, kwargs: dict) -> FileSystemReader:
    """A Hugging Face directory (or one ``.safetensors`` object) or a torch DCP checkpoint in a
    store, read in place: described from one listing and ranged GETs of headers and records, the
    tensor bytes read by the object-store reader (no checksums: these formats have none)."""
    from .foreign import HfReader, TorchDcpReader

    if fmt == "hf":
        class ObjectStoreHfReader(_RemoteDescribed, HfReader, ObjectStoreReader):
            pass

        r = ObjectStoreHfReader.__new__(ObjectStoreHfReader)
        r.only = None
        if uri.endswith(".safetensors"):
            uri, r.only = uri.rsplit("/", 1)
        r._init_remote(uri, kwargs)
        return r

    class ObjectStoreTorchDcpReader(_RemoteDescribed, TorchDcpReader, ObjectStoreReader):
        pass

    r = ObjectStoreTorchDcpReader.__new__(ObjectStoreTorchDcpReader)
    r.allow_pickle = allow_pickle
    r._init_remote(uri, kwargs)
    return r


def open_object_reader(uri: str, format: str, *, allow_pickle: bool = False, options: ObjectStoreOptions | None = None,
                       **reader_kwargs: Any) -> FileSystemReader:
    """The reader of a checkpoint in a store: ours (a commit object, or an uploaded directory
    with ``metadata.json``) or a Hugging Face directory, by ``format`` or (auto) by what is there."""
    from .foreign import engine_format
    from .location import ObjectLocation

    fmt = engine_format(ObjectLocation(uri, options), format)
    if fmt == "hpdcp":
        return ObjectStoreReader(uri, options=options, **reader_kwargs)
    if fmt in ("hf", "torch_dcp"):
        return _foreign_reader(fmt, uri, allow_pickle, {"options": options, **reader_kwargs})
    raise MetadataError(f"unknown checkpoint format {format!r}")
