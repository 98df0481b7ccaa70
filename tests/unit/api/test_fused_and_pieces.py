"""FusedShard and ShardPieces through save, async_save and load in one process: the checkpoint
holds the global tensor, and loading into either form fills the right storage."""

from __future__ import annotations

import torch

from hpdcp_runner.dcp import FusedShard, ShardPieces, async_save, load, read_metadata, save
from hpdcp_runner.dcp.tools import Box


def _state():
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    # parts [0:5) and [5:8) held whole, in one local tensor, second part first
    fused = FusedShard(torch.cat([full[5:], full[:5]]), (8, 3), [Box((5, 0), (3, 3)), Box((0, 0), (5, 3))], 0)
    stacked = torch.arange(2 * 4, dtype=torch.int64).view(2, 4)
    pieces = ShardPieces((2, 4), [(Box((1, 0), (1, 4)), stacked[1:].clone()),
                                  (Box((0, 0), (1, 4)), stacked[:1].clone())])
    return full, stacked, {"f": fused, "p": pieces}


def test_save_and_async_save_store_the_global_tensors(tmp_path):
    full, stacked, state = _state()
    save(state, checkpoint_id=tmp_path / "a")
    async_save(state, checkpoint_id=tmp_path / "b").result()
    for name in ("a", "b"):
        assert read_metadata(tmp_path / name).tensors["f"].shape == (8, 3)
        got = {"f": torch.zeros(8, 3), "p": torch.zeros(2, 4, dtype=torch.int64)}
        load(got, checkpoint_id=tmp_path / name)
        assert torch.equal(got["f"], full) and torch.equal(got["p"], stacked)


def test_load_fills_each_piece_in_place(tmp_path):
    full, stacked, _ = _state()
    save({"f": full, "p": stacked}, checkpoint_id=tmp_path / "c")
    _, _, state = _state()
    for leaf in (state["f"].local, *[t for _, t in state["p"].pieces]):
        leaf.zero_()
    load(state, checkpoint_id=tmp_path / "c")
    assert torch.equal(state["f"].local, torch.cat([full[5:], full[:5]]))
    assert torch.equal(state["p"].pieces[0][1], stacked[1:]) and torch.equal(state["p"].pieces[1][1], stacked[:1])
