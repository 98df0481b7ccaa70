"""Megatron-LM's legacy checkpoints (``--ckpt-format torch``) read in place
(hpdcp_runner/dcp/storage/formats/megatron_legacy.py), on files Megatron-LM's own ``save_checkpoint``
wrote (megatron-core 0.19.2's ``megatron.training``; tests/fixtures/megatron/legacy_*, by
scripts/write_megatron_fixtures.py): a ``torch.save`` archive per tensor-, pipeline- and
expert-parallel rank. Under Hugging Face names every tensor is bitwise Megatron's own mapped by
hand; the same model saved in both of Megatron's formats reads the same; a slice reads only its
bytes; the archives are never unpickled as code; a missing rank, a truncated archive and a
planted class are one line naming the file."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from hpdcp_runner.dcp import load, open_reader
from hpdcp_runner.dcp.core.errors import (CheckpointNotFoundError, CorruptCheckpointError, HpdcpError,
                                          PickleNotAllowedError)
from hpdcp_runner.dcp.format.metadata import Metadata, dtype_from_name
from hpdcp_runner.dcp.storage.formats.foreign import detect_format
from tests.megatron_reference import FIXTURES, expected_hf

LEGACY = ["legacy_tp2", "legacy_tp2_pp2", "legacy_moe_ep2", "legacy_tp2_pp2_vp2"]


def _config(run):
    return json.load(open(os.path.join(run, "reference", "config.json")))


def _read(run, **kw):
    r = open_reader(run, **kw)
    md = Metadata.from_json(r.read_metadata_text())
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})  # (torch_dist's common state)
    load(state, storage_reader=r, strict=True)
    return md, {k: v for k, v in state.items() if k in md.tensors}


@pytest.mark.parametrize("name", LEGACY)
def test_hugging_face_names_equal_megatrons_tensors_mapped_by_hand(name):
    """No dcp.allow_pickle: the archives are read as data."""
    run = os.path.join(FIXTURES, name)
    assert detect_format(run) == "megatron" and detect_format(os.path.join(run, "iter_0000002")) == "megatron"
    md, state = _read(run, hf_config=_config(run))
    expect = expected_hf(run)
    assert state.keys() == expect.keys() and md.extra["source_format"] == "megatron"
    for k, v in expect.items():
        assert torch.equal(state[k], v), k
    md_iter, _ = _read(os.path.join(run, "iter_0000002"), hf_config=_config(run))  # the iteration directory itself
    assert md_iter.tensors.keys() == md.tensors.keys()


def test_each_stage_and_rank_reads_its_own_archive():
    """Pipeline 2 x tensor 2: layer 1 lives in the second stage's archives (numbered 0 there), a
    query group's rows in the tensor-parallel rank that held them, the head in the last stage."""
    run = os.path.join(FIXTURES, "legacy_tp2_pp2")
    md = Metadata.from_json(open_reader(run, hf_config=_config(run)).read_metadata_text())
    files = lambda key: sorted({c.file.split("/")[0] for c in md.tensors[key].chunks})  # noqa: E731
    assert files("model.layers.0.self_attn.q_proj.weight") == ["mp_rank_00_000", "mp_rank_01_000"]
    assert files("model.layers.1.mlp.up_proj.weight") == ["mp_rank_00_001", "mp_rank_01_001"]
    assert files("lm_head.weight") == ["mp_rank_00_001", "mp_rank_01_001"]
    assert files("model.layers.1.input_layernorm.weight") == ["mp_rank_00_001"]
    assert md.world_size == 4 and md.extra["megatron"]["names"] == "hf"


def test_interleaved_stages_number_layers_across_the_virtual_stages():
    """Pipeline 2 x tensor 2 with 2 virtual stages per rank (``model0``, ``model1`` in each
    archive, a layer each): chunk v of pipeline rank p holds layer v * 2 + p, so layer 1 is the
    second stage's ``model0`` and layer 2 the first stage's ``model1`` (each numbered 0 there);
    the embedding is the first stage's first chunk, the head the last stage's last."""
    run = os.path.join(FIXTURES, "legacy_tp2_pp2_vp2")
    md = Metadata.from_json(open_reader(run).read_metadata_text())  # under Megatron's own names
    assert md.world_size == 4 and len(md.files) == 4
    files = lambda key: sorted({c.file.split("/")[0] for c in md.tensors[key].chunks})  # noqa: E731
    for layer, stage in enumerate(["000", "001", "000", "001"]):
        assert files(f"decoder.layers.{layer}.self_attention.linear_qkv.weight") == [f"mp_rank_00_{stage}",
                                                                                      f"mp_rank_01_{stage}"]
    assert files("embedding.word_embeddings.weight") == ["mp_rank_00_000", "mp_rank_01_000"]
    assert files("output_layer.weight") == ["mp_rank_00_001", "mp_rank_01_001"]
    from safetensors.torch import load_file

    _, state = _read(run)
    ref = load_file(os.path.join(run, "reference", "tp_rank0_pp_rank0_vp_rank1.safetensors"))
    norm = ref["decoder.layers.0.input_layernorm.weight"]  # the first stage's second chunk: the model's layer 2
    assert torch.equal(state["decoder.layers.2.input_layernorm.weight"], norm)
    assert not torch.equal(state["decoder.layers.0.input_layernorm.weight"], norm)


@pytest.mark.parametrize("legacy, dist", [("legacy_tp2", "gpt_tp2"), ("legacy_moe_ep2", "moe_ep2")])
def test_the_same_model_in_both_of_megatrons_formats_reads_the_same(legacy, dist):
    """The writer builds the same weights for both (same seeds, same parallel sizes): under
    Megatron's own names, each legacy per-layer tensor is the torch_dist record's layer, bitwise
    (fc1 as all gate rows then all up rows; experts stacked); under Hugging Face names, all equal."""
    _, old = _read(os.path.join(FIXTURES, legacy))
    _, new = _read(os.path.join(FIXTURES, dist), allow_pickle=True)
    # (torch_dist keeps the norms under the linear they precede, as Transformer Engine's layers do)
    renamed = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    compared = 0
    for k, v in old.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", k)
        stacked = new[f"decoder.layers.{renamed.get(m[2], m[2])}"][int(m[1])] if m else new[k]
        assert torch.equal(v, stacked), k
        compared += 1
    fc1 = "mlp.experts.experts.linear_fc1.weight" if "moe" in legacy else "mlp.linear_fc1.weight"
    assert compared == len(old) >= 15 and f"decoder.layers.1.{fc1}" in old
    cfg = _config(os.path.join(FIXTURES, dist))
    _, a = _read(os.path.join(FIXTURES, legacy), hf_config=cfg)
    _, b = _read(os.path.join(FIXTURES, dist), allow_pickle=True, hf_config=cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_slice_reads_only_its_bytes():
    """An expert's up rows (the second half of its rank's fc1) read where they lie."""
    run = os.path.join(FIXTURES, "legacy_moe_ep2")
    r = open_reader(run, hf_config=_config(run))
    md = Metadata.from_json(r.read_metadata_text())
    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert {c.file for c in md.tensors[key].chunks} == {"mp_rank_00_001/model_optim_rng.pt"}
    state = {key: torch.empty(md.tensors[key].shape)}
    before = r.counters.bytes_read
    load(state, storage_reader=r, strict=False)
    assert r.counters.bytes_read - before == state[key].numel() * 4
    assert torch.equal(state[key], expected_hf(run)[key])


def _copy(tmp_path, name="legacy_tp2"):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def test_a_missing_rank_is_named(tmp_path):
    """The last tensor-parallel rank gone: the run's args say there were 2 (a smaller model is
    never read from what is left)."""
    run = _copy(tmp_path)
    shutil.rmtree(run / "iter_0000002" / "mp_rank_01")
    with pytest.raises(CheckpointNotFoundError, match="tensor-parallel rank 1, pipeline rank 0, expert rank 0 is missing"):
        open_reader(str(run)).read_metadata_text()
    run = _copy(tmp_path, "legacy_tp2_pp2")
    (run / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match="mp_rank_01_001/model_optim_rng.pt is missing"):
        open_reader(str(run)).read_metadata_text()


def test_a_truncated_archive_is_named(tmp_path):
    run = _copy(tmp_path)
    f = run / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(CorruptCheckpointError, match=f"{f}: not a readable torch.save archive"):
        open_reader(str(run)).read_metadata_text()


class Planted:
    """A class a hostile checkpoint names: unpickling it must never run its code."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/hpdcp-megatron-planted",))


def test_a_pickle_with_another_class_is_refused_and_never_run(tmp_path):
    run = _copy(tmp_path)
    f = run / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    torch.save({"model": {"output_layer.weight": torch.zeros(2, 2)}, "args": Planted()}, f)
    if os.path.exists("/tmp/hpdcp-megatron-planted"):
        os.unlink("/tmp/hpdcp-megatron-planted")
    with pytest.raises(PickleNotAllowedError, match=f"{f}: holds an object of class posix.system"):
        open_reader(str(run), allow_pickle=True).read_metadata_text()
    assert not os.path.exists("/tmp/hpdcp-megatron-planted")


def test_in_a_bucket(s3_bucket):
    """On S3 (a real server on loopback): the rank directories are the prefix's common prefixes."""
    from hpdcp_runner.dcp.storage.objects.object_store import Bucket

    src = os.path.join(FIXTURES, "legacy_tp2_pp2")
    b = Bucket(f"{s3_bucket}/runs/legacy")
    for root, _, files in os.walk(src):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                b.put(b.key(os.path.relpath(os.path.join(root, f), src)), fh.read())
    uri = f"{s3_bucket}/runs/legacy"
    assert detect_format(uri) == "megatron" and detect_format(f"{uri}/iter_0000002") == "megatron"
    _, state = _read(uri, hf_config=_config(src))
    expect = expected_hf(src)
    assert state.keys() == expect.keys() and all(torch.equal(state[k], expect[k]) for k in expect)


def test_a_name_whose_cut_is_unknown_is_refused_under_tensor_parallelism(tmp_path):
    """An older Megatron-LM model (``language_model.*``) at tensor-parallel 2: its slices are never
    read as if one rank held the whole tensor."""
    it = tmp_path / "iter_0000002"
    for tp in (0, 1):
        (it / f"mp_rank_0{tp}").mkdir(parents=True)
        torch.save({"model": {"language_model.embedding.word_embeddings.weight": torch.zeros(4, 3)}},
                   it / f"mp_rank_0{tp}" / "model_optim_rng.pt")
    with pytest.raises(HpdcpError, match="'language_model.embedding.word_embeddings.weight' is not a Megatron-Core "
                                         "GPT tensor this reader knows how tensor parallelism cut"):
        open_reader(str(it)).read_metadata_text()
