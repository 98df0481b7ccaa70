"""The store's own digest of an object, checked where the checkpoint's format records none.

A Hugging Face safetensors file (and the data of other foreign formats) carries no checksum: a
byte flipped on the way from a bucket, or in a store's copy, loads as a wrong value. Stores keep
a whole-object digest of their own: S3 the MD5 as the ETag of an object uploaded in one part
(not of a multipart object, ``"<hex>-N"``, nor under SSE-KMS/SSE-C encryption, where the ETag is
some other 32 hex digits), GCS the MD5 as the ETag its XML API shows for an object not composed
of parts, Azure a ``Content-MD5`` property of a blob uploaded in one request (its ETag is a
version): our client does not expose that, so a signed HEAD per object reads it
(``Bucket.content_md5s``).

A load reads ranges, out of order across threads, and a part of an object only; an MD5 covers the
whole object in order. So an object is checked when the bytes that arrive cover it whole: the
pieces are hashed as they become contiguous from byte 0, by a thread of the watch's own while the
reader copies them out (pieces arriving early wait, up to a bound, then the object is skipped);
a round of reads counts as done only once its bytes are judged (:meth:`StoreDigests.settle`),
and when the last byte is hashed the MD5 is compared. A mismatch is judged by reading the object
once more, in order:

* the second read matches the store's MD5: the first bytes were corrupted on their way, and the
  load (which used them) fails, naming the object;
* the second read gives the same bytes again: the object truly differs from its ETag. That is
  corruption in the store when this bucket's ETags are known to be MD5s (another object under the
  checkpoint matched its own, checked once), and is reported as such; otherwise the ETag is not an
  MD5 here (encrypted objects) and the object is logged as not checkable (``mode="strict"`` fails
  instead);
* the second read differs from both: the store returns unstable bytes, an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import queue
import re
import threading
from typing import Any, Callable

from ...core.errors import ConfigError, CorruptCheckpointError
from ..stores import KINDS

log = logging.getLogger(__name__)

MODES = ("auto", "strict", "off")
_HEX = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{32})"?$')
_B64 = re.compile(r'^"?([A-Za-z0-9+/]{22}==)"?$')
PENDING_CAP = 64 << 20  # early pieces held per object before its check is given up
CALIBRATION_MAX = 4 << 20  # the largest object read whole to learn whether ETags are MD5s here
_REREAD_PART = 16 << 20


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"store_digests: {mode!r} is not one of {', '.join(MODES)}")
    return mode


def content_md5(scheme: str, etag: Any) -> str | None:
    """The MD5 (hex) an ETag states, where the store documents its ETags as content MD5s; None
    when it says nothing about the bytes (Azure, a multipart or composite object)."""
    if isinstance(etag, str) and etag.startswith("md5:"):  # read from the store's own MD5 property (Azure)
        return etag[4:].lower() if re.fullmatch(r"[0-9a-fA-F]{32}", etag[4:]) else None
    if not isinstance(etag, str) or KINDS.get(scheme) is None or KINDS[scheme].digest != "etag":
        return None
    m = _HEX.match(etag.strip())
    if m:
        return m.group(1).lower()
    m = _B64.match(etag.strip()) if scheme == "gs" else None  # GCS's JSON-API form, base64 of the MD5
    if m:
        try:
            raw = base64.b64decode(m.group(1), validate=True)
        except (binascii.Error, ValueError):
            return None
        return raw.hex() if len(raw) == 16 else None
    return None


class _Object:
    """One object's running MD5: the bytes hashed so far run from 0 to ``done``."""

    __slots__ = ("expected", "size", "md5", "done", "pending", "held", "state", "lock")

    def __init__(self, expected: str, size: int) -> None:
        self.expected, self.size = expected, size
        self.md5 = hashlib.md5()
        self.done = 0
        self.pending: dict[int, Any] = {}  # offset -> bytes that arrived before the bytes ahead of them
        self.held = 0
        self.state = "open"  # open | hashing | matched | skipped | unusable | failed
        self.lock = threading.Lock()


class StoreDigests:
    """The objects of one prefix whose store digests a load checks (see the module docstring).
    ``read_range(key, lo, hi)`` reads bytes again for a mismatch's second read."""

    def __init__(self, *, scheme: str, url: str, key_of: Callable[[str], str],
                 read_range: Callable[[str, int, int], Any], mode: str = "auto", counters: Any = None) -> None:
        self.scheme, self.url, self.key_of, self.read_range = scheme, url, key_of, read_range
        self.mode = check_mode(mode)
        self.counters = counters
        self._objects: dict[str, _Object] = {}
        self._calibrated: bool | None = None  # this prefix's ETags are MD5s (an object matched)
        kind = KINDS.get(scheme)
        self._by_etag = kind is None or kind.digest == "etag"  # (an ETag may be some other digest)
        self._calibration_lock = threading.Lock()
        self._listing: dict[str, tuple[int, str | None]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failures: list[Exception] = []
        self._lock = threading.Lock()

    def watch(self, listing: dict[str, tuple[int, Any]]) -> None:
        """Objects to check: {name: (size, ETag)} (those whose ETag states no MD5 are left out)."""
        if self.mode == "off":
            return
        for name, (size, etag) in listing.items():
            md5 = content_md5(self.scheme, etag)
            self._listing[name] = (size, md5)
            if md5 is not None and name not in self._objects:
                self._objects[name] = _Object(md5, size)

    def states(self) -> dict[str, str]:
        return {name: o.state for name, o in self._objects.items()}

    def _bump(self, what: str) -> None:
        if self.counters is not None:
            self.counters.bump(what)

    def feed(self, name: str, offset: int, data: Any, *, wait: bool = False) -> None:
        """Bytes [offset, offset + len(data)) of ``name`` arrived. They are hashed by a thread of
        this object's (the bytes go on to their destinations meanwhile); ``wait``: until hashed,
        raising CorruptCheckpointError when they completed an object that fails its digest (else
        :meth:`settle` raises it)."""
        o = self._objects.get(name)
        if o is None or o.state != "open":
            return
        view = memoryview(data).cast("B")
        with o.lock:
            if o.state != "open":
                return
            end = offset + len(view)
            if end <= o.done or not len(view):
                return  # read again (a header block, a second pass): hashed already
            if offset > o.done:
                if offset in o.pending and len(o.pending[offset]) >= len(view):
                    return
                o.held += len(view) - (len(o.pending[offset]) if offset in o.pending else 0)
                o.pending[offset] = view
                if o.held > PENDING_CAP:
                    self._skip(o)
                return
            self._hash(name, o, view[o.done - offset:])
            o.done = end
            self._drain(name, o)
            if o.done > o.size:  # more bytes than the listing said: a size check elsewhere reports it
                self._skip(o)
            elif o.done == o.size:
                o.state = "hashing"
                self._queue.put((name, o, None))  # the verdict, after the last bytes
        if wait:
            self.settle()

    def _hash(self, name: str, o: _Object, view: memoryview) -> None:
        if self._thread is None:
            with self._lock:  # (GET threads of several objects may get here at once)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._hasher, name="hpdcp-store-md5", daemon=True)
                    self._thread.start()
        self._queue.put((name, o, view))  # (under the object's lock: its pieces stay in order)

    def _hasher(self) -> None:
        while True:
            name, o, view = self._queue.get()
            try:
                if o is None:
                    return
                if view is not None:
                    o.md5.update(view)
                else:
                    self._judge(name, o)
            except Exception as e:  # a failed digest, or a failed second read (a storage error, as such)
                with self._lock:
                    self._failures.append(e)
            finally:
                self._queue.task_done()

    def settle(self) -> None:
        """Wait until every byte fed so far is hashed and judged; raise the first failure."""
        if self._thread is not None:
            self._queue.join()
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise failures[0]

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(("", None, None))
            self._thread.join()
            self._thread = None

    def round_ended(self) -> None:
        """A read round ended: an object still waiting for bytes before its early pieces is being
        read in part (a reshard's slices), so its check is given up and the pieces let go."""
        for o in self._objects.values():
            if o.state == "open" and o.pending:
                with o.lock:
                    if o.state == "open" and o.pending:
                        self._skip(o)

    def _drain(self, name: str, o: _Object) -> None:
        while o.pending:
            at = min(o.pending)
            if at > o.done:
                return
            view = o.pending.pop(at)
            o.held -= len(view)
            if at + len(view) > o.done:
                self._hash(name, o, view[o.done - at:])
                o.done = at + len(view)

    @staticmethod
    def _skip(o: _Object) -> None:
        o.state, o.pending, o.held = "skipped", {}, 0

    # -- a completed object ------------------------------------------------------------------
    def _judge(self, name: str, o: _Object) -> None:
        got = o.md5.hexdigest()
        if got == o.expected:
            o.state = "matched"
            self._calibrated = True
            self._bump("store_digests_matched")
            return
        o.state = "failed"
        where = f"{self.url}/{name}"
        what = "ETag" if self._by_etag else "Content-MD5"
        again = self._reread(name, o.size)
        if again == o.expected:
            raise CorruptCheckpointError(
                f"{where}: the bytes read do not match the store's MD5 of the object ({what} {o.expected}, read "
                f"{got}), and a second read does match it: the first read was corrupted on its way (load again)")
        if again != got:
            raise CorruptCheckpointError(
                f"{where}: two reads of the object returned different bytes (MD5 {got}, then {again}; the store "
                f"records {o.expected}): the store or the network is returning corrupted data")
        stored = f"{where}: the object's bytes do not match the MD5 the store recorded for it ({what} " \
                 f"{o.expected}, read twice: {got}): the stored copy is corrupted"
        if not self._by_etag:  # a Content-MD5 is the MD5 of the bytes, whatever the encryption
            raise CorruptCheckpointError(stored)
        if self.mode == "strict":
            raise CorruptCheckpointError(f"{stored} (dcp.storage.store_digests=strict: an ETag that is not an MD5 "
                                         f"reads as corruption too)")
        if self._etags_are_md5s(name):
            raise CorruptCheckpointError(f"{stored}. Other objects of this checkpoint match their ETags")
        o.state = "unusable"
        self._bump("store_digests_unusable")
        log.warning("%s: its ETag is not the MD5 of its bytes (read twice, the same bytes). This store does not "
                    "use MD5 ETags here (objects encrypted with SSE-KMS or SSE-C have such ETags), so the object "
                    "is not checked; run verify on a trusted copy", where)

    def _reread(self, name: str, size: int) -> str:
        md5, key = hashlib.md5(), self.key_of(name)
        for lo in range(0, size, _REREAD_PART):
            md5.update(memoryview(self.read_range(key, lo, min(size, lo + _REREAD_PART))).cast("B"))
        return md5.hexdigest()

    def _etags_are_md5s(self, failed: str) -> bool:
        """Whether another object of this prefix matched its ETag: read once, the smallest one
        with an MD5 ETag (up to ``CALIBRATION_MAX``), unless one matched during the load."""
        with self._calibration_lock:
            if self._calibrated is None:
                others = sorted((size, name) for name, (size, md5) in self._listing.items()
                                if md5 is not None and name != failed and size <= CALIBRATION_MAX)
                if others:
                    size, name = others[0]
                    self._calibrated = self._reread(name, size) == self._listing[name][1]
                else:
                    self._calibrated = False
            return self._calibrated
