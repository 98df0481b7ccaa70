"""``layout=auto`` from the family's own parallel plans (transformers' ``base_model_tp_plan`` /
``base_model_ep_plan``), checked on files ``save_pretrained`` wrote for 40 families (14 with
experts), at 2 and 4 ranks and under every parallel mode: every weight the plan splits is split
(or, key/value heads fewer than the ranks, replicated and reported), every rank's boxes tile the
tensor, no box cuts a head, experts are whole per rank. The CLI round trip (bitwise HF export)
is in tests/e2e/test_hf_plan_cli.py."""

from __future__ import annotations

import itertools
import math

import pytest

from hpdcp_runner.config import load_preset, make_layout
from hpdcp_runner.dcp import ConfigError
from hpdcp_runner.layouts import Placer, resolve_auto
from tests import hf_families

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the families' parallel plans as tested here are transformers 5.x's", allow_module_level=True)

from hpdcp_runner.hf_plan import plan_rules  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every family's tiny model, written once by save_pretrained."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for fam in hf_families.FAMILIES:
        hf_families.build(fam, root / fam)
        out[fam] = hf_families.shapes(root / fam)
    return out


def _boxes(placer, key, shape, ranks):
    return [[(b.offsets, b.sizes) for b in placer.boxes(key, shape, r)] for r in range(ranks)]


def _check_tiles(key, shape, per_rank):
    """The distinct boxes over all ranks cover the tensor exactly once (no gap, no overlap)."""
    distinct = {b for boxes in per_rank for b in boxes}
    assert sum(math.prod(s) for _, s in distinct) == math.prod(shape), (key, shape, sorted(distinct))
    for (o1, s1), (o2, s2) in itertools.combinations(distinct, 2):
        assert any(a + n <= b or b + m <= a for a, n, b, m in zip(o1, s1, o2, s2)), (key, o1, s1, o2, s2)


def _plan(raw, shapes, parallel, ranks):
    fields, note, report = plan_rules(raw, shapes, parallel, [], ranks)
    return make_layout(fields), note, report


CASES = [(f, None, r) for f in hf_families.FAMILIES for r in (2, 4)] + \
    [(f, "fsdp_tp", 4) for f in hf_families.DENSE_FAMILIES] + [(f, "ep_tp", 4) for f in hf_families.EXPERT_FAMILIES]


@pytest.mark.parametrize("family,parallel,ranks", CASES, ids=[f"{f}-{p or 'auto'}-{r}" for f, p, r in CASES])
def test_plan_splits_what_the_family_splits_whole_heads_whole_experts(written, family, parallel, ranks):
    raw, shapes = written[family]
    layout, note, report = _plan(raw, shapes, parallel, ranks)
    assert f"the {raw['model_type']} family's own" in note
    assert report["unmapped"] == [] and report["whole_by_plan"] == [], report
    expected = "ep" if family in hf_families.EXPERT_FAMILIES else "tp"
    assert report["parallel"] == (parallel or expected)
    placer = Placer(layout, 0, ranks, model_config=raw, keys=shapes)
    kv = raw.get("num_key_value_heads") or raw.get("num_attention_heads")
    for key, shape in shapes.items():
        per_rank = _boxes(placer, key, shape, ranks)
        _check_tiles(key, shape, per_rank)
        distinct = {b for boxes in per_rank for b in boxes}
        rule = placer.rule_for(key)
        if key in report["split"] and placer.describe_rule(key).get("expert") is not None:
            holders = [r for r, boxes in enumerate(per_rank) if boxes]  # one key per expert: its owners only
            assert 0 < len(holders) < ranks
            whole = all(per_rank[r] == [((0,) * len(shape), shape)] for r in holders)
            assert whole == (report["parallel"] == "ep"), (key, per_rank)  # ep_tp: split inside the expert too
        elif key in report["split"]:
            assert len(distinct) > 1, key
        unit = placer.describe_rule(key).get("unit")
        if unit:  # whole heads: every box starts and ends on a head boundary along the unit dim
            d = layout.rules[rule].parts_dim
            starts = [0]
            for p in placer.describe_rule(key).get("parts", []):
                starts.append(starts[-1] + p)
            for off, size in distinct:
                base = max(s for s in starts if s <= off[d])
                assert (off[d] - base) % unit == 0 and size[d] % unit == 0, (key, off, size, unit)
        # what the family's plan splits is split: attention projections and MLPs of dense
        # families under tensor parallelism, every expert weight under expert parallelism
        leafmod = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else key
        if len(shape) >= 2 and key.endswith("weight") and report["parallel"] in ("ep", "ep_tp") and \
                (".experts." in key or "input_linear" in leafmod or "output_linear" in leafmod):
            assert key in report["split"], (key, layout.rules[rule])
            assert "E" in [str(p) for p in layout.rules[rule].placements]
        if report["parallel"] in ("tp", "fsdp_tp") and leafmod in ("q_proj", "o_proj", "gate_proj", "up_proj",
                                                                   "down_proj") and key.endswith("weight"):
            assert key in report["split"], (key, layout.rules[rule])
        if leafmod in ("k_proj", "v_proj") and key.endswith("weight") and report["parallel"] != "ep":
            tp = layout.mesh[-1] if report["parallel"] in ("fsdp_tp", "ep_tp") else ranks
            assert (key in report["replicated_kv"]) == (kv % tp != 0), (key, kv, tp)


def test_key_value_heads_fewer_than_ranks_are_replicated_and_said(written):
    raw, shapes = written["starcoder2"]  # 2 key/value heads
    _, note, report = _plan(raw, shapes, None, 4)
    assert "key/value projection(s) replicated (2 key/value heads for 4 tensor-parallel ranks)" in note
    assert {k.rsplit(".", 2)[-2] for k in report["replicated_kv"]} == {"k_proj", "v_proj"}
    _, _, report = _plan(raw, shapes, None, 2)
    assert report["replicated_kv"] == []


def test_fused_qkv_with_fewer_key_value_heads_than_ranks_holds_them_whole(written):
    """Phi-3's fused qkv_proj (8 query heads, 4 key/value heads of 8) on 8 ranks: each rank its
    query head, and key/value head r // 2 of k and of v whole (the pair of ranks that shares it
    holds the same rows), as a tensor-parallel runtime replicates key/value heads."""
    raw, shapes = written["phi3"]
    layout, note, report = _plan(raw, shapes, None, 8)
    key = "model.layers.1.self_attn.qkv_proj.weight"
    assert key in report["replicated_kv"] and "key/value projection(s) replicated" in note
    placer = Placer(layout, 0, 8, model_config=raw, keys=shapes)
    assert placer.describe_rule(key)["replicate_few"] is True
    q, kv, hd = 64, 32, 8
    for r in range(8):
        got = [(b.offsets[0], b.sizes[0]) for b in placer.boxes(key, shapes[key], r)]
        assert got == [(r * hd, hd), (q + r // 2 * hd, hd), (q + kv + r // 2 * hd, hd)], (r, got)


def test_a_split_that_would_cut_a_query_head_is_refused_by_name(written):
    raw, shapes = written["qwen2"]  # 12 heads, 4 key/value heads
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.self_attn\.(q|o)_proj\.(weight|bias)' holds 12 query head\(s\), "
                                          r"which do not divide by 8 tensor-parallel ranks"):
        _plan(raw, shapes, None, 8)
    raw = {**raw, "num_key_value_heads": 6}  # more key/value heads than ranks, not divisible: refused too
    with pytest.raises(ConfigError, match=r"holds 6 key/value head\(s\), which do not divide by 4"):
        _plan(raw, {k: s if "k_proj" not in k and "v_proj" not in k else (96,) + s[1:] for k, s in shapes.items()},
              None, 4)


def test_expert_parallel_needs_experts(written):
    raw, shapes = written["llama"]
    with pytest.raises(ConfigError, match=r"layout.parallel=ep: the llama family's plan places no experts"):
        _plan(raw, shapes, "ep", 2)


def test_auto_prefers_the_plan_and_refuses_a_family_with_neither_plan_nor_preset(written):
    raw, shapes = written["starcoder2"]
    lay, note, report = resolve_auto(load_preset("auto"), raw, {k: _Meta(s) for k, s in shapes.items()}, load_preset,
                                     make_layout, 4)
    assert lay.name == "auto:starcoder2_tp" and report["split"]
    # bitnet: transformers has no plan for it and we have no preset (its sub-norms sit inside the
    # attention); its q_proj must not make auto guess llama, as StableLM's once did before it was named
    with pytest.raises(ConfigError, match=r"the 'bitnet' family \(config.json model_type\) has no parallel plan we "
                                          r"can use \(transformers .* has no parallel plan for 'bitnet'\) and no preset"):
        resolve_auto(load_preset("auto"), {"model_type": "bitnet", "hidden_size": 64},
                     {"model.layers.0.self_attn.q_proj.weight": _Meta((64, 64))}, load_preset, make_layout, 2)
    # stablelm: no plan either, but Llama's names and layout: its preset, named
    lay, note, _ = resolve_auto(load_preset("auto"), {"model_type": "stablelm", "hidden_size": 64},
                                {"model.layers.0.self_attn.q_proj.weight": _Meta((64, 64))}, load_preset, make_layout, 2)
    assert lay.name == "llama_tp" and "model_type 'stablelm'" in note
    # layout.family names a preset: the user's word beats the plan
    auto = load_preset("auto")
    auto.family = "llama"
    lay, note, report = resolve_auto(auto, raw, {}, load_preset, make_layout, 2)
    assert lay.name == "llama_tp" and report is None


class _Meta:
    def __init__(self, shape):
        self.shape = shape


def test_gpt_neox_query_key_value_splits_on_whole_heads_of_q_k_and_v(written):
    raw, shapes = written["gpt_neox"]  # q, k and v rows of each head together: a unit of 3 * head_dim
    layout, _, _ = _plan(raw, shapes, None, 4)
    placer = Placer(layout, 0, 4, model_config=raw, keys=shapes)
    assert placer.describe_rule("gpt_neox.layers.0.attention.query_key_value.weight")["unit"] == 3 * 8


def test_a_training_state_under_a_prefix_with_optimizer_state_follows_the_plan(written):
    raw, shapes = written["mixtral"]
    state = {f"model.{k}": s for k, s in shapes.items()}
    state |= {f"optim.state.{k}.exp_avg": s for k, s in shapes.items()}
    layout, _, report = _plan(raw, state, "ep_tp", 4)
    placer = Placer(layout, 0, 4, model_config=raw, keys=state)
    key = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    for k in (f"model.{key}", f"optim.state.{key}.exp_avg"):
        assert placer.placements_for(k, 2) == ["E", "S1"] and k in report["split"]
        assert [bool(placer.boxes(k, (64, 32), r)) for r in range(4)] == [False, False, True, True]  # 8 experts / 2
    assert layout.rules[placer.rule_for(f"model.{key}")].experts == 8


def test_a_hostile_config_cannot_make_the_meta_model_hang(written):
    raw, shapes = written["llama"]
    with pytest.raises(ConfigError, match=r"num_hidden_layers \[1000000000\] is not a layer count from 1 to 1024"):
        _plan({**raw, "num_hidden_layers": 10 ** 9}, shapes, None, 2)


def test_experts_split_inside_as_their_module_declares_them(written):
    """ep_tp with no tensor-parallel entry for the experts: gate|up by output and down by input,
    oriented as transformers' experts module declares (GPT-OSS: [experts, in, out], gate and up
    interleaved, so whole gate/up pairs per rank; GraniteMoE: [experts, out, in], concatenated)."""
    raw, shapes = written["gpt_oss"]
    layout, note, report = _plan(raw, shapes, "ep_tp", 4)
    placer = Placer(layout, 0, 4, model_config=raw, keys=shapes)
    up = "model.layers.0.mlp.experts.gate_up_proj"
    assert placer.placements_for(up, 3) == ["E", "S2"] and placer.describe_rule(up)["unit"] == 2
    assert placer.placements_for("model.layers.0.mlp.experts.down_proj", 3) == ["E", "S1"]
    assert placer.placements_for("model.layers.0.mlp.experts.down_proj_bias", 2) == ["E", "R"]
    assert report["experts_whole_in_tp"] == [] and "experts whole inside" not in note
    raw, shapes = written["granitemoe"]
    layout, _, _ = _plan(raw, shapes, "ep_tp", 4)
    placer = Placer(layout, 0, 4, model_config=raw, keys=shapes)
    key = "model.layers.1.block_sparse_moe.input_linear.weight"
    assert placer.placements_for(key, 3) == ["E", "S1"] and placer.describe_rule(key)["parts"] == [64, 64]


def test_fused_gate_up_and_qkv_split_per_part(written):
    """Phi-3's plan gathers its fused outputs (colwise_gather_output), so a plain split would give
    rank 0 all of gate; auto splits each part on its own (its heads of q, k, v; its rows of gate, up)."""
    raw, shapes = written["phi3"]
    layout, _, _ = _plan(raw, shapes, None, 2)
    placer = Placer(layout, 0, 2, model_config=raw, keys=shapes)
    up = [[(b.offsets, b.sizes) for b in placer.boxes("model.layers.0.mlp.gate_up_proj.weight", (128, 64), r)]
          for r in range(2)]
    assert up == [[((0, 0), (32, 64)), ((64, 0), (32, 64))], [((32, 0), (32, 64)), ((96, 0), (32, 64))]]
    qkv = placer.describe_rule("model.layers.0.self_attn.qkv_proj.weight")
    assert qkv["parts"] == [64, 32, 32] and qkv["unit"] == 8


def test_a_config_json_with_infinity_is_read_as_transformers_reads_it(tmp_path):
    """Falcon-H1's config.json holds Infinity, which transformers writes as {"__float__": ...}."""
    hf = tmp_path / "falcon_h1"
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon_h1", **hf_families.BASE)).save_pretrained(hf)
    raw, shapes = hf_families.shapes(hf)
    assert "__float__" in (hf / "config.json").read_text()
    _, note, report = _plan(raw, shapes, None, 2)
    assert "the falcon_h1 family's own tensor-parallel plan" in note and report["unmapped"] == []
