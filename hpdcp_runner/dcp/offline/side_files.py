"""The small files that travel with Hugging Face weights: config, generation config, tokenizer,
chat template, custom code (copied, never run). Read whole, each from a descriptor opened without
following links and checked, so what is copied is what was checked."""

from __future__ import annotations

import os
import re

from ..core.errors import ConfigError, HpdcpError
from ..core.rafile import open_regular_file
from ..core.utils import get_logger
from ..storage.location import locate

log = get_logger(__name__)
# weights and checkpoint metadata never travel as side files (ours included: a commit object, a
# rank's objects file); everything else small does
_NOT_SIDE_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|distcp|ckpt|h5|msgpack)|\..*|metadata\.json|"
                             r".*\.index\.json|hpdcp-commit\.json|rank\d+\.objects\.json")
MAX_SIDE_FILE_BYTES = 256 << 20


def side_files(directory: str) -> list[str]:
    """The regular files of a model directory that are not weights: config, generation config,
    tokenizer, chat template, custom code (copied, never run)."""
    return sorted(read_side_files(directory, names_only=True))


def resolve_side_dir(files_from: str | os.PathLike | None, default: str | None) -> str | None:
    """The directory side files are copied from: ``files_from`` (a directory, or a weights file
    in it; local or in a store), else ``default``."""
    where = files_from or default
    if not where:
        return None
    loc = locate(where)
    if (loc.local_path and loc.is_file()) or (not loc.local_path and loc.url.endswith(".safetensors")):
        return loc.parent().url
    return loc.url


def check_side_dir(where: str | None) -> None:
    loc = locate(where) if where is not None else None
    if loc is not None and loc.local_path and not loc.is_dir():
        raise ConfigError(f"{where}: the directory to copy config/tokenizer files from does not exist")


def read_side_files(where: str, names_only: bool = False) -> dict[str, bytes]:
    """The side files of a local directory or of a directory in a store, read whole: they are
    small (config, tokenizer), and a store has no copy across buckets. Locally each is opened
    inside the directory without following links and checked on the descriptor, then read from
    it: a link swapped in after the listing is refused, never followed (what is copied is what
    was checked)."""
    loc = locate(where)
    if loc.local_path:
        out = {}
        dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            for name in sorted(os.listdir(dfd)):
                if _NOT_SIDE_FILES.fullmatch(name):
                    continue
                try:
                    f = open_regular_file(os.path.join(where, name), dfd, what="side file")
                except (FileNotFoundError, HpdcpError):
                    continue  # a link, a directory, a device, or gone: not copied
                with f:
                    if os.fstat(f.fileno()).st_size > MAX_SIDE_FILE_BYTES:
                        log.warning("not copying %s: over %d bytes", os.path.join(where, name), MAX_SIDE_FILE_BYTES)
                        continue
                    out[name] = b"" if names_only else f.read(MAX_SIDE_FILE_BYTES + 1)[:MAX_SIDE_FILE_BYTES]
        finally:
            os.close(dfd)
        return out
    out = {}
    for name, size in loc.files().items():
        if _NOT_SIDE_FILES.fullmatch(name) or size > MAX_SIDE_FILE_BYTES:
            continue
        got = b"" if names_only else loc.read_small(name, MAX_SIDE_FILE_BYTES)
        if got is not None:
            out[name] = got
    return out


def read_side_file(where: str, name: str) -> bytes | None:
    """One side file (``config.json``) of a local directory or of a directory in a store, or None
    when there is none: what a layout sized by the model's config reads, without the tokenizer."""
    return locate(where).read_small(name, MAX_SIDE_FILE_BYTES)
