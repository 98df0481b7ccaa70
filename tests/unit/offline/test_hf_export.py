"""export_hf: any checkpoint -> a Hugging Face directory; shard planning, side files, and an
export that fails publishes nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpdcp_runner.dcp import CheckpointExistsError, save
from hpdcp_runner.dcp.offline import hf_export
from hpdcp_runner.dcp.offline.hf_export import assign_files, export_hf, natural_key
from hpdcp_runner.dcp.offline.side_files import side_files


def test_planning_is_pure_and_balanced():
    keys = ["layers.10.w", "layers.9.w", "layers.1.w", "embed", "layers.2.w"]
    assert sorted(keys, key=natural_key) == ["embed", "layers.1.w", "layers.2.w", "layers.9.w", "layers.10.w"]
    assert assign_files([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # largest first, least loaded: 110 | 110
    assert assign_files([5, 5, 5], 4) == [0, 1, 2]
    assert assign_files([], 3) == []


def _checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"model.layers.{i}.w": torch.randn(6, 5, generator=g).to(torch.bfloat16) for i in range(12)}
    state["lm_head.weight"] = torch.randn(9, 5, generator=g)
    save({**state, "step": 3}, checkpoint_id=tmp_path / "ours")
    return state


def test_export_is_bitwise_sharded_and_carries_the_model_files(tmp_path):
    state = _checkpoint(tmp_path)
    cfg = tmp_path / "cfgdir"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"model_type": "llama"}')
    (cfg / "tokenizer.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(cfg / "model.safetensors"))  # weights never travel
    (cfg / ".hidden").write_text("x")
    assert side_files(str(cfg)) == ["config.json", "tokenizer.json"]
    res = export_hf(tmp_path / "ours", tmp_path / "hf", max_shard_size=200, files_from=cfg)
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(res["files"]) > 1 and sorted(set(index["weight_map"].values())) == res["files"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    got = {}
    for f in res["files"]:
        got.update(load_file(str(out / f)))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    # consecutive layers share files, in natural order
    layer_files = [index["weight_map"][f"model.layers.{i}.w"] for i in range(12)]
    assert layer_files == sorted(layer_files)
    assert (out / "config.json").read_text() == '{"model_type": "llama"}' and (out / "tokenizer.json").exists()
    assert res["skipped_objects"] == ["step"]
    with pytest.raises(CheckpointExistsError):
        export_hf(tmp_path / "ours", out)
    export_hf(tmp_path / "ours", out, overwrite=True)  # one file now
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_a_failed_export_publishes_nothing_and_leaves_no_staging(tmp_path, monkeypatch):
    _checkpoint(tmp_path)
    calls = []

    def failing(self, name, specs, meta):  # the second file's disk fills as it is written
        calls.append(name)
        w = real(self, name, specs, meta)
        if len(calls) == 2:
            def full(key, t):
                raise OSError(28, "No space left on device")
            w.append = full
        return w

    from hpdcp_runner.dcp.storage import outputs

    real = outputs.RenameOutput.stream_safetensors
    monkeypatch.setattr(outputs.RenameOutput, "stream_safetensors", failing)
    with pytest.raises(Exception, match="No space left"):
        export_hf(tmp_path / "ours", tmp_path / "hf", max_shard_size=200)
    assert not (tmp_path / "hf").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hf")]


def test_reserved_and_renamed_names(tmp_path):
    save({"__metadata__": torch.zeros(2), "w": torch.ones(2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(Exception, match="__metadata__"):
        export_hf(tmp_path / "c", tmp_path / "hf")
    res = export_hf(tmp_path / "c", tmp_path / "hf", rename=[(r"^__metadata__$", "meta")])
    assert sorted(load_file(str(tmp_path / "hf" / res["files"][0]))) == ["meta", "w"]
