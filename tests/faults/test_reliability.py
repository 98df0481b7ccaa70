"""Reliability round 2: no lost checkpoint where the file system cannot swap directories
atomically, commits reported as they happened, type mismatches and small format holes refused."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

from hpdcp_runner.dcp import (CommitDurabilityError, FileSystemReader, MetadataError, StateDictError, faults, load,
                              save)
from hpdcp_runner.dcp.storage.posix import commit as fs
from hpdcp_runner.dcp.format.metadata import check_file_name
from hpdcp_runner.dcp.storage.retention import apply_retention, list_checkpoints, series_extra
from tests.faults.conftest import loads_bitwise, state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERIES = "step_{step}"


def _eio(path, **_):
    faults.fail(OSError(errno.EIO, os.strerror(errno.EIO), str(path)))


@pytest.fixture
def no_exchange(monkeypatch):
    """A file system without renameat2(RENAME_EXCHANGE) (some FUSE and network file systems)."""
    monkeypatch.setattr(fs, "_exchange", lambda a, b: False)


def test_fallback_overwrite_failing_between_its_renames_keeps_the_old_checkpoint(tmp_path, no_exchange, fault_row):
    ck = tmp_path / "step_2"
    save(state(2), checkpoint_id=ck)
    with faults.armed("commit.displaced", _eio), pytest.raises(Exception, match="Input/output error"):
        save(state(5), checkpoint_id=ck, overwrite=True)
    intact = loads_bitwise(ck, 2)
    assert intact and sorted(os.listdir(tmp_path)) == ["step_2"]  # no staging, no displaced copy left
    save(state(5), checkpoint_id=ck, overwrite=True)  # and a later overwrite works
    assert loads_bitwise(ck, 5) and sorted(os.listdir(tmp_path)) == ["step_2"]
    fault_row("EIO between the two renames of an overwrite without RENAME_EXCHANGE", "storage faults",
              "save fails; the old checkpoint is renamed back at once and stays loadable under its name",
              "OSError (EIO)", "file", intact, None, None)


def test_fallback_overwrite_killed_between_its_renames_is_recovered(tmp_path, fault_row):
    for k in (1, 2):
        save(state(k), checkpoint_id=tmp_path / f"step_{k}", extra=series_extra(SERIES, k))
    code = f"""
        from hpdcp_runner.dcp import save
        from hpdcp_runner.dcp.storage.posix import commit as fs
        from hpdcp_runner.dcp.storage.retention import series_extra
        from tests.faults.conftest import state
        fs._exchange = lambda a, b: False
        save(state(9), checkpoint_id={str(tmp_path / 'step_2')!r}, overwrite=True, extra=series_extra({SERIES!r}, 2))
    """
    env = dict(os.environ, HPDCP_FAULTS="commit.displaced:kill", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                       env=env, cwd=ROOT)
    assert r.returncode == -9, r.stderr
    left = sorted(os.listdir(tmp_path))
    assert "step_2" not in left and any(n.startswith(".step_2.old-") for n in left), left  # killed in between
    # retention's trash cleanup must not take the only copy; the first access restores it
    apply_retention(tmp_path, 5, series=SERIES)
    assert [e.name for e in list_checkpoints(tmp_path, SERIES)] == ["step_1", "step_2"]
    intact = loads_bitwise(tmp_path / "step_2", 2) and loads_bitwise(tmp_path / "step_1", 1)
    assert intact and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    fault_row("process killed between the two renames of an overwrite without RENAME_EXCHANGE", "process faults",
              "the old checkpoint waits under a displaced name that no cleanup deletes; loads read it there in "
              "place (readers never rename); the next save or retention of that name renames it back",
              "SIGKILL", None, intact, None, None)


def test_commit_durability_failure_says_the_checkpoint_is_committed(tmp_path, fault_row):
    ck = tmp_path / "step_1"
    with faults.armed("commit.dir_fsync", _eio), pytest.raises(CommitDurabilityError) as ei:
        save(state(1), checkpoint_id=ck)
    msg = str(ei.value)
    assert "IS committed" in msg and str(ck) in msg and "Input/output error" in msg
    assert loads_bitwise(ck, 1)
    fault_row("EIO from fsync of the parent directory after the commit rename", "storage faults",
              "CommitDurabilityError saying the checkpoint IS committed (loadable) but may not be durable",
              "CommitDurabilityError", "file", True, None, None)


def test_object_in_checkpoint_never_replaces_a_tensor_and_vice_versa(tmp_path, fault_row):
    save({"step": 3, "w": torch.ones(2)}, checkpoint_id=tmp_path / "a")
    target = {"step": torch.zeros(1), "w": torch.zeros(2)}
    with pytest.raises(StateDictError, match="'step' is a non-tensor object in the checkpoint but a Tensor"):
        load(target, checkpoint_id=tmp_path / "a")
    assert isinstance(target["step"], torch.Tensor) and torch.equal(target["w"], torch.zeros(2))
    with pytest.raises(StateDictError, match="'w' is a tensor in the checkpoint but a int"):
        load({"step": 0, "w": 5}, checkpoint_id=tmp_path / "a")
    fault_row("checkpoint object loaded into a tensor (or a tensor into an object)", "tampered metadata",
              "refused at planning naming the key; the target is untouched", "StateDictError", "key", None, None, None)


def test_small_format_holes(tmp_path, caplog):
    with pytest.raises(MetadataError):
        check_file_name("rank00000.safetensors\n")  # '$' matched before a trailing newline
    # complex tensors: the error names the key
    with pytest.raises(StateDictError, match="'z'"):
        save({"z": torch.zeros(2, dtype=torch.complex64)}, checkpoint_id=tmp_path / "c")
    # OrderedDict leaves round-trip as ordered maps, no pickle
    od = OrderedDict([("b", 1), ("a", [2, 3])])
    save({"w": torch.ones(1), "cfg": [od]}, checkpoint_id=tmp_path / "o")
    tgt = {"w": torch.zeros(1), "cfg": None}
    load(tgt, checkpoint_id=tmp_path / "o")
    assert type(tgt["cfg"][0]) is OrderedDict and list(tgt["cfg"][0].items()) == [("b", 1), ("a", [2, 3])]
    # unknown fields in metadata.json are refused, naming them
    md = tmp_path / "o" / "metadata.json"
    doc = json.loads(md.read_text())
    doc["chunk_index"] = "v2.bin"
    md.write_text(json.dumps(doc))
    with pytest.raises(MetadataError, match="unknown field.*chunk_index"):
        load({"w": torch.zeros(1), "cfg": None}, checkpoint_id=tmp_path / "o")
    # an actual unpickle is logged as a warning
    save({"obj": {1, 2}}, checkpoint_id=tmp_path / "p", allow_pickle=True)
    with caplog.at_level(logging.WARNING):
        got = {"obj": None}
        load(got, checkpoint_id=tmp_path / "p", allow_pickle=True)
    assert got["obj"] == {1, 2} and any("was unpickled" in r.getMessage() for r in caplog.records)


def _save_two_rank_files(rank, ws, path, value):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    save({"w": distribute_tensor(torch.full((8, 4), float(value)), mesh, [Shard(0)])}, checkpoint_id=path)
    return True


def test_a_load_racing_an_overwrite_never_mixes_two_checkpoints(tmp_path, fault_row):
    from tests.multiproc.harness import run_ranks

    ck, new = tmp_path / "ck", tmp_path / "new"
    assert run_ranks(2, _save_two_rank_files, str(ck), 1.0) == [True, True]
    assert run_ranks(2, _save_two_rank_files, str(new), 2.0) == [True, True]
    fired = []

    def overwrite_once(file, **_):
        if not fired:  # while the load reads its first file, another process commits a new checkpoint
            fired.append(file)
            os.rename(ck, tmp_path / "moved")
            os.rename(new, ck)
            import shutil
            shutil.rmtree(tmp_path / "moved")

    target = {"w": torch.zeros(8, 4)}
    with faults.armed("load.read", overwrite_once), pytest.raises(Exception) as ei:
        load(target, checkpoint_id=ck)
    msg = str(ei.value)
    assert "changed during the load" in msg and str(ck) in msg, msg
    fault_row("a load racing an overwrite (the directory is replaced and the old one deleted mid-load)",
              "process faults", "the load keeps reading the directory it pinned, or fails saying the checkpoint "
              "changed; it never mixes rows of two checkpoints", "CheckpointChangedError", "file", None, None, None)
    # an overwrite that leaves the old files in place (trash not yet deleted): the pinned one is read whole
    assert run_ranks(2, _save_two_rank_files, str(new), 3.0) == [True, True]
    fired.clear()

    def swap_keep(file, **_):
        if not fired:
            fired.append(file)
            os.rename(ck, tmp_path / "old")
            os.rename(new, ck)

    target = {"w": torch.zeros(8, 4)}
    with faults.armed("load.read", swap_keep):
        load(target, storage_reader=FileSystemReader(ck, files_kept=1), checkpoint_id=ck)
    assert torch.equal(target["w"], torch.full((8, 4), 2.0))  # all of the checkpoint it started with


def test_a_missing_file_is_found_before_any_data_moves(tmp_path):
    from tests.multiproc.harness import run_ranks

    ck = tmp_path / "ck"
    assert run_ranks(2, _save_two_rank_files, str(ck), 1.0) == [True, True]
    (ck / "rank00001.safetensors").unlink()
    target = {"w": torch.full((8, 4), 7.0)}
    with pytest.raises(Exception, match="rank00001.safetensors is missing"):
        load(target, checkpoint_id=ck)
    assert torch.equal(target["w"], torch.full((8, 4), 7.0))  # rank00000's rows were not copied in first


def test_verify_checks_every_claim_of_the_metadata(tmp_path, fault_row):
    from hpdcp_runner.dcp.offline.inspection import verify

    def fresh(name):
        save({"w": torch.arange(12, dtype=torch.float32).view(3, 4), "meta": {"step": 3, "tag": "x"}},
             checkpoint_id=tmp_path / name, format_version=1)  # the chunk table inline, to tamper with
        return tmp_path / name, json.loads((tmp_path / name / "metadata.json").read_text())

    def rewrite(ck, doc):
        (ck / "metadata.json").write_text(json.dumps(doc))

    assert verify(fresh("ok")[0]).ok
    ck, doc = fresh("dtype")  # a dtype that reinterprets the same bytes
    doc["tensors"]["w"]["dtype"] = "int32"
    rewrite(ck, doc)
    assert any("records tensor 'w' as int32" in p for p in verify(ck).problems)
    ck, doc = fresh("shape")  # same element count, another shape
    doc["tensors"]["w"]["shape"] = [4, 3]
    doc["tensors"]["w"]["chunks"][0][1] = [4, 3]
    rewrite(ck, doc)
    assert any("chunk [4, 3]" in p for p in verify(ck).problems)
    ck, doc = fresh("ranks")
    doc["world_size"] = 1
    doc["files"]["rank00000.safetensors"]["rank"] = 3
    rewrite(ck, doc)
    assert any("outside world_size" in p for p in verify(ck).problems)
    ck, doc = fresh("objects")  # the objects file lacks a listed key, though its checksum is updated
    from hpdcp_runner.dcp.format.safetensors_io import digest
    body = b'{"meta.step":["i","3"]}'
    (ck / "rank00000.objects.json").write_bytes(body)
    doc["files"]["rank00000.objects.json"].update(size=len(body), checksum=digest(body))
    rewrite(ck, doc)
    assert any("'meta.tag' listed in the metadata is not in the file" in p for p in verify(ck).problems)
    ck, doc = fresh("notjson")
    body = b"not json"
    (ck / "rank00000.objects.json").write_bytes(body)
    doc["files"]["rank00000.objects.json"].update(size=len(body), checksum=digest(body))
    rewrite(ck, doc)
    assert any("not valid JSON" in p for p in verify(ck).problems)
    fault_row("metadata.json tampered consistently (dtype, shape, ranks) or an objects file rewritten with "
              "matching file checksums", "tampered metadata", "verify reports each claim the bytes do not bear out",
              None, "file and key", None, None, "reports the problem")


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("version", [1, 2])
def test_partial_reads_are_verified_block_by_block(tmp_path, fault_row, version):
    from hpdcp_runner.dcp import CorruptCheckpointError, LocalShard, read_metadata
    from hpdcp_runner.dcp.format.safetensors_io import BLOCK_BYTES

    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB: 4 blocks
    ck = tmp_path / "c"
    save({"w": full}, checkpoint_id=ck, format_version=version)
    md = read_metadata(ck)
    [chunk] = md.tensors["w"].chunks
    assert md.format_version == version and md.block_bytes == BLOCK_BYTES and len(chunk.blocks) == 4 * 16
    byte0 = chunk.byte_offset

    def part(a, b):  # rows a..b: a dim-0 reshard's share
        t = torch.zeros(b - a, 1024)
        return t, load({"w": LocalShard(t, (a, 0), (1024, 1024))}, checkpoint_id=ck)

    t, res = part(300, 600)  # rows 300..599 touch blocks 1 and 2 only
    assert torch.equal(t, full[300:600]) and res.counters["bytes_read"] == 2 * BLOCK_BYTES
    _flip(ck / "rank00000.safetensors", byte0 + 3 * BLOCK_BYTES + 17)  # a bit in block 3: not read
    t, _ = part(300, 600)
    assert torch.equal(t, full[300:600])
    with pytest.raises(CorruptCheckpointError, match="block 3"):
        part(700, 800)
    # a column split (every row) reads and verifies every block
    t = torch.zeros(1024, 512)
    with pytest.raises(CorruptCheckpointError, match="fails the checksum of its block 3"):
        load({"w": LocalShard(t, (0, 512), (1024, 1024))}, checkpoint_id=ck)
    fault_row(f"a flipped bit inside a chunk read only in part (a reshard; format v{version})", "corrupted data",
              "load fails naming the file, key and block; blocks the read does not touch are not read",
              "CorruptCheckpointError", "file and key", None, None, None)


def test_partial_reads_of_small_and_legacy_chunks_verify_the_whole_chunk(tmp_path):
    from hpdcp_runner.dcp import CorruptCheckpointError, LocalShard

    full = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)  # 16 KiB: one block
    ck = tmp_path / "c"
    save({"w": full}, checkpoint_id=ck, format_version=1)
    doc = json.loads((ck / "metadata.json").read_text())
    assert "block_checksums" not in doc
    # a byte_offset off by 4 in a damaged metadata.json: the part read is caught
    doc["tensors"]["w"]["chunks"][0][4] -= 4
    (ck / "metadata.json").write_text(json.dumps(doc))
    t = torch.zeros(64, 32)
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        load({"w": LocalShard(t, (0, 32), (64, 64))}, checkpoint_id=ck)


def test_verify_checks_block_checksums(tmp_path):
    from hpdcp_runner.dcp.offline.inspection import verify

    ck = tmp_path / "c"
    save({"w": torch.arange(1024 * 1024, dtype=torch.float32)}, checkpoint_id=ck, format_version=1)
    assert verify(ck).ok
    doc = json.loads((ck / "metadata.json").read_text())
    chunks = doc["block_checksums"]["chunks"]["rank00000.safetensors"]
    key = next(iter(chunks))
    chunks[key] = "0" * 16 + chunks[key][16:]
    (ck / "metadata.json").write_text(json.dumps(doc))
    assert any("block checksums do not match" in p for p in verify(ck).problems)


def _safetensors_file(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("entry,data,needle", [
    ({"dtype": "F32", "shape": [2 ** 62], "data_offsets": [0, 8]}, b"\0" * 8, "non-negative integers"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, b"\0" * 8, "spans 8 bytes"),
    ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, b"\0" * 8, "non-negative integers"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, b"\0" * 8, "non-negative integers"),
])
def test_hostile_safetensors_headers_are_refused_naming_the_file(tmp_path, entry, data, needle):
    from hpdcp_runner.dcp import CorruptCheckpointError
    from hpdcp_runner.dcp.offline.transforms import import_checkpoint

    src = tmp_path / "evil.safetensors"
    _safetensors_file(src, {"w": entry}, data)
    with pytest.raises(CorruptCheckpointError, match=needle) as ei:
        import_checkpoint(src, tmp_path / "out")
    assert "evil.safetensors" in str(ei.value) and not (tmp_path / "out").exists()


def test_overlapping_tensors_and_a_pt_that_is_a_system_file(tmp_path):
    from hpdcp_runner.dcp import CorruptCheckpointError
    from hpdcp_runner.dcp.offline.transforms import import_checkpoint

    src = tmp_path / "overlap.safetensors"
    _safetensors_file(src, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    with pytest.raises(CorruptCheckpointError, match="'a' and 'b' overlap"):
        import_checkpoint(src, tmp_path / "out")
    pt = tmp_path / "model.pt"
    os.symlink("/etc/passwd", pt)
    with pytest.raises(CorruptCheckpointError, match="model.pt: not a readable torch.save file"):
        import_checkpoint(pt, tmp_path / "out2")


def test_huge_offsets_in_metadata_are_a_clear_error(tmp_path):
    from hpdcp_runner.dcp.offline.inspection import describe, verify

    save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "c", format_version=1)
    doc = json.loads((tmp_path / "c" / "metadata.json").read_text())
    doc["tensors"]["w"]["shape"] = [2 ** 63]
    doc["tensors"]["w"]["chunks"][0][1] = [2 ** 63]
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(doc))
    problems = verify(tmp_path / "c").problems
    assert problems and "below 2**62" in problems[0]
    with pytest.raises(MetadataError, match="below 2\\*\\*62"):
        describe(tmp_path / "c")


def test_an_output_the_reader_would_refuse_is_never_reported_done(tmp_path):
    from hpdcp_runner.dcp import ConfigError
    from hpdcp_runner.dcp.offline.transforms import merge_to_hf

    save({"__metadata__": torch.ones(2), "w": torch.ones(2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ConfigError, match="'__metadata__'"):
        merge_to_hf(tmp_path / "c", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    merge_to_hf(tmp_path / "c", tmp_path / "hf", rename=[("^__metadata__$", "meta_w")])
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {"meta_w", "w"}


def test_an_import_header_declaring_too_many_tensors_is_refused_before_work(tmp_path, monkeypatch):
    from hpdcp_runner.dcp import CorruptCheckpointError
    from hpdcp_runner.dcp.offline.transforms import import_checkpoint
    from hpdcp_runner.dcp.storage.formats import foreign

    monkeypatch.setattr(foreign, "MAX_ENTRIES_PER_FILE", 100)  # the engine's reader: the import's too
    src = tmp_path / "many.safetensors"
    _safetensors_file(src, {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                            for i in range(101)}, b"\0" * 404)
    with pytest.raises(CorruptCheckpointError, match="many.safetensors: header declares 101 tensors, over the limit"):
        import_checkpoint(src, tmp_path / "out")
