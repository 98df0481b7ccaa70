"""Model families the presets once missed, through the CLI under torchrun: Hugging Face ->
family layout -> another layout (other world size) -> Hugging Face, transformers reopens it and
the logits are bitwise equal; the per-rank shards are what the family's tensor-parallel forward
needs (fused q/k/v split by head, whole experts per rank).

Needs the optional extra: pip install -e ".[interop]" (skipped cleanly without it). Slow tier:
each family is three torchrun launches.
"""

from __future__ import annotations

import json

import pytest
import torch

from hpdcp_runner.dcp import read_metadata
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64)
FAMILIES = {
    "phi3": dict(SMALL, pad_token_id=0),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(SMALL, head_dim=8),
    "qwen3_moe": dict(SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "olmo2": dict(SMALL),
}


def _model(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    cfg = AutoConfig.for_model(family, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    return model


def _logits(model):
    ids = torch.arange(24).remainder(97).view(2, 12)
    with torch.no_grad():
        return model(ids).logits


def _reshard(cli, tmp_path, tag, nproc, *args):
    r = cli(["+job=reshard", *args, f"hydra.run.dir={tmp_path}/run_{tag}"], nproc=nproc)
    assert r.returncode == 0, _tail(r)
    return metrics(tmp_path / f"run_{tag}")["result"]


def _written_by(path, key):
    """{rank: [(offsets, sizes), ...]} of the chunks of ``key`` each rank's file holds."""
    md = read_metadata(path)
    out: dict[int, list] = {}
    for c in md.tensors[key].chunks:
        out.setdefault(md.files[c.file].rank, []).append((list(c.offsets), list(c.sizes)))
    return {r: sorted(v) for r, v in out.items()}


def _round_trip(cli, tmp_path, model, first, second, n_first=2, n_second=4):
    """HF -> ``first`` (n_first ranks) -> ``second`` (n_second ranks) -> HF; logits bitwise."""
    a = _reshard(cli, tmp_path, "a", n_first, f"job.source.path={tmp_path}/hf", *first, "layout.strict=true",
                 f"job.output={tmp_path}/a")
    b = _reshard(cli, tmp_path, "b", n_second, f"job.source.path={tmp_path}/a", *second, "layout.strict=true",
                 f"job.output={tmp_path}/b")
    # no job.hf_files_from: the config.json (and generation_config.json, where the model has one)
    # recorded since the first reshard travel to the output
    c = _reshard(cli, tmp_path, "c", 2, f"job.source.path={tmp_path}/b", "job.output_format=hf",
                 f"job.output={tmp_path}/out")
    gen = tmp_path / "hf" / "generation_config.json"
    assert c["copied"] == ["config.json"] + (["generation_config.json"] if gen.exists() else [])
    if gen.exists():
        assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == json.loads(gen.read_text())
    from transformers import AutoModelForCausalLM

    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(_logits(back.eval()), _logits(model))
    assert a["verified_tensors"] == b["verified_tensors"] == c["verified_tensors"] > 0
    return a, b


def test_phi3_qkv_and_gate_up_split_by_head_at_2_and_4_ranks(cli, tmp_path):
    model = _model(tmp_path, "phi3")
    a, b = _round_trip(cli, tmp_path, model, ["layout=auto"], ["layout=phi3_fsdp_tp"])
    assert a["target_layout"] == "auto:phi3_tp"
    assert "the phi3 family's own tensor-parallel plan" in a["layout_recognised"]
    # rank r of 2 holds heads 4r..4r+3 of q (8 heads of 8) and heads 2r..2r+1 of k and of v (4 kv heads)
    q, kv = 64, 32
    assert _written_by(tmp_path / "a", "model.layers.1.self_attn.qkv_proj.weight") == {
        r: [([r * 32, 0], [32, 64]), ([q + r * 16, 0], [16, 64]), ([q + kv + r * 16, 0], [16, 64])] for r in range(2)}
    assert _written_by(tmp_path / "a", "model.layers.0.mlp.gate_up_proj.weight") == {
        r: [([r * 24, 0], [24, 64]), ([48 + r * 24, 0], [24, 64])] for r in range(2)}
    # fsdp x tp at 4 ranks: tp rank t holds heads of q, k and v; fsdp halves the input dim
    got = _written_by(tmp_path / "b", "model.layers.0.self_attn.qkv_proj.weight")
    for rank, (dp, tp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert got[rank] == sorted([([tp * 32, dp * 32], [32, 32]), ([q + tp * 16, dp * 32], [16, 32]),
                                    ([q + kv + tp * 16, dp * 32], [16, 32])])
    # bench times the fused layout on it (its second target is placed like the first)
    r = cli(["+job=bench", f"job.source.path={tmp_path}/a", "layout=auto", "job.repeats=1", "job.warmup=0",
             f"hydra.run.dir={tmp_path}/run_bench"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert metrics(tmp_path / "run_bench")["layout"] == "auto:phi3_tp"
    # straight to phi3_tp at 4 ranks too: 2 q heads, 1 kv head each
    _reshard(cli, tmp_path, "tp4", 4, f"job.source.path={tmp_path}/hf", "layout=phi3_tp", f"job.output={tmp_path}/tp4")
    assert _written_by(tmp_path / "tp4", "model.layers.0.self_attn.qkv_proj.weight")[3] == sorted(
        [([48, 0], [16, 64]), ([q + 24, 0], [8, 64]), ([q + kv + 24, 0], [8, 64])])


def test_mixtral_experts_expert_parallel_then_expert_x_tensor_parallel(cli, tmp_path):
    model = _model(tmp_path, "mixtral")
    a, b = _round_trip(cli, tmp_path, model, ["layout=auto"], ["layout=auto", "layout.parallel=ep_tp"])
    assert a["target_layout"] == "auto:mixtral_ep" and b["target_layout"] == "auto:mixtral_ep_tp"
    assert "unmatched" not in a and "unmatched" not in b
    # ep=2: rank 0 wrote experts 0 and 1 whole, rank 1 experts 2 and 3, of every layer
    for e in range(4):
        w = _written_by(tmp_path / "a", f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight")
        assert w == {e // 2: [([0, 0], [64, 48])]}
    # ep=2 x tp=2 at 4 ranks: expert 3 lives on ranks 2 and 3, w1 split by rows, w2 by columns
    assert _written_by(tmp_path / "b", "model.layers.0.block_sparse_moe.experts.3.w1.weight") == {
        2: [([0, 0], [24, 64])], 3: [([24, 0], [24, 64])]}
    assert _written_by(tmp_path / "b", "model.layers.0.block_sparse_moe.experts.3.w2.weight") == {
        2: [([0, 0], [64, 24])], 3: [([0, 24], [64, 24])]}


@pytest.mark.parametrize("family, parallel", [("gemma2", "tp"), ("qwen3_moe", "ep"), ("olmo2", "tp")])
def test_other_families_round_trip_under_auto(cli, tmp_path, family, parallel):
    model = _model(tmp_path, family)
    second = ["layout=auto", "layout.parallel=ep_tp"] if parallel == "ep" else \
        ["layout=auto", "layout.parallel=fsdp_tp"]
    a, b = _round_trip(cli, tmp_path, model, ["layout=auto"], second)
    assert a["target_layout"] == f"auto:{family}_{parallel}" and f"the {family} family's own" in a["layout_recognised"]
    assert "unmatched" not in a and "unmatched" not in b


def test_mixtral_per_expert_keys_stacked_and_back_to_hugging_face(cli, tmp_path):
    """job.experts=stack reads Mixtral's one-key-per-expert checkpoint into stacked [experts, ...]
    tensors (expert x tensor parallel), unstack brings the family's own names back, and the
    Hugging Face export of that reopens with bitwise logits."""
    model = _model(tmp_path, "mixtral")
    a = _reshard(cli, tmp_path, "stack", 4, f"job.source.path={tmp_path}/hf", "layout=moe_ep_tp", "layout.strict=true",
                 "job.experts=stack", f"job.output={tmp_path}/stacked")
    md = read_metadata(tmp_path / "stacked")
    w1 = "model.layers.1.block_sparse_moe.experts.w1.weight"
    assert md.tensors[w1].shape == (4, 48, 64) and not any(".experts.0." in k for k in md.tensors)
    # rank (ep, tp): experts 2ep..2ep+1 whole, rows 24tp..24tp+23 of each
    assert _written_by(tmp_path / "stacked", w1) == {
        r: [([2 * (r // 2), 24 * (r % 2), 0], [2, 24, 64])] for r in range(4)}
    # verified expert by expert against the 41 tensors of the Hugging Face file
    assert a["verified_tensors"] == 41 and a["experts"].startswith("stack: 6 stacked group(s) of 4 experts")
    _reshard(cli, tmp_path, "unstack", 2, f"job.source.path={tmp_path}/stacked", "layout=moe_ep", "layout.strict=true",
             "job.experts=unstack", f"job.output={tmp_path}/per_expert")
    assert _written_by(tmp_path / "per_expert", "model.layers.0.block_sparse_moe.experts.3.w2.weight") == {
        1: [([0, 0], [64, 48])]}
    _reshard(cli, tmp_path, "hf_out", 2, f"job.source.path={tmp_path}/per_expert", "job.output_format=hf",
             f"job.hf_files_from={tmp_path}/hf", f"job.output={tmp_path}/out")
    from transformers import AutoModelForCausalLM

    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(_logits(back.eval()), _logits(model))


NO_PLAN = {  # transformers has no parallel plan for these; our presets place their fused q/k/v
    "bloom": ("bloom", dict(SMALL)),
    "falcon_gqa": ("falcon", dict(SMALL, num_kv_heads=4, new_decoder_architecture=True, bias=True)),
    "mpt": ("mpt", dict(vocab_size=128, d_model=64, n_heads=8, n_layers=2, max_seq_len=64)),
    "falcon_mq": ("falcon", dict(SMALL, bias=True)),  # multi_query: transformers' default
    "bigcode_mq": ("gpt_bigcode", dict(vocab_size=128, n_embd=64, n_head=8, n_layer=2, n_positions=64)),
    "persimmon": ("persimmon", dict(SMALL)),  # BLOOM's preset: q, k, v interleaved per head
    "opt": ("opt", dict(vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=8,
                        max_position_embeddings=64, word_embed_proj_dim=64)),
}


@pytest.mark.parametrize("family", list(NO_PLAN))
def test_families_without_a_plan_round_trip_under_auto(cli, tmp_path, family):
    """BLOOM, Persimmon, Falcon (40B-style and multi-query), MPT, StarCoder-style and OPT checkpoints: auto picks
    our preset from config.json, each of 2 ranks holds the q, k and v rows of its own 4 query heads
    (multi-query: the one key and value head on both, written once), fsdp x tp at 4 ranks reads
    them, and the Hugging Face export reopens with bitwise logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = NO_PLAN[family]
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)).eval()
    model.save_pretrained(tmp_path / "hf")
    a, b = _round_trip(cli, tmp_path, model, ["layout=auto"], ["layout=auto", "layout.parallel=fsdp_tp"])
    preset = "bloom" if family == "persimmon" else family
    assert a["target_layout"] == f"{preset}_tp" and b["target_layout"] == f"{preset}_fsdp_tp"
    assert "no parallel plan" in a["layout_recognised"]
    hd = 8
    if family == "mpt":  # [q | k | v], 8 heads each: rank r holds heads 4r..4r+3 of each
        key = "transformer.blocks.1.attn.Wqkv.weight"
        want = {r: [([p * 64 + r * 32, 0], [32, 64]) for p in range(3)] for r in range(2)}
    elif family in ("bloom", "persimmon"):  # [heads, 3, head_dim]: heads 4r..4r+3 are rows 96r..96r+95
        key = {"bloom": "transformer.h.1.self_attention.query_key_value.weight",
               "persimmon": "model.layers.1.self_attn.query_key_value.weight"}[family]
        want = {r: [([r * 96, 0], [96, 64])] for r in range(2)}
    elif family == "opt":  # separate q/k/v: heads 4r..4r+3 of each, out_proj's columns of the same heads
        assert _written_by(tmp_path / "a", "model.decoder.layers.1.self_attn.out_proj.weight") == {
            r: [([0, r * 32], [64, 32])] for r in range(2)}
        key = "model.decoder.layers.1.self_attn.k_proj.weight"
        want = {r: [([r * 32, 0], [32, 64])] for r in range(2)}
    elif family == "falcon_gqa":  # 4 groups of (2 queries, k, v): groups 2r, 2r+1
        key = "transformer.h.1.self_attention.query_key_value.weight"
        want = {r: [([r * 8 * hd, 0], [8 * hd, 64])] for r in range(2)}
    else:  # [8 query heads | k | v]: rank r its 4 query heads; k and v held by both, written once
        key = {"falcon_mq": "transformer.h.1.self_attention.query_key_value.weight",
               "bigcode_mq": "transformer.h.1.attn.c_attn.weight"}[family]
        got = _written_by(tmp_path / "a", key)
        assert all(([r * 32, 0], [32, 64]) in got[r] for r in range(2))
        assert sorted(c for r in got for c in got[r] if c[0][0] >= 64) == [([64, 0], [8, 64]), ([72, 0], [8, 64])]
        return
    assert _written_by(tmp_path / "a", key) == want
