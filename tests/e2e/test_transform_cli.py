"""+job=transform through the CLI: one process, no torchrun."""

from __future__ import annotations

import json

import pytest

from safetensors.torch import load_file

from hpdcp_runner.dcp import read_metadata
from hpdcp_runner.dcp.offline.inspection import full_tensor_digests
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_merge_hf_import_and_torch_dcp_export(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", "layout=tp", f"checkpoint.dir={ck}", "checkpoint.name=step_1", f"hydra.run.dir={tmp_path}/r0"],
            nproc=2)
    assert r.returncode == 0, _tail(r)
    src = ck / "step_1"
    r = cli(["+job=transform", f"transform.src={src}", f"transform.dst={tmp_path}/hf", "transform.max_shard_size=8KiB",
             "transform.dtype=bfloat16", "transform.include='^model\\.'", "transform.rename=[{pattern: '^model\\.', replace: ''}]",
             f"hydra.run.dir={tmp_path}/r1"])
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "r1")["result"]
    assert res["kind"] == "merge_hf" and len(res["files"]) > 1 and res["skipped_objects"] == ["meta.model", "meta.seed", "meta.step"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "embed.weight" in index["weight_map"] and not any(k.startswith("model.") for k in index["weight_map"])
    shard = load_file(tmp_path / "hf" / index["weight_map"]["embed.weight"])
    assert str(shard["embed.weight"].dtype) == "torch.bfloat16"

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    r = cli(["+job=transform", "transform=import", f"transform.src={tmp_path}/junk.pt",
             f"transform.dst={tmp_path}/bad", f"hydra.run.dir={tmp_path}/r2"])
    assert r.returncode == 1 and "junk.pt" in r.stderr and "Traceback" not in r.stderr, _tail(r)
    assert not (tmp_path / "bad").exists()

    r = cli(["+job=transform", "transform=to_torch_dcp", f"transform.src={src}", f"transform.dst={tmp_path}/tdcp",
             f"hydra.run.dir={tmp_path}/r3"])
    assert r.returncode == 0, _tail(r)
    r = cli(["+job=transform", "transform=from_torch_dcp", f"transform.src={tmp_path}/tdcp",
             f"transform.dst={tmp_path}/back", "transform.world_size=2", "transform.layout=tp",
             "transform.allow_pickle=true", f"hydra.run.dir={tmp_path}/r4"])
    assert r.returncode == 0, _tail(r)
    assert read_metadata(tmp_path / "back").world_size == 2
    assert full_tensor_digests(tmp_path / "back") == full_tensor_digests(src)
    r = cli(["+job=verify", f"checkpoint.path={tmp_path}/back", f"hydra.run.dir={tmp_path}/r5"])
    assert r.returncode == 0 and "OK:" in r.stdout, _tail(r)
