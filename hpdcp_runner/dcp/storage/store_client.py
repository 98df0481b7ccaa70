"""The client of a store: the few calls the store protocol (``object_checkpoint``) and the store
readers (``object_files``) make, whatever serves them.

A store is a flat namespace of whole objects under ``<scheme>://<container>/<key prefix>``: read
whole or by ranges, written whole (or streamed, visible only when complete), listed by prefix,
deleted, and written *conditionally*: a create that fails when the object exists, a replace that
fails when it changed since it was read. The commit protocol rests on those two conditions alone,
so any storage that offers them is a store: obstore's clouds (``object_store.Bucket``) and a
file server reached over SSH (``sftp.client.SftpBucket``) are both clients of this interface.

:func:`open_client` is the only constructor: the store registry (``stores.KINDS``) names each
kind's client class, so nothing else knows which class serves which scheme.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

from ..core.errors import ConfigError
from .stores import KINDS, StoreKind, kind_of

MIN_UPLOAD_PART = 5 << 20  # S3's smallest multipart part (but the last)


def parse_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, container, key prefix without slashes at either end) of ``s3://bucket/prefix``."""
    from .uri import check_uri

    check_uri(uri)  # credentials, a scheme we serve
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    why = KINDS[scheme.lower()].check_container(uri, bucket)
    if why:
        raise ConfigError(why)
    return scheme.lower(), bucket, key.strip("/")


class StoreClient(ABC):
    """The objects under one URI's key prefix. ``options`` is an ``object_store.ObjectStoreOptions``
    (parts, concurrency, timeouts, the orphan grace, whether unconditional stores are allowed).

    Object metadata (``head``, ``get``, ``list``) is a dict with ``path`` (listing), ``size``,
    ``last_modified`` (an aware datetime on the store's clock) and ``e_tag`` (what a conditional
    replace names; None where the client cannot tell versions apart)."""

    options: Any
    scheme: str
    #: the container (bucket, Azure container, SFTP host[:port])
    bucket: str
    #: the key prefix the URI names (no slashes at either end)
    root: str
    kind: StoreKind

    def _parse(self, uri: str) -> None:
        self.scheme, self.bucket, self.root = parse_uri(uri)
        self.kind = KINDS[self.scheme]

    # -- names ----------------------------------------------------------------------------
    def key(self, *names: str) -> str:
        return "/".join(p.strip("/") for p in (self.root, *names) if p and p.strip("/"))

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    # -- the calls ------------------------------------------------------------------------
    @abstractmethod
    def error(self, e: BaseException, what: str, key: str) -> Exception:
        """One line for a failed call on ``key`` (an ``HpdcpError``), naming where and why."""

    @abstractmethod
    def head(self, key: str) -> dict | None:
        """The object's meta, or None when there is none."""

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, dict] | None:
        """(body, meta) of a small object, or None; over ``max_bytes`` is refused before the body."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> Any:
        """Bytes [start, end) of an object (short past its end)."""

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, mode: Any = None) -> dict:
        """Write a whole object, visible at once and whole; ``mode``: None (replace), "create"
        (only if absent) or the meta of the object it replaces (only if still that object). A
        refused condition raises FileExistsError."""

    @abstractmethod
    def writer(self, key: str, size_hint: int | None = None) -> Any:
        """A streaming writer (``write(bytes)``, ``close()``): the object exists from ``close``."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[dict]:
        """Every object under ``prefix/`` (recursive), each with its ``path`` (the key)."""

    @abstractmethod
    def list_dir(self, prefix: str) -> tuple[list[str], list[dict]]:
        """(names of the 'directories' right under ``prefix/``, the objects right under it)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove these objects (those already gone are not an error)."""

    # -- shared behaviour -----------------------------------------------------------------
    def part_for(self, nbytes: int | None, smallest: int = MIN_UPLOAD_PART) -> int:
        """The part of a transfer of ``nbytes`` (an upload's parts, a read's ranged requests):
        ``part_size``, or smaller when that would leave some of the ``concurrency`` connections
        idle (a store serves each connection at a bounded rate: a 64 MiB file in 16 MiB parts uses
        4 of 8), but not under ``smallest`` (S3 refuses multipart parts under 5 MiB)."""
        o = self.options
        if not nbytes:
            return o.part_size
        return max(min(smallest, o.part_size), min(o.part_size, -(-nbytes // o.concurrency)))

    def upload_file(self, key: str, local_path: str) -> int:
        """Stream a local file into one object, unchanged; returns its bytes."""
        w, n = self.writer(key, os.path.getsize(local_path)), 0
        with open(local_path, "rb") as f:
            while True:
                block = f.read(8 << 20)  # a new buffer each time: a writer may not copy
                if not block:
                    break
                w.write(block)
                n += len(block)
        w.close()
        return n

    def content_md5s(self, keys: Sequence[str]) -> dict[str, str]:
        """{key: MD5 hex} where the store states one beside the object (``StoreKind.digest ==
        "content-md5"``); none by default."""
        return {}


def open_client(uri: str, options: Any = None) -> StoreClient:
    """The client of the store ``uri`` is in, as its registry entry names it (``options``: an
    ``ObjectStoreOptions``, default the process's)."""
    kind = kind_of(uri)
    if kind is None:
        from .uri import check_uri

        check_uri(uri)  # a scheme we do not serve: the one-line refusal
        raise ConfigError(f"{uri}: not a store location")
    module, _, name = kind.client.partition(":")
    return getattr(importlib.import_module(module, __package__), name)(uri, options)
