"""Every format version stays readable forever: the checkpoints committed under
tests/fixtures/format_v1 and format_v2 (written by the code of 2026-12-03 at world sizes 1, 2 and 4,
sharded, replicated, on a 2-D mesh, as ragged flat shards, with objects and block digests) load
bit for bit, reshard on two ranks and verify clean."""

from __future__ import annotations

import os

import pytest
import torch

from hpdcp_runner.dcp import load, read_metadata
from hpdcp_runner.dcp.tools import verify
from tests.format_fixtures import CASES, VERSIONS, objects, same_object, tensors
from tests.multiproc.harness import run_ranks

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")
ALL = [(v, c) for v in VERSIONS for c in CASES]


def _expected(case: str) -> dict:
    t, o = tensors(), objects()
    if case == "ws1_plain":
        return {"tensors": {k: v for k, v in t.items() if k != "u8_big"}, "list": [t["f16"], {"deep": t["bool"]}],
                "objects": o}
    if case == "ws2_sharded":
        return {"model": {"f32": t["f32"], "wide": t["wide"], "bf16": t["bf16"]}, "u8_big": t["u8_big"],
                "step": o["step"]}
    return {"wide": t["wide"], "bf16": t["bf16"], "i64": t["i64"], "meta": {"name": o["name"]}}


def _empty_like(x):
    if isinstance(x, dict):
        return {k: _empty_like(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_empty_like(v) for v in x]
    return torch.full_like(x, 7) if isinstance(x, torch.Tensor) else None


def _same(got, want) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return all(_same(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and torch.equal(got, want)
    return same_object(got, want)


@pytest.mark.parametrize("version,case", ALL)
def test_committed_checkpoints_load_bitwise_and_verify(version, case):
    path = os.path.join(FIXTURES, f"format_v{version}", case)
    md = read_metadata(path)
    assert md.format_version == version
    assert os.path.exists(os.path.join(path, "chunk_index.safetensors")) == (version >= 2)
    report = verify(path)
    assert report.ok, report.problems
    want = _expected(case)
    got = _empty_like(want)
    load(got, checkpoint_id=path)
    assert _same(got, want)
    if case == "ws2_sharded":
        assert md.blocks  # the >1 MiB chunk carries per-block digests


def _load_sharded(rank: int, ws: int) -> bool:
    """Every fixture under Shard(1) (or Shard(0) for 1-D) DTensors on 2 ranks: a reshard of each."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])

    def placed(x):
        if isinstance(x, dict):
            return {k: placed(v) for k, v in x.items()}
        if isinstance(x, list):
            return [placed(v) for v in x]
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.numel():
            return distribute_tensor(torch.full_like(x, 7), mesh, [Shard(x.dim() - 1)])
        return _empty_like(x)

    def full(x):
        if isinstance(x, dict):
            return {k: full(v) for k, v in x.items()}
        if isinstance(x, list):
            return [full(v) for v in x]
        return x.full_tensor() if isinstance(x, DTensor) else x

    for version, case in ALL:
        want = _expected(case)
        got = placed(want)
        load(got, checkpoint_id=os.path.join(FIXTURES, f"format_v{version}", case), timeout=60)
        if not _same(full(got), want):
            raise AssertionError(f"v{version} {case} differs after a load on 2 ranks")
    return True


def test_committed_checkpoints_reshard_on_two_ranks():
    assert run_ranks(2, _load_sharded) == [True, True]
