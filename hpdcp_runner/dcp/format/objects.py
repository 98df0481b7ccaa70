"""Safe encoding of non-tensor state-dict leaves.

Values become tagged JSON, so ints, floats (bit-exact, nan/inf included), str, bool, None,
bytes, tuples, lists and dicts round-trip with their types. Anything else needs pickle, which is
refused unless the caller passes ``allow_pickle=True`` at save *and* at load; an unpickle is
never attempted without it, so loading an untrusted checkpoint runs no code.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections import OrderedDict
from typing import Any, Mapping

import torch

from ..core.errors import MetadataError, PickleNotAllowedError, StateDictError
from ..core.utils import get_logger, is_stateful

log = get_logger(__name__)
_MAX_DEPTH = 200


def encode(value: Any, *, key: str, allow_pickle: bool = False) -> Any:
    """Encode ``value`` (the leaf at ``key``) as tagged JSON-able data."""
    try:
        return _enc(value, 0)
    except _NeedsPickle as e:
        if not allow_pickle:
            if is_stateful(value):
                raise StateDictError(
                    f"state-dict key {key!r} holds a {e.type_name}, a Stateful object (state_dict/load_state_dict): "
                    f"put it at the top level of the state dict, where it is saved through its state_dict(), or "
                    f"pass its state_dict() here")
            raise PickleNotAllowedError(
                f"state-dict key {key!r} holds a {e.type_name}, which can only be saved with pickle; "
                f"pass allow_pickle=True to save (and to load) it, or convert it to plain data"
            ) from None
        return ["p", base64.b64encode(pickle.dumps(value, protocol=4)).decode("ascii")]


class _NeedsPickle(Exception):
    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _enc(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise StateDictError(f"object nested deeper than {_MAX_DEPTH} levels")
    t = type(v)
    if v is None:
        return ["n"]
    if t is bool:
        return ["b", v]
    if t is int:
        return ["i", str(v)]
    if t is float:
        return ["f", v.hex()]
    if t is str:
        return ["s", v]
    if t is bytes:
        return ["y", base64.b64encode(v).decode("ascii")]
    if t is list:
        return ["l", [_enc(x, depth + 1) for x in v]]
    if t is tuple:
        return ["t", [_enc(x, depth + 1) for x in v]]
    if t is torch.Size:
        return ["S", [int(x) for x in v]]
    if t is dict:
        return ["d", [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]]
    if t is OrderedDict:  # an ordered map: no pickle needed, its order and type round-trip
        return ["o", [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]]
    if isinstance(v, torch.dtype):
        return ["D", str(v).removeprefix("torch.")]
    raise _NeedsPickle(t.__qualname__)


def decode(data: Any, *, key: str, source: str, allow_pickle: bool = False) -> Any:
    """Decode data written by :func:`encode`; malformed data is a MetadataError naming the key."""
    try:
        unpickled: list[int] | bool = [] if allow_pickle else False  # a list: allowed, and counts unpickles
        value = _dec(data, 0, unpickled)
        if unpickled:
            log.warning("%s: key %r was unpickled (allow_pickle=True): this ran code from the checkpoint", source, key)
        return value
    except PickleNotAllowedError:
        raise PickleNotAllowedError(
            f"{source}: key {key!r} was saved with pickle; refusing to unpickle it without "
            f"allow_pickle=True (unpickling runs code from the checkpoint: only allow it for trusted files)"
        ) from None
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise MetadataError(f"{source}: key {key!r}: malformed object encoding ({e})") from None


def _dec(d: Any, depth: int, allow_pickle: list[int] | bool) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if not isinstance(d, list) or not d or not isinstance(d[0], str):
        raise ValueError(f"bad node {d!r:.60}")
    tag = d[0]
    if tag == "n":
        return None
    arg = d[1]
    if tag == "b" and type(arg) is bool:
        return arg
    if tag == "i" and isinstance(arg, str):
        return int(arg)
    if tag == "f" and isinstance(arg, str):
        return float.fromhex(arg)
    if tag == "s" and isinstance(arg, str):
        return arg
    if tag == "y" and isinstance(arg, str):
        return base64.b64decode(arg, validate=True)
    if tag in ("l", "t") and isinstance(arg, list):
        items = [_dec(x, depth + 1, allow_pickle) for x in arg]
        return items if tag == "l" else tuple(items)
    if tag == "S" and isinstance(arg, list):
        return torch.Size([int(x) for x in arg])
    if tag in ("d", "o") and isinstance(arg, list):
        out = {} if tag == "d" else OrderedDict()
        for pair in arg:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("bad dict item")
            out[_dec(pair[0], depth + 1, allow_pickle)] = _dec(pair[1], depth + 1, allow_pickle)
        return out
    if tag == "D" and isinstance(arg, str):
        dt = getattr(torch, arg, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {arg!r}")
        return dt
    if tag == "p" and isinstance(arg, str):
        if allow_pickle is False:
            raise PickleNotAllowedError("pickle")
        if isinstance(allow_pickle, list):
            allow_pickle.append(1)
        return pickle.loads(base64.b64decode(arg, validate=True))
    raise ValueError(f"unknown tag {tag!r}")


def encode_object_file(objects: Mapping[str, Any]) -> tuple[bytes, dict[str, str]]:
    """One rank's object file (a JSON object of already-encoded values) and each value's
    checksum, as every storage writes it."""
    from .checksums import digest

    texts = {k: json.dumps(v, separators=(",", ":")) for k, v in objects.items()}
    body = ("{" + ",".join(f"{json.dumps(k)}:{t}" for k, t in texts.items()) + "}").encode()
    return body, {k: digest(t.encode()) for k, t in texts.items()}
