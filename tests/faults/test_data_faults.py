"""Corrupted data, tampered metadata, hostile objects and storage faults, one process.

Every case asserts: the error type, that the message names the file/key, that the previous
checkpoint (``step_1``, and for failed saves the checkpoint being replaced) still loads bitwise,
that nothing was committed or left half-written, and that ``verify`` reports the problem.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess

import pytest

from hpdcp_runner.dcp import (CheckpointNotFoundError, CorruptCheckpointError, HpdcpError, MetadataError,
                              PickleNotAllowedError, faults, load, save)
from hpdcp_runner.dcp.offline.inspection import verify
from hpdcp_runner.dcp.offline.transforms import merge_to_hf
from tests.faults.conftest import loads_bitwise, raises_naming, state, zeros

RANK0 = "rank00000.safetensors"


_raises = raises_naming


def _load(path):
    return lambda: load(zeros(), checkpoint_id=path)


def _verify_flags(path, needle):
    rep = verify(path)
    assert not rep.ok and any(needle in p for p in rep.problems), rep.problems
    return "; ".join(rep.problems).replace(f"{path}/", "")[:120]


def _md(path):
    return json.loads((path / "metadata.json").read_text())


def _write_md(path, doc):
    (path / "metadata.json").write_text(json.dumps(doc))


# -- corrupted data ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", ["empty", "inside_length", "inside_header", "inside_data", "last_byte"])
def test_truncated_file(two_checkpoints, fault_row, cut):
    ck = two_checkpoints / "step_2"
    f = ck / RANK0
    data = f.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    n = {"empty": 0, "inside_length": 5, "inside_header": 8 + hlen // 2, "inside_data": 8 + hlen + 100,
         "last_byte": len(data) - 1}[cut]
    f.write_bytes(data[:n])
    _raises(_load(ck), CorruptCheckpointError, RANK0, "truncated")
    v = _verify_flags(ck, RANK0)
    assert loads_bitwise(two_checkpoints / "step_1", 1)
    fault_row(f"truncated rank file ({cut}, {n} of {len(data)} bytes)", "corrupted data", "load refused before reading",
              "CorruptCheckpointError", "file", True, None, v)


def test_flipped_data_byte(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    f = ck / RANK0
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x01
    f.write_bytes(bytes(data))
    msg = _raises(_load(ck), CorruptCheckpointError, RANK0, "checksum")
    assert "key 'b" in msg or "key 'w" in msg
    v = _verify_flags(ck, "fails its checksum")
    assert loads_bitwise(two_checkpoints / "step_1", 1)
    fault_row("one flipped bit in tensor data (checksums on)", "corrupted data", "load refused at the chunk's checksum",
              "CorruptCheckpointError", "file and key", True, None, v)


def test_damaged_safetensors_header(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    f = ck / RANK0
    data = bytearray(f.read_bytes())
    data[9] = ord("#")  # inside the JSON header
    f.write_bytes(bytes(data))
    # Loading reads by the offsets in metadata.json and checks every chunk's checksum, so the data is
    # still proven intact and loads; the file is no longer valid safetensors, which verify reports.
    assert loads_bitwise(ck, 2)
    v = _verify_flags(ck, RANK0)
    fault_row("damaged safetensors header", "corrupted data",
              "load succeeds (offsets come from metadata.json, every chunk checksum-verified); verify flags the file",
              None, "file", True, None, v)


def test_missing_rank_file(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    (ck / RANK0).unlink()
    _raises(_load(ck), CheckpointNotFoundError, RANK0, "missing")
    v = _verify_flags(ck, f"{RANK0}: missing")
    assert loads_bitwise(two_checkpoints / "step_1", 1)
    fault_row("missing rank file", "corrupted data", "load refused", "CheckpointNotFoundError", "file", True, None, v)


def test_stray_files(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    (ck / "rank00009.safetensors").write_bytes(b"junk")
    (ck / "notes.txt").write_text("x")
    assert loads_bitwise(ck, 2)  # never read: only files named in metadata.json are opened
    v = _verify_flags(ck, "not listed")
    fault_row("stray files in the checkpoint directory", "corrupted data", "ignored by load; verify lists them",
              None, "file", True, None, v)


# -- tampered metadata ------------------------------------------------------------------------------

def _retarget(doc, new_name):
    fm = doc["files"].pop(RANK0)
    doc["files"][new_name] = fm
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            if c[2] == RANK0:
                c[2] = new_name


@pytest.mark.parametrize("name", ["../step_1/rank00000.safetensors", "/etc/passwd", ".hidden", "a/b"])
def test_file_name_escaping_the_directory(two_v1_checkpoints, fault_row, name):
    ck = two_v1_checkpoints / "step_2"
    doc = _md(ck)
    _retarget(doc, name)
    _write_md(ck, doc)
    _raises(_load(ck), MetadataError, "metadata.json", repr(name)[:20])
    v = _verify_flags(ck, "metadata.json")
    assert loads_bitwise(two_v1_checkpoints / "step_1", 1)
    fault_row(f"file name {name!r} in metadata.json (format v1)", "tampered metadata", "refused while validating metadata",
              "MetadataError", "file", True, None, v)


def test_symlinked_rank_file_and_metadata(two_checkpoints, fault_row, tmp_path):
    ck = two_checkpoints / "step_2"
    outside = tmp_path / "outside.safetensors"
    shutil.move(ck / RANK0, outside)
    os.symlink(outside, ck / RANK0)
    _raises(_load(ck), CorruptCheckpointError, RANK0, "symbolic link")
    v = _verify_flags(ck, "symbolic link")
    fault_row("rank file is a symlink (to a file outside)", "tampered metadata", "refused at open (O_NOFOLLOW)",
              "CorruptCheckpointError", "file", loads_bitwise(two_checkpoints / "step_1", 1), None, v)
    md_real = tmp_path / "md.json"
    shutil.move(ck / "metadata.json", md_real)
    os.symlink(md_real, ck / "metadata.json")
    _raises(_load(ck), CorruptCheckpointError, "metadata.json", "symbolic link")
    fault_row("metadata.json is a symlink", "tampered metadata", "refused at open", "CorruptCheckpointError", "file",
              loads_bitwise(two_checkpoints / "step_1", 1), None, None)


def test_fifo_in_place_of_a_rank_file_does_not_hang(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    (ck / RANK0).unlink()
    os.mkfifo(ck / RANK0)
    _raises(_load(ck), CorruptCheckpointError, RANK0, "not a regular file")
    v = _verify_flags(ck, "not a regular file")
    fault_row("a FIFO in place of a rank file", "tampered metadata", "refused at open (no blocking read)",
              "CorruptCheckpointError", "file", loads_bitwise(two_checkpoints / "step_1", 1), None, v)


@pytest.mark.parametrize("case", ["offsets_out_of_bounds", "absurd_shape", "overlap", "gap", "bytes_past_eof"])
def test_bad_geometry(two_v1_checkpoints, fault_row, case):
    ck = two_v1_checkpoints / "step_2"
    doc = _md(ck)
    w = doc["tensors"]["w"]
    c = w["chunks"][0]
    if case == "offsets_out_of_bounds":
        c[0] = [60, 0]
        needle = "outside shape"
    elif case == "absurd_shape":
        w["shape"] = [10**12, 10**12]
        c[1] = [10**12, 10**12]
        needle = "2**62 elements or more"  # refused at parse, before any size arithmetic
    elif case == "overlap":
        w["chunks"].append(list(c))
        needle = "overlap"
    elif case == "gap":
        c[1] = [32, 32]
        needle = "cover"
    else:
        c[4] = doc["files"][RANK0]["size"] - 10
        needle = "beyond the end"
    _write_md(ck, doc)
    _raises(_load(ck), MetadataError, "metadata.json", "'w'", needle)
    v = _verify_flags(ck, needle)
    fault_row(f"chunk geometry: {case.replace('_', ' ')} (format v1)", "tampered metadata",
              "refused while validating metadata, before any allocation or read", "MetadataError", "file and key",
              loads_bitwise(two_v1_checkpoints / "step_1", 1), None, v)


def test_absurd_shape_with_matching_claimed_size_is_refused_before_allocating(two_v1_checkpoints, fault_row, tmp_path):
    """A shape of 1e12 x 1e12 with a file size claimed to match: offline tools check the real file
    size before allocating anything from the metadata."""
    ck = two_v1_checkpoints / "step_2"
    doc = _md(ck)
    doc["tensors"] = {"w": {**doc["tensors"]["w"], "shape": [10**6, 10**6]}}
    doc["tensors"]["w"]["chunks"] = [[[0, 0], [10**6, 10**6], RANK0, "w@0,0", 4096, "0"]]
    doc["files"][RANK0]["size"] = 4 * 10**12 + 4096
    _write_md(ck, doc)
    _raises(lambda: merge_to_hf(ck, tmp_path / "hf"), CorruptCheckpointError, RANK0, "bytes but metadata.json records")
    _raises(_load(ck), HpdcpError, "'w'")  # the target's shape disagrees: refused before reading
    assert not (tmp_path / "hf").exists()
    fault_row("absurd shape (1e6 x 1e6 fp32) with a matching claimed file size", "tampered metadata",
              "load: shape mismatch with the target; offline tools: real file size checked before allocating",
              "CorruptCheckpointError", "file", loads_bitwise(two_v1_checkpoints / "step_1", 1), None, None)


def test_unknown_version_pickle_and_oversized_metadata(two_checkpoints, fault_row, tmp_path):
    ck = two_checkpoints / "step_2"
    doc = _md(ck)
    _write_md(ck, {**doc, "format_version": 99})
    _raises(_load(ck), MetadataError, "metadata.json", "unsupported format version 99")
    fault_row("unknown format_version", "tampered metadata", "refused", "MetadataError", "file",
              loads_bitwise(two_checkpoints / "step_1", 1), None, _verify_flags(ck, "format version"))
    marker = tmp_path / "PWNED"
    (ck / "metadata.json").write_bytes(pickle.dumps(_Payload(marker)))
    _raises(_load(ck), MetadataError, "metadata.json", "not valid JSON")
    assert not marker.exists()
    fault_row("a pickle where metadata.json should be", "tampered metadata", "refused as invalid JSON; never unpickled",
              "MetadataError", "file", loads_bitwise(two_checkpoints / "step_1", 1), True, None)
    (ck / "metadata.json").write_text(json.dumps({**doc, "extra": {"pad": "x" * 4096}}))
    _raises(lambda: load(zeros(), storage_reader=_small_reader(ck)), MetadataError, "metadata.json", "limit")
    fault_row("oversized metadata.json (over max_metadata_bytes)", "tampered metadata", "refused before parsing",
              "MetadataError", "file", loads_bitwise(two_checkpoints / "step_1", 1), None, None)


def _small_reader(path):
    from hpdcp_runner.dcp import FileSystemReader

    return FileSystemReader(path, max_metadata_bytes=2048)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


# -- hostile objects ----------------------------------------------------------------------------------

def test_pickle_payload_in_an_object_item(two_checkpoints, fault_row, tmp_path):
    marker = tmp_path / "PWNED"
    ck = tmp_path / "evil"
    save({**state(3), "meta": {"step": _Payload(marker)}}, checkpoint_id=ck, allow_pickle=True)
    assert not marker.exists()
    _raises(_load(ck), PickleNotAllowedError, "meta.step", "allow_pickle")
    assert not marker.exists()
    fault_row("pickle payload in an object item (loaded without allow_pickle)", "hostile objects",
              "refused; never unpickled", "PickleNotAllowedError", "file and key",
              loads_bitwise(two_checkpoints / "step_1", 1), True, None)


# -- storage faults -----------------------------------------------------------------------------------

def _staging_left(root):
    return [n for n in os.listdir(root) if ".tmp-" in n]


def test_disk_full(tmp_path, fault_row):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    try:
        import torch

        save({"w": torch.ones(16), "meta": {"step": 1}}, checkpoint_id=mnt / "step_1")
        big = {"w": torch.ones(16), "x": torch.ones(256 * 1024), "meta": {"step": 2}}  # 1 MiB
        if mounted:
            fn = lambda: save(big, checkpoint_id=mnt / "step_1", overwrite=True)  # noqa: E731
        else:  # not root (or no tmpfs): the same OSError, raised where the write would fail
            def fn():
                with faults.armed("file.write", lambda path, **_: faults.fail(
                        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))):
                    save(big, checkpoint_id=mnt / "step_1", overwrite=True)
        _raises(fn, HpdcpError, "rank 0", "No space left on device", RANK0)
        tgt = {"w": torch.zeros(16), "meta": {"step": 0}}
        load(tgt, checkpoint_id=mnt / "step_1")
        intact = bool(torch.equal(tgt["w"], torch.ones(16))) and tgt["meta"] == {"step": 1}
        assert intact and not _staging_left(mnt)
        fault_row(f"disk full ({'256 KiB tmpfs' if mounted else 'simulated ENOSPC'}) while overwriting a checkpoint",
                  "storage faults", "save fails on every rank; staging removed; the old checkpoint stays",
                  type(_exc(fn)).__name__, "rank and file", intact, None, None)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True)


def _exc(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.parametrize("point", ["file.fsync", "commit.rename", "save.commit"])
def test_fsync_and_commit_failures(two_checkpoints, fault_row, point):
    ck = two_checkpoints / "step_2"
    eio = lambda path, **_: faults.fail(OSError(errno.EIO, os.strerror(errno.EIO), str(path)))  # noqa: E731
    with faults.armed(point, eio):
        msg = _raises(lambda: save(state(5), checkpoint_id=ck, overwrite=True), HpdcpError, "rank 0",
                      "Input/output error")
    assert str(two_checkpoints) in msg
    assert loads_bitwise(ck, 2) and not _staging_left(two_checkpoints)
    fault_row(f"EIO at {point} while overwriting", "storage faults",
              "save fails; nothing committed; staging removed; the old checkpoint stays", "DistributedError",
              "rank and file", True, None, None)


def test_eio_while_reading(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    eio = lambda path, file, **_: faults.fail(OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(path, file)))  # noqa: E731
    with faults.armed("load.read", eio):
        _raises(_load(ck), HpdcpError, "rank 0", RANK0, "Input/output error")
    assert loads_bitwise(ck, 2) and loads_bitwise(two_checkpoints / "step_1", 1)
    fault_row("EIO while reading a rank file", "storage faults", "load fails on every rank naming the file",
              "DistributedError", "rank and file", True, None, None)


def test_created_files_respect_the_umask(tmp_path, fault_row):
    old = os.umask(0o027)
    try:
        save(state(1), checkpoint_id=tmp_path / "ck")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ck").iterdir()}
    assert set(modes.values()) == {0o640}, modes
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o750
    fault_row("umask 027 at save", "hardening", "files 0640, directory 0750 (safetensors' own writer forces 0600)",
              None, None, None, None, None)
