"""Strict JSON for every document read from a checkpoint (metadata, object files, safetensors
headers, commit objects, Hugging Face indexes).

Python's ``json`` accepts ``NaN``/``Infinity`` (not JSON: other readers refuse the file or read
something else) and raises a bare ``RecursionError`` on deep nesting, naming no file. Here both
are refused with the error class and file the caller names. Nesting is bounded by the parser's
own recursion limit (about 1,000 levels); the recursive walks after it (object values) have
their own, lower bound (``objects._MAX_DEPTH``).
"""

from __future__ import annotations

import json
from typing import Any

from ..core.errors import HpdcpError, MetadataError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes | bytearray | str, source: str, error: type[HpdcpError] = MetadataError) -> Any:
    """``raw`` parsed as strict JSON; anything else is ``error`` naming ``source``."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # the C parser's own bound (the interpreter's recursion limit)
        raise error(f"{source}: JSON nested too deeply to parse (hostile or damaged file)") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise error(f"{source}: not valid JSON ({e})") from None
