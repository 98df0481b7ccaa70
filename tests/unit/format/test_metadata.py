import json

import pytest
import torch

from hpdcp_runner.dcp import save
from hpdcp_runner.dcp.core.errors import MetadataError
from hpdcp_runner.dcp.format.metadata import ChunkMeta, FileMeta, Metadata, ObjectMeta, TensorMeta


def _md() -> Metadata:
    files = {"rank00000.safetensors": FileMeta("rank00000.safetensors", 1000, "ab", 0),
             "rank00000.objects.json": FileMeta("rank00000.objects.json", 10, "cd", 0)}
    t = TensorMeta("float32", (4, 3), (ChunkMeta((0, 0), (2, 3), "rank00000.safetensors", "w@0,0", 100, "x"),
                                       ChunkMeta((2, 0), (2, 3), "rank00000.safetensors", "w@2,0", 124, "y")),
                   ("model", "w"))
    return Metadata(1, {"model.w": t}, {"step": ObjectMeta("rank00000.objects.json", "z", ("step",))}, files)


def test_json_round_trip_is_exact():
    md = _md()
    again = Metadata.from_json(md.to_json())
    assert again == md
    assert json.loads(md.to_json())["format_version"] == 1


def _mutate(fn):
    doc = json.loads(_md().to_json())
    fn(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("mutation,message", [
    (lambda d: d.update(format_version=99), "unsupported format version 99"),
    (lambda d: d.update(format="torch"), "not an hpdcp checkpoint"),
    (lambda d: d["files"].update({"../escape": {"size": 1, "checksum": "a", "rank": 0}}), "not a plain file name"),
    (lambda d: d["files"].update({"/etc/passwd": {"size": 1, "checksum": "a", "rank": 0}}), "not a plain file name"),
    # a foreign checkpoint's description may name a subdirectory's file (a universal checkpoint's
    # zero/<param>/fp32.pt): a path of plain names, no dot-dot in any part, no empty part, at most 4 deep
    (lambda d: d.update(extra={"source_format": "deepspeed"}) or d["files"].update(
        {"zero/../../x": {"size": 1, "checksum": "a", "rank": 0}}), "not a plain file name"),
    (lambda d: d.update(extra={"source_format": "deepspeed"}) or d["files"].update(
        {"zero//x": {"size": 1, "checksum": "a", "rank": 0}}), "not a plain file name"),
    (lambda d: d.update(extra={"source_format": "deepspeed"}) or d["files"].update(
        {"a/b/c/d/e": {"size": 1, "checksum": "a", "rank": 0}}), "nor a path of at most 4"),
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(0, [3, 0]), "outside shape"),
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(0, [1, 0]), "overlap"),
    (lambda d: d["tensors"]["model.w"]["chunks"].pop(), "cover 6 of 12"),
    (lambda d: d["tensors"]["model.w"].update(chunks=[]), "cover 0 of 12"),
    # volumes add up (6 + 6 = 12) but rows 1 overlap and row 3 is missing: only adjacency tells
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(0, [1, 0]) or
     d["tensors"]["model.w"]["chunks"][0].__setitem__(1, [2, 3]), "overlap"),
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(0, [2, -1]), "non-negative integers"),
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(1, [2]), "chunk rank"),
    (lambda d: d["tensors"]["model.w"]["chunks"][1].__setitem__(3, 7), "bad chunk location"),
    (lambda d: d["tensors"]["model.w"]["chunks"][0].__setitem__(4, 990), "beyond the end"),
    (lambda d: d["tensors"]["model.w"]["chunks"][0].__setitem__(2, "other.safetensors"), "unknown file"),
    (lambda d: d["tensors"]["model.w"].update(dtype="complex512"), "unknown dtype"),
    (lambda d: d["tensors"]["model.w"].update(shape=[4, -3]), "non-negative integers"),
    (lambda d: d.update(world_size=0), "world_size"),
    (lambda d: d["objects"]["step"].update(file="nope.json"), "unknown file"),
])
def test_malformed_metadata_is_rejected_with_the_problem_named(mutation, message):
    with pytest.raises(MetadataError, match=message):
        Metadata.from_json(_mutate(mutation))


def test_not_json():
    with pytest.raises(MetadataError, match="not valid JSON"):
        Metadata.from_json("{nope")


def test_metadata_size_cap(tmp_path):
    from hpdcp_runner.dcp import FileSystemReader

    save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(MetadataError, match="over the 16-byte limit"):
        FileSystemReader(tmp_path / "c", max_metadata_bytes=16).read_metadata_text()


def test_deferred_metadata_parses_on_first_use_and_equals_the_original():
    from hpdcp_runner.dcp.format.metadata import DeferredMetadata

    md = _md()
    d = DeferredMetadata(md.to_json())
    assert "_deferred" in d.__dict__ and isinstance(d, Metadata)  # nothing parsed yet
    assert md == d and type(d) is Metadata and d.tensors == md.tensors
    bad = DeferredMetadata("{not json", source="x/metadata.json")
    with pytest.raises(MetadataError, match="x/metadata.json: not valid JSON"):
        bad.world_size
