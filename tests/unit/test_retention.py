import os

import torch

from hpdcp_runner.dcp import save
from hpdcp_runner.dcp.retention import apply_retention, latest_checkpoint, list_checkpoints


def _layout(root):
    for step in (2, 10, 9):
        save({"w": torch.full((2,), float(step))}, checkpoint_id=root / f"step_{step}")
    (root / ".step_11.tmp-abc").mkdir()          # an uncommitted save in progress
    (root / ".step_1.trash-def").mkdir()         # trash left by a crash mid-deletion
    (root / "step_12").mkdir()                   # a directory without metadata.json


def test_discovery_ignores_staging_trash_and_uncommitted_and_orders_numerically(tmp_path):
    _layout(tmp_path)
    assert list_checkpoints(tmp_path) == ["step_2", "step_9", "step_10"]
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "step_10")
    assert latest_checkpoint(tmp_path / "nope") is None


def test_keep_last_deletes_oldest_committed_and_clears_old_trash(tmp_path):
    _layout(tmp_path)
    assert apply_retention(tmp_path, 2) == ["step_2"]
    assert sorted(os.listdir(tmp_path)) == [".step_11.tmp-abc", "step_10", "step_12", "step_9"]
    assert apply_retention(tmp_path, 0) == [] and list_checkpoints(tmp_path) == ["step_9", "step_10"]
