"""Checkpoint location names: a local directory path or a store URI (``s3://bucket/prefix``,
``gs://``, ``az://``; the schemes are ``stores.KINDS``).

Only storage code asks :func:`is_uri`; tools go through ``location.locate``. A URI never becomes a
directory named ``s3:`` under the working directory, and a scheme we do not serve is refused in
one line naming it.
"""

from __future__ import annotations

import os
import posixpath
import re

from ..core.errors import ConfigError

from .stores import SCHEMES, credentials_hint, examples, is_remote as is_uri, scheme_of  # noqa: F401  (re-exported)

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)[^/@]*@")
_QUERY = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^?#]*[?#]")
# the query (or fragment) of any URL in a text: where signatures and SAS tokens travel
_URL_QUERY = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^\s?#'\"]*)[?#][^\s'\"]*")
# signed-request parameters outside a whole URL (a message quoting part of one)
_SIGNED_PARAM = re.compile(r"(?i)\b(sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|"
                           r"x-goog-signature|x-goog-credential|access_token|token)=[^&\s'\"]+")


def redact(text: str) -> str:
    """``text`` with every secret a URI in it can carry replaced: credentials
    (``s3://KEY:SECRET@bucket``), a query string or fragment (``az://c/p?sv=...&sig=...``,
    ``https://...?X-Amz-Signature=...``), and signed-request parameters quoted on their own."""
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s]*@", r"\1***@", text)
    text = _URL_QUERY.sub(r"\1?***", text)
    return _SIGNED_PARAM.sub(r"\1=***", text)


def credentials_refused(path: str) -> str | None:
    """Why a URI that carries credentials is refused (None: it carries none). They would reach
    error messages, logs and the run's saved config; the store's own environment holds them. A
    query string is refused whatever it holds: a store location has none, and it is where
    presigned signatures and SAS tokens travel."""
    env = f"give them through the environment ({credentials_hint()})"
    if _USERINFO.match(path):
        return (f"{redact(path)}: credentials in a URI are refused (they would be recorded in logs and the run's "
                f"config); {env}")
    if _QUERY.match(path):
        return (f"{redact(path)}: a query string in a location is refused (a signature or SAS token there would be "
                f"recorded in logs and the run's config, and a store location has none); {env}")
    return None


def check_uri(path: str) -> str:
    """``path`` if its scheme is one we serve (and it carries no credentials), else a ConfigError
    naming the scheme."""
    why = credentials_refused(path)
    if why:
        raise ConfigError(why)
    s = scheme_of(path)
    if s is not None and s not in SCHEMES:
        raise ConfigError(f"{redact(path)}: the {s}:// scheme is not supported; a checkpoint location is a local directory "
                          f"or {examples()}")
    return path


def normalize(path: str | os.PathLike) -> str:
    """A local path made absolute; a URI checked and stripped of trailing slashes."""
    p = os.fspath(path)
    if is_uri(p):
        check_uri(p)
        head, rest = p.split("://", 1)
        rest = re.sub(r"/+", "/", rest).rstrip("/")
        return f"{head.lower()}://{rest}"
    return os.path.abspath(p)


def join(base: str, *names: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for URIs."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(base, *names)


def split(path: str) -> tuple[str, str]:
    """(parent, name) of a local path or a URI."""
    if is_uri(path):
        p = normalize(path)
        head, rest = p.split("://", 1)
        parent, name = posixpath.split(rest)
        return f"{head}://{parent}", name
    return os.path.split(path)


def dirname(path: str) -> str:
    return split(path)[0]
