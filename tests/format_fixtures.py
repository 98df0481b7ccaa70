"""The reference content of the committed checkpoints of every format version
(tests/fixtures/format_v<N>/): deterministic values, so any later version can check it still
reads them bit for bit.

Written once per version by ``scripts/make_format_fixtures.py`` (v1 and v2 both with the code of
2026-12-03, before and after the chunk index); never rewrite them to make a test pass: a reader
that cannot load them has broken compatibility.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

VERSIONS = (1, 2)  # one committed set per format version, each loaded by every later build
CASES = ("ws1_plain", "ws2_sharded", "ws4_mesh_flat")


def tensors() -> dict[str, torch.Tensor]:
    """Full tensors (every case stores some of them, laid out its own way)."""
    g = torch.Generator().manual_seed(20261203)
    return {
        "f32": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(7, 4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(6, generator=g).to(torch.float16),
        "i64": torch.arange(-4, 8, dtype=torch.int64).view(3, 4),
        "bool": torch.tensor([True, False, True]),
        "u8_big": (torch.arange(1_100_000) % 251).to(torch.uint8),  # one chunk over 1 MiB: block digests
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "wide": torch.arange(4 * 10, dtype=torch.float32).view(4, 10),
    }


def objects() -> dict:
    return {"step": 12, "lr": 0.5, "nan": math.nan, "name": "run-α", "raw": b"\x00\xff",
            "pair": (1, "two"), "nested": {"a": [1, 2.5, None, True]}, "ordered": OrderedDict([("z", 1), ("a", 2)]),
            "dtype": torch.bfloat16, "size": torch.Size([2, 3])}


def same_object(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b
