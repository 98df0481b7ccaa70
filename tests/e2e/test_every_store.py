"""Every store a peer, through the real CLI under torchrun: a new user's workflow (a Hugging Face
model in a bucket -> layout=auto -> ours in another store -> Hugging Face back in a third ->
``from_pretrained`` logits bit for bit) with source and outputs on different stores in one job,
and the checkpoint tools on Azure Blob. Real servers on loopback: moto (S3), azurite (Azure Blob),
fake-gcs-server (GCS, as a source: it cannot take the XML API's writes, see tests/emulators.py),
OpenSSH's sshd (SFTP, tests/sftp_server.py)."""

from __future__ import annotations

import os

import pytest
import torch

from hpdcp_runner.dcp.storage.store_client import open_client as Bucket
from tests import emulators
from tests.e2e.conftest import metrics
from tests.e2e.test_cli import _tail

transformers = pytest.importorskip("transformers")


class Place:
    """A directory on one store: where files are uploaded and read back for checking."""

    def __init__(self, request, kind, tmp_path, name):
        self.kind = kind
        if kind == "local":
            self.uri = str(tmp_path / name)
        elif kind == "gs":
            self.endpoint = request.getfixturevalue("gcs_endpoint")
            self.bucket = request.getfixturevalue("gcs_bucket")
            self.uri = f"gs://{self.bucket}/{name}"
        else:
            self.uri = f"{request.getfixturevalue({'s3': 's3_bucket', 'az': 'az_container', 'sftp': 'sftp_dir'}[kind])}/{name}"

    def upload(self, directory):
        if self.kind == "local":
            import shutil

            shutil.copytree(directory, self.uri)
        elif self.kind == "gs":
            emulators.gcs_upload_dir(self.endpoint, self.bucket, self.uri.split("/", 3)[3], str(directory))
        else:
            b = Bucket(self.uri)
            for f in os.listdir(directory):
                with open(os.path.join(directory, f), "rb") as fh:
                    b.put(b.key(f), fh.read())

    def download(self, into):
        """The files right under this directory, copied to ``into`` (a local path)."""
        if self.kind == "local":
            return self.uri
        os.makedirs(into)
        b = Bucket(self.uri)
        for o in b.list_dir(b.root)[1]:
            with open(os.path.join(into, o["path"].rsplit("/", 1)[-1]), "wb") as fh:
                fh.write(b.get(o["path"])[0])
        return str(into)


def _llama(where):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=160, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(where)
    return model


def _logits(model):
    ids = torch.arange(20).remainder(97).view(2, 10)
    with torch.no_grad():
        return model(ids).logits


def _workflow(cli, request, tmp_path, source, ours, back):
    model = _llama(tmp_path / "hf_src")
    src = Place(request, source, tmp_path, "models/llama")
    src.upload(tmp_path / "hf_src")
    mid = Place(request, ours, tmp_path, "ckpts/llama_tp")
    out = Place(request, back, tmp_path, "export/llama_hf")
    r = cli(["+job=reshard", f"job.source.path={src.uri}", f"job.output={mid.uri}", "layout=auto",
             f"hydra.run.dir={tmp_path}/r1"], nproc=2)
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "r1")["result"]
    assert res["target_layout"] == "auto:llama_tp" and res["model_config"] == f"{src.uri}/config.json", res
    assert res["verified_tensors"] > 0
    r = cli(["+job=reshard", f"job.source.path={mid.uri}", f"job.output={out.uri}", "job.output_format=hf",
             "job.hf_max_shard_size=20KB", f"hydra.run.dir={tmp_path}/r2"], nproc=2)
    assert r.returncode == 0, _tail(r)
    got = out.download(tmp_path / "downloaded")
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(got))
    from transformers import AutoModelForCausalLM

    reopened = AutoModelForCausalLM.from_pretrained(got).eval()
    assert torch.equal(_logits(reopened), _logits(model))
    for k, v in model.state_dict().items():
        assert torch.equal(reopened.state_dict()[k], v), k


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_hf_in_gcs_to_ours_in_azure_to_hf_in_azure(cli, request, tmp_path):
    _workflow(cli, request, tmp_path, "gs", "az", "az")


def test_the_workflow_on_an_sftp_server(cli, request, tmp_path):
    """A model on a file server reached over SSH, resharded into ours there and exported back
    there as Hugging Face, every file through the SFTP store."""
    _workflow(cli, request, tmp_path, "sftp", "sftp", "sftp")


@pytest.mark.slow
@pytest.mark.parametrize("source,ours,back", [("az", "s3", "local"), ("local", "az", "s3"), ("s3", "local", "az")])
def test_the_workflow_between_stores(cli, request, tmp_path, source, ours, back):
    _workflow(cli, request, tmp_path, source, ours, back)


@pytest.mark.slow  # the slow tier: the conformance suite covers the engine on Azure in the default one
def test_checkpoint_tools_on_azure(cli, tmp_path, az_container):
    run = tmp_path / "run"
    r = cli(["+job=save", f"checkpoint.dir={az_container}/run1", "layout=tp", f"hydra.run.dir={run}"], nproc=2)
    assert r.returncode == 0, _tail(r)
    assert not (tmp_path / "az:").exists()
    keys = [o["path"] for o in Bucket(az_container).list("run1/step_0")]
    assert "run1/step_0/hpdcp-commit.json" in keys and sum("/rank" in k and k.endswith(".safetensors") for k in keys) == 2, keys
    r = cli(["+job=load", f"checkpoint.dir={az_container}/run1", "layout=fsdp", f"hydra.run.dir={tmp_path}/load"],
            nproc=2)
    assert r.returncode == 0 and metrics(tmp_path / "load")["result"]["verified"] is True, _tail(r)
    r = cli(["+job=verify", f"checkpoint.path={az_container}/run1/step_0", f"hydra.run.dir={tmp_path}/verify"])
    assert r.returncode == 0 and "OK:" in r.stdout, _tail(r)
    r = cli(["+job=inspect", f"checkpoint.path={az_container}/run1/step_0", f"hydra.run.dir={tmp_path}/inspect"])
    assert r.returncode == 0 and "rank00001.safetensors" in r.stdout, _tail(r)
    # a flipped byte in a rank object: verify names it
    b = Bucket(az_container)
    key = next(k for k in keys if k.endswith("rank00000.safetensors"))
    body = bytearray(b.get(key)[0])
    body[-3] ^= 0xFF
    b.put(key, bytes(body))
    r = cli(["+job=verify", f"checkpoint.path={az_container}/run1/step_0", f"hydra.run.dir={tmp_path}/verify2"])
    assert r.returncode != 0 and "checksum" in (r.stdout + r.stderr), _tail(r)


def test_a_missing_container_and_an_unknown_scheme_are_one_line(cli, tmp_path, az_endpoint):
    r = cli(["+job=verify", "checkpoint.path=az://no-such-container/x", f"hydra.run.dir={tmp_path}/a"])
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "container 'no-such-container' does not exist" in err and "AZURE_STORAGE_ENDPOINT" in err, _tail(r)
    assert "Traceback" not in r.stderr, _tail(r)
    r = cli(["+job=verify", "checkpoint.path=hdfs://nn/x", f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode != 0 and "s3://bucket/prefix / gs://bucket/prefix / az://container/prefix" in r.stderr, _tail(r)


@pytest.mark.slow
def test_offline_transforms_between_stores(cli, request, tmp_path, s3_bucket, az_container):
    """import (Hugging Face in Azure -> ours in S3, 2 rank files), to_torch_dcp (S3 -> Azure) and
    merge_hf (S3 -> Azure): each output read back and compared bit for bit."""
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import load_file, save_file

    from hpdcp_runner.dcp import load

    g = torch.Generator().manual_seed(5)
    tensors = {"model.embed_tokens.weight": torch.randn(40, 8, generator=g).to(torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.randn(24, 8, generator=g),
               "model.norm.weight": torch.randn(8, generator=g)}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    src = Place(request, "az", tmp_path, "models/tiny")
    src.upload(tmp_path / "hf")
    r = cli(["+job=transform", "transform=import", f"transform.src={src.uri}", f"transform.dst={s3_bucket}/imported",
             "transform.world_size=2", f"hydra.run.dir={tmp_path}/t1"])
    assert r.returncode == 0, _tail(r)
    keys = [o["path"] for o in Bucket(s3_bucket).list("imported")]
    assert "imported/hpdcp-commit.json" in keys and sum("/rank" in k and k.endswith(".safetensors") for k in keys) == 2, keys
    got = {k: torch.zeros_like(v) for k, v in tensors.items()}
    load(got, checkpoint_id=f"{s3_bucket}/imported")
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    # an existing output is refused before any work; the old one stays
    r = cli(["+job=transform", "transform=import", f"transform.src={src.uri}", f"transform.dst={s3_bucket}/imported",
             f"hydra.run.dir={tmp_path}/t1b"])
    assert r.returncode != 0 and "already exists" in r.stderr, _tail(r)

    r = cli(["+job=transform", "transform=to_torch_dcp", f"transform.src={s3_bucket}/imported",
             f"transform.dst={az_container}/tdcp", f"hydra.run.dir={tmp_path}/t2"])
    assert r.returncode == 0, _tail(r)
    local = Place(request, "az", tmp_path, "tdcp")
    local.uri = f"{az_container}/tdcp"
    d = local.download(tmp_path / "tdcp_local")
    assert ".metadata" in os.listdir(d)
    got = {k: torch.zeros_like(v) for k, v in tensors.items()}
    tdcp.load(got, checkpoint_id=d, no_dist=True)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)

    r = cli(["+job=transform", "transform=merge_hf", f"transform.src={s3_bucket}/imported",
             f"transform.dst={az_container}/merged", "transform.max_shard_size=1KB", f"hydra.run.dir={tmp_path}/t3"])
    assert r.returncode == 0, _tail(r)
    merged = Place(request, "az", tmp_path, "merged")
    merged.uri = f"{az_container}/merged"
    d = merged.download(tmp_path / "merged_local")
    assert "model.safetensors.index.json" in os.listdir(d)
    back = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            back.update(load_file(os.path.join(d, f)))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_ours_and_torch_dcp_read_in_place_from_gcs(cli, tmp_path, gcs_endpoint, gcs_bucket):
    """GCS as a source of every reading tool: our checkpoint and a torch DCP one, uploaded
    (through the emulator's JSON API), verified, inspected, loaded under another layout."""
    import torch.distributed.checkpoint as tdcp

    from hpdcp_runner.dcp import load, save, tools

    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(32, 6, generator=g), "b": torch.arange(7, dtype=torch.int32)}
    save(state, checkpoint_id=str(tmp_path / "ours"))
    emulators.gcs_upload_dir(gcs_endpoint, gcs_bucket, "ck/ours", str(tmp_path / "ours"))
    uri = f"gs://{gcs_bucket}/ck/ours"
    assert tools.verify(uri).ok
    assert tools.describe(uri)["tensors"]["w"]["shape"] == [32, 6]
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, checkpoint_id=uri)
    assert all(torch.equal(got[k], state[k]) for k in state)
    tdcp.save(state, checkpoint_id=str(tmp_path / "tdcp"), no_dist=True)
    emulators.gcs_upload_dir(gcs_endpoint, gcs_bucket, "ck/tdcp", str(tmp_path / "tdcp"))
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, checkpoint_id=f"gs://{gcs_bucket}/ck/tdcp", format="auto", allow_pickle=True)
    assert all(torch.equal(got[k], state[k]) for k in state)
    r = cli(["+job=inspect", f"checkpoint.path={uri}", f"hydra.run.dir={tmp_path}/i"])
    assert r.returncode == 0 and "rank00000.safetensors" in r.stdout, _tail(r)


@pytest.mark.parametrize("kind", ["s3", "az", "gs"])
def test_a_deepspeed_universal_checkpoint_in_a_bucket_exports_to_hugging_face(cli, request, tmp_path, kind):
    """A universal checkpoint keeps each parameter in a directory of its own (zero/<param>/): a
    foreign prefix's listing is its top level, so the files under zero/ are listed once, on first
    use. Exported from each store, the weights equal DeepSpeed's zero_to_fp32, bit for bit."""
    from safetensors.torch import load_file

    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed", "zero2_fp32")
    src = Place(request, kind, tmp_path, "runs/ds_universal")
    if kind == "gs":
        emulators.gcs_upload_dir(src.endpoint, src.bucket, src.uri.split("/", 3)[3], os.path.join(fixture, "_universal"))
    else:
        b = Bucket(src.uri)
        for root, _, files in os.walk(os.path.join(fixture, "_universal")):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), os.path.join(fixture, "_universal")).replace(os.sep, "/")
                with open(os.path.join(root, f), "rb") as fh:
                    b.put(b.key(rel), fh.read())
    out = tmp_path / "hf"
    r = cli(["+job=reshard", f"job.source.path={src.uri}", "job.output_format=hf", f"job.output={out}",
             f"hydra.run.dir={tmp_path}/r"])
    assert r.returncode == 0, _tail(r)
    got = load_file(str(out / "model.safetensors"))
    expect = load_file(os.path.join(fixture, "reference", "zero_to_fp32.safetensors"))
    assert got.keys() == expect.keys() and all(torch.equal(got[k], v) for k, v in expect.items())
