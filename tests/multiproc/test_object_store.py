"""Distributed save / load / reshard against a real S3 server (moto on loopback), on real gloo
ranks: every layout of the reshard workload saved at 2 ranks and loaded at 2 and 4 under every
layout, bitwise; replicated shards read once per replica group and broadcast (on by default for
object stores); async_save; a rank killed before the commit publishes nothing."""

from __future__ import annotations

import os

import pytest

from tests.multiproc import workload
from tests.multiproc.harness import run_ranks

SAVE_LAYOUTS = ["rep", "s0", "s1", "ragged"]


def _save_all(rank, ws, root, endpoint_env):
    os.environ.update(endpoint_env)
    from hpdcp_runner.dcp import async_save, save

    for layout in SAVE_LAYOUTS:
        if layout == "ragged":  # async, with the same promises
            async_save(workload.build(layout), checkpoint_id=f"{root}/{layout}", timeout=60).result(timeout=120)
        else:
            save(workload.build(layout), checkpoint_id=f"{root}/{layout}", timeout=60)
    return True


def _load_all(rank, ws, root, endpoint_env):
    os.environ.update(endpoint_env)
    from hpdcp_runner.dcp import load

    out = {}
    for src in SAVE_LAYOUTS:
        for layout in workload.LAYOUTS_BY_WS[ws]:
            tgt = workload.build(layout, zeros=True)
            res = load(tgt, checkpoint_id=f"{root}/{src}", timeout=60)
            out[f"{src}->{layout}"] = (workload.check(tgt), res.counters.get("bytes_read", 0),
                                       res.counters.get("bytes_received", 0))
    return out


def _env():
    return {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_REGION", "AWS_ALLOW_HTTP")}


@pytest.mark.slow
def test_reshard_through_object_store(s3_bucket):
    root = f"{s3_bucket}/matrix"
    run_ranks(2, _save_all, root, _env())
    for ws in (2, 4):
        results = run_ranks(ws, _load_all, root, _env(), timeout=300)
        for case, (problems, _, _) in results[0].items():
            assert problems == [], f"ws={ws} {case}: {problems}"
        for r in range(1, ws):
            assert all(p == [] for p, _, _ in results[r].values()), results[r]
    # a replicated save loaded replicated: one rank of each replica group reads, the rest receive
    from hpdcp_runner.dcp import read_metadata

    total = read_metadata(f"{root}/rep").total_tensor_bytes
    rep = [results[r]["rep->plain"] for r in range(4)]
    assert sum(read for _, read, _ in rep) < 1.5 * total + 4 * 4096  # once, not 4 times (+ object files)
    assert sum(recv for _, _, recv in rep) >= 2 * total


def _killed_before_commit(rank, ws, root, endpoint_env):
    os.environ.update(endpoint_env)
    from hpdcp_runner.dcp import faults, save

    if rank == 1:
        faults.arm("save.written", lambda **_: os._exit(9))
    save(workload.build("s0"), checkpoint_id=f"{root}/killed", timeout=20)


def _load_killed(rank, ws, root, endpoint_env):
    os.environ.update(endpoint_env)
    from hpdcp_runner.dcp import CheckpointNotFoundError, load

    try:
        load(workload.build("s0", zeros=True), checkpoint_id=f"{root}/killed", timeout=30)
    except CheckpointNotFoundError as e:
        return str(e)
    return "loaded"


def test_rank_killed_mid_save_publishes_nothing(s3_bucket):
    root = f"{s3_bucket}/crash"
    with pytest.raises(AssertionError):
        run_ranks(2, _killed_before_commit, root, _env(), timeout=120, pg_timeout=20)
    got = run_ranks(2, _load_killed, root, _env())
    assert all("no committed checkpoint" in g for g in got), got
