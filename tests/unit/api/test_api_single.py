"""save/load in one process with no process group: format, safety and error behaviour."""

import os

import pytest
import torch
from safetensors.torch import load_file

from hpdcp_runner.dcp import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, FileSystemWriter,
                              FlatShard, KeyMismatchError, PickleNotAllowedError, ShapeMismatchError, load,
                              read_metadata, save)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64]


def _ref(dtype, shape=(5, 3)):
    base = torch.arange(15 * 7).reshape(-1)[: torch.Size(shape).numel()].reshape(shape) % 11
    return (base % 2 == 0) if dtype == torch.bool else (base.to(torch.float64) * 0.37 - 1.5).to(dtype) \
        if dtype.is_floating_point else base.to(dtype)


def test_all_dtypes_round_trip_bitwise(tmp_path):
    sd = {str(dt): _ref(dt) for dt in DTYPES}
    save(sd, checkpoint_id=tmp_path / "c")
    tgt = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(tgt, checkpoint_id=tmp_path / "c")
    for k, v in sd.items():
        assert tgt[k].dtype == v.dtype and torch.equal(tgt[k], v), k


def test_files_are_standard_safetensors_and_names_never_come_from_keys(tmp_path):
    sd = {"../../evil/key": torch.ones(2), "a/b": torch.arange(3)}
    save(sd, checkpoint_id=tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c")) == ["chunk_index.safetensors", "metadata.json", "rank00000.safetensors"]
    got = load_file(str(tmp_path / "c" / "rank00000.safetensors"))
    assert torch.equal(got["a/b@0"], sd["a/b"]) and torch.equal(got["../../evil/key@0"], sd["../../evil/key"])


def test_parameters_views_tied_weights_and_nested_containers(tmp_path):
    emb = torch.nn.Parameter(torch.randn(6, 4))
    base = torch.randn(8, 6)
    sd = {"emb": emb, "head": emb, "view": base[2:6, 1:5], "t": base.t(), "scalar": torch.tensor(2.5),
          "layers": [{"w": torch.randn(3)}, (torch.randn(2), "tag")], "opt": {"step": 10, "empty": {}},
          "flat": FlatShard(torch.arange(12, dtype=torch.float32), (3, 4), 0)}
    save(sd, checkpoint_id=tmp_path / "c")
    tgt_emb = torch.nn.Parameter(torch.zeros(6, 4))  # requires_grad leaf: loading into it must work
    tgt_base = torch.zeros(8, 6)
    tgt = {"emb": tgt_emb, "head": tgt_emb, "view": tgt_base[2:6, 1:5], "t": torch.zeros(8, 6).t(),
           "scalar": torch.tensor(0.0), "layers": [{"w": torch.zeros(3)}, [torch.zeros(2), None]],
           "opt": {"step": 0, "empty": None}, "flat": FlatShard(torch.nn.Parameter(torch.zeros(12)), (3, 4), 0)}
    load(tgt, checkpoint_id=tmp_path / "c")
    assert tgt_emb.requires_grad and torch.equal(tgt_emb, emb)
    assert torch.equal(tgt_base[2:6, 1:5], base[2:6, 1:5]) and tgt_base[0].abs().sum() == 0
    assert torch.equal(tgt["t"], base.t()) and torch.equal(tgt["scalar"], torch.tensor(2.5))
    assert torch.equal(tgt["layers"][0]["w"], sd["layers"][0]["w"])
    assert torch.equal(tgt["layers"][1][0], sd["layers"][1][0]) and tgt["layers"][1][1] == "tag"
    assert tgt["opt"] == {"step": 10, "empty": {}}
    assert torch.equal(tgt["flat"].local, torch.arange(12, dtype=torch.float32))


def test_partial_coverage_is_refused_at_save(tmp_path):
    from hpdcp_runner.dcp import CoverageError

    with pytest.raises(CoverageError, match="key 'flat'.*cover 7 of 12"):
        save({"flat": FlatShard(torch.arange(7.0), (3, 4), 2)}, checkpoint_id=tmp_path / "c")
    assert not (tmp_path / "c").exists() and os.listdir(tmp_path) == []


def test_strict_lists_missing_and_unexpected_in_one_error(tmp_path):
    save({"a": torch.ones(2), "b": torch.ones(2), "n": 3}, checkpoint_id=tmp_path / "c")
    with pytest.raises(KeyMismatchError) as ei:
        load({"a": torch.zeros(2), "z": torch.zeros(2)}, checkpoint_id=tmp_path / "c")
    assert ei.value.missing == ["z"] and ei.value.unexpected == ["b", "n"]
    assert "'z'" in str(ei.value) and "'b'" in str(ei.value) and "strict=False" in str(ei.value)
    tgt = {"a": torch.zeros(2), "z": torch.zeros(2)}
    res = load(tgt, checkpoint_id=tmp_path / "c", strict=False)
    assert res.missing_keys == ("z",) and res.unexpected_keys == ("b", "n") and torch.equal(tgt["a"], torch.ones(2))


def test_shape_and_dtype_mismatch(tmp_path):
    save({"w": torch.ones(4, 3)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ShapeMismatchError, match=r"key 'w': checkpoint shape \[4, 3\] != target shape \[3, 4\]"):
        load({"w": torch.zeros(3, 4)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ShapeMismatchError, match="allow_cast=True"):
        load({"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, checkpoint_id=tmp_path / "c")
    tgt = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    load(tgt, checkpoint_id=tmp_path / "c", allow_cast=True)
    assert torch.equal(tgt["w"], torch.ones(4, 3, dtype=torch.bfloat16))


def test_existing_target_refused_and_overwrite_replaces(tmp_path):
    path = tmp_path / "c"
    save({"w": torch.ones(2)}, checkpoint_id=path)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        save({"w": torch.zeros(2)}, checkpoint_id=path)
    save({"w": torch.full((2,), 7.0)}, checkpoint_id=path, overwrite=True)
    tgt = {"w": torch.zeros(2)}
    load(tgt, checkpoint_id=path)
    assert torch.equal(tgt["w"], torch.full((2,), 7.0))
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging or trash left behind


class _FailingWriter(FileSystemWriter):
    def write(self, tensors, objects):
        super().write(tensors, objects)
        raise OSError("disk full (injected)")


def test_failed_overwrite_keeps_old_checkpoint_and_commits_nothing(tmp_path):
    path = tmp_path / "c"
    save({"w": torch.ones(2)}, checkpoint_id=path)
    with pytest.raises(Exception, match="disk full"):
        save({"w": torch.zeros(2)}, storage_writer=_FailingWriter(path), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    tgt = {"w": torch.zeros(2)}
    load(tgt, checkpoint_id=path)
    assert torch.equal(tgt["w"], torch.ones(2))
    with pytest.raises(Exception, match="disk full"):
        save({"w": torch.zeros(2)}, storage_writer=_FailingWriter(tmp_path / "new"))
    assert not (tmp_path / "new").exists() and sorted(os.listdir(tmp_path)) == ["c"]


def test_missing_truncated_and_corrupted_files(tmp_path):
    path = tmp_path / "c"
    save({"w": torch.arange(1000, dtype=torch.float32)}, checkpoint_id=path)
    f = path / "rank00000.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(CorruptCheckpointError, match=r"rank00000.safetensors is .* \(truncated"):
        load({"w": torch.zeros(1000)}, checkpoint_id=path)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    f.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="key 'w@0' fails its checksum"):
        load({"w": torch.zeros(1000)}, checkpoint_id=path)
    f.unlink()
    with pytest.raises(CheckpointNotFoundError, match="rank00000.safetensors is missing"):
        load({"w": torch.zeros(1000)}, checkpoint_id=path)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        load({"w": torch.zeros(1000)}, checkpoint_id=tmp_path / "nope")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_object_refused_without_allow_pickle_and_no_code_runs(tmp_path):
    marker = tmp_path / "pwned"
    save({"x": _Evil(str(marker))}, checkpoint_id=tmp_path / "c", allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(PickleNotAllowedError, match="key 'x' was saved with pickle"):
        load({"x": None}, checkpoint_id=tmp_path / "c")
    assert not marker.exists()
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        save({"x": _Evil(str(marker))}, checkpoint_id=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_metadata_records_files_sizes_and_checksums(tmp_path):
    md = save({"w": torch.ones(4, 4), "n": "x"}, checkpoint_id=tmp_path / "c")
    on_disk = read_metadata(tmp_path / "c")
    assert on_disk == md
    for name, fm in md.files.items():
        assert os.path.getsize(tmp_path / "c" / name) == fm.size and fm.checksum
    assert md.tensors["w"].chunks[0].file == "rank00000.safetensors"


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.parametrize("gap,cast", [(0, False), (0, True), (64 << 10, False), (None, False)])
def test_column_slices_read_exact_runs_through_gaps_or_slabs(tmp_path, gap, cast):
    """Without checksum verification. (Verified partial reads read whole blocks:
    test_partial_reads_are_verified_block_by_block.)"""
    from hpdcp_runner.dcp import FileSystemReader, LocalShard

    full = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)  # rows of 4 KiB
    save({"w": full}, checkpoint_id=tmp_path / "c")
    # columns 256..767 (Shard(1)-like): 2 KiB of every 4 KiB row
    local = torch.zeros(256, 512, dtype=torch.float64 if cast else torch.float32)
    reader = FileSystemReader(tmp_path / "c", read_gap_bytes=gap, verify_checksums=False)
    before = _rchar()
    res = load({"w": LocalShard(local, (0, 256), (256, 1024))}, storage_reader=reader, allow_cast=cast)
    read = _rchar() - before
    assert torch.equal(local, full[:, 256:768].to(local.dtype))
    kept, span = 256 * 512 * 4, (255 * 1024 + 512) * 4
    how = "slab" if cast else reader.copier.strategy(256, 2048, span)[0]  # a cast cannot land in the destination
    assert res.counters[f"partial_reads_{how}"] == 1
    if how == "exact":  # exactly the kept bytes, one request per row, straight into the destination
        assert res.counters["bytes_read"] == kept and res.counters["reads"] == 256
        assert read <= 1.1 * kept + 65536, read
    elif how == "through":  # one vectored request from the first wanted to the last wanted byte
        assert res.counters["bytes_read"] == span and res.counters["reads"] == 1
    else:  # slabs: the span in cache-sized windows
        assert res.counters["bytes_read"] == span and res.counters["reads"] == 1  # 1 MiB: one window
