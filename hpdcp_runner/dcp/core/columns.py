"""Columnar helpers for planning at scale: int64 arrays on the wire, rows grouped by equal keys.

Plans gathered from thousands of ranks are decoded and grouped as torch int64 arrays instead of
one Python object per item; see ``planning/save_dedup.py`` (save) and ``planning/load_replicas.py`` (load).
"""

from __future__ import annotations

import base64

import torch

from .utils import byte_view


def pack_ints(t: torch.Tensor) -> str:
    """An integer tensor as base64 of its int64 bytes (native order: every rank is one machine type)."""
    t = t.to(torch.int64).contiguous()
    return base64.b64encode(byte_view(t)).decode()


def unpack_ints(text: str) -> torch.Tensor:
    raw = base64.b64decode(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)


def group_rows(keyrows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows with equal keys grouped, groups in lexicographic key order: (order, group id per
    sorted position, group starts). Successive stable argsorts over the columns that vary
    (torch.unique(dim=0) was 17x slower); equal rows keep their input order."""
    order = torch.arange(keyrows.shape[0])
    if not len(order):
        return order, order, order
    varying = [c for c in range(keyrows.shape[1]) if keyrows[:, c].min() != keyrows[:, c].max()]
    keyrows = keyrows[:, varying] if varying else keyrows[:, :1]
    for col in reversed(range(keyrows.shape[1])):
        order = order[torch.argsort(keyrows[order, col], stable=True)]
    s = keyrows[order]
    new = torch.ones(len(order), dtype=torch.bool)
    if len(order) > 1:
        new[1:] = (s[1:] != s[:-1]).any(dim=1)
    gid = torch.cumsum(new.to(torch.int64), 0) - 1
    return order, gid, torch.nonzero(new).flatten()


def padded_boxes(flat: torch.Tensor, ndims: torch.Tensor, d: int) -> torch.Tensor:
    """Boxes stored back to back in ``flat`` (offsets then sizes, ``ndims[i]`` each) as one
    ``[n, 2d]`` int64 matrix: offsets padded with 0, sizes padded with 1 (so 0-d boxes and
    missing dimensions compare equal and count one element). One gather per distinct rank of
    box (a state dict has a handful), not one pass per dimension."""
    n = ndims.numel()
    out = torch.zeros((n, 2 * d), dtype=torch.int64)
    out[:, d:] = 1
    if not flat.numel():  # only 0-d boxes: nothing but padding
        return out
    if n and bool((ndims == d).all()):
        return flat.view(n, 2 * d).clone()
    start = torch.cumsum(2 * ndims, 0) - 2 * ndims  # where each box starts in ``flat``
    for k in torch.unique(ndims).tolist():
        if k == 0:
            continue
        rows = torch.nonzero(ndims == k).flatten()
        vals = flat[start[rows, None] + torch.arange(2 * k)]
        out[rows, :k] = vals[:, :k]
        out[rows, d:d + k] = vals[:, k:]
    return out


def singletons(keyrows: torch.Tensor) -> torch.Tensor:
    """A mask of rows whose key occurs once (cheap: one 64-bit hash per row and one sort; a
    hash collision only keeps a row for the exact grouping). Lets a planner drop rows that
    cannot be in a group of two before grouping the rest column by column."""
    n = keyrows.shape[0]
    if n < 2:
        return torch.ones(n, dtype=torch.bool)
    mult = torch.tensor([(0x9E3779B97F4A7C15 * (2 * j + 1)) % (1 << 63) | 1 for j in range(keyrows.shape[1])],
                        dtype=torch.int64)
    h = (keyrows * mult).sum(1)  # wraps modulo 2**64
    hs, order = torch.sort(h)
    dup = torch.zeros(n, dtype=torch.bool)
    same = hs[1:] == hs[:-1]
    dup[1:] |= same
    dup[:-1] |= same
    out = torch.ones(n, dtype=torch.bool)
    out[order] = ~dup
    return out


# -- binary frames: a JSON message whose integer columns travel as raw bytes ------------------------

_FRAME_MAGIC = b"HPF1"
_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64, torch.int16)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def encode_frame(obj: object) -> bytes:
    """``obj`` (JSON values and CPU tensors of the dtypes above, anywhere inside it) as one byte
    string: a small header, the JSON with each tensor replaced by a reference, then the tensors'
    raw bytes, each 8-byte aligned. The receiver views the columns in place (``decode_frame``):
    no base64 (a third larger, and a decode pass), no pickle."""
    import json
    import struct

    blobs: list[torch.Tensor] = []

    def ref(o: object) -> dict:
        if not isinstance(o, torch.Tensor) or o.dtype not in _CODE:
            raise TypeError(f"{type(o).__name__} cannot travel in a frame")
        blobs.append(o.detach().to("cpu").contiguous().view(-1))
        return {"$b": len(blobs) - 1}

    text = json.dumps(obj, separators=(",", ":"), default=ref, allow_nan=False).encode()
    table = b"".join(struct.pack("<QQ", _CODE[b.dtype], b.numel()) for b in blobs)
    head = _FRAME_MAGIC + struct.pack("<IQ", len(blobs), len(text)) + table + text
    parts = [head, bytes(-len(head) % 8)]
    for b in blobs:
        n = b.numel() * b.element_size()
        if n:
            parts.append(byte_view(b))  # (joined below: one copy, not two)
        parts.append(bytes(-n % 8))
    return b"".join(parts)


def decode_frame(buf: "torch.Tensor | bytes") -> object:
    """The object ``encode_frame`` encoded; its tensors are views of ``buf`` (a uint8 tensor that
    starts 8-byte aligned, as collectives hand it over) or copies (``bytes``). Malformed frames
    raise ``ValueError``."""
    import json
    import struct

    if isinstance(buf, (bytes, bytearray, memoryview)):
        buf = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    n = buf.numel()
    mv = byte_view(buf)
    if n < 16 or bytes(mv[:4]) != _FRAME_MAGIC:
        raise ValueError("not a frame (bad magic)")
    nblobs, tlen = struct.unpack_from("<IQ", mv, 4)
    pos = 16
    if pos + 16 * nblobs + tlen > n:
        raise ValueError("truncated frame header")
    specs = [struct.unpack_from("<QQ", mv, pos + 16 * i) for i in range(nblobs)]
    pos += 16 * nblobs
    text = bytes(mv[pos:pos + tlen])
    pos += tlen
    pos += -pos % 8
    tensors = []
    for code, count in specs:
        if code >= len(_DTYPES):
            raise ValueError(f"unknown column dtype code {code}")
        dt = _DTYPES[code]
        size = torch.empty(0, dtype=dt).element_size()
        nbytes = count * size
        if pos + nbytes > n:
            raise ValueError("truncated frame column")
        tensors.append(buf[pos:pos + nbytes].view(dt) if nbytes else torch.empty(0, dtype=dt))
        pos += nbytes + (-nbytes % 8)

    def hook(d: dict) -> object:
        if len(d) == 1 and "$b" in d:
            i = d["$b"]
            if not (type(i) is int and 0 <= i < len(tensors)):
                raise ValueError(f"bad column reference {i!r}")
            return tensors[i]
        return d

    return json.loads(text, object_hook=hook if tensors else None)
