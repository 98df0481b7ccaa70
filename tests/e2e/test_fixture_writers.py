"""The DeepSpeed and Megatron-Core fixtures rewritten by the libraries themselves, then read.

The writers are never dependencies of ours: they live in a virtualenv of their own (the scripts'
docstrings say how to make it), named by ``HPDCP_FIXTURE_PYTHON``. Without it this test skips;
with it, the committed fixtures' recipe is re-run into a scratch directory and the reader is held
to the fresh references (what a new DeepSpeed or Megatron-Core release would change)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from hpdcp_runner.dcp import load, open_reader
from hpdcp_runner.dcp.format.metadata import Metadata, dtype_from_name
from tests.e2e.conftest import ROOT
from tests.megatron_reference import expected_hf

PYTHON = os.environ.get("HPDCP_FIXTURE_PYTHON")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not PYTHON, reason="HPDCP_FIXTURE_PYTHON names no virtualenv with the writers")]


def _state(path, **kw):
    r = open_reader(path, allow_pickle=True, **kw)
    md = Metadata.from_json(r.read_metadata_text())
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})
    load(state, storage_reader=r)
    return state


def test_deepspeed_rewritten_and_read(tmp_path):
    subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "write_deepspeed_fixtures.py"), "--out", str(tmp_path),
                    "--only", "zero3_bf16"], check=True, capture_output=True, timeout=1200)
    run = tmp_path / "zero3_bf16"
    state = _state(str(run))
    for k, v in load_file(str(run / "reference" / "zero_to_fp32.safetensors")).items():
        assert torch.equal(state[k], v), k
    universal = _state(str(run / "_universal"))  # ds_to_universal's own output, read in place
    for k, v in load_file(str(run / "reference" / "universal.safetensors")).items():
        name, moment = k.rsplit(".", 1)
        assert torch.equal(state[f"optim.state.{name}.{moment}"].flatten(), v.flatten()), k
        assert torch.equal(universal[f"optim.state.{name}.{moment}"].flatten(), v.flatten()), k
    assert all(torch.equal(universal[k], state[k]) for k in load_file(str(run / "reference" / "zero_to_fp32.safetensors")))
    subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "write_deepspeed_fixtures.py"), "--out", str(tmp_path),
                    "--only", "zero2_fp32_tp2_dp2"], check=True, capture_output=True, timeout=1200)
    run = tmp_path / "zero2_fp32_tp2_dp2"  # AutoTP: the model-parallel slices joined as ds_to_universal does
    state = _state(str(run))
    for k, v in load_file(str(run / "reference" / "universal_fp32.safetensors")).items():
        assert torch.equal(state[k], v), k
    for k, v in load_file(str(run / "reference" / "universal.safetensors")).items():
        name, moment = k.rsplit(".", 1)
        assert torch.equal(state[f"optim.state.{name}.{moment}"], v), k
    subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "write_deepspeed_fixtures.py"), "--out", str(tmp_path),
                    "--only", "pipe_zero1_bf16_pp2_dp2"], check=True, capture_output=True, timeout=1200)
    run = tmp_path / "pipe_zero1_bf16_pp2_dp2"  # the pipeline engine: the stages' parameters as one model
    state = _state(str(run))
    for k, v in load_file(str(run / "reference" / "universal.safetensors")).items():
        key = "optim.state.{}.{}".format(*k.rsplit(".", 1)) if k.endswith(("exp_avg", "exp_avg_sq")) else k
        assert torch.equal(state[key], v), k
    # without ZeRO: FP16_Optimizer's state in the model states, and the pipeline engine's BF16_Optimizer
    for name, refs in (("zero0_bf16", ["live.safetensors"]),
                       ("pipe_zero0_bf16_pp2_dp2", ["live_stage0.safetensors", "live_stage1.safetensors"])):
        subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "write_deepspeed_fixtures.py"), "--out", str(tmp_path),
                        "--only", name], check=True, capture_output=True, timeout=1200)
        state = _state(str(tmp_path / name))
        for ref in refs:
            for k, v in load_file(str(tmp_path / name / "reference" / ref)).items():
                key = "optim.state.{}.{}".format(*k.rsplit(".", 1)) if k.endswith(("exp_avg", "exp_avg_sq", "step")) else k
                assert (state[key] == float(v)) if k.endswith("step") else torch.equal(state[key], v), k


def test_megatron_rewritten_and_read(tmp_path):
    subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "write_megatron_fixtures.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=1200)
    for name in ("gpt_tp1", "gpt_tp2", "gpt_pp2", "moe_ep2", "moe_tp2_shared", "moe_qk_norm", "legacy_tp2",
                 "legacy_tp2_pp2", "legacy_moe_ep2", "legacy_tp2_pp2_vp2"):
        run = tmp_path / name
        state = _state(str(run), hf_config=json.load(open(run / "reference" / "config.json")))
        expect = expected_hf(str(run))
        assert state.keys() == expect.keys() and all(torch.equal(state[k], expect[k]) for k in expect)
