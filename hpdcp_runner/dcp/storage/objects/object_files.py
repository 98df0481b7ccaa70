"""A checkpoint under a key prefix in an object store (see ``checkpoint_files``).

Ours is the save its commit object names (``object_checkpoint``), or a checkpoint directory
uploaded as it is; a foreign one (Hugging Face, torch DCP) is the prefix as it is. Bytes come from
ranged GETs fetched ahead concurrently, round by round (``concurrency`` in flight, ranges closer
than ``coalesce_bytes`` merged, cut into parts so one connection's rate does not bound a read)."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from ...core.errors import CheckpointNotFoundError, CorruptCheckpointError, HpdcpError
from ...core.rafile import RandomAccessFile
from ...format.metadata import METADATA_FILE
from ..checkpoint_files import CheckpointFiles, plain_name
from ..interfaces import IOCounters
from .object_checkpoint import SAVE_PREFIX, check_commit_matches, read_commit
from .object_store import RemoteFile
from ..store_client import StoreClient as Bucket
from .store_digests import StoreDigests


READ_PART_FLOOR = 1 << 20  # ranged GETs smaller than this cost more in requests than they gain


class StorePrefix(CheckpointFiles):
    """``committed``: our format, read from the save the commit object names (the pin); else the
    files under the prefix itself (an uploaded directory, a foreign checkpoint)."""

    shared = True

    def __init__(self, bucket: Bucket, *, committed: bool = True, commit: tuple | None = None) -> None:
        self.bucket = bucket
        self.url = bucket.url(bucket.root).rstrip("/")
        self.name_key = self.bucket.root
        self.counters = IOCounters()  # (the reader that owns these files sets its own)
        self.data: str | None = None if committed else ""  # the pinned save prefix ("" for the prefix itself)
        self.committed = committed
        self.round_bytes = self.bucket.options.read_buffer_bytes
        self._commit_seen = commit  # (read_commit's answer, seconds): read moments ago, used by the first pin
        self.listing = _Listing(self)
        self.digests = _DigestFeed(self)
        self.fetcher = _Fetcher(self)

    def _key(self, name: str) -> str:
        return "/".join(p for p in (self.name_key, self.data, name) if p)

    # -- the pin ------------------------------------------------------------------------------
    def _resolve(self) -> tuple[dict, dict] | None:
        """Pin the save the commit object names (returned), or the prefix itself when a checkpoint
        directory was uploaded there as it is (None); neither is not found."""
        if self._commit_seen is not None:  # the format's detection read it in this same load
            (got, seconds), self._commit_seen = self._commit_seen, None
        else:
            t0 = time.perf_counter()
            got = read_commit(self.bucket, self.name_key)
            seconds = time.perf_counter() - t0
        self.fetcher.observe(0, seconds)  # a small request: the store's latency
        if got is None and self.bucket.head(f"{self.name_key}/{METADATA_FILE}") is None:
            raise self.not_found()
        self.data = got[0]["data"] if got else ""
        return got

    def metadata_text(self, name: str, max_bytes: int) -> str:
        """The coordinator's read: the save's listing runs beside the metadata GET, and its sizes
        travel in the pin, so no other rank lists the save (one listing per load, not one per
        rank, and one round trip fewer before the first byte)."""
        got = self._resolve()
        with cf.ThreadPoolExecutor(1, thread_name_prefix="hpdcp-list") as pool:
            listed = pool.submit(self.listing.of_save)
            body = self.bucket.get(self._key(name), max_bytes=max_bytes)
            listed.result()
        if body is None:
            raise self.changed(f"its {name} disappeared")
        if got is not None:
            check_commit_matches(got[0], body[0], self.bucket.url(self._key(name)))
        return body[0].decode("utf-8", errors="replace")

    def pin_directory(self) -> None:
        if self.data is None:
            self._resolve()

    def pin(self) -> Any:
        """The save read (its id; "" for the prefix itself) and, once listed, its files' sizes
        (and the store's digests of them, for a rank that checks them)."""
        if self.listing.sizes is None:
            return self.data
        if not self.digests.wanted:
            return {"save": self.data, "sizes": self.listing.sizes}
        self.digests.watch()  # the digests final (Azure's read by HEADs) before they travel
        return {"save": self.data, "sizes": self.listing.sizes, "etags": self.digests.etags}

    def attach(self, pin: Any) -> None:
        if isinstance(pin, dict):
            self.data, self.listing.sizes = pin["save"], {str(k): int(v) for k, v in pin["sizes"].items()}
            self.digests.etags = {str(k): str(v) for k, v in (pin.get("etags") or {}).items()}
            self.digests.final = "etags" in pin
        elif pin is not None:
            self.data = pin
        self.pin_directory()

    def not_found(self) -> CheckpointNotFoundError:
        dirs, objs = self.bucket.list_dir(self.name_key)
        names = {o["path"].rsplit("/", 1)[-1] for o in objs}
        hint = ""
        if any(d.startswith(SAVE_PREFIX) for d in dirs):
            hint = " (only an uncommitted or abandoned save is there)"
        if names & {"model.safetensors", "model.safetensors.index.json"}:
            hint = "; it looks like a Hugging Face model directory (read it with format='hf' or 'auto')"
        elif ".metadata" in names:
            hint = "; it looks like a torch.distributed.checkpoint directory (format='torch_dcp' or 'auto')"
        return CheckpointNotFoundError(f"no committed checkpoint at {self.url}{hint}")

    def missing(self, name: str) -> HpdcpError:
        got = read_commit(self.bucket, self.name_key) if self.data else None
        if self.data and (got is None or got[0]["data"] != self.data):
            return self.changed("the save it names was replaced")
        return CheckpointNotFoundError(f"checkpoint file {self.url}/{name} is missing (listed in metadata.json)")

    # -- files --------------------------------------------------------------------------------
    # -- the store's own digests (foreign files: the format records none) -------------------------
    def check_store_digests(self) -> None:
        self.digests.wanted = self.bucket.options.store_digests != "off"

    def store_digest_states(self) -> dict[str, str]:
        """{file: matched | skipped | unusable | failed | hashing | open} of the objects with a store digest."""
        watch = self.digests.watch()
        return watch.states() if watch is not None else {}

    def require_directory(self) -> None:
        # (a foreign checkpoint may keep its files in directories only: Megatron's mp_rank_*)
        if not self.listing.of_save() and (self.committed or not self.bucket.list_dir(self._key(""))[0]):
            raise CheckpointNotFoundError(f"no checkpoint at {self.url} (nothing is stored under it)")

    def exists(self, name: str) -> bool:
        return name in self.listing.holding(name)

    def size_of(self, name: str) -> int:
        sizes = self.listing.holding(name)
        if name not in sizes:
            raise CheckpointNotFoundError(f"{self.url}/{name} is missing")
        return sizes[name]

    def read_small(self, name: str, max_bytes: int) -> bytes:
        self.pin_directory()
        got = self.bucket.get(self._key(plain_name(name, self.url)), max_bytes=max_bytes)  # over: an error naming it
        if got is None:
            raise CheckpointNotFoundError(f"{self.url}/{name} is missing")
        self.digests.feed(name, 0, got[0])
        return got[0]

    def open_random(self, name: str) -> RandomAccessFile:
        # its size from the listing a load makes anyway (check_sizes), not a HEAD of its own: one
        # round trip fewer before a load's first byte
        size = self.listing.holding(name).get(name)
        return RemoteFile(self.bucket, self._key(name), size, lambda: self.missing(name),
                          self.counters, self.digests.on_data(name))

    def check_sizes(self, names: Iterable[str], expected: dict[str, int]) -> None:
        for name in names:
            sizes = self.listing.holding(name)
            if name not in sizes:
                raise self.missing(name)
            if name in expected and sizes[name] != expected[name]:
                raise CorruptCheckpointError(f"checkpoint file {self.url}/{name} is {sizes[name]} bytes but "
                                             f"metadata.json records {expected[name]} (truncated or modified)")

    def open_handle(self, name: str, expected: int | None) -> RemoteFile:
        self.pin_directory()
        return RemoteFile(self.bucket, self._key(plain_name(name, self.url)), expected, lambda: self.missing(name),
                          self.counters, self.digests.on_data(name))

    def handles_kept(self, files_kept: int) -> int:
        return 1 << 30  # a handle holds nothing open

    def size(self, handle: RemoteFile) -> int:
        return handle.size()

    def pread_into(self, handle: RemoteFile, offset: int, view: memoryview, name: str) -> None:
        self.fetcher.serve(handle, offset, view, name)

    # -- fetching ahead (``_Fetcher``) ----------------------------------------------------------
    def fetch(self, ranges: Sequence[tuple[str, int, int]], handles: dict[str, Any]) -> None:
        self.fetcher.fetch(ranges, handles)

    def release(self) -> None:
        """Drop the round's buffers, then the store digests' verdicts on its bytes."""
        self.fetcher.release()
        self.digests.round_ended()

    def bytes_arrived(self) -> int:
        return self.fetcher.arrived

    def close(self) -> None:
        try:
            self.release()
        finally:
            self.digests.close()


class _Listing:
    """What is under the pinned save (or the prefix): one listing, {file name: size}, and the
    subdirectories of a foreign prefix listed when a name inside them is asked for."""

    def __init__(self, files: StorePrefix) -> None:
        self.files = files
        self.sizes: dict[str, int] | None = None  # one listing of the pinned save
        self._below: set[str] = set()  # a foreign prefix's subdirectories listed (for names inside them)
        self._below_lock = threading.Lock()

    def of_save(self) -> dict[str, int]:
        """One listing of the pinned save (or the prefix): {file name: size}."""
        f = self.files
        f.pin_directory()
        if self.sizes is None:
            base = f._key("")
            if f.data:
                objs = {o["path"][len(base) + 1:]: o for o in f.bucket.list(base)}
            else:
                objs = {o["path"].rsplit("/", 1)[-1]: o for o in f.bucket.list_dir(base)[1]}
            self.sizes = {name: o["size"] for name, o in objs.items()}
            f.digests.etags = {name: o["e_tag"] for name, o in objs.items() if o.get("e_tag")}
        return self.sizes

    def holding(self, name: str) -> dict[str, int]:
        """The listing, holding ``name``'s size when it is there: a foreign checkpoint's listing
        is its top level only (a Hugging Face repo's subfolders are not its files), so a name in
        a subdirectory (``zero/<param>/fp32.pt``) lists everything under its first part once."""
        f = self.files
        sizes = self.of_save()
        name = plain_name(name, f.url)
        top = name.split("/", 1)[0]
        if "/" in name and name not in sizes and not f.data:
            with self._below_lock:  # (describing threads: the second waits for the first's listing)
                if top not in self._below:
                    base = f._key("")
                    for o in f.bucket.list(f._key(top)):
                        rel = o["path"][len(base) + 1:]
                        if rel.startswith(f"{top}/"):
                            sizes[rel] = o["size"]
                            if o.get("e_tag"):
                                f.digests.etags[rel] = o["e_tag"]
                    self._below.add(top)
        return sizes


class _DigestFeed:
    """The store's own digests of a foreign checkpoint's objects (``store_digests``), fed every
    range that is read: asked for by ``check_store_digests``, judged round by round."""

    def __init__(self, files: StorePrefix) -> None:
        self.files = files
        self.wanted = False
        self.etags: dict[str, str] = {}  # of the listing: the store's digests, where they are MD5s
        self.final = False  # Azure's Content-MD5s read (here, or by the rank that pinned)
        self._watch: StoreDigests | None = None

    def watch(self) -> StoreDigests | None:
        if not self.wanted:
            return None
        if self._watch is None:
            f = self.files
            sizes = f.listing.of_save()
            if f.bucket.kind.digest == "content-md5" and not self.final:
                # a HEAD each (the listing does not carry it), on the rank that pins the
                # checkpoint; the others get them in the pin
                found = f.bucket.content_md5s([f._key(name) for name in sizes])
                self.etags = {name: f"md5:{found[f._key(name)]}" for name in sizes if f._key(name) in found}
            self.final = True
            self._watch = StoreDigests(scheme=f.bucket.scheme, url=f.url, key_of=f._key,
                                       read_range=f.bucket.get_range, mode=f.bucket.options.store_digests,
                                       counters=f.counters)
            self._watch.watch({name: (size, self.etags.get(name)) for name, size in sizes.items()})
        return self._watch

    def feed(self, name: str, offset: int, data: Any, wait: bool = True) -> None:
        """``wait``: until hashed (a read the caller uses now); a round's GETs go on instead, and
        ``round_ended`` waits for their verdicts before the round counts as read."""
        watch = self.watch()
        if watch is not None:
            watch.feed(name, offset, data, wait=wait)

    def on_data(self, name: str) -> Callable[[int, Any], None] | None:
        return (lambda offset, data: self.feed(name, offset, data)) if self.wanted else None

    def round_ended(self) -> None:
        if self._watch is not None:
            self._watch.round_ended()
            self._watch.settle()  # the round's bytes judged before the load may use them as read

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()


class _Fetcher:
    """A round's ranges fetched ahead of its reads (``fetch``), reads served from them
    (``serve``), and the cost model measured on these files' own requests."""

    _DEFAULT_LATENCY_S = 0.01
    _DEFAULT_BANDWIDTH = 100e6  # bytes/s of one connection, until a large GET says otherwise

    def __init__(self, files: StorePrefix) -> None:
        self.files = files
        self._fetched: dict[str, list[tuple[int, int, cf.Future]]] = {}  # (lo, hi, its GET) per file
        self._pool: cf.ThreadPoolExecutor | None = None  # the round's GETs in flight
        self._samples: list[tuple[int, float]] = []  # (bytes, seconds) of requests: the cost model
        self.arrived = 0
        self._arrived_lock = threading.Lock()

    def serve(self, handle: RemoteFile, offset: int, view: memoryview, name: str) -> None:
        """From the ranges fetched ahead when they hold it (waiting for those still in flight),
        else one ranged GET."""
        n = len(view)
        pieces = self._fetched.get(name, ())
        k = bisect.bisect_right(pieces, (offset, float("inf"))) - 1  # the piece holding ``offset``
        at = offset
        while 0 <= k < len(pieces) and at < offset + n and pieces[k][0] <= at < pieces[k][1]:
            lo, hi, got = pieces[k]
            buf = memoryview(got.result())  # (a failed GET raises here, as it would have in fetch)
            if len(buf) != hi - lo:
                raise CorruptCheckpointError(f"{self.files.url}/{name}: short read of bytes {lo}..{hi} (truncated?)")
            take = min(hi, offset + n) - at
            view[at - offset:at - offset + take] = buf[at - lo:at - lo + take]
            at += take
            k += 1
        if at == offset + n:
            return
        data = handle.pread(n, offset)
        if len(data) != n:
            raise CorruptCheckpointError(f"{self.files.url}/{name}: short read of {n} bytes at offset {offset} (truncated?)")
        view[:] = data

    # -- fetching ahead -------------------------------------------------------------------------
    def fetch(self, ranges: Sequence[tuple[str, int, int]], handles: dict[str, Any]) -> None:
        """Start fetching these ranges and return: coalesced per file, cut into parts
        (``Bucket.part_for`` the round's bytes: at most ``part_size``, small enough to keep every
        connection busy; a store serves one connection at a bounded rate, many at once in
        parallel), GET ``concurrency`` at a time in file and offset order. ``pread_into`` waits
        only for the parts it reads, so the reader copies and verifies the first chunks while
        the later ones are still arriving (measured: the copy and checksums of a round no longer
        follow its last GET)."""
        self.release()
        o = self.files.bucket.options
        merged: list[tuple[str, int, int]] = []
        for name, lo, hi in sorted(ranges):
            if hi <= lo:
                continue
            if merged and merged[-1][0] == name and lo - merged[-1][2] <= self.coalesce_bytes():
                if hi > merged[-1][2]:
                    merged[-1] = (name, merged[-1][1], hi)
            else:
                merged.append((name, lo, hi))
        step = self.files.bucket.part_for(sum(hi - lo for _, lo, hi in merged), READ_PART_FLOOR)
        merged = [(name, a, min(a + step, hi)) for name, lo, hi in merged for a in range(lo, hi, step)]
        for name, lo, hi in merged:
            if hi > handles[name].size():
                raise CorruptCheckpointError(f"{self.files.url}/{name}: a read of bytes {lo}..{hi} would end past the "
                                             f"file's {handles[name].size()} bytes (truncated file or bad metadata)")
        if not merged:
            return
        self.files.digests.watch()  # made here, before the GETs that feed it run in threads

        def get(name: str, key: str, lo: int, hi: int) -> Any:
            t0 = time.perf_counter()
            try:
                buf = self.files.bucket.get_range(key, lo, hi)
            except CheckpointNotFoundError:
                raise self.files.missing(name) from None
            self.observe(hi - lo, time.perf_counter() - t0)
            with self._arrived_lock:
                self.arrived += hi - lo
            self.files.digests.feed(name, lo, buf, wait=False)
            return buf

        self._pool = cf.ThreadPoolExecutor(max_workers=min(o.concurrency, len(merged)), thread_name_prefix="hpdcp-get")
        for name, lo, hi in merged:
            self._fetched.setdefault(name, []).append((lo, hi, self._pool.submit(get, name, handles[name].key, lo, hi)))
            self.files.counters.bump("store_requests")
            self.files.counters.bump("bytes_requested", hi - lo)
        for pieces in self._fetched.values():
            pieces.sort(key=lambda p: p[0])

    def release(self) -> None:
        """Drop the round's buffers; GETs not started are cancelled, running ones waited for (no
        thread outlives the round, e.g. after a checksum failure)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._fetched.clear()

    def observe(self, nbytes: int, seconds: float) -> None:
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
        o = self.files.bucket.options
        if o.coalesce_bytes is not None:
            return o.coalesce_bytes
        lat, bw = self.cost_model_now()
        return int(min(max(lat * bw, 64 << 10), o.part_size))
