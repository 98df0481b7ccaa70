"""Reliability round 3, the classes that lose checkpoints:

* names cannot lie: a checkpoint is a member of a series only if its name is the series pattern
  formatted with its recorded step (and it is not a link); others are never deleted, never picked,
  and reported;
* readers never repair: a load reads an overwrite's displaced checkpoint in place while the swap is
  between its renames (or was killed there), never renames anything; a deliberate deletion stays
  deleted; repair is for writers, and never of a swap in progress;
* a load whose checkpoint is replaced under it says CheckpointChangedError, not that a file is
  missing."""

from __future__ import annotations

import fcntl
import os
import shutil

import pytest

from hpdcp_runner.dcp import (CheckpointChangedError, CheckpointNotFoundError, FileSystemReader, Metadata, faults,
                              load, save, tools)
from hpdcp_runner.dcp.storage.posix import commit as fs
from hpdcp_runner.dcp.storage.retention import (apply_retention, latest_checkpoint, list_checkpoints, series_extra,
                                                series_outsiders)
from tests.faults.conftest import loads_bitwise, state

SERIES = "step_{step}"


def _save(root, name, k, step, series=SERIES):
    save(state(k), checkpoint_id=root / name, extra=series_extra(series, step) if series else None)


# -- names cannot lie --------------------------------------------------------------------------

def test_a_name_that_disagrees_with_its_recorded_step_is_not_a_member(tmp_path):
    for step in (100, 200, 300):
        _save(tmp_path, f"step_{step}", step % 7, step)
    _save(tmp_path, "step_0", 1, 999_999)  # another run's final checkpoint copied in to warm-start
    _save(tmp_path, "step_5", 2, 5, series="ckpt_{step}")  # another series' pattern, renamed in
    _save(tmp_path, "step_6", 3, None)  # a step field with no step recorded
    assert latest_checkpoint(tmp_path, SERIES) == os.path.join(tmp_path, "step_300")
    assert apply_retention(tmp_path, 2, series=SERIES, keep=["step_300"]) == ["step_100"]
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert left == ["step_0", "step_200", "step_300", "step_5", "step_6"]
    why = dict(series_outsiders(tmp_path, SERIES))
    assert set(why) == {"step_0", "step_5", "step_6"}
    assert "records step 999999" in why["step_0"] and "'step_999999', not 'step_0'" in why["step_0"]
    assert "ckpt_{step}" in why["step_5"]
    assert loads_bitwise(tmp_path / "step_0", 1)  # kept whole


def test_links_are_never_members(tmp_path):
    other = tmp_path / "other_run"
    other.mkdir()
    _save(other, "step_900", 4, 900)
    run = tmp_path / "run"
    run.mkdir()
    _save(run, "step_1", 1, 1)
    _save(run, "step_2", 2, 2)
    os.symlink(other / "step_900", run / "step_900")  # a link claiming step 900
    assert latest_checkpoint(run, SERIES) == os.path.join(run, "step_2")
    apply_retention(run, 1, series=SERIES, keep=["step_2"])
    assert os.path.islink(run / "step_900") and loads_bitwise(other / "step_900", 4)
    assert "symbolic link" in dict(series_outsiders(run, SERIES))["step_900"]


def test_inspect_says_why_a_checkpoint_is_not_a_member(tmp_path):
    _save(tmp_path, "step_0", 1, 42)
    d = tools.describe(tmp_path / "step_0")
    assert d["series"]["member"] is False and "records step 42" in d["series"]["why"]
    _save(tmp_path, "step_42", 1, 42)
    assert tools.describe(tmp_path / "step_42")["series"] == {"series": SERIES, "step": 42, "member": True,
                                                               "why": None}


# -- readers never repair ----------------------------------------------------------------------

def _interrupted_swap(root, name, old_k, new_k, *, live: bool):
    """What an overwrite without RENAME_EXCHANGE leaves between its renames: the committed one
    under ``.NAME.old-<id>``, the new one complete in ``.NAME.tmp-<id>`` (its lock held by a live
    writer when ``live``). Returns the lock fd (or None)."""
    save(state(old_k), checkpoint_id=root / name)
    staged = root / "_staged"
    save(state(new_k), checkpoint_id=staged)
    tid = "0123456789ab"
    os.rename(staged, root / f".{name}.tmp-{tid}")
    fd = None
    if live:
        fd = os.open(root / f".{name}.tmp-{tid}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        open(root / f".{name}.tmp-{tid}.lock", "w").close()  # its writer died: the lock is free
    os.rename(root / name, root / f".{name}.old-{tid}")
    return fd


def test_a_load_between_the_renames_reads_the_committed_one_in_place(tmp_path):
    fd = _interrupted_swap(tmp_path, "ck", 1, 2, live=True)
    before = sorted(os.listdir(tmp_path))
    assert loads_bitwise(tmp_path / "ck", 1)  # the committed (displaced) one, read where it is
    assert latest_checkpoint(tmp_path, "ck") is None  # (no series) ...
    assert sorted(os.listdir(tmp_path)) == before  # ... and nothing was renamed by the readers
    apply_retention(tmp_path, 1, series="ck")  # a writer: a swap in progress is not its to finish
    assert sorted(os.listdir(tmp_path)) == before
    os.close(fd)  # the overwriting process died between its renames
    apply_retention(tmp_path, 1, series="ck")  # now a writer restores the committed one
    assert sorted(os.listdir(tmp_path)) == ["ck"] and loads_bitwise(tmp_path / "ck", 1)


def test_latest_sees_a_checkpoint_whose_overwrite_was_killed_between_renames(tmp_path):
    _save(tmp_path, "step_1", 1, 1)
    save(state(2), checkpoint_id=tmp_path / "step_2", extra=series_extra(SERIES, 2))
    staged = tmp_path / "_s"
    save(state(3), checkpoint_id=staged, extra=series_extra(SERIES, 2))
    os.rename(staged, tmp_path / ".step_2.tmp-aaaaaaaaaaaa")
    os.rename(tmp_path / "step_2", tmp_path / ".step_2.old-aaaaaaaaaaaa")
    assert latest_checkpoint(tmp_path, SERIES) == os.path.join(tmp_path, "step_2")
    assert loads_bitwise(tmp_path / "step_2", 2)


def test_a_deliberate_deletion_stays_deleted(tmp_path):
    save(state(1), checkpoint_id=tmp_path / "ck")
    shutil.copytree(tmp_path / "ck", tmp_path / ".ck.old-0123456789ab")  # a completed swap's stale leftover
    shutil.rmtree(tmp_path / "ck")  # deleted on purpose
    with pytest.raises(CheckpointNotFoundError):
        load(state(0), checkpoint_id=tmp_path / "ck")
    save(state(5), checkpoint_id=tmp_path / "ck")  # a new save of the name is not "already exists"
    assert loads_bitwise(tmp_path / "ck", 5)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the writer removed the stale copy


def test_a_load_racing_a_fallback_overwrite_between_its_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "_exchange", lambda a, b: False)
    save(state(1), checkpoint_id=tmp_path / "ck")
    seen = []

    def load_now(**_):
        seen.append(loads_bitwise(tmp_path / "ck", 1))

    with faults.armed("commit.displaced", load_now):
        save(state(2), checkpoint_id=tmp_path / "ck", overwrite=True)  # no "Directory not empty"
    assert seen == [True] and loads_bitwise(tmp_path / "ck", 2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- error kinds under overwrite ---------------------------------------------------------------

def test_a_file_missing_from_a_replaced_checkpoint_is_a_change(tmp_path):
    save(state(1), checkpoint_id=tmp_path / "ck")
    r = FileSystemReader(tmp_path / "ck")
    md = Metadata.from_json(r.read_metadata_text(), source="x", open_file=r.open_file)
    r.attach_metadata(md, r.pin())
    os.rename(tmp_path / "ck", tmp_path / "moved")  # replaced under the load, its files being deleted
    save(state(2), checkpoint_id=tmp_path / "ck")
    os.unlink(tmp_path / "moved" / "rank00000.objects.json")
    with pytest.raises(CheckpointChangedError):
        r.check_files(sorted(md.files))
    with pytest.raises(CheckpointChangedError):
        r.read_objects(md.objects, allow_pickle=False)
    r.close()
    r = FileSystemReader(tmp_path / "ck")  # the same file really missing from the current one
    md = Metadata.from_json(r.read_metadata_text(), source="x", open_file=r.open_file)
    r.attach_metadata(md, r.pin())
    os.unlink(tmp_path / "ck" / "rank00000.objects.json")
    with pytest.raises(CheckpointNotFoundError, match="is missing"):
        r.check_files(sorted(md.files))
    r.close()
