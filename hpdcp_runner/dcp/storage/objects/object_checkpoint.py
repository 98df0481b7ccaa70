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

import datetime as _dt
import json
import os
import posixpath
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ...core import faults
from ...core.errors import (CheckpointChangedError, CheckpointExistsError, ConfigError, CorruptCheckpointError,
                           HpdcpError, MetadataError, StorageAccessError)
from ...core.utils import get_logger
from ...format import jsondoc
from ...format.chunk_index import INDEX_FILE
from ...format.metadata import METADATA_FILE, FileMeta, Metadata, check_file_name, dtype_name
from ...format.objects import encode_object_file
from ...format.chunk_index import ChunkIndex
from ...format.safetensors_io import SafetensorsStreamWriter, digest, index_parts
from ..posix.filesystem import rank_file
from ..interfaces import IOCounters, StorageWriter, WriteResult
from .object_store import ObjectStoreOptions, RemoteFile
from ..catalog import Catalog
from ..store_client import StoreClient as Bucket, open_client
from ..uri import is_uri, normalize

log = get_logger(__name__)
COMMIT_OBJECT = "hpdcp-commit.json"
LEASE_OBJECT = ".lease"
SAVE_PREFIX = "save-"
_COMMIT_FORMAT = "hpdcp-commit"
_MAX_COMMIT_BYTES = 1 << 20
_MAX_SCAN_BYTES = 256 << 20  # a metadata.json larger than this is not read while listing a series


def server_now(bucket: Bucket, key: str, written: bool = False) -> _dt.datetime:
    """The store's clock now: the time it gives an object written at ``key`` (a probe deleted
    again; ``written``: one just written, e.g. a save's lease). Ages of what others wrote are
    judged on this clock, never the local one, which may be ahead of the store's by more than
    any grace."""
    if not written:
        bucket.put(key, b"{}")
    meta = bucket.head(key)
    if not written:
        bucket.delete([key])
    if meta is None or not isinstance(meta.get("last_modified"), _dt.datetime):
        raise StorageAccessError(f"{bucket.url(key)}: the store did not report the time of an object just written")
    return meta["last_modified"]


def read_commit(bucket: Bucket, name_key: str) -> tuple[dict, dict] | None:
    """(commit document, the object's meta: ``e_tag``, ``last_modified``) of the checkpoint at
    key ``name_key``, or None."""
    got = bucket.get(f"{name_key}/{COMMIT_OBJECT}", max_bytes=_MAX_COMMIT_BYTES)
    if got is None:
        return None
    body, meta = got
    doc = jsondoc.parse(body, bucket.url(name_key + '/' + COMMIT_OBJECT))
    data = doc.get("data") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("format") == _COMMIT_FORMAT and isinstance(data, str)
            and data.startswith(SAVE_PREFIX) and "/" not in data):
        raise MetadataError(f"{bucket.url(name_key + '/' + COMMIT_OBJECT)} is not an hpdcp commit object")
    return doc, meta


def check_commit_matches(doc: dict, body: bytes, where: str) -> None:
    """The metadata a commit names is the one it published: its recorded size and checksum. A
    commit is never trusted alone (one naming tampered or replaced metadata does not load)."""
    size, checksum = doc.get("metadata_size"), doc.get("metadata_checksum")
    if size is None and checksum is None:
        return  # a commit written before these were recorded
    if size != len(body) or checksum != digest(body):
        raise CorruptCheckpointError(f"{where} does not match the commit that published it (it records "
                                     f"{size} bytes, checksum {checksum}; the object is {len(body)} bytes, checksum "
                                     f"{digest(body)}): modified after the commit")


def _commit_disagrees(bucket: Bucket, key: str, doc: dict) -> str | None:
    """Why the metadata a commit names does not back it (None: it does)."""
    try:
        got = bucket.get(key, max_bytes=_MAX_SCAN_BYTES)
    except StorageAccessError as e:
        return f"whose metadata cannot be read ({e})"
    if got is None:
        return "which holds no metadata"
    try:
        check_commit_matches(doc, got[0], bucket.url(key))
        recorded = jsondoc.parse(got[0], bucket.url(key), CorruptCheckpointError).get("extra") or {}
    except (CorruptCheckpointError, ValueError, AttributeError) as e:
        return f"whose metadata does not match it ({str(e)[:200]})"
    mine = doc.get("extra") if isinstance(doc.get("extra"), dict) else {}
    for field in ("series", "step"):
        if recorded.get(field) != mine.get(field):
            return f"whose metadata records {field} {recorded.get(field)!r}, not the commit's {mine.get(field)!r}"
    return None


def clean_orphans(bucket: Bucket, name_key: str, commit: tuple[dict, dict] | None,
                  now: _dt.datetime | Callable[[], _dt.datetime], own: str | None = None,
                  listing: Iterable[dict] | None = None) -> list[str]:
    """Delete the save prefixes under ``name_key`` that ``commit`` (its ``read_commit``) does not
    name and nothing touched for ``orphan_grace_s`` (a live save refreshes its lease; a
    superseded checkpoint is kept that long after the commit that replaced it, for loads still
    reading it), ages judged against ``now`` on the store's clock (:func:`server_now`). Only a
    prefix holding our lease object is ours to delete: a user's own ``save-*`` folder never is.
    ``own``: the caller's own save, never collected. ``now`` may be a function, asked only when
    some prefix is a candidate (a save of a new name pays no request for the clock);
    ``listing``: ``bucket.list(name_key)`` when the caller has it. Returns them."""
    grace = _dt.timedelta(seconds=bucket.options.orphan_grace_s)
    current = commit[0]["data"] if commit else None
    commit_time = commit[1]["last_modified"] if commit else None
    newest: dict[str, _dt.datetime] = {}
    keys: dict[str, list[str]] = {}
    leased: set[str] = set()
    for o in bucket.list(name_key) if listing is None else listing:
        rel = o["path"][len(name_key) + 1:]
        prefix = rel.split("/", 1)[0]
        if not prefix.startswith(SAVE_PREFIX) or "/" not in rel:
            continue
        keys.setdefault(prefix, []).append(o["path"])
        newest[prefix] = max(newest.get(prefix, o["last_modified"]), o["last_modified"])
        if rel == f"{prefix}/{LEASE_OBJECT}":
            leased.add(prefix)
    gone = []
    if callable(now) and any(p not in (current, own) and p in leased for p in newest):
        now = now()
    for prefix, when in newest.items():
        if prefix in (current, own) or prefix not in leased or now - when < grace:
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
    there), then delete the save it named. Other saves under the name (abandoned, superseded)
    are collected by later clean-ups once their grace is over; nothing else there is ours."""
    got = read_commit(bucket, name_key)
    bucket.delete([f"{name_key}/{COMMIT_OBJECT}"])
    if got is not None:
        bucket.delete([o["path"] for o in bucket.list(f"{name_key}/{got[0]['data']}")])


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


#: (store kind, endpoint, bucket) -> (creates honoured, replaces honoured), probed once per process
_HONOURS_CONDITIONS: dict[tuple, tuple[bool, bool]] = {}


def _store_identity(bucket: Bucket) -> tuple[str, str, str]:
    """What a conditional-write verdict belongs to: the kind of store, the endpoint its client
    really talks to (the option, else that kind's own environment variable, else its default),
    and the bucket. A verdict for an Azure container is never taken for an S3 bucket of the same
    name, nor one endpoint's for another's."""
    kind = bucket.kind
    endpoint = (bucket.options.endpoint or (os.environ.get(kind.endpoint_env) if kind.endpoint_env else None)
                or (f"{kind.scheme}:default" if kind.endpoint_env else f"{kind.scheme}://{bucket.bucket}"))
    return kind.scheme, endpoint, bucket.bucket


def _probe_conditions(bucket: Bucket, probe_key: str) -> tuple[bool, bool]:
    """(creates honoured, replaces honoured), found by doing both on a fresh key: a second create
    must be refused, and a replace naming the first version after it was replaced (a stale ETag
    or generation) must be refused too. S3 gained If-None-Match and If-Match months apart and
    S3-compatible stores differ, so one never vouches for the other."""
    first = bucket.put(probe_key, b"1", mode="create")
    try:
        try:
            bucket.put(probe_key, b"2", mode="create")
            creates = False
        except FileExistsError:
            creates = True
        current = bucket.head(probe_key) or first
        try:
            bucket.put(probe_key, b"3", mode=current)  # the current version: must succeed
        except FileExistsError:
            return creates, False
        try:
            bucket.put(probe_key, b"4", mode=current)  # now stale: must be refused
            replaces = False
        except FileExistsError:
            replaces = True
        return creates, replaces
    finally:
        bucket.delete([probe_key])


def check_conditional_writes(bucket: Bucket, probe_key: str, *, replacing: bool = False) -> None:
    """The commit's safety rests on conditional writes: a create-if-absent for a new name, a
    replace-if-unchanged for an overwrite. Probed once per store kind, endpoint and bucket; a save
    that needs the kind the store ignores is refused unless ``unconditional_ok`` (then a warning
    says what is no longer guaranteed)."""
    o = bucket.options
    ident = _store_identity(bucket)
    if ident not in _HONOURS_CONDITIONS:
        _HONOURS_CONDITIONS[ident] = _probe_conditions(bucket, probe_key)
    creates, replaces = _HONOURS_CONDITIONS[ident]
    if creates and (replaces or not replacing):
        return
    create, replace = bucket.kind.conditions
    header, what = (create, "two saves of one name could both report success and one be lost") \
        if not creates else (replace, "two overwrites of one name could both report success and one be lost")
    if not o.unconditional_ok:
        raise ConfigError(f"{bucket.url(probe_key.rsplit('/', 1)[0])}: the store at {ident[1]} ignores conditional "
                          f"{'creates' if not creates else 'replaces'} ({header}), so {what}; use a store that "
                          f"honours them, or set dcp.storage.unconditional_ok=true and never run two saves of one "
                          f"name at once")
    log.warning("%s ignores conditional writes (%s): a concurrent save of the same name can silently replace this one "
                "(dcp.storage.unconditional_ok=true)", bucket.url(bucket.root), header)


_JOINED_INDEX = 64 << 20  # a chunk index up to this size is joined and PUT whole; a larger one streamed


class _UploadSink:
    """One object uploaded block by block (a copied file): ``close`` completes the upload, so an
    aborted one is never visible."""

    def __init__(self, upload: Any, counters: IOCounters) -> None:
        self._up, self.counters = upload, counters

    def write(self, data: bytes) -> None:
        self._up.write(data)  # (a new buffer per block: the upload reads it when it sends the part)
        self.counters.bytes_written += len(data)

    def close(self) -> None:
        self._up.close()
        self.counters.files_written += 1

    def abort(self) -> None:
        self._up = None


class ObjectStoreWriter(StorageWriter):
    """Per-rank safetensors objects streamed under a save prefix unique to this save, published
    by the conditional write of the commit object (module docstring)."""

    def __init__(self, uri: str, *, options: ObjectStoreOptions | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.bucket = open_client(self.uri, options)
        self.name_key = self.bucket.root
        if not self.name_key:
            raise ConfigError(f"{uri}: a checkpoint needs a name under the bucket (s3://bucket/name)")
        self.counters = IOCounters()
        self.save_id: str | None = None
        self.rank = 0
        self._replaces: dict | None = None  # the meta (ETag, generation) of the commit this save replaces
        self._lease: _Lease | None = None
        self._written: list[str] = []  # keys this rank wrote (or may have: an upload in flight)

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.uri

    def _key(self, name: str) -> str:
        return f"{self.name_key}/{self.save_id}/{name}"

    def begin(self, *, overwrite: bool) -> str:
        # one listing of the name says whether a commit or an uploaded directory is there (a save
        # of a new name reads nothing else) and feeds the clean-up of abandoned saves below; the
        # lease of this save is written beside it (one round trip before the first byte, not two)
        self.overwrite = overwrite
        self.save_id = f"{SAVE_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}"
        with ThreadPoolExecutor(1, thread_name_prefix="hpdcp-begin") as pool:
            leasing = pool.submit(_Lease, self.bucket, self._key(LEASE_OBJECT))
            try:
                listing = list(self.bucket.list(self.name_key))
                names = {o["path"][len(self.name_key) + 1:] for o in listing}
                got = read_commit(self.bucket, self.name_key) if COMMIT_OBJECT in names else None
                uploaded = got is None and METADATA_FILE in names
                if (got is not None or uploaded) and not overwrite:  # an uploaded directory is a checkpoint too
                    raise CheckpointExistsError(f"checkpoint {self.uri} already exists; pass overwrite=True to replace "
                                                f"it (the old one stays loadable until the new one commits)")
                check_conditional_writes(self.bucket, self._key(".probe"), replacing=got is not None)
            except BaseException:
                self._drop_lease(leasing)
                raise
            self._lease = leasing.result()
        self._replaces = got[1] if got else None
        # the lease's own time is "now" on the store's clock (never this machine's)
        clean_orphans(self.bucket, self.name_key, got,
                      lambda: server_now(self.bucket, self._key(LEASE_OBJECT), written=True), own=self.save_id,
                      listing=listing)
        return self.save_id

    def _drop_lease(self, leasing: Any) -> None:
        """A save refused in ``begin``: its lease, written beside the listing, goes again."""
        try:
            leasing.result().release()
            self.bucket.delete([self._key(LEASE_OBJECT)])
        except Exception as e:  # (not written, or not removable: a later save's clean-up takes it)
            log.debug("no lease to remove for %s: %s", self.uri, e)

    def attach(self, token: str, *, rank: int, world_size: int) -> None:
        if not (isinstance(token, str) and token.startswith(SAVE_PREFIX) and "/" not in token):
            raise MetadataError(f"{self.uri}: bad save token {token!r}")
        self.save_id, self.rank = token, rank

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], objects: Mapping[str, Any]) -> WriteResult:
        files, chunks, objs = [], {}, {}
        if tensors:
            name = rank_file(self.rank, "safetensors")
            self._written.append(self._key(name))
            w = SafetensorsStreamWriter(self.bucket.url(self._key(name)),
                                        [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors],
                                        meta={"format": "pt"},
                                        sink=self.bucket.writer(self._key(name),
                                                                sum(t.numel() * t.element_size() for _, t in tensors)))
            try:
                for key, t in tensors:
                    w.append(key, t)
                    self.counters.bytes_written += t.numel() * t.element_size()
                with self.counters.staged("finishing the upload"):
                    wf = w.close()
            except BaseException:
                w.abort()
                raise
            self.counters.files_written += 1  # (counted as each completes: progress shows it move)
            files.append(FileMeta(name, wf.size, wf.checksum, self.rank))
            for e in wf.entries:
                chunks[e.key] = (name, e.byte_offset, e.checksum, e.blocks)
        if objects:
            name = rank_file(self.rank, "objects.json")
            body, digests = encode_object_file(objects)
            self._written.append(self._key(name))
            self.bucket.put(self._key(name), body)
            files.append(FileMeta(name, len(body), digest(body), self.rank))
            objs.update((k, (name, d)) for k, d in digests.items())
            self.counters.bytes_written += len(body)
            self.counters.files_written += 1
        return WriteResult(self.rank, tuple(files), chunks, objs)

    def upload_file(self, name: str, local_path: str) -> None:
        """Stream one file written locally (an import's rank file) into this save, unchanged: the
        metadata that describes it locally describes it here."""
        check_file_name(name)
        self._written.append(self._key(name))
        self.counters.bytes_written += self.bucket.upload_file(self._key(name), local_path)
        self.counters.files_written += 1

    def commit(self, metadata: Metadata) -> None:
        self._commit(metadata, metadata.to_json().encode(), metadata.index)  # format v2: with the chunk index

    def open_sink(self, name: str, size: int) -> "_UploadSink":
        check_file_name(name)
        self._written.append(self._key(name))
        return _UploadSink(self.bucket.writer(self._key(name), size), self.counters)

    def commit_copy(self, metadata: Metadata, body: bytes) -> None:
        self._commit(metadata, body, None)

    def _put_index(self, index: ChunkIndex) -> None:
        """The chunk index streamed from its columns in memory: no joined copy of it (1.2 GB at
        8,192 ranks x 2,000 tensors, which doubled the coordinator's memory at its commit)."""
        key = self._key(INDEX_FILE)
        parts = index_parts(index)
        size = sum(len(p) for p in parts)
        if size <= _JOINED_INDEX:  # one PUT, as every other small object
            self.bucket.put(key, b"".join(parts))
            return
        try:
            up = self.bucket.writer(key, size)
            for p in parts:
                up.write(p)
            up.close()
        except HpdcpError:
            raise
        except Exception as e:
            raise self.bucket.error(e, "writing", key) from None

    def _commit(self, metadata: Metadata, body: bytes, index: ChunkIndex | None) -> None:
        """The chunk index (if given) and ``metadata.json`` written while this save's prefix is
        listed to check every rank's files (one round trip for the three), then the conditional
        commit object: two round trips on the commit's critical path, not four."""
        key = f"{self.name_key}/{COMMIT_OBJECT}"
        try:
            # the publishing round starts here (as the rename does locally); the listing below is
            # as late as before: one round trip before the commit object
            faults.point("commit.rename", path=self.uri)
            with ThreadPoolExecutor(3, thread_name_prefix="hpdcp-commit") as pool:
                puts = [pool.submit(self.bucket.put, self._key(METADATA_FILE), body)]
                if index is not None:
                    puts.append(pool.submit(self._put_index, index))
                listed = pool.submit(self._listed)
                for f in puts:
                    f.result()
                have = listed.result()
            doc = {"format": _COMMIT_FORMAT, "version": 1, "data": self.save_id, "metadata_size": len(body),
                   "metadata_checksum": digest(body), "extra": dict(metadata.extra or {})}
            self._check_complete(metadata, have)  # never publish a save whose files are gone
            self._publish(key, json.dumps(doc, separators=(",", ":")).encode())
        finally:
            self._stop_lease()  # (its object stays: it proves the save ours once superseded)

    def _listed(self) -> dict[str, int]:
        base = f"{self.name_key}/{self.save_id}/"
        return {o["path"][len(base):]: o["size"] for o in self.bucket.list(base.rstrip("/"))}

    def _check_complete(self, metadata: Metadata, have: dict[str, int]) -> None:
        """Every rank file the metadata names is in this save's prefix (``have``: its listing) at
        its recorded size (another process may have deleted them: a commit naming them would
        publish a checkpoint that does not load)."""
        want = {n: f.size for n, f in metadata.files.items()}
        for name, size in sorted(want.items()):
            if have.get(name) != size:
                got = "missing" if name not in have else f"{have[name]} bytes, not {size}"
                raise CheckpointChangedError(f"{self.uri}: this save's {name} is {got} in the store just before its "
                                             f"commit (deleted or replaced by another process); nothing was committed")

    def _publish(self, key: str, body: bytes) -> None:
        """The conditional write of the commit object. A refusal or an error may hide a write that
        landed (its reply lost, the client's retry then refused): the commit is read back and
        decides. Never reports failure for a commit that names this save, nor success for one
        that does not."""
        try:
            self.bucket.put(key, body, mode=self._replaces if self._replaces else "create")
            return
        except FileExistsError:
            refused: Exception = CheckpointExistsError(
                f"{self.uri} was {'replaced' if self._replaces else 'committed'} by another save while this one was in "
                f"progress; nothing was committed")
        except HpdcpError as e:
            refused = e
        try:
            now = read_commit(self.bucket, self.name_key)
        except HpdcpError:
            now = None
        if now is not None and now[0].get("data") == self.save_id:
            log.warning("the commit of %s was applied although its reply was lost; read back: committed", self.uri)
            return
        raise refused from None

    def abort(self) -> None:
        self._stop_lease()
        if self.save_id:
            try:
                got = read_commit(self.bucket, self.name_key)
                if got is not None and got[0].get("data") == self.save_id:  # published after all: never ours to delete
                    log.warning("not removing %s/%s: the commit names it", self.uri, self.save_id)
                    return
                # the lease stays: an upload of another rank that completes after this listing lands
                # beside it, provably ours, and a later clean-up collects both after the grace
                lease = self._key(LEASE_OBJECT)
                self.bucket.delete([o["path"] for o in self.bucket.list(f"{self.name_key}/{self.save_id}")
                                    if o["path"] != lease])
            except Exception as e:  # best effort: a later save removes what is left
                log.warning("could not remove the aborted save %s: %s", self.uri, e)

    def discard_own(self) -> None:
        """This rank's uploads go (an upload can complete after the coordinator's abort listed
        the save), unless a commit names this save after all."""
        keys, self._written = self._written, []
        if not keys or not self.save_id:
            return
        try:
            got = read_commit(self.bucket, self.name_key)
            if got is not None and got[0].get("data") == self.save_id:
                return
            self.bucket.delete(keys)
        except Exception as e:  # best effort: the save's lease marks it for a later clean-up
            log.warning("could not remove this rank's uploads of the failed save %s: %s", self.uri, e)

    def _stop_lease(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def reopen_args(self) -> dict[str, Any] | None:
        # (exactly this class: a subclass may do what a plain writer reopened elsewhere would not)
        return {"path": self.uri, "fsync": True, "store_options": self.bucket.options} \
            if type(self) is ObjectStoreWriter else None

    def committed_opener(self) -> Callable[[str], Any]:
        """How other ranks open the committed checkpoint's files (the index, lazily)."""
        bucket, prefix = self.bucket, f"{self.name_key}/{self.save_id}"
        return lambda name: RemoteFile(bucket, f"{prefix}/{check_file_name(name)}", None)


# -- directories of checkpoints (retention, latest) ----------------------------------------------

def committed_extras(bucket: Bucket, name_ok: Callable[[str], Any]) -> list[tuple[str, dict | None]]:
    """(name, the ``extra`` its commit records) of each committed checkpoint under ``bucket``'s
    prefix whose name passes ``name_ok``: one listing, then two GETs per candidate (the commit, the
    metadata it names). A commit is not trusted alone: the save it names must hold the metadata
    it records (size and checksum), and that metadata must record the same series and step,
    else the name is left out (never latest, never counted by retention)."""
    out = []
    for name in sorted(bucket.list_dir(bucket.root)[0]):
        if name.startswith(".") or not name_ok(name):
            continue
        try:
            got = read_commit(bucket, bucket.key(name))
        except (MetadataError, StorageAccessError):
            continue  # not one of ours (or not readable): never touched
        if got is None:
            continue
        doc = got[0]
        extra = doc.get("extra")
        why = _commit_disagrees(bucket, bucket.key(name, doc["data"], METADATA_FILE), doc)
        if why:
            log.warning("%s is not counted as a checkpoint: its commit names %s, %s", bucket.url(bucket.key(name)),
                        doc["data"], why)
            continue
        out.append((name, extra if isinstance(extra, dict) else None))
    return out


def clean_directory_orphans(bucket: Bucket, keep: Iterable[str] = ()) -> None:
    """Abandoned and superseded saves of every checkpoint under ``bucket``'s prefix (after a grace)."""
    names = [n for n in bucket.list_dir(bucket.root)[0] if n not in set(keep)]
    if not names:
        return
    now = server_now(bucket, bucket.key(f".hpdcp-clock-{uuid.uuid4().hex[:12]}"))
    for name in names:
        try:
            clean_orphans(bucket, bucket.key(name), read_commit(bucket, bucket.key(name)), now)
        except MetadataError:
            continue  # not one of ours
        except StorageAccessError as e:  # e.g. a key the client cannot list (a '..' segment): skip it
            log.warning("retention skipped %s: %s", bucket.url(bucket.key(name)), e)


class StoreCatalog(Catalog):
    """The committed checkpoints under a store prefix: each name whose commit object names a
    save holding the metadata it records."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket

    def checkpoints(self, name_ok: Callable[[str], Any], *, repair: bool = False) -> list[tuple[str, dict | None]]:
        return committed_extras(self.bucket, name_ok)

    def tidy(self, keep: Iterable[str] = ()) -> None:
        clean_directory_orphans(self.bucket, keep)

    def delete(self, name: str) -> None:
        delete_checkpoint(self.bucket, self.bucket.key(name))


def remove_checkpoint(path: str) -> None:
    """Delete a scratch directory the caller wrote whole (a benchmark's checkpoints, ours or a
    peer's), wherever it is, best effort: everything under it goes. A store's commit object goes
    first, so a checkpoint there is never half present under its name."""
    if is_uri(path):
        bucket = open_client(normalize(path))
        bucket.delete([bucket.key(COMMIT_OBJECT)])
        bucket.delete([o["path"] for o in bucket.list(bucket.root)])
    else:
        shutil.rmtree(path, ignore_errors=True)


# -- a directory of plain files written to a store (Hugging Face output) --------------------------

class ObjectDirectoryOutput:
    """A Hugging Face directory written to ``uri/``: the side files (config, tokenizer) first,
    the weight files as each rank finishes them, and the file that makes the directory usable
    last (the shard index, or the one ``model.safetensors``), so a reader never finds an index
    naming a shard not yet uploaded. The format has fixed file names and no commit object: an
    overwrite replaces the files in place (never atomic), then deletes the weight files the old
    export wrote that the new one lacks. What the old export wrote is what its manifest
    (``.hpdcp-export.json``) recorded, but a manifest is a plain object anyone could have put
    there, so it proves nothing alone: a file goes only if its name is one an export writes
    (a weight shard, its index, a torch DCP file) and the store still holds the very object
    recorded (same size and ETag). A planted manifest naming a user's objects deletes nothing of
    theirs. Anything already under the prefix needs overwrite; a prefix holding one of our
    checkpoints, or the export's own source, is never written."""

    MARKERS = ("model.safetensors", "model.safetensors.index.json")
    MANIFEST = ".hpdcp-export.json"
    # the names an export generates (hf_export / transforms), the only ones a manifest may retire
    GENERATED = re.compile(r"model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors|"
                           r"__\d+_\d+\.distcp|\.metadata")

    def __init__(self, uri: str, overwrite: bool, source: str | None = None) -> None:
        self.uri, self.overwrite, self.source = uri.rstrip("/"), overwrite, source
        self.bucket = open_client(self.uri)
        self.prefix = self.bucket.root
        if not self.prefix:
            raise ConfigError(f"{uri}: the output needs a name under the bucket (s3://bucket/name)")

    def begin(self) -> list[str]:
        """Coordinator: refuse what the output must not replace; returns the keys a previous export
        of ours wrote there (what ``finish`` may delete)."""
        src = (self.source or "").rstrip("/")
        if src and (src == self.uri or src.startswith(self.uri + "/") or self.uri.startswith(src + "/")):
            raise ConfigError(f"{self.uri}: the export's output is (or holds, or lies inside) its source {src}")
        objs = list(self.bucket.list(self.prefix))
        rel = [o["path"][len(self.prefix) + 1:] for o in objs]
        present = set(rel)
        # ours: committed here (a commit object), or uploaded as plain files (metadata.json beside
        # a rank file, no commit object: ``aws s3 cp --recursive`` of a local checkpoint)
        ours = [r for r in rel if r == COMMIT_OBJECT or r.endswith("/" + COMMIT_OBJECT)] + \
            [r for r in rel if (r == METADATA_FILE or r.endswith("/" + METADATA_FILE))
             and posixpath.join(posixpath.dirname(r), rank_file(0, "safetensors")) in present]
        if ours:
            found = self.bucket.url(self.key_of(ours[0]))
            raise CheckpointExistsError(f"{self.uri} holds an hpdcp checkpoint ({found}); a Hugging Face export never "
                                        f"replaces one: pick another output")
        if rel and not self.overwrite:
            what = "a Hugging Face model" if any(r in self.MARKERS for r in rel) else \
                f"{len(rel)} object(s), e.g. {rel[0]}"
            raise CheckpointExistsError(f"{self.uri} already holds {what}; pass overwrite to replace it (its files are "
                                        f"replaced in place, not atomically: a reader during the export may see old "
                                        f"and new files mixed)")
        return self._retirable({r: o for r, o in zip(rel, objs)})

    def _retirable(self, present: Mapping[str, Mapping]) -> list[str]:
        """The keys of the objects the previous export provably wrote (``begin``'s promise to
        ``finish``): named in its manifest with the size and ETag the store still shows, and
        named as an export names its weight files. Anything else the manifest lists is kept
        (and said once)."""
        got = self.bucket.get(self.key_of(self.MANIFEST), max_bytes=1 << 20) if self.MANIFEST in present else None
        try:
            files = json.loads(got[0]).get("files") if got else None
        except (ValueError, AttributeError):
            files = None
        if not isinstance(files, dict):  # none, unreadable, or a v1 list without sizes and ETags: prove nothing
            if got:
                log.warning("%s: its export manifest records no sizes and ETags; nothing the previous export may "
                            "have written is deleted", self.uri)
            return []
        mine, kept = [], []
        for name, rec in sorted(files.items()):
            obj = present.get(name) if isinstance(name, str) else None
            if obj is None or not isinstance(rec, dict):
                continue
            same = rec.get("size") == obj.get("size") and rec.get("e_tag") == obj.get("e_tag")
            (mine if same and self.GENERATED.fullmatch(name) else kept).append(name)
        if kept:
            log.warning("%s: the export manifest lists %d object(s) this export cannot prove it wrote (e.g. %s); "
                        "they are kept", self.uri, len(kept), kept[0])
        return [self.key_of(n) for n in mine]

    def key_of(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def key(self, name: str) -> str:
        """The key of a file of the output: a plain name (side files may have spaces, as locally)."""
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not name.isprintable():
            raise MetadataError(f"{name!r} is not a plain file name for {self.uri}")
        return f"{self.prefix}/{name}"

    def sink(self, name: str) -> Any:
        return self.bucket.writer(self.key(name))

    def put(self, name: str, data: bytes) -> None:
        self.bucket.put(self.key(name), data)

    def finish(self, before: list[str], written: list[str]) -> None:
        """Coordinator, after the last file: record what this export wrote (its manifest), then
        delete what the previous export of ours wrote and this one lacks."""
        names = set(written)
        seen = {o["path"][len(self.prefix) + 1:]: o for o in self.bucket.list(self.prefix)}
        files = {n: {"size": seen[n].get("size"), "e_tag": seen[n].get("e_tag")} for n in sorted(names) if n in seen}
        self.bucket.put(self.key_of(self.MANIFEST), json.dumps({"format": "hpdcp-export", "version": 2,
                                                                "files": files}).encode())
        keep = {self.key(n) for n in written}
        self.bucket.delete([k for k in before if k not in keep])

    def abort(self, written: list[str]) -> None:
        try:
            self.bucket.delete([self.key(n) for n in written])
        except Exception as e:  # best effort
            log.warning("could not remove the partial output %s: %s", self.uri, e)

