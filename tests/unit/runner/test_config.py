"""Every conf option composes and validates; the key set is golden; sizes parse; the engine
imports no Hydra/OmegaConf."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpdcp_runner import config, runtime
from hpdcp_runner.config import parse_size, validate
from hpdcp_runner.dcp.core.errors import ConfigError
from hpdcp_runner.paths import find_conf_dir

CONF = find_conf_dir()
runtime.register_resolvers()
config.register()


def _compose(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        return compose(config_name="config", overrides=overrides)


def _options(group):
    return sorted(n[:-5] for n in os.listdir(os.path.join(CONF, group)) if n.endswith(".yaml"))


@pytest.mark.parametrize("group", ["job", "planner", "storage", "layout", "model", "transform"])
def test_every_option_composes_and_validates(group):
    for opt in _options(group):
        overrides = [f"+job={opt}" if group == "job" else "+job=transform" if group == "transform" else "+job=save"]
        if group != "job":
            overrides.append(f"{group}={opt}")
        if opt in ("inspect", "verify"):
            overrides.append("checkpoint.path=/tmp/x")
        if group == "layout" and opt == "auto":  # auto reads the source's family
            overrides = ["+job=reshard", "layout=auto", "job.source.path=/tmp/x"]
        if group == "transform" or opt == "transform":
            overrides += ["transform.src=/tmp/a", "transform.dst=/tmp/b"]
        ws = 4 if opt == "dp_tp" else 1 if group == "transform" or opt == "transform" else 2
        c = validate(_compose(overrides), ws)
        if group == "layout":
            assert c.layout.name == opt
        if group == "job":
            assert c.job.name == opt
        if group == "transform":
            assert c.transform.kind in ("merge_hf", "import", "to_torch_dcp")


def test_transform_problems_listed_by_key():
    cfg = _compose(["+job=transform", "transform=import", "transform.layout=dp_tp", "transform.world_size=3",
                    "transform.dtype=float13", "transform.include='[a-'", "transform.max_shard_size=5XB",
                    "transform.rename=[{pattern: a}]"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 2)
    text = str(ei.value)
    for key in ("job.name: transform runs as one process", "transform.src", "transform.dst", "transform.dtype",
                "transform.include", "transform.max_shard_size", "transform.rename[0]", "transform.layout (dp_tp).mesh"):
        assert key in text, key


@pytest.mark.parametrize("name", _options("experiment"))
def test_experiments_compose_and_open_with_their_launch_command(name):
    lines = open(os.path.join(CONF, "experiment", f"{name}.yaml")).read().splitlines()
    assert lines[0] == "# @package _global_" and "-m hpdcp_runner" in lines[1] and f"+experiment={name}" in lines[1]
    ws = int(lines[1].split("--nproc-per-node=")[1].split()[0]) if "--nproc-per-node=" in lines[1] else 1
    c = validate(_compose([f"+experiment={name}"]), ws)
    assert c.job is not None


GOLDEN_KEYS = sorted("""
checkpoint.dir checkpoint.fast_tier.dir checkpoint.fast_tier.keep_last checkpoint.fast_tier.drain_every checkpoint.fast_tier.node_local checkpoint.fast_tier.replicas checkpoint.keep_last checkpoint.name checkpoint.overwrite checkpoint.path
checkpoint.rank_state checkpoint.resume checkpoint.step
dcp.broadcast.batch_bytes dcp.broadcast.max_in_flight dcp.broadcast.mode dcp.broadcast.share_reads
dcp.storage.max_read_bytes_per_s dcp.storage.read_gap_bytes dcp.storage.max_request_bytes dcp.storage.shared
dcp.allow_cast dcp.allow_pickle dcp.planner.name dcp.storage.files_kept dcp.storage.fsync
dcp.storage.max_metadata_bytes dcp.storage.name dcp.storage.verify_checksums dcp.timeout_s dcp.verify_replicas
dcp.cache_plan dcp.format_version dcp.async_mode dcp.persist_start_wait_s dcp.persist_nice dcp.async_staging
dcp.storage.endpoint dcp.storage.region dcp.storage.allow_http dcp.storage.part_size dcp.storage.concurrency
dcp.storage.max_retries dcp.storage.coalesce_bytes dcp.storage.read_buffer_bytes dcp.storage.orphan_grace_s
dcp.storage.request_timeout_s dcp.storage.retry_timeout_s dcp.storage.unconditional_ok dcp.storage.store_digests
job.fail_on_rank job.name job.output job.output_format job.hf_max_shard_size job.hf_files_from job.verify
job.include job.exclude job.model_only job.dtype job.experts
job.source.layout job.source.path job.source.format job.source.weights job.source.rename
layout.config layout.family layout.file layout.flat_units layout.kind layout.mesh layout.name layout.parallel layout.rules
layout.strict
model.big_rows model.dtype model.ffn model.hidden model.kind model.layers model.name model.seed model.vocab
model.dropout model.heads model.seq_len
transform.allow_pickle transform.dst transform.dtype transform.exclude transform.include transform.kind transform.layout
transform.max_shard_size transform.overwrite transform.rename transform.single_file transform.source_format
transform.src transform.world_size transform.model_only transform.files_from
runtime.backend runtime.device runtime.nproc_per_node runtime.progress runtime.timeout_s
""".split())


def _keys(node, prefix=""):
    out = []
    for k, v in node.items():
        if isinstance(v, dict):
            out += _keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def test_golden_config_keys():
    plain = OmegaConf.to_container(_compose(["+job=reshard"]), resolve=True)
    assert sorted(_keys(plain)) == GOLDEN_KEYS


def test_plus_override_of_unknown_key_is_caught():
    with pytest.raises(ConfigError, match="files_kep"):
        validate(_compose(["+job=save", "+dcp.storage.files_kep=3"]), 1)


def test_all_problems_reported_at_once():
    cfg = _compose(["+job=inspect", "layout=dp_tp", "dcp.storage.files_kept=0", "runtime.backend=mpi"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 3)
    text = str(ei.value)
    for key in ("layout.mesh", "dcp.storage.files_kept", "runtime.backend", "checkpoint.path"):
        assert key in text


@pytest.mark.parametrize("text,value", [("64MiB", 64 << 20), ("6MB", 6_000_000), ("1GiB", 1 << 30), (4096, 4096),
                                        ("0", 0), ("1.5KiB", 1536), ("12 kb", 12000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["12XB", "-1", "MiB", True, -5, "0.3B"])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="k"):
        parse_size(bad, "k")


def test_engine_imports_no_hydra_or_omegaconf():
    code = ("import sys, hpdcp_runner.dcp, hpdcp_runner.dcp.offline.inspection;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('hydra','omegaconf')];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    root = os.path.join(os.path.dirname(config.__file__), "dcp")
    for name in os.listdir(root):
        if name.endswith(".py"):
            src = open(os.path.join(root, name)).read()
            assert "import hydra" not in src and "omegaconf" not in src, name


def test_a_command_without_dtensors_never_imports_dtensors_module(tmp_path):
    """``torch.distributed.tensor`` costs ~0.6 s of every command's start (3.65 s -> 2.85 s for an
    inspect here): the engine asks whether a value is a DTensor only once that module is loaded.
    Importing the runner's entry, a save and a load of plain tensors must not load it."""
    code = (
        "import sys, torch; from hpdcp_runner import __main__ as cli; from hpdcp_runner.dcp import save, load;"
        f"p = {str(tmp_path / 'ck')!r}; sd = {{'w': torch.arange(6.).view(2, 3), 'b': torch.ones(2)}};"
        "save(sd, checkpoint_id=p); got = {'w': torch.zeros(2, 3), 'b': torch.zeros(2)}; load(got, checkpoint_id=p);"
        "assert torch.equal(got['w'], sd['w']) and torch.equal(got['b'], sd['b']);"
        "loaded = [m for m in sys.modules if m.startswith('torch.distributed.tensor')];"
        "print(loaded); sys.exit(1 if loaded else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
