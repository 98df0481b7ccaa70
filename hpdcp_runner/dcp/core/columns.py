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
