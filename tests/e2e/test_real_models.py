"""A real client: transformers models (built from configs in code, no downloads) saved by
Hugging Face and by torch DCP, resharded by the runner under torchrun into family layouts, written
back as Hugging Face / torch DCP, and reopened by transformers / torch: logits equal bit for bit.

Needs the optional extra: pip install -e ".[interop]" (skipped cleanly without it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hpdcp_runner.dcp import read_metadata
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

transformers = pytest.importorskip("transformers")


def _llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # tied embeddings: the Hugging Face file has no lm_head.weight, which must not be "missing"
    cfg = LlamaConfig(vocab_size=160, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "llama_hf")
    return model


def _gpt2(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=150, n_embd=40, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "gpt2_hf")
    return model


def _logits(model) -> torch.Tensor:
    ids = torch.arange(20).remainder(97).view(2, 10)
    with torch.no_grad():
        return model(ids).logits


def _reopened(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _chunks(path, key):
    return [(list(c.offsets), list(c.sizes)) for c in read_metadata(path).tensors[key].chunks]


def _reshard(cli, tmp_path, tag, *args):
    r = cli(["+job=reshard", *args, f"hydra.run.dir={tmp_path}/run_{tag}"], nproc=2)
    assert r.returncode == 0, _tail(r)
    return metrics(tmp_path / f"run_{tag}")["result"]


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_llama_from_hugging_face_through_tp_and_fsdp_tp_back_to_hugging_face(cli, tmp_path):
    model = _llama(tmp_path)
    n = len(model.state_dict()) - 1  # lm_head is tied: not stored
    m = _reshard(cli, tmp_path, "tp", f"job.source.path={tmp_path}/llama_hf", "layout=llama_tp", "layout.strict=true",
                 f"job.output={tmp_path}/tp")
    assert m["verified_tensors"] == n
    q = "model.layers.2.self_attn.q_proj.weight"
    assert _chunks(tmp_path / "tp", q) == [([0, 0], [24, 48]), ([24, 0], [24, 48])]  # column-parallel
    assert _chunks(tmp_path / "tp", "model.layers.0.mlp.down_proj.weight") == [([0, 0], [48, 40]), ([0, 40], [48, 40])]
    m = _reshard(cli, tmp_path, "fsdp_tp", f"job.source.path={tmp_path}/tp", "layout=llama_fsdp_tp",
                 "layout.strict=true", f"job.output={tmp_path}/fsdp_tp")
    assert m["verified_tensors"] == n
    m = _reshard(cli, tmp_path, "hf", f"job.source.path={tmp_path}/fsdp_tp", "job.output_format=hf",
                 f"job.hf_files_from={tmp_path}/llama_hf", "job.hf_max_shard_size=60KB", f"job.output={tmp_path}/out")
    assert m["verified_tensors"] == n and len(m["files"]) > 2 and "config.json" in m["copied"]
    # the summary says what the layouts really are (not "none"): read as saved, written whole
    assert m["source_layout"] == "as saved" and m["target_layout"].startswith("whole tensors (Hugging Face")
    assert torch.equal(_logits(_reopened(tmp_path / "out")), _logits(model))


@pytest.mark.slow  # the slow tier: keeps the default run near 10 minutes on 2 cores
def test_gpt2_conv1d_layout_and_a_torch_dcp_checkpoint_written_by_torch(cli, tmp_path):
    import torch.distributed.checkpoint as tdcp

    gpt2 = _gpt2(tmp_path)
    # GPT-2 straight from its Hugging Face directory to Hugging Face output with FSDP x TP between
    m = _reshard(cli, tmp_path, "gpt2", f"job.source.path={tmp_path}/gpt2_hf", "layout=gpt2_fsdp_tp",
                 "layout.strict=true", f"job.output={tmp_path}/gpt2_ours")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gpt2_hf" / "model.safetensors"), "pt") as f:
        assert m["verified_tensors"] == len(f.keys()) == len(gpt2.state_dict()) - 1  # lm_head: tied, not stored
    # Conv1D stores [in, out]: column-parallel c_attn splits dim 1, part by part (q, k, v of
    # 40 columns each): each tp rank holds 2 of the 4 heads of each
    assert sorted(_chunks(tmp_path / "gpt2_ours", "transformer.h.0.attn.c_attn.weight")) == [
        ([0, c], [40, 20]) for c in range(0, 120, 20)]
    m = _reshard(cli, tmp_path, "gpt2_hf", f"job.source.path={tmp_path}/gpt2_ours", "job.output_format=hf",
                 f"job.hf_files_from={tmp_path}/gpt2_hf", f"job.output={tmp_path}/gpt2_out")
    assert torch.equal(_logits(_reopened(tmp_path / "gpt2_out")), _logits(gpt2))

    # a torch DCP checkpoint of a Llama, written by torch itself, resharded by the runner (its
    # keys renamed into Hugging Face names on the way) and loaded back by torch DCP
    llama = _llama(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"model": llama.state_dict(), "step": 5}, checkpoint_id=str(tmp_path / "tdcp"), no_dist=True)
    m = _reshard(cli, tmp_path, "tdcp", f"job.source.path={tmp_path}/tdcp", "dcp.allow_pickle=true",
                 "job.source.rename=[{pattern: '^model[.]', replace: ''}]", "layout=llama_tp",
                 f"job.output={tmp_path}/from_tdcp")
    assert _chunks(tmp_path / "from_tdcp", "model.layers.1.self_attn.k_proj.weight") == [([0, 0], [12, 48]),
                                                                                        ([12, 0], [12, 48])]
    from hpdcp_runner.dcp.offline.transforms import export_torch_dcp

    export_torch_dcp(tmp_path / "from_tdcp", tmp_path / "back")
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM(llama.config).eval()
    sd = {k: torch.zeros_like(v) for k, v in back.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = {**sd, "step": 0}
        tdcp.load(target, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert target["step"] == 5
    back.load_state_dict({k: target[k] for k in sd})
    assert torch.equal(_logits(back), _logits(llama))


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_a_model_and_optimizer_checkpoint_to_hugging_face_in_one_command(cli, tmp_path):
    """A training script's torch DCP checkpoint of {"model", "optim"} (torch's own state_dict
    helpers, after an AdamW step) -> Hugging Face: the output holds the model's weights only,
    under the model's own names, in the dtype asked for, with config.json, and transformers loads
    it with nothing unexpected or missing. The transform does the same for our own checkpoint."""
    import json

    import torch.distributed.checkpoint as tdcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=130, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(16).view(2, 8)
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    cfg.save_pretrained(tmp_path / "config_dir")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        tdcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=str(tmp_path / "tdcp"), no_dist=True)
    m = _reshard(cli, tmp_path, "mo", f"job.source.path={tmp_path}/tdcp", "dcp.allow_pickle=true",
                 "job.output_format=hf", f"job.hf_files_from={tmp_path}/config_dir", "job.dtype=bfloat16",
                 f"job.output={tmp_path}/hf")
    n_params = len(list(model.named_parameters()))
    assert m["tensors"] == m["verified_tensors"] == len(msd)
    assert "left_out" in m and f"{3 * n_params} optimizer-state tensors (optim.*)" in m["left_out"], m
    assert m["copied"] == ["config.json"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(msd)  # the model's own names, no optim.*, no "model." prefix
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # nothing unexpected, missing or mismatched
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)) for k, v in msd.items())

    # the same model+optimizer checkpoint in our format, merged offline by the transform: the
    # config travels with transform.files_from
    m = _reshard(cli, tmp_path, "ours", f"job.source.path={tmp_path}/tdcp", "dcp.allow_pickle=true",
                 f"job.output={tmp_path}/ours")
    assert m["verified_tensors"] == len(msd) + 3 * n_params  # hpdcp output keeps everything
    r = cli(["+job=transform", f"transform.src={tmp_path}/ours", f"transform.dst={tmp_path}/merged",
             f"transform.files_from={tmp_path}/config_dir", f"hydra.run.dir={tmp_path}/run_merge"])
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "run_merge")["result"]
    assert res["copied"] == ["config.json"] and res["tensors"] == len(msd) and "optimizer-state" in res["left_out"]
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["hidden_size"] == 40
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(_logits(merged), _logits(model))
