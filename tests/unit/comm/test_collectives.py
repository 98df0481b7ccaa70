"""Comm: JSON collectives over real gloo ranks, the coordinator pattern, and agreed errors."""

from __future__ import annotations

import pytest
import torch

from hpdcp_runner.dcp import CorruptCheckpointError, DistributedError
from hpdcp_runner.dcp.comm.collectives import Comm
from tests.multiproc.harness import run_ranks


def _cases(rank: int, ws: int) -> dict:
    comm = Comm.create(None, 30)
    out = {"gathered": comm.all_gather_json({"r": rank, "x": [rank] * rank}),
           "bcast": comm.broadcast_json({"from": rank}),
           "gather": comm.gather_frames(rank * 10),
           "scatter": comm.scatter_frames([f"for {r}" for r in range(ws)] if rank == 0 else None)}
    # the coordinator pattern: every rank's value to rank 0, one reply per rank back
    out["frames"] = comm.coordinate("f", lambda: {"cols": torch.arange(rank, dtype=torch.int64), "flags": torch.ones(2, dtype=torch.bool)},
                                    lambda vals: [{"sum": int(sum(v["cols"].sum() for v in vals)), "mine": vals[r]["cols"] * 2}
                                                  for r in range(ws)])
    out["frames"]["mine"] = out["frames"]["mine"].tolist()
    # rows received in place, uneven (rank 0 sends none): in rank order, nothing padded
    rows = torch.arange(3 * rank, dtype=torch.int64).view(rank, 3) + 100 * rank
    got = comm.gather_rows(rows, [r for r in range(ws)] if rank == 0 else None)
    out["rows"] = None if got is None else got.tolist()
    out["coord"] = comm.coordinate("c", lambda: rank + 1, lambda vals: [sum(vals) * 100 + r for r in range(ws)])
    try:  # a failure of ours on one rank: the same type on every rank, naming that rank
        comm.agree("a", lambda: (_ for _ in ()).throw(CorruptCheckpointError("bad bytes")) if rank == 2 else 1)
    except CorruptCheckpointError as e:
        out["agreed"] = (type(e).__name__, str(e))
    try:  # anything else becomes a DistributedError
        comm.agree_root("b", lambda: 1 / 0)
    except DistributedError as e:
        out["root"] = str(e)
    return out


def test_collectives_on_three_ranks():
    res = run_ranks(3, _cases)
    for rank, r in enumerate(res):
        assert r["gathered"] == [{"r": 0, "x": []}, {"r": 1, "x": [1]}, {"r": 2, "x": [2, 2]}]
        assert r["bcast"] == {"from": 0}
        assert r["gather"] == ([0, 10, 20] if rank == 0 else None)
        assert r["scatter"] == f"for {rank}"
        assert r["coord"] == 600 + rank  # (1 + 2 + 3) * 100 + rank
        assert r["frames"] == {"sum": 0 + 0 + 1, "mine": [2 * i for i in range(rank)]}
        assert r["rows"] == ([[100, 101, 102], [200, 201, 202], [203, 204, 205]] if rank == 0 else None)
        assert r["agreed"] == ("CorruptCheckpointError", "a failed on 1 rank(s): rank 2: bad bytes")
        assert "rank 0: ZeroDivisionError: division by zero" in r["root"]


def test_one_process_needs_no_process_group():
    comm = Comm.create(None, 5)
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.coordinate("c", lambda: 2, lambda vals: [vals[0] * 3]) == 6
    with pytest.raises(DistributedError, match="rank 0: KeyError"):
        comm.agree("k", lambda: {}["missing"])


def test_a_reply_repeated_for_every_rank_is_encoded_once(monkeypatch):
    from hpdcp_runner.dcp.comm import collectives
    from hpdcp_runner.dcp.core.columns import decode_frame

    calls = []
    real = collectives.encode_frame
    monkeypatch.setattr(collectives, "encode_frame", lambda o: calls.append(o) or real(o))
    same, other = {"ok": {"writes": torch.arange(3), "token": "t"}}, {"ok": 1}
    out = collectives.encode_each([same] * 1000 + [other, same])
    assert len(calls) == 2 and out[0] is out[999] is out[1001]
    back = decode_frame(out[0])
    assert back["ok"]["writes"].tolist() == [0, 1, 2] and back["ok"]["token"] == "t"
    assert decode_frame(out[1000]) == other


@pytest.mark.parametrize("cut", [0, 3, 15, 17, 40])
def test_a_damaged_frame_is_a_value_error_not_a_crash(cut):
    from hpdcp_runner.dcp.core.columns import decode_frame, encode_frame

    frame = encode_frame({"a": torch.arange(10), "b": [1, "x"]})
    with pytest.raises(ValueError):
        decode_frame(frame[:cut])
    with pytest.raises(ValueError):
        decode_frame(b"JSON" + frame[4:])
