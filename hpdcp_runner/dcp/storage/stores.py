"""The registry of stores by URI scheme: the one place that knows which schemes exist.

A checkpoint location is a local path or ``<scheme>://<bucket>/<prefix>`` of a store registered
here. Everything else (the client, the commit, the readers, every tool) asks this registry, so
adding a store that obstore serves is one entry here and its client constructor in
``object_store``; another kind of storage with the two conditional writes (an SFTP server) is one
entry here naming its own client (``store_client.StoreClient``) in a subpackage of its own, and
its server fixture in the tests (see docs/architecture.md, "Adding a kind of storage").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


@dataclass(frozen=True)
class StoreKind:
    """What differs between object stores, as data: names, the environment they are configured
    from (named in errors), and how a conditional replace names the object it replaces."""

    scheme: str
    title: str
    #: what the first part of the URI is called there ("bucket", "container")
    container: str
    #: the names that store accepts for it (checked before any request, with a message)
    container_pattern: str
    #: where credentials come from, for error messages
    credentials: str
    #: the environment variable that points the client at another endpoint (an emulator, MinIO)
    endpoint_env: str
    #: the environment variable that allows plain http (a loopback server)
    allow_http_env: str
    #: what a conditional replace matches: "e_tag" (S3, Azure) or "version" (GCS's generation)
    replace_by: str = "e_tag"
    #: the fsspec file system a peer (torch DCP's fsspec path) reaches this store with
    fsspec_package: str = "s3fs"
    #: where the store states an object's MD5: "etag" (S3 for an object uploaded in one part, GCS
    #: for one not composed of parts) or "content-md5" (Azure: a property a HEAD reports, kept
    #: for a blob uploaded in one request); see store_digests
    digest: str = "etag"
    #: the class that serves it, "module:Class" relative to this package (a ``StoreClient``)
    client: str = ".objects.object_store:Bucket"
    #: what its two conditional writes are called there, for messages: a create-if-absent and a
    #: replace-if-unchanged
    conditions: tuple[str, str] = ("If-None-Match", "If-Match")

    def check_container(self, uri: str, name: str) -> str | None:
        """Why ``name`` is not a valid bucket/container name here, or None."""
        if re.match(self.container_pattern, name or ""):
            return None
        return f"{uri}: {name!r} is not a valid {self.title} {self.container} name"


KINDS: dict[str, StoreKind] = {k.scheme: k for k in (
    StoreKind("s3", "S3", "bucket", r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$",
              "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"),
    StoreKind("gs", "Google Cloud Storage", "bucket", r"^[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9]$",
              "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT", "GOOGLE_BASE_URL", "GOOGLE_ALLOW_HTTP",
              replace_by="version", fsspec_package="gcsfs"),
    StoreKind("az", "Azure Blob Storage", "container", r"^[a-z0-9](?!.*--)[a-z0-9\-]{1,61}[a-z0-9]$",
              "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or Azure AD",
              "AZURE_STORAGE_ENDPOINT", "AZURE_ALLOW_HTTP", fsspec_package="adlfs", digest="content-md5"),
    StoreKind("sftp", "SFTP", "host", r"^[A-Za-z0-9]([A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?(:[0-9]{1,5})?$",
              "SFTP_USER with SFTP_KEY_FILE or SFTP_PASSWORD (else ssh-agent and ~/.ssh keys); the host key in "
              "SFTP_KNOWN_HOSTS or ~/.ssh/known_hosts", "", "", fsspec_package="paramiko", digest="none",
              client=".sftp.client:SftpBucket", conditions=("an exclusive rename", "a locked replace")),
)}
SCHEMES = tuple(KINDS)


def scheme_of(path: str | os.PathLike | None) -> str | None:
    """The URI scheme of ``path`` (lower case), or None for a local path."""
    m = _SCHEME.match(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    return m.group(1).lower() if m else None


def kind_of(path: str | os.PathLike | None) -> StoreKind | None:
    """The store ``path`` is in (None: a local path, or a scheme we do not serve)."""
    return KINDS.get(scheme_of(path) or "")


def is_remote(path: str | os.PathLike | None) -> bool:
    """True for a URI of any scheme (supported or not): never to be used as a local path."""
    return path is not None and scheme_of(path) is not None


def credentials_hint() -> str:
    """Where each store's credentials come from, for the message that refuses them in a URI."""
    return "; ".join(f"{k.scheme}://: {k.credentials}" for k in KINDS.values())


def examples() -> str:
    """The location forms we serve, for messages."""
    return " / ".join(f"{k.scheme}://{k.container}/prefix" for k in KINDS.values())
