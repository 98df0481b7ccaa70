"""Reshard a checkpoint the runner did not write: the target comes from its metadata, placed by a
model-family layout preset (Hugging Face Llama names here); model= plays no part."""

from __future__ import annotations

import json

import pytest
import torch

from hpdcp_runner.dcp import load, read_metadata, save
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

V, H, F = 96, 32, 80  # vocab, hidden, ffn: not the synthetic presets' shapes


def _llama_state() -> dict:
    g = torch.Generator().manual_seed(3)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    model = {"model.embed_tokens.weight": t(V, H), "model.norm.weight": t(H), "lm_head.weight": t(V, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        model.update({p + "self_attn.q_proj.weight": t(H, H), p + "self_attn.k_proj.weight": t(H // 2, H),
                      p + "self_attn.v_proj.weight": t(H // 2, H), p + "self_attn.o_proj.weight": t(H, H),
                      p + "mlp.gate_proj.weight": t(F, H), p + "mlp.up_proj.weight": t(F, H),
                      p + "mlp.down_proj.weight": t(H, F), p + "input_layernorm.weight": t(H),
                      p + "post_attention_layernorm.weight": t(H)})
    q = "model.layers.0.self_attn.q_proj.weight"
    optim = {"state": {q: {"exp_avg": t(H, H, dtype=torch.float32), "step": torch.tensor(7.0)}}}
    return {"model": model, "optim": optim, "train": {"step": 7}}


def _chunks(path, key):
    return [(list(c.offsets), list(c.sizes)) for c in read_metadata(path).tensors[key].chunks]


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_reshard_a_llama_checkpoint_under_family_layouts(cli, tmp_path):
    src = tmp_path / "hf_like"
    state = _llama_state()
    save(state, checkpoint_id=src)
    for nproc, layout in ((2, "llama_tp"), (4, "llama_fsdp_tp")):
        out = tmp_path / f"out_{layout}"
        r = cli(["+job=reshard", f"job.source.path={src}", f"layout={layout}", f"job.output={out}",
                 "layout.strict=true", f"hydra.run.dir={tmp_path}/r_{layout}"], nproc=nproc)
        assert r.returncode == 0, _tail(r)
        m = metrics(tmp_path / f"r_{layout}")["result"]
        assert m["verified_tensors"] == 23  # every tensor bit for bit, including the optimizer's
        q, o = "model.model.layers.0.self_attn.q_proj.weight", "model.model.layers.1.self_attn.o_proj.weight"
        if layout == "llama_tp":
            assert _chunks(out, q) == [([0, 0], [16, 32]), ([16, 0], [16, 32])]  # column-parallel: dim 0
            assert _chunks(out, o) == [([0, 0], [32, 16]), ([0, 16], [32, 16])]  # row-parallel: dim 1
            assert len(_chunks(out, "model.model.norm.weight")) == 1  # replicated, written once
            # optimizer state follows its parameter's rule; its step scalar stays whole
            assert _chunks(out, "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg") == _chunks(out, q)
        else:  # dp=2 x tp=2: both split dim 0 of q_proj, o_proj split by rows (dp) and columns (tp)
            assert len(_chunks(out, q)) == 4 and len(_chunks(out, o)) == 4
        tgt = {k: torch.zeros_like(v) for k, v in state["model"].items()}
        load({"model": tgt}, checkpoint_id=out, strict=False)
        assert all(torch.equal(tgt[k], state["model"][k]) for k in tgt)


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_layout_rules_are_checked_against_the_checkpoint(cli, tmp_path):
    src = tmp_path / "hf_like"
    state = _llama_state()
    state["model"]["model.layers.0.mystery.weight"] = torch.zeros(4, 4)
    save(state, checkpoint_id=src)
    r = cli(["+job=reshard", f"job.source.path={src}", "layout=llama_tp", "layout.strict=true",
             f"job.output={tmp_path}/o", f"hydra.run.dir={tmp_path}/a"])
    assert r.returncode != 0 and "layout.strict" in r.stderr and "model.model.layers.0.mystery.weight" in r.stderr, \
        _tail(r)
    assert not (tmp_path / "o").exists()
    # a rule that cannot apply (1-D norms told Shard(1)) names the rule and the tensor
    r = cli(["+job=reshard", f"job.source.path={src}", "layout=llama_tp",
             "layout.rules=[{pattern: '.*norm.*', placements: [S1]}]", f"job.output={tmp_path}/o",
             f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode != 0 and "rules[0]" in r.stderr and "norm.weight" in r.stderr and "S1" in r.stderr, _tail(r)
    assert not (tmp_path / "o").exists()
    # without strict the unmatched tensor is replicated, and the summary and metrics.json say so;
    # rules given on the command line are named, the layout is not passed off as the preset
    r = cli(["+job=reshard", f"job.source.path={src}", "layout=llama_tp", "layout.mesh=[1]",
             f"job.output={tmp_path}/o", f"hydra.run.dir={tmp_path}/c"])
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "c")["result"]
    assert m["unmatched"] == {"tensors": 1, "bytes": 64, "first": ["model.model.layers.0.mystery.weight"],
                              "placed": "replicated on every rank (layout.strict=true refuses them)"}
    assert m["layout_overridden"] == ["layout.mesh=[1]"]
    assert 'unmatched: {"tensors": 1' in r.stdout and "layout_overridden" in r.stdout
    # a layout file of one's own: a key the schema lacks is one line naming the file and the key
    (tmp_path / "mine.yaml").write_text("kind: dtensor\nmesh: [-1]\nrules:\n  - {pattern: x, placement: [S0]}\n")
    r = cli(["+job=reshard", f"job.source.path={src}", "layout.file=mine.yaml", f"job.output={tmp_path}/o2",
             f"hydra.run.dir={tmp_path}/d"])
    assert r.returncode != 0 and "layout.file" in r.stderr and "mine.yaml" in r.stderr and "placement" in r.stderr, \
        _tail(r)
    assert not (tmp_path / "o2").exists()


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_foreign_checkpoints_bad_input_is_one_line_and_writes_nothing(cli, tmp_path):
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import save_file

    tdcp.save({"w": torch.ones(4)}, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "tdcp")))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.a.weight": torch.ones(4), "model.b.weight": torch.zeros(4)}, str(hf / "model.safetensors"))
    cases = [
        # torch DCP without the pickle opt-in: names the file and the config key
        (["job.source.path=tdcp"], [".metadata", "dcp.allow_pickle=true"]),
        # a rename that merges two tensors: names both and the result
        (["job.source.path=hf", "job.source.rename=[{pattern: '[.][ab][.]', replace: .x.}]"],
         ["'model.a.weight' and 'model.b.weight' -> 'model.x.weight'", "job.source.rename"]),
        # told it is ours, a Hugging Face directory says what it is
        (["job.source.path=hf", "job.source.format=hpdcp"], ["Hugging Face model directory", "job.source.format"]),
    ]
    for i, (args, expected) in enumerate(cases):
        r = cli(["+job=reshard", *args, "job.output=o", f"hydra.run.dir={tmp_path}/r{i}"])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and all(x in lines[0] for x in expected), _tail(r)
        assert not (tmp_path / "o").exists()
    # the layout report of a Hugging Face directory, machine-readable
    r = cli(["+job=inspect", "job.source.path=hf", "layout=fsdp", "job.ranks=3", "job.format=json",
             f"hydra.run.dir={tmp_path}/i"])
    assert r.returncode == 0, _tail(r)
    doc = json.loads(r.stdout)
    assert doc["format"] == "hf" and doc["layout"]["tensors"]["model.a.weight"] == {
        "rule": 0, "placements": ["S0"], "shards": [[[0], [2]], [[2], [2]], [[4], [0]]]}


def test_verify_a_torch_dcp_checkpoint_checks_each_record_crc(cli, tmp_path):
    """verify on a torch DCP source: every record read whole against its zip CRC-32; a flipped
    bit in a record's data is named (file, key) with a non-zero exit."""
    import warnings
    import torch.distributed.checkpoint as tdcp

    state = {k: v for k, v in list(_llama_state().items())[:4]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    args = ["+job=verify", f"job.source.path={tmp_path}/t", "job.source.format=torch_dcp", "dcp.allow_pickle=true"]
    r = cli(args + [f"hydra.run.dir={tmp_path}/r1"])
    assert r.returncode == 0 and f"{len(state)} records matched their zip CRC-32" in r.stdout, _tail(r)
    (name,) = [n for n in (tmp_path / "t").iterdir() if n.suffix == ".distcp"]
    data = bytearray(name.read_bytes())
    at = data.index(b"archive/data/0") + 100  # inside the first record's data entry (64-byte aligned, >= 64 bytes)
    data[at] ^= 0x04
    name.write_bytes(bytes(data))
    r = cli(args + [f"hydra.run.dir={tmp_path}/r2"])
    assert r.returncode != 0 and "CRC-32" in r.stderr and name.name in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_reshard_and_load_take_part_of_a_checkpoint(cli, tmp_path):
    """job.include / job.exclude on reshard (hpdcp output) and load of a user's checkpoint: only
    the keys chosen are read, written and verified; job.dtype is for Hugging Face output only."""
    src = tmp_path / "src"
    save(_llama_state(), checkpoint_id=src)
    r = cli(["+job=reshard", f"job.source.path={src}", "layout=llama_tp", "job.exclude='^optim[.]'",
             f"job.output={tmp_path}/model_only", f"hydra.run.dir={tmp_path}/r"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert metrics(tmp_path / "r")["result"]["verified_tensors"] == 21
    out = read_metadata(tmp_path / "model_only")
    assert len(out.tensors) == 21 and not any(k.startswith("optim.") for k in list(out.tensors) + list(out.objects))
    r = cli(["+job=load", f"job.source.path={src}", "job.include='^model[.]'", "job.exclude='norm'",
             f"hydra.run.dir={tmp_path}/l"])
    assert r.returncode == 0, _tail(r)
    assert metrics(tmp_path / "l")["result"]["loaded_keys"] == 21 - 5  # 2 layers x 2 norms + the final norm
    r = cli(["+job=reshard", f"job.source.path={src}", "job.dtype=bfloat16", f"job.output={tmp_path}/x",
             "job.exclude='('", f"hydra.run.dir={tmp_path}/e"])
    assert r.returncode == 2 and "job.dtype" in r.stderr and "job.output_format=hf" in r.stderr, _tail(r)
    assert "job.exclude: bad regex" in r.stderr and not (tmp_path / "x").exists()
