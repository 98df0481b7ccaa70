"""The object-store client: one maintained library (obstore, the Python binding of Rust's
``object_store``) behind a few calls the checkpoint storage needs, for every store of the
registry (``stores.KINDS``: S3 and S3-compatible, Google Cloud Storage, Azure Blob), with errors
turned into one line naming the bucket and key.

Configuration comes from each cloud's standard environment, read by the library itself: AWS
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, profiles),
Google (``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT``, ``GOOGLE_BASE_URL``), Azure
(``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``,
``AZURE_STORAGE_ENDPOINT``); ``<AWS|GOOGLE|AZURE>_ALLOW_HTTP=true`` for an http endpoint.
:class:`ObjectStoreOptions` overrides endpoint and region. Credentials are never stored here,
never logged and never part of an error.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ...core.errors import CheckpointNotFoundError, ConfigError, StorageAccessError
from ..uri import redact
from ..interfaces import IOCounters
from .store_digests import check_mode as check_digest_mode
from ..store_client import StoreClient
from ..stores import KINDS

_log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "hpdcp_runner[s3]" (or [gcs], [azure]: the same client)'


@dataclass(frozen=True)
class ObjectStoreOptions:
    """Knobs of the object-store storage (``dcp.storage.*`` in the runner).

    ``part_size``: bytes per multipart-upload part (and per upload buffer); ``concurrency``:
    parts uploaded and ranged GETs in flight per rank, so a rank holds at most about
    ``part_size x concurrency`` of upload buffers; ``coalesce_bytes``: two ranges of one object
    closer than this are fetched in one GET (a request costs milliseconds on a store);
    ``read_buffer_bytes``: the most one rank fetches ahead before copying into destinations;
    ``orphan_grace_s``: how long what no commit names (a crashed or superseded save) is left
    alone before a later save or retention deletes it."""

    endpoint: str | None = None
    region: str | None = None
    allow_http: bool | None = None
    part_size: int = 16 << 20
    concurrency: int = 8
    max_retries: int = 5
    retry_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    coalesce_bytes: int | None = None  # None: auto, the measured latency x per-connection bandwidth
    read_buffer_bytes: int = 256 << 20
    orphan_grace_s: float = 900.0
    # a store that ignores conditional writes (If-None-Match / If-Match) cannot keep two saves of
    # one name from both reporting success; true runs on such a store anyway (one saver per name)
    unconditional_ok: bool = False
    # foreign files (no checksums of their own): check each object read whole against the MD5 the
    # store keeps (auto | strict | off; see store_digests)
    store_digests: str = "auto"

    def __post_init__(self) -> None:
        check_digest_mode(self.store_digests)
        if self.part_size < 5 << 20:
            raise ConfigError(f"part_size must be >= 5MiB (the S3 minimum for a multipart part), got {self.part_size}")
        for name in ("concurrency", "max_retries"):
            if getattr(self, name) < (1 if name == "concurrency" else 0):
                raise ConfigError(f"{name} must be >= {1 if name == 'concurrency' else 0}, got {getattr(self, name)}")
        if (self.coalesce_bytes is not None and self.coalesce_bytes < 0) or self.read_buffer_bytes < 1 << 20:
            raise ConfigError("coalesce_bytes must be >= 0 and read_buffer_bytes >= 1MiB")
        for name, lo, hi in (("orphan_grace_s", 0.0, 365 * 86400.0), ("retry_timeout_s", 1e-3, 86400.0),
                             ("request_timeout_s", 1e-3, 86400.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # nan fails both
                raise ConfigError(f"{name}: {v!r} is not seconds from {lo:g} to {hi:g}")
        if self.endpoint is not None:
            if not isinstance(self.endpoint, str) or not _ENDPOINT.match(self.endpoint):
                raise ConfigError(f"endpoint: {redact(str(self.endpoint))!r} is not an http:// or https:// URL with a "
                                  f"host (and no credentials or query string: those come from the environment)")

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


_ENDPOINT = re.compile(r"^https?://[^/?#@\s]+(/[^?#@\s]*)?$")


def _obstore() -> Any:
    try:
        import obstore
        import obstore.store  # noqa: F401
    except ImportError:
        raise ConfigError(f"checkpoints in an object store ({', '.join(s + '://' for s, k in KINDS.items() if k.client == '.objects.object_store:Bucket')}) need the "
                          f"object-store client: {INSTALL_HINT}") from None
    return obstore


_DEFAULT = [ObjectStoreOptions()]


def configure(options: ObjectStoreOptions) -> None:
    """The options every object-store call of this process uses unless given others (the runner
    sets them once from ``dcp.storage.*``, so tools called without options agree with it)."""
    _DEFAULT[0] = options


def default_options() -> ObjectStoreOptions:
    return _DEFAULT[0]


_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()


def _store(scheme: str, bucket: str, o: ObjectStoreOptions) -> Any:
    """One client per store, bucket and options in a process (its connection pool is reused)."""
    key = (scheme, bucket, o.endpoint, o.region, o.allow_http, o.max_retries, o.retry_timeout_s, o.request_timeout_s)
    with _STORES_LOCK:
        if key not in _STORES:
            kind = KINDS[scheme]
            # in milliseconds: 0.5 s is 500 ms, never truncated to 0 s
            client: dict[str, Any] = {"timeout": f"{max(1, round(o.request_timeout_s * 1000))}ms",
                                      "connect_timeout": "10s"}
            allow_http = o.allow_http
            if allow_http is None:  # client options given here replace the library's reading of it
                allow_http = os.environ.get(kind.allow_http_env, "").lower() in ("1", "true", "yes") or \
                    os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true") and scheme == "az"
            client["allow_http"] = allow_http
            preflight(scheme, bucket, o, allow_http)
            retry = {"max_retries": o.max_retries, "retry_timeout": _dt.timedelta(seconds=o.retry_timeout_s),
                     "backoff": {"init_backoff": _dt.timedelta(milliseconds=100),
                                 "max_backoff": _dt.timedelta(seconds=15), "base": 2.0}}
            try:
                _STORES[key] = _CLIENTS[scheme](_obstore(), bucket, o, client, retry)
            except ConfigError:
                raise
            except Exception as e:  # a malformed endpoint or option: the library says which
                raise ConfigError(f"{scheme}://{bucket}: cannot configure the object-store client: "
                                  f"{_first_line(e)}") from None
        return _STORES[key]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def preflight(scheme: str, bucket: str, o: ObjectStoreOptions, allow_http: bool) -> None:
    """The set-up mistakes a client would only report as a raw error from its first request
    (a ``builder error``, a 400 in XML, a token error from the cloud metadata address), checked
    before it is built: one line naming the variable to set."""
    kind = KINDS[scheme]
    where = f"{scheme}://{bucket}"
    endpoint = o.endpoint or os.environ.get(kind.endpoint_env) or ""
    named = "dcp.storage.endpoint" if o.endpoint else kind.endpoint_env
    if endpoint.lower().startswith("http://") and not allow_http:
        raise ConfigError(f"{where}: {named}={endpoint} is plain http: set {kind.allow_http_env}=true (a loopback "
                          f"emulator or test server), or use an https endpoint")
    if scheme == "az":
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT")
        if not account and not _env_true("AZURE_STORAGE_USE_EMULATOR"):
            raise ConfigError(f"{where}: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME=<account> (with "
                              f"AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or Azure AD credentials), or "
                              f"AZURE_STORAGE_USE_EMULATOR=true for azurite on its default port")
        host = (urllib.parse.urlparse(endpoint).hostname or "") if endpoint else ""
        path = urllib.parse.urlparse(endpoint).path.strip("/") if endpoint else ""
        if endpoint and account and ".blob.core." not in host and path != account:
            raise ConfigError(f"{where}: {named}={endpoint} does not name the account: an emulator's endpoint ends "
                              f"in /<account> (azurite: http://127.0.0.1:10000/{account})")
    if scheme == "gs" and endpoint:
        creds = [v for v in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
                             "GOOGLE_SERVICE_ACCOUNT_KEY") if os.environ.get(v)]
        if not creds and not _env_true("GOOGLE_SKIP_SIGNATURE"):  # else it asks the cloud's metadata address
            raise ConfigError(f"{where}: no Google credentials for {named}={endpoint}: an emulator (fake-gcs-server) "
                              f"needs GOOGLE_SKIP_SIGNATURE=true; another endpoint a key file in "
                              f"GOOGLE_APPLICATION_CREDENTIALS")


def _s3_client(obs: Any, bucket: str, o: ObjectStoreOptions, client: dict, retry: dict) -> Any:
    # The body is not hashed into the request's signature (SigV4 UNSIGNED-PAYLOAD, as AWS's own
    # SDKs do over TLS): hashing every byte on the client cost ~20% of a PUT's time, and every
    # chunk carries our own checksum, verified on every load.
    config: dict[str, Any] = {"unsigned_payload": True}
    if o.endpoint:
        config["endpoint"] = o.endpoint
    if o.region:
        config["region"] = o.region
    provider = _profile_credentials()
    extra = {"credential_provider": provider} if provider is not None else {}
    return obs.store.S3Store(bucket, config=config, client_options=client, retry_config=retry, **extra)


def _gcs_client(obs: Any, bucket: str, o: ObjectStoreOptions, client: dict, retry: dict) -> Any:
    if o.region:
        raise ConfigError(f"gs://{bucket}: dcp.storage.region applies to S3 only (a GCS bucket's location is its own)")
    config: dict[str, Any] = {"base_url": o.endpoint} if o.endpoint else {}
    return obs.store.GCSStore(bucket, config=config, client_options=client, retry_config=retry)


def _azure_client(obs: Any, bucket: str, o: ObjectStoreOptions, client: dict, retry: dict) -> Any:
    if o.region:
        raise ConfigError(f"az://{bucket}: dcp.storage.region applies to S3 only")
    config: dict[str, Any] = {"endpoint": o.endpoint} if o.endpoint else {}
    return obs.store.AzureStore(bucket, config=config, client_options=client, retry_config=retry)


#: the client constructor of each store of the registry (``stores.KINDS``)
_CLIENTS: dict[str, Callable[..., Any]] = {"s3": _s3_client, "gs": _gcs_client, "az": _azure_client}


def _profile_credentials() -> Any:
    """AWS's shared config files (``~/.aws/credentials``, ``~/.aws/config``, ``AWS_PROFILE``, SSO,
    assumed roles), which the Rust client does not read, through boto3's credential chain when
    boto3 is installed and the environment names no keys itself. None: the client's own chain
    (environment keys, web identity, container and instance metadata)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return None
    home = os.path.expanduser("~")
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
             os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")]
    if not os.environ.get("AWS_PROFILE") and not any(os.path.isfile(f) for f in files):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None
    return Boto3CredentialProvider(session)


def _first_line(e: BaseException) -> str:
    """The client's error in one line, without what a URL in it carries (a SAS token from the
    environment rides in every Azure request's query string)."""
    return redact((str(e).strip().splitlines() or [type(e).__name__])[0])[:300]


_NETWORK = (("ConnectionRefused", "the connection was refused (nothing listens there)"),
            ("dns error", "its host name does not resolve"), ("failed to lookup address", "its host name does not resolve"),
            ("TimedOut", "it did not answer in time"), ("operation timed out", "it did not answer in time"),
            ("ConnectionReset", "it reset the connection"), ("tcp connect error", "no connection could be made"))


def _unreachable(text: str) -> str | None:
    """Why the store could not be reached, from the client's full error text (its first line says
    only "error sending request"), or None when the request reached it."""
    if "error sending request" not in text and "tcp connect error" not in text:
        return None
    for marker, why in _NETWORK:
        if marker in text:
            return why
    return "the request could not be sent"


_NO_CONTAINER = ("NoSuchBucket", "ContainerNotFound")
_REFUSED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled",
            "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch")


def _code(e: BaseException) -> str | None:
    m = re.search(r"<Code>([A-Za-z]+)</Code>", str(e))
    return m.group(1) if m else None


class Bucket(StoreClient):
    """The objects under one URI's key prefix in a cloud store obstore serves (``StoreClient``)."""

    def __init__(self, uri: str, options: ObjectStoreOptions | None = None) -> None:
        self.options = options or _DEFAULT[0]
        self._parse(uri)
        self.store = _store(self.scheme, self.bucket, self.options)
        self.obs = _obstore()

    # -- errors ---------------------------------------------------------------------------
    def error(self, e: BaseException, what: str, key: str) -> Exception:
        """One line for a failed call on ``key``; the library's multi-line text is cut."""
        code = _code(e)
        where = self.url(key)
        kind = self.kind
        if code in _NO_CONTAINER:
            return StorageAccessError(f"{what}: {kind.container} {self.bucket!r} does not exist at the configured "
                                      f"endpoint (check the URI, {kind.endpoint_env} or dcp.storage.endpoint)")
        if code in _REFUSED or type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
            return StorageAccessError(f"{what}: access to {where} was refused ({code or type(e).__name__}; check the "
                                      f"credentials in the environment ({kind.credentials}) and the "
                                      f"{kind.container}'s policy)")
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{what}: {where} does not exist")
        if "169.254.169.254" in str(e) or "metadata.google.internal" in str(e):  # no credentials: the client
            return StorageAccessError(                                       # asked the cloud's metadata server
                f"{what}: no credentials for {where}: the client fell back to the cloud's metadata server, which "
                f"gave none; set {kind.credentials}" + (" (GOOGLE_SKIP_SIGNATURE=true for an emulator)"
                                                        if self.scheme == "gs" else ""))
        text = _first_line(e)
        why = _unreachable(str(e))
        if why is not None:  # the library's one line says only "error sending request"
            endpoint = self.options.endpoint or os.environ.get(kind.endpoint_env) or f"the {kind.title} default endpoint"
            return StorageAccessError(f"{what}: cannot reach the object store at {endpoint} for {where}: {why} "
                                      f"(retried for up to {self.options.retry_timeout_s:g} s; check {kind.endpoint_env} "
                                      f"or dcp.storage.endpoint, and that the server is up)")
        if "connect" in text.lower() or "timed out" in text.lower() or "dns" in text.lower():
            return StorageAccessError(f"{what}: cannot reach the object store for {where} after "
                                      f"{self.options.max_retries} retries ({text})")
        return StorageAccessError(f"{what}: {where}: {text}")

    # -- calls ----------------------------------------------------------------------------
    def head(self, key: str) -> dict | None:
        """The object's size, ETag and time, or None when it does not exist."""
        try:
            return self.obs.head(self.store, key)
        except FileNotFoundError as e:
            if _code(e) in _NO_CONTAINER:
                raise self.error(e, "reading", key) from None
            return None
        except Exception as e:
            raise self.error(e, "reading", key) from None

    def get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, dict] | None:
        """(body, meta) of a small object, or None when it does not exist; over ``max_bytes``
        is an error before the body is read."""
        try:
            r = self.obs.get(self.store, key)
            meta = r.meta
            if max_bytes is not None and meta["size"] > max_bytes:
                raise StorageAccessError(f"{self.url(key)} is {meta['size']} bytes, over the {max_bytes}-byte limit")
            return bytes(r.bytes()), meta
        except FileNotFoundError as e:
            if _code(e) in _NO_CONTAINER:
                raise self.error(e, "reading", key) from None
            return None
        except StorageAccessError:
            raise
        except Exception as e:
            raise self.error(e, "reading", key) from None

    def get_range(self, key: str, start: int, end: int) -> Any:
        """Bytes [start, end) of an object (a buffer; ``memoryview`` of it is zero-copy)."""
        try:
            return self.obs.get_range(self.store, key, start=start, end=end)
        except Exception as e:
            raise self.error(e, f"reading bytes {start}..{end}", key) from None

    def put(self, key: str, data: bytes | memoryview, *, mode: Any = None) -> dict:
        """Write a whole object; ``mode``: None (replace), "create" (only if absent) or the meta of
        the object it replaces, as ``head`` gave it (only if it is still that object: S3 and Azure
        match its ETag, GCS its generation). A failed condition raises FileExistsError."""
        if mode is None or mode == "create":
            put_mode: Any = "overwrite" if mode is None else "create"
        else:
            put_mode = {"e_tag": mode.get("e_tag"), "version": mode.get("version")} \
                if self.kind.replace_by == "version" else {"e_tag": mode["e_tag"]}
        try:
            return self.obs.put(self.store, key, data, mode=put_mode)
        except Exception as e:
            if type(e).__name__ in ("AlreadyExistsError", "PreconditionError") or _code(e) == "PreconditionFailed":
                raise FileExistsError(f"{self.url(key)} changed (conditional write refused)") from None
            raise self.error(e, "writing", key) from None

    def writer(self, key: str, size_hint: int | None = None) -> Any:
        """A streaming writer (multipart upload, ``concurrency`` parts in flight, of ``part_for``
        ``size_hint`` bytes when the size is known): ``write(bytes)``, ``close()`` completes the
        upload. It does not copy: the buffers given to ``write`` are read when their part is sent,
        so they must not change before ``close()`` (measured: a buffer rewritten after ``write``
        uploads the new bytes)."""
        o = self.options
        try:
            return self.obs.open_writer(self.store, key, buffer_size=self.part_for(size_hint),
                                        max_concurrency=o.concurrency)
        except Exception as e:
            raise self.error(e, "writing", key) from None

    def content_md5s(self, keys: Sequence[str]) -> dict[str, str]:
        """{key: MD5 hex} of the objects whose HEAD reports a ``Content-MD5`` (Azure keeps one
        for a blob uploaded in one request). Our client does not expose that header, so each HEAD
        goes to a URL the client signs with its own credentials, ``concurrency`` at a time.
        Credentials that cannot sign, or a HEAD that fails, leave that object out (nothing to
        check against: logged, never an error)."""
        import base64
        import concurrent.futures as cf
        import urllib.request
        from datetime import timedelta

        def one(key: str) -> tuple[str, str | None]:
            url = self.obs.sign(self.store, "GET", key, timedelta(minutes=15))  # read access: a HEAD too
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                        timeout=self.options.request_timeout_s) as r:
                got = r.headers.get("Content-MD5")
            raw = base64.b64decode(got) if got else b""
            return key, raw.hex() if len(raw) == 16 else None

        out: dict[str, str] = {}
        if not keys:
            return out
        try:
            with cf.ThreadPoolExecutor(min(self.options.concurrency, len(keys)), thread_name_prefix="hpdcp-head") as ex:
                for key, md5 in ex.map(one, keys):
                    if md5:
                        out[key] = md5
        except Exception as e:
            _log.info("%s: the stored MD5s of its objects could not be read (%s): they are not checked",
                      redact(self.url(self.root)), _first_line(e))
            return {}
        return out

    def list(self, prefix: str) -> Iterator[dict]:
        """Every object under ``prefix/`` (recursive)."""
        try:
            for batch in self.obs.list(self.store, prefix.rstrip("/") + "/" if prefix else None):
                yield from batch
        except Exception as e:
            raise self.error(e, "listing", prefix) from None

    def list_dir(self, prefix: str) -> tuple[list[str], list[dict]]:
        """(names of the 'directories' right under ``prefix/``, the objects right under it)."""
        try:
            r = self.obs.list_with_delimiter(self.store, prefix.rstrip("/") + "/" if prefix else None)
        except Exception as e:
            raise self.error(e, "listing", prefix) from None
        dirs = [p.rstrip("/").rsplit("/", 1)[-1] for p in r["common_prefixes"]]
        return dirs, list(r["objects"])

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            self.obs.delete(self.store, list(keys))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self.error(e, "deleting", keys[0]) from None


class RemoteFile:
    """One object read by ranges (a random-access file for the chunk index and the reads)."""

    def __init__(self, bucket: Bucket, key: str, size: int | None, on_missing: Callable[[], Exception] | None = None,
                 counters: IOCounters | None = None, on_data: Callable[[int, Any], None] | None = None) -> None:
        """``on_data(offset, bytes)`` hears every range that arrives (a store digest's check)."""
        self.bucket, self.key, self._size = bucket, key, size
        self.on_missing, self.counters, self.on_data = on_missing, counters, on_data
        self._cache: dict[int, bytes] = {}  # small reads' blocks, oldest first

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
        return CheckpointNotFoundError(f"{self.bucket.url(self.key)} is missing (named in metadata.json)")

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
        cache = self._cache
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
        if self.on_data is not None:
            self.on_data(start, data)
        return bytes(data)

    def close(self) -> None:
        pass
