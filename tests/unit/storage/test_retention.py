"""Retention and "latest" consider only the checkpoints of one series, ordered by recorded step."""

import json
import os

import pytest
import torch

from hpdcp_runner.config import checkpoint_series
from hpdcp_runner.dcp import ConfigError, save
from hpdcp_runner.dcp.storage.retention import (apply_retention, latest_checkpoint, list_checkpoints, series_extra,
                                        series_regex, unrecorded_checkpoints)

SERIES = "step_{step}"


def _save(root, name, step, series=SERIES):
    extra = series_extra(series, step) if series else None
    save({"w": torch.full((2,), float(step or 0))}, checkpoint_id=root / name, extra=extra)


def _names(root, series=SERIES):
    return [e.name for e in list_checkpoints(root, series)]


def _layout(root):
    for step in (2, 10, 9):
        _save(root, f"step_{step}", step)
    (root / ".step_11.tmp-abc").mkdir()          # an uncommitted save in progress
    (root / ".step_1.trash-def").mkdir()         # trash left by a crash mid-deletion
    (root / "step_12").mkdir()                   # a directory without metadata.json


def test_discovery_ignores_staging_trash_and_uncommitted_and_orders_by_recorded_step(tmp_path):
    _layout(tmp_path)
    assert _names(tmp_path) == ["step_2", "step_9", "step_10"]
    assert latest_checkpoint(tmp_path, SERIES) == os.path.join(tmp_path, "step_10")
    assert latest_checkpoint(tmp_path / "nope", SERIES) is None


def test_keep_last_deletes_oldest_of_the_series_and_clears_old_trash(tmp_path):
    _layout(tmp_path)
    assert apply_retention(tmp_path, 2, series=SERIES) == ["step_2"]
    assert sorted(os.listdir(tmp_path)) == [".step_11.tmp-abc", "step_10", "step_12", "step_9"]
    assert apply_retention(tmp_path, 0, series=SERIES) == [] and _names(tmp_path) == ["step_9", "step_10"]


def test_other_names_and_foreign_checkpoints_are_never_touched(tmp_path):
    # the reported data loss: 'init' and 'x' (other names), a backup copy named like a step, a
    # checkpoint of another series, and one written without any series (another tool / old version)
    for name in ("init", "x", "best", "final_model"):
        _save(tmp_path, name, 0, series=name)
    _save(tmp_path, "step_100", None, series=None)        # no recorded series: named like one, not one
    _save(tmp_path, "run2_step_7", 7, series="run2_step_{step}")
    for step in (1, 2, 3):
        _save(tmp_path, f"step_{step}", step)
    os.rename(tmp_path / "step_1", tmp_path / "step_5_backup")  # a copy under another name keeps its extra
    assert _names(tmp_path) == ["step_2", "step_3"]
    assert apply_retention(tmp_path, 1, series=SERIES) == ["step_2"]
    assert sorted(os.listdir(tmp_path)) == ["best", "final_model", "init", "run2_step_7", "step_100", "step_3",
                                            "step_5_backup", "x"]
    assert latest_checkpoint(tmp_path, SERIES) == os.path.join(tmp_path, "step_3")
    assert unrecorded_checkpoints(tmp_path, SERIES) == ["step_100"]


def test_the_checkpoint_just_committed_is_never_deleted(tmp_path):
    # step_100 of this series is newer by step than a fresh step_6: keep_last=1 keeps step_100 and
    # must still keep the step_6 this job just wrote
    for step in (100, 5, 6):
        _save(tmp_path, f"step_{step}", step)
    assert apply_retention(tmp_path, 1, series=SERIES, keep=["step_6"]) == ["step_5"]
    assert sorted(os.listdir(tmp_path)) == ["step_100", "step_6"]


def test_a_name_and_its_recorded_step_must_agree(tmp_path):
    # the names lie (renamed checkpoints): neither is a member, so neither is picked or deleted
    _save(tmp_path, "step_9", 20)
    _save(tmp_path, "step_10", 3)
    _save(tmp_path, "step_007", 7)  # zero-padded: the step in the name is still 7
    assert latest_checkpoint(tmp_path, SERIES) == os.path.join(tmp_path, "step_007")
    assert apply_retention(tmp_path, 1, series=SERIES, keep=["step_007"]) == []
    assert sorted(os.listdir(tmp_path)) == ["step_007", "step_10", "step_9"]


def test_without_steps_a_step_series_has_no_members(tmp_path):
    for name in ("ck_20", "ck_3"):
        _save(tmp_path, name, None, series="ck_{step}")
    doc = json.loads((tmp_path / "ck_3" / "metadata.json").read_text())
    assert doc["extra"]["step"] is None and doc["extra"]["series"] == "ck_{step}"
    assert latest_checkpoint(tmp_path, "ck_{step}") is None
    _save(tmp_path, "best", None, series="best")  # a series of one name
    assert latest_checkpoint(tmp_path, "best") == os.path.join(tmp_path, "best")


def test_unreadable_metadata_is_skipped_not_deleted(tmp_path):
    for step in (1, 2):
        _save(tmp_path, f"step_{step}", step)
    (tmp_path / "step_1" / "metadata.json").write_text("{not json")
    assert apply_retention(tmp_path, 1, series=SERIES, keep=["step_2"]) == []
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]


def test_series_names_and_runner_name_rules():
    rx = series_regex("step_{step}")
    assert rx.fullmatch("step_12") and not rx.fullmatch("step_12_backup") and not rx.fullmatch("step_")
    assert series_regex("best").fullmatch("best") and not series_regex("best").fullmatch("best1")
    assert series_regex("a.b_{step}").fullmatch("a.b_1") and not series_regex("a.b_{step}").fullmatch("axb_1")
    assert checkpoint_series("step_{step}", 7) == ("step_7", "step_{step}", 7)
    assert checkpoint_series("step_5", 0) == ("step_5", "step_{step}", 5)
    assert checkpoint_series("best", 3) == ("best", "best", None)
    with pytest.raises(ConfigError):
        apply_retention("x", -1, series=SERIES)
