"""Hugging Face and torch DCP checkpoints read in place by dcp.load (no import step): bitwise
values, bytes read, renames, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import (CheckpointNotFoundError, CorruptCheckpointError, KeyMismatchError, MetadataError,
                              PickleNotAllowedError, load, read_metadata, save)
from hpdcp_runner.dcp.storage.formats.foreign import detect_format


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(11, 6, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(10, 6, generator=g),
            "model.layers.1.mlp.up_proj.weight": torch.randn(10, 6, generator=g).to(torch.float16),
            "model.norm.weight": torch.randn(6, generator=g),
            "ids": torch.arange(7, dtype=torch.int64)}


def _hf(tmp_path, state, shards: int = 1):
    d = tmp_path / "hf"
    d.mkdir()
    keys = sorted(state)
    if shards == 1:
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d
    wm = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(d / name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("shards", [1, 3])
def test_hugging_face_directory_loads_bitwise_reading_only_the_requested_bytes(tmp_path, shards):
    state = _state()
    d = _hf(tmp_path, state, shards)
    assert detect_format(str(d)) == "hf"
    tgt = _zeros(state)
    res = load(tgt, checkpoint_id=d)
    assert all(torch.equal(tgt[k], state[k]) and tgt[k].dtype == state[k].dtype for k in state)
    assert res.counters["bytes_read"] == sum(v.numel() * v.element_size() for v in state.values())
    # a subset reads exactly the subset's bytes
    sub = {"model.norm.weight": torch.zeros(6)}
    res = load(sub, checkpoint_id=d, strict=False)
    assert torch.equal(sub["model.norm.weight"], state["model.norm.weight"]) and res.counters["bytes_read"] == 24
    md = read_metadata(d)
    assert md.extra["source_format"] == "hf" and set(md.tensors) == set(state)


def test_one_safetensors_file_is_a_checkpoint_too(tmp_path):
    state = _state()
    save_file(state, str(tmp_path / "weights.safetensors"))
    tgt = _zeros(state)
    load(tgt, checkpoint_id=tmp_path / "weights.safetensors")
    assert all(torch.equal(tgt[k], state[k]) for k in state)


def test_renames_map_hugging_face_names_to_torchtitan_and_back(tmp_path):
    state = _state()
    d = _hf(tmp_path, state)
    to_titan = [(r"^model\.embed_tokens\.", "tok_embeddings."), (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
                (r"^model\.norm\.", "norm.")]
    titan = {"tok_embeddings.weight": torch.zeros(11, 6, dtype=torch.bfloat16),
             "layers.0.feed_forward.w3.weight": torch.zeros(10, 6),
             "layers.1.feed_forward.w3.weight": torch.zeros(10, 6, dtype=torch.float16),
             "norm.weight": torch.zeros(6), "ids": torch.zeros(7, dtype=torch.int64)}
    load(titan, checkpoint_id=d, rename=to_titan)
    assert torch.equal(titan["layers.1.feed_forward.w3.weight"], state["model.layers.1.mlp.up_proj.weight"])
    save(titan, checkpoint_id=tmp_path / "titan")
    back = _zeros(state)
    load(back, checkpoint_id=tmp_path / "titan",
         rename=[(r"^tok_embeddings\.", "model.embed_tokens."), (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
                 (r"^norm\.", "model.norm.")])
    assert all(torch.equal(back[k], state[k]) for k in state)
    # unmatched required keys: one error listing every one
    with pytest.raises(KeyMismatchError) as e:
        load({"tok_embeddings.weight": torch.zeros(11, 6, dtype=torch.bfloat16), "output.weight": torch.zeros(3)},
             checkpoint_id=d, rename=to_titan)
    assert "output.weight" in str(e.value) and "layers.0.feed_forward.w3.weight" in str(e.value)


def test_a_rename_collision_lists_every_colliding_key(tmp_path):
    d = _hf(tmp_path, _state())
    with pytest.raises(MetadataError) as e:
        read_metadata(d, rename=[(r"\.layers\.\d+\.", ".layers.X.")])
    msg = str(e.value)
    assert "'model.layers.0.mlp.up_proj.weight' and 'model.layers.1.mlp.up_proj.weight' -> " \
           "'model.layers.X.mlp.up_proj.weight'" in msg
    with pytest.raises(MetadataError, match="onto keys of other tensors"):  # onto a key that is kept
        read_metadata(d, rename=[(r"^ids$", "model.norm.weight")])


def test_bad_hugging_face_directories_are_one_clear_error(tmp_path):
    state = _state()
    d = _hf(tmp_path, state, shards=2)
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    victim = "model-00002-of-00002.safetensors"
    os.rename(d / victim, tmp_path / "away")
    with pytest.raises(CheckpointNotFoundError, match=f"{victim} is listed in .*index.json but missing"):
        load(_zeros(state), checkpoint_id=d)
    os.rename(tmp_path / "away", d / victim)
    for bad in ("../outside.safetensors", "/etc/passwd", "sub/x.safetensors"):
        index.write_text(json.dumps({"weight_map": {**doc["weight_map"], "ids": bad}}))
        with pytest.raises(MetadataError, match="must be a plain file name inside"):
            read_metadata(d)
    index.write_text(json.dumps({"weight_map": {**doc["weight_map"], "model.norm.weight": victim,
                                                "ids": "model-00001-of-00002.safetensors"}}))
    wrong = [k for k, v in doc["weight_map"].items() if v != victim][0]
    if doc["weight_map"]["model.norm.weight"] != victim:
        with pytest.raises(MetadataError, match="maps .* to files that do not hold them"):
            read_metadata(d)
    index.write_text(json.dumps(doc))
    # the same key in two shards
    save_file({wrong: state[wrong]}, str(d / "extra.safetensors"))
    wm = dict(doc["weight_map"], **{"zzz": "extra.safetensors"})
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(MetadataError, match=f"{wrong!r} is stored twice"):
        read_metadata(d)
    index.write_text("{not json")
    with pytest.raises(MetadataError, match="index.json: not valid JSON"):
        read_metadata(d)


def test_a_truncated_or_changed_shard_is_named(tmp_path):
    state = _state()
    d = _hf(tmp_path, state)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load(_zeros(state), checkpoint_id=d)


def test_not_a_checkpoint_and_mixed_directories(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        load({"x": torch.zeros(1)}, checkpoint_id=tmp_path / "empty")
    # ours with stray foreign files beside it: ours wins, the strays are ignored
    state = _state()
    save(state, checkpoint_id=tmp_path / "ours")
    save_file({"junk": torch.zeros(2)}, str(tmp_path / "ours" / "model.safetensors"))
    (tmp_path / "ours" / ".metadata").write_bytes(b"not a pickle")
    assert detect_format(str(tmp_path / "ours")) == "hpdcp"
    tgt = _zeros(state)
    load(tgt, checkpoint_id=tmp_path / "ours")
    assert all(torch.equal(tgt[k], state[k]) for k in state)


def _torch_dcp(path, state):
    import torch.distributed.checkpoint as tdcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_torch_dcp_written_by_torch_loads_in_place_behind_allow_pickle(tmp_path):
    state = {"model": {k: v for k, v in _state().items()}, "step": 12, "sched": {"lr": 0.5, "name": "cos"}}
    _torch_dcp(tmp_path / "t", state)
    tgt = {"model": _zeros(state["model"]), "step": None, "sched": {"lr": None, "name": None}}
    with pytest.raises(PickleNotAllowedError, match=r"\.metadata: a torch.distributed.checkpoint stores its metadata"):
        load(tgt, checkpoint_id=tmp_path / "t")
    res = load(tgt, checkpoint_id=tmp_path / "t", allow_pickle=True)
    assert all(torch.equal(tgt["model"][k], state["model"][k]) for k in state["model"])
    assert tgt["step"] == 12 and tgt["sched"] == {"lr": 0.5, "name": "cos"}
    md = read_metadata(tmp_path / "t", allow_pickle=True)
    # nesting comes from torch's planner_data; each chunk points at its raw bytes in the .distcp
    assert md.tensors["model.model.norm.weight"].path == ("model", "model.norm.weight")
    tensor_bytes = sum(v.numel() * v.element_size() for v in state["model"].values())
    assert res.counters["bytes_read"] - sum(loc[1] for loc in md.extra["torch_dcp_objects"].values()) == tensor_bytes


def test_a_damaged_torch_dcp_record_is_named(tmp_path):
    state = {"w": torch.randn(8, 4)}
    _torch_dcp(tmp_path / "t", state)
    md = read_metadata(tmp_path / "t", allow_pickle=True)
    (name,) = md.files
    f = tmp_path / "t" / name
    data = bytearray(f.read_bytes())
    data[0:4] = b"XXXX"  # the record's zip signature
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{name}: record of 'w' at offset 0 is neither"):
        read_metadata(tmp_path / "t", allow_pickle=True)
    f.write_bytes(bytes(data[:20]))
    with pytest.raises(CorruptCheckpointError, match="lies outside the file"):
        read_metadata(tmp_path / "t", allow_pickle=True)
