"""The small files that travel with Hugging Face weights: config, generation config, tokenizer,
chat template, custom code (copied, never run). Read whole, each from a descriptor opened without
following links and checked, so what is copied is what was checked."""

from __future__ import annotations

import os
import re

from ..core.errors import ConfigError
from ..storage.location import locate

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
    return loc.parent().url if loc.is_file() else loc.url


def check_side_dir(where: str | None) -> None:
    if where is not None and not locate(where).is_dir():
        raise ConfigError(f"{where}: the directory to copy config/tokenizer files from does not exist")


def read_side_files(where: str, names_only: bool = False) -> dict[str, bytes]:
    """The side files of a local directory or of a directory in a store, read whole: they are
    small (config, tokenizer), and a store has no copy across buckets. Locally each is opened
    inside the directory without following links and checked on the descriptor, then read from
    it (``Location.read_files``): what is copied is what was checked."""
    return locate(where).read_files(lambda name: not _NOT_SIDE_FILES.fullmatch(name), MAX_SIDE_FILE_BYTES,
                                    names_only=names_only)


def read_side_file(where: str, name: str) -> bytes | None:
    """One side file (``config.json``) of a local directory or of a directory in a store, or None
    when there is none: what a layout sized by the model's config reads, without the tokenizer."""
    return locate(where).read_small(name, MAX_SIDE_FILE_BYTES)
