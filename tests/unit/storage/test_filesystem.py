"""The filesystem writer and reader on their own: staging invisible until the commit, abort
leaves nothing, the reader reads exactly the requested region and names a corrupted file."""

from __future__ import annotations

import os

import pytest
import torch

from hpdcp_runner.dcp import CorruptCheckpointError, FileSystemReader, FileSystemWriter, HpdcpError, load, read_metadata, save
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.storage.posix.commit import STAGING_LOCK, RenameCommit
from hpdcp_runner.dcp.storage.interfaces import ReadRequest


def test_a_save_is_invisible_until_its_commit_and_abort_leaves_nothing(tmp_path):
    w = FileSystemWriter(tmp_path / "ck")
    token = w.begin(overwrite=False)
    w.attach(token, rank=0, world_size=1)
    w.write([("t", torch.ones(3))], {})
    assert not (tmp_path / "ck").exists() and os.path.isdir(w.staging)
    w.abort()
    assert os.listdir(tmp_path) == []
    assert w.checkpoint_id == str(tmp_path / "ck")


def test_partial_reads_read_the_requested_rows_and_verify_them(tmp_path):
    full = torch.arange(64 * 256, dtype=torch.float32).view(64, 256)
    save({"w": full}, checkpoint_id=tmp_path / "ck")
    md = read_metadata(tmp_path / "ck")
    (chunk,) = md.tensors["w"].chunks
    # verified (the default), a part of a one-block chunk costs the whole chunk; unverified,
    # exactly the rows asked for
    for verify, expect in ((True, 64 * 256 * 4), (False, 8 * 256 * 4)):
        r = FileSystemReader(tmp_path / "ck", verify_checksums=verify)
        r.attach_metadata(md)
        dest = torch.zeros(8, 256)
        r.read_tensors([ReadRequest(chunk, "float32", Box((16, 0), (8, 256)), dest)])
        assert torch.equal(dest, full[16:24]) and r.counters.bytes_read == expect
        assert r.counters.chunks_verified == int(verify)
        r.close()
    # one flipped byte inside the rows read: the file and key are named
    with open(tmp_path / "ck" / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset + 20 * 256 * 4)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=rf"{chunk.file}: key 'w@0,0' fails its checksum"):
        load({"w": torch.zeros(64, 256)}, checkpoint_id=tmp_path / "ck")


def test_the_rename_commit_publishes_in_one_step_and_keeps_the_old_until_then(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("old")
    s = RenameCommit.begin(tmp_path / "out", overwrite=True, exists="{path} exists")
    assert os.path.exists(s.staging + STAGING_LOCK)  # held: cleanup tells it from a dead writer's
    (open(os.path.join(s.staging, "new"), "w")).write("new")
    assert (tmp_path / "out" / "old").exists()  # still the old one
    other = RenameCommit.adopt(tmp_path / "out", s.token, overwrite=True)  # another rank's view
    assert other.staging == s.staging
    with pytest.raises(HpdcpError, match="not a staging directory"):
        RenameCommit.adopt(tmp_path / "out", "../elsewhere", overwrite=True)
    s.publish()
    assert os.listdir(tmp_path / "out") == ["new"] and sorted(os.listdir(tmp_path)) == ["out"]
