"""The runner on s3:// paths, through the real CLI under torchrun, against a real S3 server (moto on
loopback): save / load / verify / inspect / reshard of ours, a Hugging Face directory uploaded to the
bucket resharded in place, train with keep_last and resume=latest, and the bad inputs (unknown
scheme, missing bucket, no checkpoint). Credentials never reach the run directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpdcp_runner.dcp.storage.objects.object_store import Bucket
from tests import s3_server
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail


def _keys(endpoint, bucket, prefix=""):
    out = s3_server.client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in out)


def _no_secrets(run_dir):
    secret = s3_server.CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    for dirpath, _, files in os.walk(run_dir):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                assert secret.encode() not in fh.read(), os.path.join(dirpath, f)


@pytest.mark.slow  # the slow tier (CI runs it too): keeps the default run near 10 minutes
def test_save_load_verify_inspect_reshard_on_s3(cli, tmp_path, s3_endpoint, s3_bucket):
    bucket = s3_bucket[len("s3://"):]
    run = tmp_path / "run"
    r = cli(["+job=save", f"checkpoint.dir={s3_bucket}/run1", "layout=tp", f"hydra.run.dir={run}"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert not (tmp_path / "s3:").exists()  # a URI never becomes a local directory
    keys = _keys(s3_endpoint, bucket, "run1/step_0/")
    assert "run1/step_0/hpdcp-commit.json" in keys
    assert sum(k.endswith(".safetensors") and "/rank" in k for k in keys) == 2, keys  # one object per rank
    # the committed save keeps its (no longer refreshed) lease: it proves the save ours once superseded
    assert sum(k.endswith("/.lease") for k in keys) == 1, keys
    _no_secrets(run)

    r = cli(["+job=load", f"checkpoint.dir={s3_bucket}/run1", "layout=fsdp", f"hydra.run.dir={tmp_path}/load"],
            nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "load")
    assert m["result"]["verified"] is True
    # tp's column-split weights loaded row-split: each of those chunks read once, its parts sent
    shared = [rk["counters"].get("load.shared_reads", 0) for rk in m["ranks"]]
    assert all(shared), m["ranks"]
    r = cli(["+job=load", f"checkpoint.dir={s3_bucket}/run1", "layout=fsdp", "dcp.broadcast.share_reads=false",
             f"hydra.run.dir={tmp_path}/load2"], nproc=2)
    assert r.returncode == 0, _tail(r)
    m2 = metrics(tmp_path / "load2")
    assert m2["result"]["verified"] is True and m2["engine"]["dcp.broadcast.share_reads"] is False
    assert not any(rk["counters"].get("load.shared_reads", 0) for rk in m2["ranks"])
    read = lambda m: sum(rk["counters"]["load.bytes_read"] for rk in m["ranks"])  # noqa: E731
    assert read(m) < read(m2), (read(m), read(m2))
    r = cli(["+job=verify", f"checkpoint.path={s3_bucket}/run1/step_0", f"hydra.run.dir={tmp_path}/verify"])
    assert r.returncode == 0 and "OK:" in r.stdout, _tail(r)
    r = cli(["+job=inspect", f"checkpoint.path={s3_bucket}/run1/step_0", f"hydra.run.dir={tmp_path}/inspect"])
    assert r.returncode == 0 and "rank00001.safetensors" in r.stdout, _tail(r)

    r = cli(["+job=reshard", f"checkpoint.dir={s3_bucket}/run2", "job.source.layout=tp", "layout=fsdp",
             f"hydra.run.dir={tmp_path}/reshard"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "reshard")["result"]
    assert res["output"] == f"{s3_bucket}/run2/resharded" and res["verified_tensors"] > 0

    # a flipped byte in a rank object: verify names it, a load refuses it
    key = next(k for k in _keys(s3_endpoint, bucket, "run1/step_0/") if k.endswith("rank00000.safetensors"))
    c = s3_server.client(s3_endpoint)
    body = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0xFF
    c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    r = cli(["+job=verify", f"checkpoint.path={s3_bucket}/run1/step_0", f"hydra.run.dir={tmp_path}/verify2"])
    assert r.returncode != 0 and "checksum" in (r.stdout + r.stderr), _tail(r)


@pytest.mark.slow  # the slow tier: keeps the default run near 10 minutes on 2 cores
def test_hf_directory_in_bucket_resharded_in_place(cli, tmp_path, s3_endpoint, s3_bucket):
    from safetensors.torch import save_file

    bucket = s3_bucket[len("s3://"):]
    g = torch.Generator().manual_seed(3)
    tensors = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
               "model.norm.weight": torch.randn(16, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    c = s3_server.client(s3_endpoint)
    c.upload_file(str(tmp_path / "model.safetensors"), bucket, "models/tiny/model.safetensors")
    c.put_object(Bucket=bucket, Key="models/tiny/config.json", Body=json.dumps({"model_type": "llama"}).encode())
    r = cli(["+job=reshard", f"job.source.path={s3_bucket}/models/tiny", f"job.output={s3_bucket}/out/tiny_tp",
             "layout=auto", f"hydra.run.dir={tmp_path}/r"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "r")["result"]
    assert res["verified_tensors"] == 3
    # the family is recognised from the config.json in the bucket, which the output records
    assert "the llama family's own tensor-parallel plan" in res["layout_recognised"]
    assert res["target_layout"] == "auto:llama_tp"
    assert res["model_config"] == f"{s3_bucket}/models/tiny/config.json"
    from hpdcp_runner.dcp import load

    got = {k: torch.zeros_like(v) for k, v in tensors.items()}
    load(got, checkpoint_id=f"{s3_bucket}/out/tiny_tp")
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)

    # and back to Hugging Face, in the bucket: sharded (index written last), the recorded config written
    r = cli(["+job=reshard", f"job.source.path={s3_bucket}/out/tiny_tp", f"job.output={s3_bucket}/out/hf",
             "job.output_format=hf", "job.hf_max_shard_size=2KB", f"hydra.run.dir={tmp_path}/h"], nproc=2)
    assert r.returncode == 0, _tail(r)
    keys = _keys(s3_endpoint, bucket, "out/hf/")
    assert "out/hf/config.json" in keys and "out/hf/model.safetensors.index.json" in keys, keys
    assert metrics(tmp_path / "h")["result"]["verified_tensors"] == 3
    got = {k: torch.zeros_like(v) for k, v in tensors.items()}
    load(got, checkpoint_id=f"{s3_bucket}/out/hf", format="hf")
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    r = cli(["+job=reshard", f"job.source.path={s3_bucket}/out/tiny_tp", f"job.output={s3_bucket}/out/hf",
             "job.output_format=hf", f"hydra.run.dir={tmp_path}/h2"], nproc=2)
    assert r.returncode != 0 and "already holds a Hugging Face model" in r.stderr, _tail(r)


@pytest.mark.slow
def test_train_resume_latest_on_s3(cli, tmp_path, s3_bucket):
    common = ["+job=train", "job.steps=10", "job.save_every=5", f"checkpoint.dir={s3_bucket}/train",
              "checkpoint.keep_last=1"]
    r = cli(common + [f"hydra.run.dir={tmp_path}/a", "job.steps=5"], nproc=2)
    assert r.returncode == 0, _tail(r)
    r = cli(common + [f"hydra.run.dir={tmp_path}/b", "checkpoint.resume=latest"], nproc=2)
    assert r.returncode == 0, _tail(r)
    m = metrics(tmp_path / "b")["result"]
    assert m["start_step"] == 5 and m["final_step"] == 10
    assert m["checkpoints"] == ["step_10"]  # keep_last=1 removed step_5 from the bucket
    ref = cli(["+job=train", "job.steps=10", "job.save_every=5", f"checkpoint.dir={tmp_path}/ref_ck",
               f"hydra.run.dir={tmp_path}/ref"], nproc=2)
    assert ref.returncode == 0, _tail(ref)
    a = json.loads((tmp_path / "ref" / "losses.json").read_text())["losses"]
    b = json.loads((tmp_path / "b" / "losses.json").read_text())["losses"]
    assert {k: v for k, v in a.items() if int(k) > 5} == {k: v for k, v in b.items() if int(k) > 5}


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_bad_locations_are_one_line(cli, tmp_path, s3_endpoint, s3_bucket):
    r = cli(["+job=save", "checkpoint.dir=hdfs://somewhere/run", f"hydra.run.dir={tmp_path}/a"])
    assert r.returncode != 0 and "hdfs:// scheme is not supported" in r.stderr, _tail(r)
    assert not (tmp_path / "hdfs:").exists()
    r = cli(["+job=save", "checkpoint.dir=s3://no-such-bucket-here/run", f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode != 0 and "bucket 'no-such-bucket-here' does not exist" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr
    r = cli(["+job=load", f"checkpoint.dir={s3_bucket}/nothing", f"hydra.run.dir={tmp_path}/c"])
    assert r.returncode != 0 and "no committed checkpoint at" in r.stderr and "checkpoint.path" in r.stderr, _tail(r)
    r = cli(["+job=transform", "transform=import", f"transform.src={tmp_path}/none", f"transform.dst={s3_bucket}/i",
             f"hydra.run.dir={tmp_path}/d"])
    assert r.returncode != 0 and "none does not exist" in r.stderr and "Traceback" not in r.stderr, _tail(r)
    assert not list(Bucket(s3_bucket).list("i"))  # nothing was uploaded for it


@pytest.mark.slow
def test_torch_dcp_in_bucket_resharded_in_place(cli, tmp_path, s3_endpoint, s3_bucket):
    import torch.distributed.checkpoint as tdcp

    g = torch.Generator().manual_seed(5)
    sd = {"model": {"w": torch.randn(24, 8, generator=g), "b": torch.randn(8, generator=g)}, "step": 3}
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "tdcp")), no_dist=True)
    c = s3_server.client(s3_endpoint)
    for name in os.listdir(tmp_path / "tdcp"):
        c.upload_file(str(tmp_path / "tdcp" / name), s3_bucket[5:], f"tdcp/{name}")
    r = cli(["+job=reshard", f"job.source.path={s3_bucket}/tdcp", f"job.output={s3_bucket}/ours",
             "layout=tp", f"hydra.run.dir={tmp_path}/r"], nproc=2)
    assert r.returncode != 0 and "allow_pickle" in r.stderr, _tail(r)  # its metadata is a pickle
    r = cli(["+job=reshard", f"job.source.path={s3_bucket}/tdcp", f"job.output={s3_bucket}/ours",
             "layout=tp", "dcp.allow_pickle=true", f"hydra.run.dir={tmp_path}/r2"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert metrics(tmp_path / "r2")["result"]["verified_tensors"] == 2


@pytest.mark.slow
def test_bench_and_sweep_on_s3(cli, tmp_path, s3_endpoint, s3_bucket):
    """bench against the peer's own object-store path, then a 2-point sweep saving into the bucket:
    scratch checkpoints are deleted from the bucket, each point's checkpoint is there."""
    r = cli(["+job=bench", "job.repeats=1", "job.warmup=0", "job.peer=true", f"checkpoint.dir={s3_bucket}/bench",
             f"hydra.run.dir={tmp_path}/b"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "b")["result"]
    assert res["speedup_load_vs_torch_dcp"] > 0
    assert _keys(s3_endpoint, s3_bucket[5:], "bench/") == []  # scratch checkpoints removed
    r = cli(["-m", "+job=save", f"checkpoint.dir={s3_bucket}/sweep", "checkpoint.name=a,b",
             f"hydra.sweep.dir={tmp_path}/sweep"], nproc=2)
    assert r.returncode == 0, _tail(r)
    keys = _keys(s3_endpoint, s3_bucket[5:], "sweep/")
    assert {"sweep/a/hpdcp-commit.json", "sweep/b/hpdcp-commit.json"} <= set(keys), keys


@pytest.mark.slow
def test_a_bench_of_a_checkpoint_in_a_bucket_times_that_bucket(cli, tmp_path, s3_endpoint, s3_bucket):
    """+job=bench on a user's checkpoint in a bucket saves and loads in a scratch prefix of that
    bucket (removed afterwards), names the store timed, and says which dcp.storage overrides do
    not apply to it."""
    bucket = s3_bucket[len("s3://"):]
    r = cli(["+job=save", f"checkpoint.path={s3_bucket}/models/ck", f"hydra.run.dir={tmp_path}/s"], nproc=2)
    assert r.returncode == 0, _tail(r)
    before = _keys(s3_endpoint, bucket)
    r = cli(["+job=bench", f"job.source.path={s3_bucket}/models/ck", "job.repeats=1", "job.warmup=0",
             "dcp.storage.files_kept=4", "dcp.storage.concurrency=4", f"hydra.run.dir={tmp_path}/b"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "b")["result"]
    assert res["store_timed"].startswith(f"{s3_bucket}/models/hpdcp-bench-"), res
    assert res["no_effect"] == ["dcp.storage.files_kept"], res  # concurrency applies to a store
    assert "dcp.storage.files_kept: no effect on what this bench times" in r.stdout + r.stderr
    assert f"store_timed: {s3_bucket}/models/hpdcp-bench-" in r.stdout
    assert _keys(s3_endpoint, bucket) == before  # the scratch prefix is gone, the checkpoint untouched
