"""Fused tensors split by part, experts placed expert-parallel, config-sized rules, layout=auto:
the boxes each rank holds, the local tensor it gets, and one-line errors for what does not fit."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from hpdcp_runner.config import LayoutConf, load_preset
from hpdcp_runner.dcp import ConfigError, FusedShard, LocalShard, load, read_metadata, save
from hpdcp_runner.dcp.tools import Box
from hpdcp_runner.layouts import Placer, config_values, evaluate, problems, recognise_family, resolve_auto
from hpdcp_runner.targets import state_from_metadata

PHI3 = {"model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 24}


def _layout(rules, mesh=(-1,), kind="dtensor", name="t"):
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LayoutConf),
                                               {"name": name, "kind": kind, "mesh": list(mesh), "rules": rules}))


def _rows(boxes):
    return [(b.offsets[0], b.sizes[0]) for b in boxes]


@pytest.mark.parametrize("ws", [2, 4])
def test_phi3_qkv_every_rank_holds_its_heads_of_q_k_and_v(ws):
    lay = load_preset("phi3_tp")
    hd, h, kv = 8, 4, 2  # q rows 0..31, k 32..47, v 48..63
    if kv % ws:
        with pytest.raises(ConfigError, match=r"rules\[0\].*part 1 of 'm.qkv_proj.weight' is 16 wide, 2 units of 8"):
            Placer(lay, 0, ws, model_config=PHI3).boxes("m.qkv_proj.weight", (64, 32), 0)
        return
    full = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    for r in range(ws):
        p = Placer(lay, r, ws, model_config=PHI3)
        qn, kn = h * hd // ws, kv * hd // ws
        assert _rows(p.boxes("m.qkv_proj.weight", (64, 32), r)) == [(r * qn, qn), (32 + r * kn, kn), (48 + r * kn, kn)]
        shard = p.place("m.qkv_proj.weight", full)
        assert isinstance(shard, FusedShard)  # one local tensor: q_r, then k_r, then v_r
        expect = torch.cat([full[r * qn:(r + 1) * qn], full[32 + r * kn:32 + (r + 1) * kn],
                            full[48 + r * kn:48 + (r + 1) * kn]])
        assert torch.equal(shard.local, expect)
        gate_up = _rows(p.boxes("m.gate_up_proj.weight", (48, 32), r))  # gate rows 0..23, up 24..47
        assert gate_up == [(r * 24 // ws, 24 // ws), (24 + r * 24 // ws, 24 // ws)]


def test_fused_shards_save_and_reload_as_the_fused_tensor_bitwise(tmp_path):
    lay = load_preset("phi3_tp")
    full = torch.randn(64, 32)
    shard = Placer(lay, 0, 1, model_config=PHI3).place("m.qkv_proj.weight", full)
    # one process holds every part: the checkpoint stores the plain fused tensor
    save({"m": {"qkv_proj": {"weight": shard}}}, checkpoint_id=tmp_path / "c")
    assert read_metadata(tmp_path / "c").tensors["m.qkv_proj.weight"].shape == (64, 32)
    plain = {"m": {"qkv_proj": {"weight": torch.zeros(64, 32)}}}
    load(plain, checkpoint_id=tmp_path / "c")
    assert torch.equal(plain["m"]["qkv_proj"]["weight"], full)
    # and back into a fused target whose parts are cut differently (2 parts, not 3)
    other = FusedShard(torch.zeros(64, 32), (64, 32), [b for b in Placer(_layout(
        [{"pattern": ".*", "placements": ["S0"], "parts": [40, 24]}]), 0, 1).boxes("x", (64, 32), 0)], 0)
    load({"m": {"qkv_proj": {"weight": other}}}, checkpoint_id=tmp_path / "c")
    assert torch.equal(other.local, full)


def test_fused_shard_refuses_boxes_that_do_not_fit():
    from hpdcp_runner.dcp.tools import Box

    with pytest.raises(Exception, match="hold 5 along dim 0, the local tensor 6"):
        FusedShard(torch.zeros(6, 2), (8, 2), [Box((0, 0), (2, 2)), Box((4, 0), (3, 2))], 0)
    with pytest.raises(Exception, match="does not fit global shape"):
        FusedShard(torch.zeros(6, 2), (8, 2), [Box((0, 0), (3, 2)), Box((6, 0), (3, 2))], 0)


def test_per_expert_keys_are_held_only_by_their_expert_group():
    lay = load_preset("moe_ep_tp")  # mesh [ep, tp=2]
    keys = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")]
    held = {r: [k for k in keys if Placer(lay, r, 4, keys=keys).holds(k)] for r in range(4)}
    # ep coordinate 0 (ranks 0, 1) owns experts 0 and 1; 1 (ranks 2, 3) owns 2 and 3
    assert {int(k.split(".")[5]) for k in held[0]} == {0, 1} == {int(k.split(".")[5]) for k in held[1]}
    assert {int(k.split(".")[5]) for k in held[3]} == {2, 3}
    p = Placer(lay, 3, 4, keys=keys)
    w1 = p.place(keys[6], torch.arange(24.).view(6, 4))  # expert 2's w1 on rank 3: tp half 1 of its rows
    assert isinstance(w1, LocalShard) and w1.box.offsets == (3, 0)
    assert torch.equal(w1.local, torch.arange(12., 24.).view(3, 4))
    assert p.place(keys[0], torch.zeros(6, 4)) is None  # expert 0 lives elsewhere
    with pytest.raises(ConfigError, match=r"4 experts do not divide by the expert-parallel size 3"):
        Placer(load_preset("moe_ep"), 0, 3, keys=keys).holds(keys[0])


def test_stacked_experts_split_whole_experts_and_refuse_uneven_counts():
    lay = load_preset("moe_ep")
    assert _rows(Placer(lay, 1, 2).boxes("layers.0.moe.experts.w1", (8, 6, 4), 1)) == [(4, 4)]
    with pytest.raises(ConfigError, match=r"stacks 6 experts, which do not divide by the expert-parallel size 4"):
        Placer(lay, 0, 4).boxes("layers.0.moe.experts.w1", (6, 6, 4), 0)


def test_transformers_stacked_gate_up_is_split_by_expert_and_by_part():
    lay = load_preset("moe_ep_tp")
    cfg = {"model_type": "qwen3_moe", "moe_intermediate_size": 6, "intermediate_size": 50}
    p = Placer(lay, 3, 4, model_config=cfg)  # ep 1 (experts 2, 3), tp 1: rows 3..5 of gate and of up
    assert [(b.offsets, b.sizes) for b in p.boxes("model.layers.0.mlp.experts.gate_up_proj", (4, 12, 8), 3)] == [
        ((2, 3, 0), (2, 3, 8)), ((2, 9, 0), (2, 3, 8))]


@pytest.mark.parametrize("rule, shape, message", [
    ({"parts": [30, 30]}, (64, 4), r"parts \[30, 30\] add up to 60, but 'x' has 64 along dim 0"),
    ({"parts": ["num_attention_heads*head_dim", "nope"]}, (64, 4), r"needs 'nope', but the model's config.json has no"),
    ({"parts": ["__import__('os')"]}, (64, 4), r"may only use config names, integers"),
    ({"parts": [32, 32], "unit": 24}, (64, 4), r"part 0 of 'x' is 32 wide, 1.33333 units of 24"),
    ({"parts": [32, 32], "parts_dim": 2}, (64, 4), r"parts_dim 2 does not exist in 'x'"),
])
def test_bad_rules_are_one_line_naming_rule_tensor_and_number(rule, shape, message):
    lay = _layout([{"pattern": "x", "placements": ["S0"], **rule}])
    with pytest.raises(ConfigError, match=r"layout 't' rules\[0\] \(pattern 'x'\).*" + message):
        Placer(lay, 0, 2, model_config=PHI3).boxes("x", shape, 0)


def test_rule_sizes_without_a_config_ask_for_one():
    with pytest.raises(ConfigError, match=r"no config.json was found \(set layout.config="):
        Placer(load_preset("phi3_tp"), 0, 2).boxes("a.qkv_proj.weight", (64, 32), 0)


def test_config_values_fill_in_what_families_leave_implicit():
    v = config_values({"model_type": "gpt2", "n_embd": 48, "n_head": 4, "n_layer": 2, "n_inner": None})
    assert (v["hidden_size"], v["head_dim"], v["num_key_value_heads"], v["intermediate_size"]) == (48, 12, 4, 192)
    assert config_values({"hidden_size": 32, "num_attention_heads": 4, "head_dim": 16})["head_dim"] == 16
    assert evaluate("num_key_value_heads*head_dim + 2", config_values(PHI3), "w") == 18


def test_strict_refuses_a_tensor_two_rules_place_differently(tmp_path):
    save({"a": {"q_proj": {"weight": torch.zeros(4, 2)}}}, checkpoint_id=tmp_path / "c")
    lay = _layout([{"pattern": r".*q_proj.*", "placements": ["S0"]}, {"pattern": r"a\..*", "placements": ["S1"]}])
    lay.strict = True
    with pytest.raises(ConfigError, match=r"'a.q_proj.weight' is matched by rules\[0\].*and by rules\[1\]"):
        state_from_metadata(read_metadata(tmp_path / "c"), Placer(lay, 0, 1), strict=True)


def test_layout_problems_for_the_new_fields():
    lay = _layout([{"pattern": "x", "placements": ["E", "E"]}], mesh=(2, -1))
    assert "rules[0].placements: ['E', 'E']: experts (E) go over one mesh dim" in problems(lay, 4)
    lay = _layout([{"pattern": "x", "placements": ["R"], "parts": [1, 2]}], kind="plain")
    assert "rules[0]: parts and E need kind: dtensor" in problems(lay, 2)


def test_auto_recognises_the_family_and_picks_its_preset():
    auto = load_preset("auto")
    lay, note, _ = resolve_auto(auto, PHI3, [], load_preset)
    assert lay.name == "phi3_tp" and "config.json model_type 'phi3'" in note
    lay, note, _ = resolve_auto(auto, None, ["model.layers.0.block_sparse_moe.experts.0.w1.weight"], load_preset)
    assert lay.name == "moe_ep" and "key 'model.layers.0" in note
    assert recognise_family({"model_type": "olmo2"}, [])[0] == "llama"
    assert recognise_family(None, ["tok_embeddings.weight"])[0] == "titan"
    auto.parallel = "fsdp_tp"
    auto.mesh = [-1, 4]
    lay, _, _ = resolve_auto(auto, {"model_type": "gemma2"}, [], load_preset)
    assert lay.name == "llama_fsdp_tp" and lay.mesh == [-1, 4]
    with pytest.raises(ConfigError, match=r"'fsdp_tp' is not offered for the moe family .* choose ep or ep_tp"):
        resolve_auto(auto, {"model_type": "mixtral"}, [], load_preset)
    with pytest.raises(ConfigError, match=r"cannot tell the model family .*layout.family="):
        resolve_auto(load_preset("auto"), None, ["backbone.x"], load_preset)
    # a model_type we have no preset for is refused by name, never guessed from key names
    with pytest.raises(ConfigError, match=r"the 'mamba' family \(config.json model_type\) has no parallel plan"):
        resolve_auto(load_preset("auto"), {"model_type": "mamba"}, ["model.layers.0.q_proj.weight"], load_preset)


def test_layout_picture_folds_leading_dims_into_bands_and_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from hpdcp_runner.layout_picture import _rects, draw

    # experts 0..1 of [4, 48, 32], rows 0..23 of each: one rectangle per expert
    assert _rects([0, 0, 0], [2, 24, 32], [4, 48, 32]) == [(0, 0, 32, 24), (0, 48, 32, 24)]
    assert _rects([3, 4], [2, 5], [8, 9]) == [(4, 3, 5, 2)] and _rects([2], [3], [9]) == [(2, 0, 3, 1)]
    report = {"name": "t", "ranks": 2, "mesh": [2], "tensors": {
        "w": {"rule": 0, "placements": ["S0"], "shape": [4, 2], "shards": [[[0, 0], [2, 2]], [[2, 0], [2, 2]]]},
        "n": {"rule": None, "placements": ["R"], "shape": [2], "shards": [[[0], [2]], [[0], [2]]]}}}
    out = draw(report, str(tmp_path / "p" / "l.png"), "ck")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_generic_tp_splits_an_output_head_by_rows_whatever_its_name():
    """Issue 41 item 4: GPT-NeoX's embed_out.weight matched tp's (out|down) rule and was split by
    columns; embeddings and heads come first and split by vocabulary rows."""
    for name, mesh_pl in (("tp", ["S0"]), ("dp_tp", ["R", "S0"])):
        p = Placer(load_preset(name), 0, 2 if name == "tp" else 4)
        for key in ("embed_out.weight", "gpt_neox.embed_in.weight", "lm_head.weight", "embed.weight", "head.weight"):
            assert p.placements_for(key, 2) == mesh_pl, (name, key)
        assert p.placements_for("layers.0.attn.out.weight", 2)[-1] == "S1"


def test_partly_split_blocks_are_found_and_whole_ones_are_not():
    lay = _layout([{"pattern": r".*\.o_proj\.weight", "placements": ["S1"]},
                   {"pattern": r".*\.(q_proj|k_proj|v_proj)\.weight", "placements": ["S0"]},
                   {"pattern": ".*", "placements": ["R"]}])
    p = Placer(lay, 0, 2)
    shapes = {"l.0.attn.o_proj.weight": (4, 4), "l.0.attn.q_a_proj.weight": (4, 4), "l.0.attn.norm.weight": (4,),
              "l.1.attn.o_proj.weight": (4, 4), "l.1.attn.q_proj.weight": (4, 4), "l.1.attn.k_proj.weight": (4, 4),
              "l.1.mlp.gate.weight": (2, 4), "embed.weight": (8, 4)}
    assert p.partly_split(shapes) == {"l.0.attn": (["l.0.attn.o_proj.weight"], ["l.0.attn.q_a_proj.weight"])}


def _held_rows(lay, key, shape, ws, cfg):
    """{rank: sorted row ids} a rank holds of ``key`` (rows of dim 0)."""
    out = {}
    for r in range(ws):
        rows = []
        for b in Placer(lay, r, ws, model_config=cfg).boxes(key, shape, r):
            rows += range(b.offsets[0], b.offsets[0] + b.sizes[0])
        out[r] = sorted(rows)
    return out


def _held_cols(lay, key, shape, ws, cfg):
    return {r: sorted(c for b in Placer(lay, r, ws, model_config=cfg).boxes(key, shape, r)
                      for c in range(b.offsets[1], b.offsets[1] + b.sizes[1])) for r in range(ws)}


# Each family's fused q/k/v rows as its own forward reads them (transformers 5.25: BLOOM
# ``fused_qkv.view(..., heads, 3, head_dim)``; Falcon's new decoder architecture
# ``view(..., kv_heads, -1, head_dim)``, its classic attention ``unflatten(-2, (heads, 3))``;
# GPTBigCode without multi-query ``view(..., heads, 3 * head_dim)``; MPT ``chunk(3)``):
# {query head: its q, k and v rows}. A rank must hold exactly the rows of its own heads, and the
# attention output projection's input columns of the same query heads.
def _per_head_interleaved(heads, hd):
    rows = torch.arange(heads * 3 * hd).view(heads, 3, hd)
    return {h: rows[h].flatten().tolist() for h in range(heads)}


def _per_group(heads, kv, hd):
    g = heads // kv
    rows = torch.arange((heads + 2 * kv) * hd).view(kv, g + 2, hd)
    return {h: rows[h // g, h % g].tolist() + rows[h // g, g].tolist() + rows[h // g, g + 1].tolist()
            for h in range(heads)}


def _chunked(heads, hd):
    q, k, v = torch.arange(3 * heads * hd).view(3, heads, hd)
    return {h: q[h].tolist() + k[h].tolist() + v[h].tolist() for h in range(heads)}


FUSED = {  # family config, the fused key, its rows per query head, the output projection's key
    "bloom": ({"model_type": "bloom", "hidden_size": 64, "n_head": 8}, "transformer.h.3.self_attention.query_key_value",
              _per_head_interleaved(8, 8), "transformer.h.3.self_attention.dense.weight"),
    "falcon": ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8, "multi_query": False},
               "transformer.h.0.self_attention.query_key_value", _per_head_interleaved(8, 8),
               "transformer.h.0.self_attention.dense.weight"),
    "falcon_gqa": ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 4,
                    "new_decoder_architecture": True}, "transformer.h.0.self_attention.query_key_value",
                   _per_group(8, 4, 8), "transformer.h.0.self_attention.dense.weight"),
    "bigcode": ({"model_type": "gpt_bigcode", "n_embd": 64, "n_head": 8, "multi_query": False},
                "transformer.h.1.attn.c_attn", _per_head_interleaved(8, 8), "transformer.h.1.attn.c_proj.weight"),
    "mpt": ({"model_type": "mpt", "d_model": 64, "n_heads": 8}, "transformer.blocks.0.attn.Wqkv", _chunked(8, 8),
            "transformer.blocks.0.attn.out_proj.weight"),
    "persimmon": ({"model_type": "persimmon", "hidden_size": 64, "num_attention_heads": 8},
                  "model.layers.0.self_attn.query_key_value", _per_head_interleaved(8, 8),
                  "model.layers.0.self_attn.dense.weight"),
}


@pytest.mark.parametrize("family", list(FUSED))
@pytest.mark.parametrize("parallel, ws", [("tp", 2), ("tp", 4), ("fsdp_tp", 4)])
def test_fused_qkv_families_hold_whole_heads_of_q_k_and_v(family, parallel, ws):
    """layout=auto on families transformers gives no plan for, whose q, k and v are one weight:
    every tensor-parallel rank holds exactly the q, k and v rows of its own query heads (and their
    key/value group), and the output projection's input columns of the same heads."""
    cfg, fused, per_head, out_proj = FUSED[family]
    auto = load_preset("auto")
    auto.parallel = parallel
    lay, note, _ = resolve_auto(auto, cfg, [], load_preset)
    preset = {"falcon": "bloom", "persimmon": "bloom"}.get(family, family)
    assert lay.name == f"{preset}_{parallel}" and f"config.json model_type {cfg['model_type']!r}" in note
    tp = ws if parallel == "tp" else 2
    heads = len(per_head)
    nrows = len({i for v in per_head.values() for i in v})  # (a group's k and v serve several heads)
    for suffix, shape in ((".weight", (nrows, 64)), (".bias", (nrows,))):
        held = _held_rows(lay, fused + suffix, shape, ws, cfg)
        for r in range(ws):
            t = r % tp  # the tensor-parallel coordinate (fsdp_tp: mesh [dp, tp])
            mine = range(t * heads // tp, (t + 1) * heads // tp)
            want = sorted({i for h in mine for i in per_head[h]})
            assert held[r] == want, (family, suffix, r)
        cols = _held_cols(lay, out_proj, (64, 64), ws, cfg)
        for r in range(ws):
            t = r % tp
            assert cols[r] == list(range(t * 64 // tp, (t + 1) * 64 // tp))


@pytest.mark.parametrize("family", ["falcon_mq", "bigcode_mq"])
@pytest.mark.parametrize("parallel, ws", [("tp", 2), ("tp", 4), ("fsdp_tp", 4)])
def test_multi_query_families_hold_their_query_heads_and_the_key_and_value_whole(family, parallel, ws):
    """Falcon-7B and StarCoder fuse all query heads, then one key and one value head (transformers
    5.25: ``split([heads, 1, 1])`` / ``split((embed_dim, kv_dim, kv_dim))``). Every tensor-parallel
    rank holds its query heads and the key and value heads whole, what a tensor-parallel runtime
    replicates; an omitted ``multi_query`` is transformers' default, true."""
    cfg, key, out_proj = {
        "falcon_mq": ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8},
                      "transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense.weight"),
        "bigcode_mq": ({"model_type": "gpt_bigcode", "n_embd": 64, "n_head": 8}, "transformer.h.2.attn.c_attn",
                       "transformer.h.2.attn.c_proj.weight")}[family]
    auto = load_preset("auto")
    auto.parallel = parallel
    lay, _, _ = resolve_auto(auto, cfg, [], load_preset)
    assert lay.name == f"{family}_{parallel}"
    tp = ws if parallel == "tp" else 2
    for suffix, shape in ((".weight", (80, 64)), (".bias", (80,))):
        held = _held_rows(lay, key + suffix, shape, ws, cfg)
        cols = _held_cols(lay, out_proj, (64, 64), ws, cfg)
        for r in range(ws):
            t = r % tp
            q = list(range(t * 64 // tp, (t + 1) * 64 // tp))
            assert held[r] == q + list(range(64, 80)), (suffix, r)  # its queries, then k and v whole
            assert cols[r] == q
        full = torch.arange(80.).view(80, *[1] * (len(shape) - 1)).expand(shape).contiguous()  # row ids
        local = Placer(lay, 1, ws, model_config=cfg).place(key + suffix, full)
        assert isinstance(local, FusedShard)  # one local tensor: its query rows, then k, then v
        assert local.local.reshape(len(held[1]), -1)[:, 0].tolist() == [float(i) for i in held[1]]


def test_replicate_few_holds_each_key_value_head_on_its_share_of_the_ranks():
    """GQA with fewer key/value heads than ranks, the ranks a multiple of them: each head whole on
    ranks/heads consecutive ranks (rank r holds head r * heads // ranks); without the flag, or when
    the ranks are no multiple of the heads, the split is refused naming the part."""
    rule = {"pattern": ".*", "placements": ["S0"], "parts": [32, 16, 16], "unit": 8, "replicate_few": True}
    lay = _layout([rule])
    assert [_rows(Placer(lay, r, 4).boxes("x", (64, 4), r)) for r in range(4)] == [
        [(8 * r, 8), (32 + 8 * (r // 2), 8), (48 + 8 * (r // 2), 8)] for r in range(4)]
    with pytest.raises(ConfigError, match=r"part 1 of 'x' is 16 wide, 2 units of 8 \(heads\), which do not divide "):
        Placer(_layout([dict(rule, replicate_few=False)]), 0, 4).boxes("x", (64, 4), 0)
    with pytest.raises(ConfigError, match=r"part 1 of 'x' is 16 wide, 2 units of 8 \(heads\), which do not divide "):
        Placer(_layout([dict(rule, parts=[48, 16, 16])]), 0, 3).boxes("x", (80, 4), 0)
    assert Placer(lay, 0, 4).describe_rule("x")["replicate_few"] is True


def test_mpt_names_and_unknown_families():
    assert config_values({"model_type": "mpt", "d_model": 64, "n_heads": 8, "n_layers": 2})["head_dim"] == 8
    with pytest.raises(ConfigError, match=r"has no parallel plan .* or layout=fsdp"):
        resolve_auto(load_preset("auto"), {"model_type": "mamba"}, [], load_preset)


def test_inspect_counts_what_every_rank_holds_as_whole():
    """inspect's 'split across ranks': a multi-query model's key and value rows, on every rank,
    are not split bytes; a per-expert key another group owns is."""
    from hpdcp_runner.jobs.inspect import _held_by_all

    cfg = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8}
    lay, _, _ = resolve_auto(load_preset("auto"), cfg, [], load_preset)
    key = "transformer.h.0.self_attention.query_key_value.weight"
    boxes = [Placer(lay, r, 4, model_config=cfg).boxes(key, (80, 64), r) for r in range(4)]
    assert _held_by_all(boxes) == 16 * 64  # k and v: 2 heads of 8 rows
    assert _held_by_all([[Box((0, 0), (4, 4))], []]) == 0
    assert _held_by_all([[Box((0,), (8,))], [Box((0,), (8,))]]) == 8


@pytest.mark.parametrize("model_type, cfg", [("opt", {"hidden_size": 64, "num_attention_heads": 8}),
                                             ("biogpt", {"hidden_size": 64, "num_attention_heads": 8}),
                                             ("xglm", {"d_model": 64, "attention_heads": 8})])
def test_opt_like_families_split_q_k_v_and_out_proj_by_the_same_heads(model_type, cfg):
    """OPT, BioGPT and XGLM (separate q/k/v with biases, out_proj, fc1/fc2): rank r of 4 holds
    the q, k and v rows of heads 2r, 2r+1 and the out_proj input columns of the same heads; a head
    count the ranks do not divide is refused, never cut."""
    cfg = {"model_type": model_type, **cfg}
    lay, note, _ = resolve_auto(load_preset("auto"), cfg, [], load_preset)
    assert lay.name == "opt_tp" and repr(model_type) in note
    for proj in ("q_proj", "k_proj", "v_proj"):
        for suffix, shape in ((".weight", (64, 64)), (".bias", (64,))):
            assert _held_rows(lay, f"m.layers.3.self_attn.{proj}{suffix}", shape, 4, cfg) == {
                r: list(range(16 * r, 16 * r + 16)) for r in range(4)}
    assert _held_cols(lay, "m.layers.3.self_attn.out_proj.weight", (64, 64), 4, cfg) == {
        r: list(range(16 * r, 16 * r + 16)) for r in range(4)}
    assert Placer(lay, 0, 4, model_config=cfg).placements_for("m.layers.3.self_attn.out_proj.bias", 1) == ["R"]
    with pytest.raises(ConfigError, match=r"8 units of 8 \(heads\), which do not divide by 3 ranks"):
        Placer(lay, 0, 3, model_config=cfg).boxes("m.layers.3.self_attn.q_proj.weight", (64, 64), 0)
    assert recognise_family({"model_type": "stablelm"}, [])[0] == "llama"
