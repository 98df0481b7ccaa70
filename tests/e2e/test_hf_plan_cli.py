"""``layout=auto`` from the family's own parallel plan, through the CLI under torchrun, on models
transformers wrote (``save_pretrained``): Hugging Face -> ours at 2 ranks -> ours at 4 ranks ->
Hugging Face, every weight the plan splits written split by the ranks (each rank its whole heads,
its whole experts), the export bitwise equal to the original files and transformers' logits equal.
The default tier inspects one family with experts and refuses a partly split block and a
family with neither plan nor preset; the slow tier runs Starcoder2 (fewer key/value heads than
ranks) and 30 families (10 with experts) through the whole round trip. Plan-level checks of 40 families:
tests/unit/runner/test_hf_plans.py."""

from __future__ import annotations

import re

import pytest
import torch

from hpdcp_runner.dcp import read_metadata
from tests import hf_families
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the families' parallel plans as tested here are transformers 5.x's", allow_module_level=True)

SWEEP = hf_families.DENSE_FAMILIES[:20] + hf_families.EXPERT_FAMILIES[:10]
# CI's slow tier runs one family per kind of plan (plain, fused QKV and gate/up, biases, per-head
# norms, routed and shared experts): 30 families at ~45 s each would take 23 of CI's 90 minutes.
# The rest are the `extended` tier (python -m pytest -m extended), run before a release.
CI_FAMILIES = {"llama", "gemma2", "phi3", "gpt_neox", "starcoder2", "cohere", "mixtral", "qwen3_moe", "glm4_moe",
               "dots1"}
SWEEP_PARAMS = [pytest.param(f, marks=() if f in CI_FAMILIES else pytest.mark.extended) for f in SWEEP]


def _run(cli, tmp_path, tag, nproc, *args):
    r = cli(["+job=reshard", *args, f"hydra.run.dir={tmp_path}/run_{tag}"], nproc=nproc)
    assert r.returncode == 0, _tail(r)
    return metrics(tmp_path / f"run_{tag}")["result"], r.stdout


def _ranks_writing(path):
    """{key: {rank: [boxes]}}: the chunks each rank's file holds (replicated chunks written once)."""
    md = read_metadata(str(path))
    out: dict = {}
    for k, t in md.tensors.items():
        for c in t.chunks:
            out.setdefault(k, {}).setdefault(md.files[c.file].rank, []).append((tuple(c.offsets), tuple(c.sizes)))
    return out


def _check_written(path, report_split, ranks):
    """Every weight the plan splits is written in pieces by more than one rank (or, one key per
    expert, by its owner alone), never whole by one rank for all."""
    written = _ranks_writing(path)
    for key in report_split:
        by_rank = written[key]
        pieces = sum(len(v) for v in by_rank.values())
        assert pieces > 1 or ".experts." in key, (key, by_rank)


def _bitwise(a, b):
    from safetensors.torch import load_file

    x, y = {}, {}
    for f in sorted(a.glob("*.safetensors")):
        x.update(load_file(f))
    for f in sorted(b.glob("*.safetensors")):
        y.update(load_file(f))
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
        assert torch.equal(x[k].view(torch.uint8) if x[k].dim() else x[k], y[k].view(torch.uint8) if y[k].dim() else
                           y[k]), k


def _round_trip(cli, tmp_path, family, second=()):
    model = hf_families.build(family, tmp_path / "hf")
    from hpdcp_runner.hf_plan import plan_rules

    raw, shapes = hf_families.shapes(tmp_path / "hf")
    a, out_a = _run(cli, tmp_path, "a", 2, f"job.source.path={tmp_path}/hf", "layout=auto", f"job.output={tmp_path}/a")
    assert f"the {raw['model_type']} family's own" in a["layout_recognised"], a
    _check_written(tmp_path / "a", plan_rules(raw, shapes, None, [], 2)[2]["split"], 2)
    b, _ = _run(cli, tmp_path, "b", 4, f"job.source.path={tmp_path}/a", "layout=auto", *second, f"job.output={tmp_path}/b")
    report = plan_rules(raw, shapes, dict(s.split("=") for s in second).get("layout.parallel"), [], 4)[2]
    _check_written(tmp_path / "b", report["split"], 4)
    c, _ = _run(cli, tmp_path, "c", None, f"job.source.path={tmp_path}/b", "job.output_format=hf",
                f"job.output={tmp_path}/out")
    assert a["verified_tensors"] == b["verified_tensors"] == c["verified_tensors"] == len(shapes)
    _bitwise(tmp_path / "hf", tmp_path / "out")
    return model, a, b, report


def _logits(model):
    ids = torch.arange(24).remainder(97).view(2, 12)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow  # three launches; the default tier plans 40 families in tests/unit/runner/test_hf_plans.py
def test_starcoder2_tensor_parallel_by_its_plan_kv_heads_replicated_at_4_ranks(cli, tmp_path):
    """Starcoder2 (c_fc / c_proj MLP, 2 key/value heads): once copied whole by a guessed Llama
    preset; now split by its own plan, the 2 key/value heads replicated at 4 ranks and said so."""
    model, a, b, report = _round_trip(cli, tmp_path, "starcoder2")
    assert "key/value projection(s) replicated (2 key/value heads for 4 tensor-parallel ranks)" in \
        b["layout_recognised"]
    written = _ranks_writing(tmp_path / "b")
    fc = written["model.layers.1.mlp.c_fc.weight"]
    assert sorted(fc) == [0, 1, 2, 3] and fc[3] == [((54, 0), (18, 64))]  # 72 rows, 18 per rank
    q = written["model.layers.0.self_attn.q_proj.weight"]
    assert [q[r] for r in range(4)] == [[((16 * r, 0), (16, 64))] for r in range(4)]  # 2 heads of 8 each
    assert sum(len(v) for v in written["model.layers.0.self_attn.k_proj.weight"].values()) == 1  # replicated
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(back), _logits(model))


def test_inspect_says_what_placed_each_block_and_the_share_split(cli, tmp_path):
    hf_families.build("granitemoe", tmp_path / "hf")  # stacked experts, bfloat16
    r = cli(["+job=inspect", f"job.source.path={tmp_path}/hf", "layout=auto", "layout.parallel=ep_tp", "job.ranks=4",
             f"hydra.run.dir={tmp_path}/run"])
    assert r.returncode == 0, _tail(r)
    out = r.stdout
    assert "the granitemoe family's own expert- and tensor-parallel plans" in out
    layout_part = out.split("layout auto:granitemoe_ep_tp at 4 ranks")[1]
    line = next(x for x in layout_part.splitlines() if "layers.0.block_sparse_moe.input_linear.weight" in x)
    assert "E,S1" in line and "ep plan model.layers.*.block_sparse_moe.experts.gate_up_proj: grouped_gemm" in line
    assert "parts=[64, 64]" in line  # gate and up split on their own inside each expert
    assert "unit=8" in next(x for x in layout_part.splitlines() if "layers.0.self_attn.q_proj.weight" in x)
    assert re.search(r"split across ranks: \d+ of \d+ tensor bytes \(9\d%\)", out), out[-800:]


def test_a_block_split_in_part_fails_naming_it_unless_strict_false(cli, tmp_path):
    hf_families.build("llama", tmp_path / "hf")
    rules = tmp_path / "mine.yaml"
    rules.write_text("name: mine\nkind: dtensor\nmesh: [-1]\nrules:\n"
                     "  - {pattern: '.*q_proj\\.weight(\\..+)?', placements: [S0], unit: 8}\n")
    args = ["+job=reshard", f"job.source.path={tmp_path}/hf", f"layout.file={rules}", f"job.output={tmp_path}/o"]
    r = cli(args + [f"hydra.run.dir={tmp_path}/r1"])
    assert r.returncode == 2, _tail(r)
    err = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")][-1]
    assert "model.layers.0.self_attn" in err and "q_proj" in err and "k_proj" in err and "layout.strict=false" in err
    assert not (tmp_path / "o").exists()
    r = cli(args + ["layout.strict=false", f"hydra.run.dir={tmp_path}/r2"], nproc=2)
    assert r.returncode == 0, _tail(r)


@pytest.mark.slow
@pytest.mark.parametrize("family", SWEEP_PARAMS)
def test_every_family_by_its_plan_at_2_and_4_ranks_bitwise(cli, tmp_path, family):
    second = ("layout.parallel=ep_tp",) if family in hf_families.EXPERT_FAMILIES else ("layout.parallel=fsdp_tp",)
    _round_trip(cli, tmp_path, family, second)


def test_a_family_with_neither_plan_nor_preset_is_refused_by_name(cli, tmp_path):
    """BitNet: transformers has no parallel plan for it and we have no preset; its q_proj must not
    make auto guess Llama and exit 0 (as StableLM's once did, before its preset was named). One
    line naming the family and the ways out, exit 2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("bitnet", **{k: hf_families.BASE[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    r = cli(["+job=reshard", f"job.source.path={tmp_path}/hf", "layout=auto", f"job.output={tmp_path}/o",
             f"hydra.run.dir={tmp_path}/r"])
    assert r.returncode == 2, _tail(r)
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "the 'bitnet' family (config.json model_type) has no parallel plan" in err[0] and \
        "layout=<name>" in err[0] and "layout=fsdp" in err[0], r.stderr[-2000:]
    assert not (tmp_path / "o").exists()
