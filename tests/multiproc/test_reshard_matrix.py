"""Save at world size N under layout A, load at world size M under layout B: bitwise equal.

Every ordered (save ws+layout, load ws+layout) pair over ws in {1, 2, 4} and the layouts of
``workload.LAYOUTS_BY_WS`` (plain replicated, Replicate DTensor, Shard(0), Shard(1), ragged flat
intervals, (2,2) meshes with [Shard(0), Shard(1)] and [Replicate(), Shard(0)]); shapes like 7x5 and
3x2 give uneven and empty shards.
"""

from __future__ import annotations

import os

import pytest

from tests.multiproc import workload
from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import load, save

WORLD_SIZES = (1, 2, 4)


def _save_all(rank: int, ws: int, root: str) -> list[str]:
    names = []
    for layout in workload.LAYOUTS_BY_WS[ws]:
        name = f"ws{ws}-{layout}"
        save(workload.build(layout), checkpoint_id=os.path.join(root, name), timeout=60)
        names.append(name)
    return names


def _load_all(rank: int, ws: int, root: str, names: list[str]) -> list[str]:
    failures = []
    # Negative control: an unloaded target must fail the check, so the check can fail at all.
    if not workload.check(workload.build(workload.LAYOUTS_BY_WS[ws][-1], zeros=True)):
        failures.append("check() accepted an all-zero target")
    for name in names:
        for layout in workload.LAYOUTS_BY_WS[ws]:
            target = workload.build(layout, zeros=True)
            load(target, checkpoint_id=os.path.join(root, name), timeout=60)
            for problem in workload.check(target):
                failures.append(f"saved {name} -> loaded ws{ws}-{layout}: {problem}")
    return failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("matrix"))
    names = []
    for ws in WORLD_SIZES:
        names += run_ranks(ws, _save_all, root)[0]
    return root, names


@pytest.mark.parametrize("load_ws", WORLD_SIZES)
def test_reshard_matrix(saved, load_ws):
    root, names = saved
    assert len(names) == sum(len(workload.LAYOUTS_BY_WS[w]) for w in WORLD_SIZES)
    results = run_ranks(load_ws, _load_all, root, names, timeout=600)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)
