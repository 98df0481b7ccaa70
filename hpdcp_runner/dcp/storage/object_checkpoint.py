"""Checkpoints in an object store (``s3://bucket/prefix/NAME``), published without a rename.

A store has neither rename nor directories, so a checkpoint is published by one conditional
write of a small *commit object* naming an immutable set of objects::

    NAME/hpdcp-commit.json               the commit: written last, with If-None-Match (a new
                                         checkpoint) or If-Match on the ETag it replaces (overwrite)
    NAME/save-<time>-<id>/               every object of one save, under a prefix no other save uses
        rank00000.safetensors ...        rank files (streamed as multipart uploads)
        chunk_index.safetensors          format v2's chunk index
        metadata.json                    as in a local checkpoint
        .lease                           refreshed by the coordinator while the save runs

"The checkpoint exists" means its commit object exists. A reader reads the commit object once and
pins the save prefix it names: an overwrite writes a new prefix and swaps the commit object, so
the bytes a reader reads are never replaced; it reads the old checkpoint whole or, once that one's
objects are deleted, fails with ``CheckpointChangedError`` (never a mix). What a crashed,
abandoned or superseded save left (prefixes no commit names) is never read, and is deleted by a
later save of that name or by retention once nothing has touched it for ``orphan_grace_s`` (a
live save refreshes its ``.lease``; a superseded one is kept that long for loads still reading it).
Incomplete multipart uploads of a killed rank are invisible objects; a bucket lifecycle rule
(AbortIncompleteMultipartUpload) reclaims their parts.

A directory uploaded as it is (``metadata.json`` at the top, no commit object, e.g. by ``aws s3
sync``) is read in place; it is never written that way.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import datetime as _dt
import json
import shutil
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..core import faults
from ..core.errors import (CheckpointChangedError, ConfigError, CheckpointExistsError, CheckpointNotFoundError,
                           CorruptCheckpointError, MetadataError, StorageAccessError)
from ..core.geometry import flat_span
from ..core.utils import get_logger
from ..format.chunk_index import INDEX_FILE
from ..format.metadata import (DEFAULT_MAX_METADATA_BYTES, METADATA_FILE, FileMeta, Metadata, check_file_name, dtype_name,
                               element_size)
from ..format.objects import encode_object_file
from ..format.safetensors_io import SafetensorsStreamWriter, digest, index_bytes
from .filesystem import DEFAULT_FILES_KEPT, FileSystemReader, rank_file
from .interfaces import IOCounters, ReadRequest, StorageWriter, WriteResult
from .object_store import Bucket, ObjectStoreOptions
from .uri import is_uri, normalize

log = get_logger(__name__)
COMMIT_OBJECT = "hpdcp-commit.json"
LEASE_OBJECT = ".lease"
SAVE_PREFIX = "save-"
_COMMIT_FORMAT = "hpdcp-commit"
_MAX_COMMIT_BYTES = 1 << 20


def _now_utc() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def read_commit(bucket: Bucket, name_key: str) -> tuple[dict, str] | None:
    """(commit document, its ETag) of the checkpoint at key ``name_key``, or None."""
    got = bucket.get(f"{name_key}/{COMMIT_OBJECT}", max_bytes=_MAX_COMMIT_BYTES)
    if got is None:
        return None
    body, meta = got
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise MetadataError(f"{bucket.url(name_key + '/' + COMMIT_OBJECT)} is not valid JSON ({e})") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("format") == _COMMIT_FORMAT and isinstance(data, str)
            and data.startswith(SAVE_PREFIX) and "/" not in data):
        raise MetadataError(f"{bucket.url(name_key + '/' + COMMIT_OBJECT)} is not an hpdcp commit object")
    return doc, meta["e_tag"]


def clean_orphans(bucket: Bucket, name_key: str, *, keep: Iterable[str] = ()) -> list[str]:
    """Delete the save prefixes under ``name_key`` that the commit does not name and nothing
    touched for ``orphan_grace_s`` (a live save refreshes its lease; a superseded checkpoint is
    kept that long after the commit that replaced it, for loads still reading it). Returns them."""
    grace = _dt.timedelta(seconds=bucket.options.orphan_grace_s)
    got = read_commit(bucket, name_key)
    current = got[0]["data"] if got else None
    commit_time = bucket.head(f"{name_key}/{COMMIT_OBJECT}")["last_modified"] if got else None
    newest: dict[str, _dt.datetime] = {}
    keys: dict[str, list[str]] = {}
    for o in bucket.list(name_key):
        rel = o["path"][len(name_key) + 1:]
        prefix = rel.split("/", 1)[0]
        if not prefix.startswith(SAVE_PREFIX) or "/" not in rel:
            continue
        keys.setdefault(prefix, []).append(o["path"])
        newest[prefix] = max(newest.get(prefix, o["last_modified"]), o["last_modified"])
    now = _now_utc()
    gone = []
    for prefix, when in newest.items():
        if prefix == current or prefix in keep or now - when < grace:
            continue
        if commit_time is not None and now - commit_time < grace:
            continue  # superseded moments ago: a load may still be reading it
        bucket.delete(keys[prefix])
        gone.append(prefix)
    if gone:
        log.info("removed %d abandoned or superseded save(s) under %s: %s", len(gone), bucket.url(name_key), gone)
    return gone


def delete_checkpoint(bucket: Bucket, name_key: str) -> None:
    """Unpublish first (the commit object goes: the checkpoint is gone at once, never half
    there), then delete what it named and anything else under the name."""
    bucket.delete([f"{name_key}/{COMMIT_OBJECT}"])
    bucket.delete([o["path"] for o in bucket.list(name_key)])


class _Lease:
    """Refreshes ``<save>/.lease`` while a save runs, so no other writer's cleanup takes the save
    for abandoned (the store has no lock that dies with the process)."""

    def __init__(self, bucket: Bucket, key: str) -> None:
        self.bucket, self.key = bucket, key
        self.stop = threading.Event()
        bucket.put(key, b"{}")
        period = max(1.0, bucket.options.orphan_grace_s / 4)
        self.thread = threading.Thread(target=self._run, args=(period,), name="hpdcp-lease", daemon=True)
        self.thread.start()

    def _run(self, period: float) -> None:
        while not self.stop.wait(period):
            try:
                self.bucket.put(self.key, b"{}")
            except Exception as e:  # the save itself reports storage failures
                log.warning("could not refresh the save lease %s: %s", self.bucket.url(self.key), e)

    def release(self) -> None:
        self.stop.set()


class ObjectStoreWriter(StorageWriter):
    """Per-rank safetensors objects streamed under a save prefix unique to this save, published
    by the conditional write of the commit object (module docstring)."""

    def __init__(self, uri: str, *, options: ObjectStoreOptions | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.bucket = Bucket(self.uri, options)
        self.name_key = self.bucket.root
        if not self.name_key:
            raise ConfigError(f"{uri}: a checkpoint needs a name under the bucket (s3://bucket/name)")
        self.counters = IOCounters()
        self.save_id: str | None = None
        self.rank = 0
        self._replaces: str | None = None  # the ETag of the commit this save replaces
        self._lease: _Lease | None = None

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.uri

    def _key(self, name: str) -> str:
        return f"{self.name_key}/{self.save_id}/{name}"

    def begin(self, *, overwrite: bool) -> str:
        got = read_commit(self.bucket, self.name_key)
        if got is not None and not overwrite:
            raise CheckpointExistsError(f"checkpoint {self.uri} already exists; pass overwrite=True to replace it "
                                        f"(the old one stays loadable until the new one commits)")
        self._replaces = got[1] if got else None
        self.overwrite = overwrite
        clean_orphans(self.bucket, self.name_key)
        self.save_id = f"{SAVE_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}"
        self._lease = _Lease(self.bucket, self._key(LEASE_OBJECT))
        return self.save_id

    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        if not (isinstance(token, str) and token.startswith(SAVE_PREFIX) and "/" not in token):
            raise MetadataError(f"{self.uri}: bad save token {token!r}")
        self.save_id, self.rank = token, rank

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], objects: Mapping[str, Any]) -> WriteResult:
        files, chunks, objs = [], {}, {}
        if tensors:
            name = rank_file(self.rank, "safetensors")
            w = SafetensorsStreamWriter(self.bucket.url(self._key(name)),
                                        [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors],
                                        meta={"format": "pt"}, sink=self.bucket.writer(self._key(name)))
            try:
                for key, t in tensors:
                    w.append(key, t)
                    self.counters.bytes_written += t.numel() * t.element_size()
                wf = w.close()
            except BaseException:
                w.abort()
                raise
            files.append(FileMeta(name, wf.size, wf.checksum, self.rank))
            for e in wf.entries:
                chunks[e.key] = (name, e.byte_offset, e.checksum, e.blocks)
        if objects:
            name = rank_file(self.rank, "objects.json")
            body, digests = encode_object_file(objects)
            self.bucket.put(self._key(name), body)
            files.append(FileMeta(name, len(body), digest(body), self.rank))
            objs.update((k, (name, d)) for k, d in digests.items())
            self.counters.bytes_written += len(body)
        self.counters.files_written += len(files)
        return WriteResult(self.rank, tuple(files), chunks, objs)

    def commit(self, metadata: Metadata) -> None:
        if metadata.index is not None:  # format v2: the chunk index first, metadata.json after it
            self.bucket.put(self._key(INDEX_FILE), index_bytes(metadata.index))
        body = metadata.to_json().encode()
        self.bucket.put(self._key(METADATA_FILE), body)
        doc = {"format": _COMMIT_FORMAT, "version": 1, "data": self.save_id, "metadata_size": len(body),
               "metadata_checksum": digest(body), "extra": dict(metadata.extra or {})}
        key = f"{self.name_key}/{COMMIT_OBJECT}"
        faults.point("commit.rename", path=self.uri)  # the one step that publishes (as the rename does locally)
        try:
            self.bucket.put(key, json.dumps(doc, separators=(",", ":")).encode(),
                            mode=self._replaces if self._replaces else "create")
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self.uri} was {'replaced' if self._replaces else 'committed'} by another save while this one was in "
                f"progress; nothing was committed") from None
        finally:
            self._stop_lease()
        self.bucket.delete([self._key(LEASE_OBJECT)])

    def abort(self) -> None:
        self._stop_lease()
        if self.save_id:
            try:
                self.bucket.delete([o["path"] for o in self.bucket.list(f"{self.name_key}/{self.save_id}")])
            except Exception as e:  # best effort: a later save removes what is left
                log.warning("could not remove the aborted save %s: %s", self.uri, e)

    def _stop_lease(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def committed_opener(self) -> Callable[[str], Any]:
        """How other ranks open the committed checkpoint's files (the index, lazily)."""
        bucket, prefix = self.bucket, f"{self.name_key}/{self.save_id}"
        return lambda name: _RemoteFile(bucket, f"{prefix}/{check_file_name(name)}", None)


class _RemoteFile:
    """One object read by ranges (a random-access file for the chunk index and the reads)."""

    def __init__(self, bucket: Bucket, key: str, size: int | None, on_missing: Callable[[], Exception] | None = None,
                 counters: IOCounters | None = None) -> None:
        self.bucket, self.key, self._size = bucket, key, size
        self.on_missing, self.counters = on_missing, counters

    def size(self) -> int:
        if self._size is None:
            meta = self.bucket.head(self.key)
            if meta is None:
                raise self._missing()
            self._size = meta["size"]
        return self._size

    def _missing(self) -> Exception:
        if self.on_missing is not None:
            return self.on_missing()
        return CheckpointNotFoundError(f"{self.bucket.url(self.key)} is missing (named in {METADATA_FILE})")

    _BLOCK = 64 << 10  # small reads (headers, zip directories) go through cached blocks of this size
    _BLOCKS_KEPT = 64

    def pread(self, n: int, offset: int) -> bytes:
        """Bytes [offset, offset+n); small reads are served from aligned cached blocks (a parser
        walking a header or a zip record makes many small reads of a few places: one request
        each would cost a round trip each)."""
        if n <= 0:
            return b""
        if n > self._BLOCK:
            return self._get(offset, offset + n)
        out = bytearray()
        for b in range(offset // self._BLOCK, (offset + n - 1) // self._BLOCK + 1):
            out += self._block(b)
        lo = offset - offset // self._BLOCK * self._BLOCK
        return bytes(out[lo:lo + n])

    def _block(self, b: int) -> bytes:
        cache = self.__dict__.setdefault("_cache", {})
        if b not in cache:
            end = min((b + 1) * self._BLOCK, self.size())
            cache[b] = self._get(b * self._BLOCK, end) if end > b * self._BLOCK else b""
            while len(cache) > self._BLOCKS_KEPT:
                cache.pop(next(iter(cache)))
        return cache[b]

    def _get(self, start: int, end: int) -> bytes:
        try:
            data = self.bucket.get_range(self.key, start, end)
        except CheckpointNotFoundError:
            raise self._missing() from None
        except StorageAccessError as e:
            if "416" in str(e) or "Range Not Satisfiable" in str(e):
                return b""  # past the end: a short read, which the caller reports
            raise
        if self.counters is not None:
            self.counters.bump("store_requests")
        return bytes(data)

    def close(self) -> None:
        pass


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
        got = self.bucket.get(self._data_key(METADATA_FILE), max_bytes=self.max_metadata_bytes)
        if got is None:
            raise self._changed("its metadata.json disappeared")
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

    def open_file(self, name: str) -> _RemoteFile:
        check_file_name(name)
        self._pin_directory()
        return _RemoteFile(self.bucket, self._data_key(name), None, lambda: self._missing_file(name), self.counters)

    def _fd(self, name: str) -> Any:
        check_file_name(name)
        self._pin_directory()
        size = self.metadata.files[name].size if self.metadata and name in self.metadata.files else None
        self.counters.files_opened += name not in self._fds
        self._fds[name] = 0
        return _RemoteFile(self.bucket, self._data_key(name), size, lambda: self._missing_file(name), self.counters)

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
            self._fetch({requests[k].chunk.file: None for k in round_},
                        [(requests[k].chunk.file, *spans[k]) for k in round_])
            try:
                super().read_tensors([requests[k] for k in round_],
                                     None if on_done is None else (lambda m, rr=round_: on_done(rr[m])), keep_order=True)
            finally:
                self._fetched.clear()
            i = j

    def _fetch(self, files: Mapping[str, None], ranges: list[tuple[str, int, int]]) -> None:
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
        handles = {name: self._fd(name) for name in files}
        for name, h in handles.items():
            size = h.size()
            for n2, lo, hi in merged:
                if n2 == name and hi > size:
                    raise CorruptCheckpointError(f"{self.path}/{name}: a read of bytes {lo}..{hi} would end past the "
                                                 f"file's {size} bytes (truncated file or bad metadata)")

        def get(item: tuple[str, int, int]) -> tuple[str, int, int, Any]:
            name, lo, hi = item
            t0 = time.perf_counter()
            try:
                buf = self.bucket.get_range(handles[name].key, lo, hi)
            except CheckpointNotFoundError:
                raise self._missing_file(name) from None
            self._observe(hi - lo, time.perf_counter() - t0)
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

    # -- the cost model: measured on this reader's own requests -------------------------------
    _DEFAULT_LATENCY_S = 0.01
    _DEFAULT_BANDWIDTH = 100e6  # bytes/s of one connection, until a large GET says otherwise

    def _observe(self, nbytes: int, seconds: float) -> None:
        self.__dict__.setdefault("_samples", []).append((nbytes, seconds))

    def cost_model_now(self) -> tuple[float, float]:
        """(latency s, bytes/s of one connection): latency from the fastest small request (a
        commit object, a metadata read), bandwidth from the large GETs net of that latency."""
        samples = self.__dict__.get("_samples", [])
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


# -- directories of checkpoints (retention, latest) ----------------------------------------------

def committed_extras(directory: str, name_ok: Callable[[str], Any]) -> list[tuple[str, dict | None]]:
    """(name, the ``extra`` its commit records) of each committed checkpoint under ``directory``
    whose name passes ``name_ok``: one listing, then one small GET per candidate."""
    bucket = Bucket(directory)
    out = []
    for name in sorted(bucket.list_dir(bucket.root)[0]):
        if name.startswith(".") or not name_ok(name):
            continue
        try:
            got = read_commit(bucket, bucket.key(name))
        except MetadataError:
            continue  # not one of ours: never touched
        if got is not None:
            extra = got[0].get("extra")
            out.append((name, extra if isinstance(extra, dict) else None))
    return out


def clean_directory_orphans(directory: str, keep: Iterable[str] = ()) -> None:
    """Abandoned and superseded saves of every checkpoint under ``directory`` (after a grace)."""
    bucket = Bucket(directory)
    for name in bucket.list_dir(bucket.root)[0]:
        if name not in set(keep):
            try:
                clean_orphans(bucket, bucket.key(name))
            except MetadataError:
                continue


def delete_checkpoint_at(uri: str) -> None:
    bucket = Bucket(uri)
    delete_checkpoint(bucket, bucket.root)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint (or any directory of files) wherever it is, best effort: scratch
    checkpoints of benchmarks. A store's is unpublished first (``delete_checkpoint``)."""
    if is_uri(path):
        delete_checkpoint_at(normalize(path))
    else:
        shutil.rmtree(path, ignore_errors=True)


# -- checkpoints of other formats read in place from a store ------------------------------------

class _RemoteDescribed:
    """What a reader of a foreign format (its files described as our metadata, see
    ``foreign._DescribedReader``) needs of a store: one listing of the directory, small objects
    whole, files by ranges. Mixed in before the format's reader and ``ObjectStoreReader``."""

    def _init_remote(self, uri: str, kwargs: dict) -> None:
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

    def _random_access(self, name: str) -> "_RemoteFile":
        return _RemoteFile(self.bucket, self._data_key(name), self._size_of(name), counters=self.counters)

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
    fmt = format
    if fmt == "auto":
        if uri.endswith(".safetensors"):
            fmt = "hf"
        else:
            bucket = Bucket(uri, options)
            _, objs = bucket.list_dir(bucket.root)
            names = {o["path"].rsplit("/", 1)[-1] for o in objs}
            if names & {"model.safetensors", "model.safetensors.index.json"}:
                fmt = "hf"
            elif ".metadata" in names and not names & {COMMIT_OBJECT, METADATA_FILE}:
                fmt = "torch_dcp"
            else:
                fmt = "hpdcp"
    if fmt == "hpdcp":
        return ObjectStoreReader(uri, options=options, **reader_kwargs)
    if fmt in ("hf", "torch_dcp"):
        return _foreign_reader(fmt, uri, allow_pickle, {"options": options, **reader_kwargs})
    raise MetadataError(f"unknown checkpoint format {format!r}")


# -- a directory of plain files written to a store (Hugging Face output) --------------------------

class ObjectDirectoryOutput:
    """A Hugging Face directory written to ``uri/``: the side files (config, tokenizer) first,
    the weight files as each rank finishes them, and the file that makes the directory usable
    last (the shard index, or the one ``model.safetensors``), so a reader never finds an index
    naming a shard not yet uploaded. The format has fixed file names and no commit object: an
    overwrite replaces the files in place (never atomic), then deletes what the old one had that
    the new one lacks. Without overwrite an existing directory is refused."""

    MARKERS = ("model.safetensors", "model.safetensors.index.json")

    def __init__(self, uri: str, overwrite: bool) -> None:
        self.uri, self.overwrite = uri.rstrip("/"), overwrite
        self.bucket = Bucket(self.uri)
        self.prefix = self.bucket.root
        if not self.prefix:
            raise ConfigError(f"{uri}: the output needs a name under the bucket (s3://bucket/name)")

    def begin(self) -> list[str]:
        """Coordinator: refuse an existing output (unless overwrite); returns the keys there now."""
        _, objs = self.bucket.list_dir(self.prefix)
        names = [o["path"].rsplit("/", 1)[-1] for o in objs]
        if any(n in self.MARKERS for n in names) and not self.overwrite:
            raise CheckpointExistsError(f"{self.uri} already holds a Hugging Face model; pass overwrite to replace it")
        return [o["path"] for o in objs]

    def key(self, name: str) -> str:
        return f"{self.prefix}/{check_file_name(name)}"

    def sink(self, name: str) -> Any:
        return self.bucket.writer(self.key(name))

    def put(self, name: str, data: bytes) -> None:
        self.bucket.put(self.key(name), data)

    def finish(self, before: list[str], written: list[str]) -> None:
        """Coordinator, after the last file: delete what an overwritten output had and this one lacks."""
        keep = {self.key(n) for n in written}
        self.bucket.delete([k for k in before if k not in keep])

    def abort(self, written: list[str]) -> None:
        try:
            self.bucket.delete([self.key(n) for n in written])
        except Exception as e:  # best effort
            log.warning("could not remove the partial output %s: %s", self.uri, e)

