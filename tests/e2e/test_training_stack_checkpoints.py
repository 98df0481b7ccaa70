"""Checkpoints written by training stacks, through the CLI, on files those stacks wrote.

DeepSpeed (tests/fixtures/deepspeed): inspect, verify, export to Hugging Face (a model
transformers loads, its logits equal to the trained model's), reshard into ours under the family's
tensor-parallel plan at another world size (weights equal to zero_to_fp32's, moments to
ds_to_universal's). Megatron-Core (tests/fixtures/megatron): export to Hugging Face and reshard
into ours, every tensor equal to Megatron's own mapped by hand. Bad input: one line, exit 2,
nothing written (exit 1, as for every bad checkpoint)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed")


def _fixture(config):
    return os.path.abspath(os.path.join(FIXTURES, config))


def _errors(stderr):
    return [x for x in stderr.splitlines() if "error:" in x]


def test_inspect_and_verify_a_deepspeed_run(cli, tmp_path):
    run = _fixture("zero3_bf16")
    r = cli(["+job=inspect", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/i"])
    assert r.returncode == 0, r.stderr[-3000:]
    head = r.stdout.splitlines()[0]
    assert f"{run}/global_step2" in head and "deepspeed" in head and "world size 2" in head, head
    assert "optim.state.model.embed_tokens.weight.exp_avg_sq" in r.stdout
    r = cli(["+job=verify", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/v"])
    assert r.returncode == 0 and "format: deepspeed" in r.stdout, r.stderr[-3000:]


# ZeRO 1 and 3; and AutoTP training (tensor-parallel 2 beside 2 data-parallel ranks: a set of files
# per model-parallel rank), whose weights are ds_to_universal's merge (zero_to_fp32 does not merge them)
# and without ZeRO (bf16: FP16_Optimizer's fp32 copies; the head tied to the embedding), whose weights
# are what the engine held (DeepSpeed's tools do not read such a checkpoint)
@pytest.mark.parametrize("config", ["zero1_bf16", "zero3_bf16", "zero2_fp32_tp2_dp2", "zero0_bf16"])
def test_export_to_hugging_face_gives_the_trained_model(cli, tmp_path, config):
    transformers = pytest.importorskip("transformers")
    run = _fixture(config)
    ref = os.path.join(run, "reference")
    weights = os.path.join(ref, "universal_fp32.safetensors" if "_tp" in config else "zero_to_fp32.safetensors")
    if config.startswith("zero0_"):
        from safetensors.torch import save_file

        live = load_file(os.path.join(ref, "live.safetensors"))
        weights = str(tmp_path / "live_weights.safetensors")
        save_file({k: v for k, v in live.items() if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))}, weights)
    out = tmp_path / "hf"
    r = cli(["+job=reshard", f"job.source.path={run}", "job.output_format=hf", f"job.hf_files_from={ref}",
             f"job.output={out}", f"hydra.run.dir={tmp_path}/r"])
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    expect = load_file(weights)
    assert exported.keys() == expect.keys() and all(torch.equal(exported[k], expect[k]) for k in expect)
    # the logits: bitwise those of the trained model's fp32 weights (zero_to_fp32's) run here, and
    # within float rounding of the writer's own forward (another machine's kernels round differently)
    trained = tmp_path / "trained"
    trained.mkdir()
    shutil.copy(os.path.join(ref, "config.json"), trained)
    shutil.copy(weights, trained / "model.safetensors")
    x = torch.arange(12).reshape(2, 6) % 67
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(input_ids=x).logits
        expected = transformers.AutoModelForCausalLM.from_pretrained(str(trained)).eval()(input_ids=x).logits
    assert torch.equal(logits, expected)
    written = load_file(os.path.join(ref, "logits.safetensors"))["logits"]
    assert torch.allclose(logits, written, rtol=1e-5, atol=1e-6), (logits - written).abs().max()


@pytest.mark.slow  # four ranks under torchrun (saved by two)
def test_reshard_into_ours_under_the_familys_plan_at_another_world_size(cli, tmp_path):
    run = _fixture("zero2_fp32")
    ref = os.path.join(run, "reference")
    out = tmp_path / "ours"
    r = cli(["+job=reshard", f"job.source.path={run}", "layout=auto", f"job.hf_files_from={ref}",
             f"job.output={out}", f"hydra.run.dir={tmp_path}/r"], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "target_layout: auto:llama_tp" in r.stdout and "verified_tensors: 63" in r.stdout, r.stdout
    from hpdcp_runner.dcp import load, read_metadata
    from hpdcp_runner.dcp.format.metadata import dtype_from_name

    md = read_metadata(str(out))
    assert md.world_size == 4
    split = [k for k, t in md.tensors.items() if len(t.chunks) == 4]
    assert "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in split, split
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})
    load(state, checkpoint_id=str(out))
    weights = load_file(os.path.join(ref, "zero_to_fp32.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    for k, v in load_file(os.path.join(ref, "universal.safetensors")).items():
        name, moment = k.rsplit(".", 1)
        assert torch.equal(state[f"optim.state.{name}.{moment}"].flatten(), v.flatten()), k
    assert state["optim.state.lm_head.weight.step"] == 2.0


def test_a_pipeline_parallel_run_resharded_into_ours_and_verified(cli, tmp_path):
    """DeepSpeed's pipeline engine (2 stages x 2 data-parallel ranks, bf16, ZeRO 1, an embedding
    tied to the head): resharded into ours on 2 ranks under FSDP, every weight and moment bitwise
    ds_to_universal's merge; verify checks the layer files' zip CRC-32s (``weights=module``)."""
    run = _fixture("pipe_zero1_bf16_pp2_dp2")
    out = tmp_path / "ours"
    r = cli(["+job=reshard", f"job.source.path={run}", f"job.output={out}", f"hydra.run.dir={tmp_path}/r"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "target_layout: fsdp" in r.stdout and "verified_tensors: 81" in r.stdout, r.stdout
    from hpdcp_runner.dcp import load, read_metadata
    from hpdcp_runner.dcp.format.metadata import dtype_from_name

    md = read_metadata(str(out))
    assert md.world_size == 2 and len(md.tensors["optim.state.3.up.weight.exp_avg"].chunks) == 2
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})
    load(state, checkpoint_id=str(out))
    for k, v in load_file(os.path.join(run, "reference", "universal.safetensors")).items():
        key = "optim.state.{}.{}".format(*k.rsplit(".", 1)) if k.endswith(("exp_avg", "exp_avg_sq")) else k
        assert torch.equal(state[key], v), k
    assert state["optim.state.tied_modules.embed.tok.weight.step"] == 2.0
    r = cli(["+job=verify", f"job.source.path={run}", "job.source.weights=module", f"hydra.run.dir={tmp_path}/v"])
    assert r.returncode == 0 and "records_crc_checked: 27" in r.stdout, r.stdout + r.stderr[-3000:]


def test_bad_deepspeed_input_is_one_line_and_writes_nothing(cli, tmp_path):
    """A damaged or hostile checkpoint exits 1, as every bad checkpoint does (2 is for config
    errors: docs/configuration.md)."""
    run = tmp_path / "run"
    shutil.copytree(_fixture("zero2_fp32"), run)
    f = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:3000])
    out = tmp_path / "out"
    r = cli(["+job=reshard", f"job.source.path={run}", "job.output_format=hf", f"job.output={out}",
             f"hydra.run.dir={tmp_path}/r"])
    errs = _errors(r.stderr)
    assert r.returncode == 1 and len(errs) == 1 and str(f) in errs[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not out.exists()
    torch.save({"optimizer_state_dict": {"x": torch.nn.Linear(1, 1)}}, f)  # a class nobody admitted
    r = cli(["+job=inspect", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/i"])
    errs = _errors(r.stderr)
    assert r.returncode == 1 and len(errs) == 1 and str(f) in errs[0] and "torch.nn.modules.linear.Linear" in errs[0], \
        r.stderr[-3000:]


# a Llama; a Qwen2 (biases on q, k, v); a Mixtral (expert parallel); a Qwen2-MoE (shared expert, dense
# layer 0); a Qwen3-MoE (norms on query and key heads); Megatron-LM's legacy format (a torch.save
# archive per rank: tensor x pipeline parallel, with and without interleaved virtual stages, and a
# Mixtral at expert parallel), with no
# dcp.allow_pickle (torch_dist's .metadata needs it; the legacy archives are read as data)
@pytest.mark.parametrize("name", ["gpt_tp2", "gpt_tp2_qkv_bias", "moe_ep2", "moe_tp2_shared", "moe_qk_norm",
                                  "legacy_tp2_pp2", "legacy_moe_ep2", "legacy_tp2_pp2_vp2"])
def test_megatron_to_hugging_face(cli, tmp_path, name):
    transformers = pytest.importorskip("transformers")
    from tests.megatron_reference import expected_hf

    run = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron", name))
    out = tmp_path / "hf"
    pickle = [] if name.startswith("legacy") else ["dcp.allow_pickle=true"]
    r = cli(["+job=reshard", f"job.source.path={run}", *pickle, "job.output_format=hf",
             f"job.hf_files_from={run}/reference", f"job.output={out}", f"hydra.run.dir={tmp_path}/r"])
    assert r.returncode == 0, r.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    expect = expected_hf(run)
    assert exported.keys() == expect.keys() and all(torch.equal(exported[k], expect[k]) for k in expect)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    family = json.load(open(os.path.join(run, "reference", "config.json")))["architectures"][0]
    assert type(model).__name__ == family


@pytest.mark.slow  # four ranks under torchrun
@pytest.mark.parametrize("name, plan", [("gpt_tp2", "llama_tp"), ("moe_ep2", "mixtral_ep"),
                                        ("legacy_tp2_pp2", "llama_tp")])
def test_megatron_resharded_into_ours_under_the_familys_plan(cli, tmp_path, name, plan):
    from hpdcp_runner.dcp import load, read_metadata
    from hpdcp_runner.dcp.format.metadata import dtype_from_name
    from tests.megatron_reference import expected_hf

    run = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron", name))
    out = tmp_path / "ours"
    r = cli(["+job=reshard", f"job.source.path={run}", "dcp.allow_pickle=true", "layout=auto",
             f"job.hf_files_from={run}/reference", f"job.output={out}", f"hydra.run.dir={tmp_path}/r"], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"target_layout: auto:{plan}" in r.stdout, r.stdout
    md = read_metadata(str(out))
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    load(state, checkpoint_id=str(out))
    expect = expected_hf(run)
    assert state.keys() == expect.keys() and all(torch.equal(state[k], expect[k]) for k in expect)
    if name != "moe_ep2":
        assert "kv_replicated" in r.stdout and len(md.tensors["model.layers.0.self_attn.q_proj.weight"].chunks) == 4
    else:  # experts spread over the four ranks' files
        experts = [md.tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"] for e in range(4)]
        assert len({c.file for t in experts for c in t.chunks}) == 4, [t.chunks for t in experts]


def test_inspect_a_legacy_megatron_run_and_a_missing_rank_is_one_line(cli, tmp_path):
    """Megatron-LM's legacy format under Megatron's own names (no config.json): the whole model,
    layers numbered across pipeline stages; a rank's archive gone: one line naming it, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron", "legacy_tp2_pp2"), run)
    r = cli(["+job=inspect", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/i"])
    assert r.returncode == 0, r.stderr[-3000:]
    head = r.stdout.splitlines()[0]
    assert f"{run}/iter_0000002" in head and "megatron" in head, head
    assert "decoder.layers.1.mlp.linear_fc1.weight" in r.stdout and "[80, 24]" in r.stdout, r.stdout
    # verify: every slice that fills its storage is checked against the zip's CRC-32 (fc1's gate and
    # up halves are parts of one: not checkable); a flipped byte in one is named
    r = cli(["+job=verify", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/v"])
    assert r.returncode == 0 and "21 records matched their zip CRC-32" in r.stdout, r.stdout + r.stderr[-2000:]
    from hpdcp_runner.dcp import open_reader
    from hpdcp_runner.dcp.format.metadata import Metadata

    md = Metadata.from_json(open_reader(str(run)).read_metadata_text())
    c = next(c for c in md.tensors["output_layer.weight"].chunks if c.file.startswith("mp_rank_01_001/"))
    flipped = run / "iter_0000002" / c.file
    raw = bytearray(flipped.read_bytes())
    raw[c.byte_offset + 5] ^= 0x40
    flipped.write_bytes(bytes(raw))
    r = cli(["+job=verify", f"job.source.path={run}", f"hydra.run.dir={tmp_path}/v2"])
    errs = _errors(r.stderr)
    assert r.returncode == 1 and len(errs) == 1 and str(flipped) in errs[0] and "zip CRC-32" in errs[0], \
        r.stderr[-3000:]
    gone = run / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt"
    gone.unlink()
    out = tmp_path / "out"
    r = cli(["+job=reshard", f"job.source.path={run}", "job.output_format=hf", f"job.hf_files_from={run}/reference",
             f"job.output={out}", f"hydra.run.dir={tmp_path}/r"])
    errs = _errors(r.stderr)
    assert r.returncode == 1 and len(errs) == 1 and str(gone) in errs[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_zarr_megatron_checkpoint_is_one_line(cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron", "gpt_tp1"), run)
    marker = run / "iter_0000002" / "metadata.json"
    marker.write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    out = tmp_path / "out"
    r = cli(["+job=reshard", f"job.source.path={run}", "dcp.allow_pickle=true", "job.output_format=hf",
             f"job.output={out}", f"hydra.run.dir={tmp_path}/r"])
    errs = _errors(r.stderr)
    assert r.returncode == 1 and len(errs) == 1 and str(marker) in errs[0] and "zarr" in errs[0], r.stderr[-3000:]
    assert not out.exists()


def test_a_megatron_checkpoint_without_its_config_is_refused_not_exported_under_megatrons_names(cli, tmp_path):
    """Without the model's config.json a Megatron checkpoint reads under Megatron's own names
    (layer-stacked, QKV fused): an HF export of those once wrote a model.safetensors no model
    loads, exit 0; layout=auto had no family to name. Both now say what to give, exit 2."""
    run = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron", "moe_ep2"))
    for i, (knob, said) in enumerate([("job.output_format=hf", "Megatron's own names"),
                                      ("layout=auto", "Megatron-Core's own names")]):
        out = tmp_path / f"out{i}"
        r = cli(["+job=reshard", f"job.source.path={run}", "dcp.allow_pickle=true", knob, f"job.output={out}",
                 f"hydra.run.dir={tmp_path}/r{i}"])
        errs = _errors(r.stderr)
        assert r.returncode == 2 and len(errs) == 1 and said in errs[0] and "job.hf_files_from=" in errs[0], \
            r.stderr[-3000:]
        assert not out.exists()
