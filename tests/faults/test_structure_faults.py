"""Hostile structure (reliability round 3): JSON that is not JSON (NaN, Infinity), nesting deep
enough to overflow a recursive parser, a file table that disagrees with its world size, chunks
that share bytes, and state-dict keys that are not strings. Each is refused by name before any
tensor byte is read, or round-trips exactly; the other checkpoint stays intact."""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import pytest
import torch

from hpdcp_runner.dcp import (CorruptCheckpointError, HpdcpError, MetadataError, StateDictError, load, save,
                              tools)
from hpdcp_runner.dcp.offline.inspection import verify
from tests.faults.conftest import loads_bitwise, raises_naming, zeros

RANK0 = "rank00000.safetensors"
OBJ0 = "rank00000.objects.json"


_fails = raises_naming


def _load(path):
    return lambda: load(zeros(), checkpoint_id=path)


def _md(path) -> dict:
    return json.loads((path / "metadata.json").read_text())


def _put_md(path, doc, text: str | None = None) -> None:
    (path / "metadata.json").write_text(text if text is not None else json.dumps(doc))


def _problems(path) -> str:
    rep = verify(path)
    assert not rep.ok
    return "; ".join(rep.problems)


def _short(text: str) -> str:
    """For the fault table: without directories."""
    return re.sub(r"/[^\s:']*/", "", text)[:110]


# -- JSON that is not JSON ----------------------------------------------------------------------

@pytest.mark.parametrize("where,constant", [("extra", "NaN"), ("extra", "Infinity"), ("extra", "-Infinity"),
                                            ("size", "NaN")])
def test_non_json_constants_in_metadata_are_refused(two_checkpoints, fault_row, where, constant):
    ck = two_checkpoints / "step_2"
    doc = _md(ck)
    if where == "extra":
        doc["extra"] = {"loss": "@"}
    else:
        doc["files"][RANK0]["size"] = "@"
    _put_md(ck, None, json.dumps(doc).replace('"@"', constant))
    _fails(_load(ck), MetadataError, "metadata.json", f"{constant.lstrip('-')} is not a JSON number")
    msg = _problems(ck)
    assert constant.lstrip("-") in msg
    fault_row(f"{constant} in metadata.json ({where})", "hostile structure", "refused while reading metadata",
              "MetadataError", "file", loads_bitwise(two_checkpoints / "step_1", 1), verify=_short(msg))


def test_nan_in_extra_is_refused_at_save_not_written(tmp_path):
    _fails(lambda: save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "c", extra={"loss": float("nan")}),
           HpdcpError, "extra['loss']", "metadata.json")
    assert not (tmp_path / "c").exists()


def test_nan_literal_in_objects_file_is_refused(two_checkpoints, fault_row):
    ck = two_checkpoints / "step_2"
    body = json.dumps({"meta.step": ["f", "@"]}).replace('"@"', "NaN").encode()
    _rewrite_objects(ck, body)
    _fails(_load(ck), CorruptCheckpointError, OBJ0, "NaN is not a JSON number")
    msg = _problems(ck)
    assert "NaN" in msg
    fault_row("NaN literal in an objects file (checksums rewritten to match)", "hostile structure",
              "refused while reading objects", "CorruptCheckpointError", "file",
              loads_bitwise(two_checkpoints / "step_1", 1), verify=_short(msg))


def _rewrite_objects(ck, body: bytes) -> None:
    """Replace the objects file and make metadata.json agree with it (size and checksum), as a
    hostile writer would: the checks under test are the ones after the checksums."""
    from hpdcp_runner.dcp.format.checksums import digest

    (ck / OBJ0).write_bytes(body)
    doc = _md(ck)
    doc["files"][OBJ0].update(size=len(body), checksum=digest(body))
    _put_md(ck, doc)


# -- nesting ------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [5_000, 200_000])
def test_deep_nesting_in_objects_file_names_the_file(two_checkpoints, fault_row, depth):
    ck = two_checkpoints / "step_2"
    _rewrite_objects(ck, b'{"meta.step":' + b'["l",[' * depth + b"]]" * depth + b"}")
    _fails(_load(ck), CorruptCheckpointError, OBJ0, "nested too deeply")
    msg = _problems(ck)
    assert "nested too deeply" in msg
    fault_row(f"objects file nested {depth} levels deep", "hostile structure", "refused while reading objects "
              "(no RecursionError)", "CorruptCheckpointError", "file", loads_bitwise(two_checkpoints / "step_1", 1),
              verify=_short(msg))


def test_nesting_within_the_parser_but_beyond_the_codec_is_refused(two_checkpoints):
    ck = two_checkpoints / "step_2"
    _rewrite_objects(ck, b'{"meta.step":' + b'["l",[' * 400 + b'["n"]' + b"]]" * 400 + b"}")
    _fails(_load(ck), MetadataError, OBJ0, "'meta.step'", "nested too deeply")


@pytest.mark.parametrize("depth", [3_000, 100_000])
def test_deep_nesting_in_metadata_names_the_file(two_checkpoints, depth):
    ck = two_checkpoints / "step_2"
    doc = _md(ck)
    doc["extra"] = {"x": "@"}
    _put_md(ck, None, json.dumps(doc).replace('"@"', "[" * depth + "]" * depth))
    _fails(_load(ck), MetadataError, "metadata.json", "nested too deeply")
    assert "nested too deeply" in _problems(ck)


def test_deep_nesting_in_a_hugging_face_header_names_the_file(tmp_path):
    raw = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    f = tmp_path / "model.safetensors"
    f.write_bytes(len(raw).to_bytes(8, "little") + raw)
    reader = tools_open_reader(tmp_path)
    _fails(reader.read_metadata_text, CorruptCheckpointError, "model.safetensors", "nested too deeply")


def tools_open_reader(path):
    from hpdcp_runner.dcp import open_reader

    return open_reader(str(path), "hf")


def test_objects_nested_beyond_the_codec_bound_are_refused_at_save(tmp_path):
    v: list = []
    for _ in range(300):
        v = [v]
    _fails(lambda: save({"w": torch.ones(2), "deep": v}, checkpoint_id=tmp_path / "c"), StateDictError,
           "nested deeper")
    assert not (tmp_path / "c").exists()


# -- the file table and the world size -------------------------------------------------------

@pytest.mark.parametrize("fixture", ["two_checkpoints", "two_v1_checkpoints"])
@pytest.mark.parametrize("case", ["rank_outside_world", "name_disagrees", "world_shrunk"])
def test_file_table_disagreeing_with_world_size_is_refused(request, fault_row, fixture, case):
    root = request.getfixturevalue(fixture)
    ck = root / "step_2"
    doc = _md(ck)
    if case == "rank_outside_world":
        doc["files"][RANK0]["rank"] = 3
        needle = "recorded rank 3 is outside world_size 1"
    elif case == "name_disagrees":
        doc["world_size"] = 4
        doc["files"][RANK0]["rank"] = 2
        needle = "recorded rank 2 differs from the rank in its name"
    else:  # a file of rank 3 listed in a world of 2
        doc["world_size"] = 2
        os.rename(ck / RANK0, ck / "rank00003.safetensors")
        doc["files"]["rank00003.safetensors"] = dict(doc["files"].pop(RANK0), rank=3)
        if "tensors" in doc and any("chunks" in t for t in doc["tensors"].values()):
            for t in doc["tensors"].values():
                for c in t.get("chunks", []):
                    c[2] = "rank00003.safetensors" if c[2] == RANK0 else c[2]
        needle = "recorded rank 3 is outside world_size 2"
    _put_md(ck, doc)
    _fails(_load(ck), MetadataError, "metadata.json", needle)
    msg = _problems(ck)
    assert needle in msg
    if case != "world_shrunk" or fixture == "two_checkpoints":
        fault_row(f"file table disagrees with world_size ({case}, format v{1 if 'v1' in fixture else 2})",
                  "tampered metadata", "refused while validating metadata", "MetadataError", "file",
                  loads_bitwise(root / "step_1", 1), verify=_short(msg))


# -- chunks sharing bytes ----------------------------------------------------------------------

def test_two_chunks_naming_the_same_bytes_are_refused_v1(tmp_path, fault_row):
    ck = tmp_path / "c"
    save({"a": torch.arange(8.0), "b": torch.arange(8.0, 16.0), "c": torch.zeros(0)}, checkpoint_id=ck,
         format_version=1)
    doc = _md(ck)
    a, b = doc["tensors"]["a"]["chunks"][0], doc["tensors"]["b"]["chunks"][0]
    b[4], b[5] = a[4] + 8, a[5]  # b's bytes overlap a's second half; checksum irrelevant to the check
    _put_md(ck, doc)
    tgt = {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.zeros(0)}
    _fails(lambda: load(tgt, checkpoint_id=ck), MetadataError, "metadata.json", "share bytes of " + RANK0, "'a'", "'b'")
    msg = _problems(ck)
    assert "share bytes" in msg
    fault_row("two chunks naming overlapping bytes (format v1)", "tampered metadata",
              "refused while validating metadata, before any read", "MetadataError", "file and key",
              verify=_short(msg))


def test_two_chunks_naming_the_same_bytes_are_found_by_verify_v2(tmp_path):

    ck = tmp_path / "c"
    save({"a": torch.arange(8.0), "b": torch.arange(8.0, 16.0)}, checkpoint_id=ck)
    # describe both as v1 to learn the offsets, then point b at a's bytes in the index
    md = tools_metadata(ck)
    ca, cb = md.tensors["a"].chunks[0], md.tensors["b"].chunks[0]
    raw = (ck / "chunk_index.safetensors").read_bytes()
    old = cb.byte_offset.to_bytes(8, "little", signed=True)
    new = ca.byte_offset.to_bytes(8, "little", signed=True)
    assert raw.count(old) == 1
    (ck / "chunk_index.safetensors").write_bytes(raw.replace(old, new))
    assert "share bytes" in _problems(ck)


def tools_metadata(ck):
    from hpdcp_runner.dcp import FileSystemReader

    return FileSystemReader(ck).read_metadata_once().as_v1()


# -- state-dict keys that are not strings ------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_int_keys_round_trip_with_their_types(tmp_path, version):
    sd = {"t": torch.arange(4.0), "m": {"a": 1, 2: "b", 3: torch.ones(3), "n": {0: torch.zeros(2), "z": 5}},
          "o": OrderedDict([(1, "x"), ("y", 2)])}
    save(sd, checkpoint_id=tmp_path / "c", format_version=version)
    tgt = {"t": torch.zeros(4), "m": {"a": 0, 2: "", 3: torch.zeros(3), "n": {0: torch.ones(2), "z": 0}},
           "o": OrderedDict([(1, ""), ("y", 0)])}
    load(tgt, checkpoint_id=tmp_path / "c")
    assert tgt["m"]["a"] == 1 and tgt["m"][2] == "b" and torch.equal(tgt["m"][3], torch.ones(3))
    assert torch.equal(tgt["m"]["n"][0], torch.zeros(2)) and tgt["m"]["n"]["z"] == 5
    assert list(tgt["o"].items()) == [(1, "x"), ("y", 2)] and type(tgt["o"]) is OrderedDict
    assert set(type(k) for k in tgt["m"]) == {str, int}
    # and an object leaf keeps its non-string keys exactly
    save({"w": torch.ones(1), "leaf": [{1: "a", "1": "b", (2, 3): None}]}, checkpoint_id=tmp_path / "d",
         format_version=version)
    t2 = {"w": torch.zeros(1), "leaf": None}
    load(t2, checkpoint_id=tmp_path / "d")
    assert t2["leaf"] == [{1: "a", "1": "b", (2, 3): None}]


@pytest.mark.parametrize("key", [1.5, True, None, (1, 2), b"k"])
def test_keys_that_cannot_round_trip_are_refused_at_save(tmp_path, key):
    _fails(lambda: save({"t": torch.ones(1), "m": {key: torch.ones(1)}}, checkpoint_id=tmp_path / "c"),
           StateDictError, "only str and int keys")
    assert not (tmp_path / "c").exists()


def test_a_string_and_an_int_key_that_flatten_alike_are_refused(tmp_path):
    _fails(lambda: save({"m": {"2": torch.ones(1), 2: torch.ones(1)}}, checkpoint_id=tmp_path / "c"),
           StateDictError, "flatten to the same key")


def test_int_keys_keep_their_type_in_the_metadata(tmp_path):
    save({"m": {7: torch.ones(2)}}, checkpoint_id=tmp_path / "c")
    md = tools.describe(tmp_path / "c")
    assert "m.7" in md["tensors"]
    from hpdcp_runner.dcp import FileSystemReader

    assert FileSystemReader(tmp_path / "c").read_metadata_once().tensors["m.7"].path == ("m", 7)
