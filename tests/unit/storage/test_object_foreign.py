"""Foreign checkpoints uploaded to an object store and read in place (a real S3 server on
loopback): a Hugging Face directory (one file, and shards with an index) and a torch DCP
checkpoint load bitwise, sliced (a rank's part), with the headers and zip records read in a few
ranged GETs, not a round trip per small read."""

import json
import os

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp.core.geometry import Box
from tests import s3_server


def _tensors():
    g = torch.Generator().manual_seed(11)
    return {"emb.weight": torch.randn(40, 24, generator=g).to(torch.bfloat16),
            "layers.0.w": torch.randn(24, 24, generator=g), "layers.1.w": torch.randn(24, 24, generator=g),
            "norm": torch.randn(24, generator=g), "count": torch.tensor(7, dtype=torch.int64)}


def _upload(endpoint, bucket, local_dir, prefix):
    c = s3_server.client(endpoint)
    for name in os.listdir(local_dir):
        c.upload_file(os.path.join(local_dir, name), bucket, f"{prefix}/{name}")


def _load_all(uri, fmt, **kw):
    ref = _tensors()
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    res = dcp.load(got, checkpoint_id=uri, format=fmt, **kw)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    return res


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_in_place(tmp_path, s3_endpoint, s3_bucket, sharded):
    from safetensors.torch import save_file

    t = _tensors()
    d = tmp_path / "hf"
    d.mkdir()
    if sharded:
        a = {k: v for k, v in t.items() if k.startswith("emb") or k == "count"}
        b = {k: v for k, v in t.items() if k not in a}
        save_file(a, str(d / "model-00001-of-00002.safetensors"))
        save_file(b, str(d / "model-00002-of-00002.safetensors"))
        wm = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    else:
        save_file(t, str(d / "model.safetensors"))
    bucket = s3_bucket[5:]
    _upload(s3_endpoint, bucket, d, "models/m")
    res = _load_all(f"{s3_bucket}/models/m", "auto")
    assert res.counters["store_requests"] <= 12, res.counters
    md = dcp.read_metadata(f"{s3_bucket}/models/m")
    assert md.extra["source_format"] == "hf" and md.tensors["norm"].shape == (24,)
    # a slice, as a tensor-parallel rank reads it
    reader = dcp.open_reader(f"{s3_bucket}/models/m")
    m = dcp.Metadata.from_json(reader.read_metadata_text(), source="x", open_file=reader.open_file)
    reader.attach_metadata(m)
    from hpdcp_runner.dcp.storage.interfaces import ReadRequest
    dest = torch.zeros(40, 12, dtype=torch.bfloat16)
    reader.read_tensors([ReadRequest(m.tensors["emb.weight"].chunks[0], "bfloat16", Box((0, 12), (40, 12)), dest)])
    assert torch.equal(dest, t["emb.weight"][:, 12:])


def test_torch_dcp_in_place(tmp_path, s3_endpoint, s3_bucket):
    import torch.distributed.checkpoint as tdcp

    t = _tensors()
    tdcp.save({**t, "step": 5}, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "tdcp")), no_dist=True)
    _upload(s3_endpoint, s3_bucket[5:], tmp_path / "tdcp", "dcp/run")
    uri = f"{s3_bucket}/dcp/run"
    with pytest.raises(dcp.PickleNotAllowedError):
        dcp.read_metadata(uri)
    got = {k: torch.zeros_like(v) for k, v in t.items()}
    got["step"] = 0
    res = dcp.load(got, checkpoint_id=uri, allow_pickle=True)
    assert got["step"] == 5 and all(torch.equal(got[k], t[k]) for k in t)
    assert res.counters["store_requests"] <= 16, res.counters
    # a flipped length in a record's zip structure is refused, not read shifted
    c = s3_server.client(s3_endpoint)
    key = next(o["Key"] for o in c.list_objects_v2(Bucket=s3_bucket[5:], Prefix="dcp/run/")["Contents"]
               if o["Key"].endswith(".distcp"))
    body = bytearray(c.get_object(Bucket=s3_bucket[5:], Key=key)["Body"].read())
    body[:4] = b"XXXX"  # the first record's zip magic
    c.put_object(Bucket=s3_bucket[5:], Key=key, Body=bytes(body))
    with pytest.raises(dcp.CorruptCheckpointError, match="distcp"):
        dcp.load({**{k: torch.zeros_like(v) for k, v in t.items()}, "step": 0}, checkpoint_id=uri, allow_pickle=True)


def test_merge_to_hf_from_and_to_a_bucket(s3_bucket):
    from hpdcp_runner.dcp.tools import transforms

    t = {k: v for k, v in _tensors().items() if v.dim()}
    dcp.save({**t, "step": 4}, checkpoint_id=f"{s3_bucket}/ours")
    res = transforms.merge_to_hf(f"{s3_bucket}/ours", f"{s3_bucket}/hf", max_shard_size=2048)
    assert len(res["files"]) > 1 and res["skipped_objects"] == ["step"]
    got = {k: torch.zeros_like(v) for k, v in t.items()}
    dcp.load(got, checkpoint_id=f"{s3_bucket}/hf", format="hf")
    assert all(torch.equal(got[k], t[k]) for k in t)
    with pytest.raises(dcp.CheckpointExistsError, match="already holds a Hugging Face model"):
        transforms.merge_to_hf(f"{s3_bucket}/ours", f"{s3_bucket}/hf")
    transforms.merge_to_hf(f"{s3_bucket}/ours", f"{s3_bucket}/hf", overwrite=True, single_file=True)
    md = dcp.read_metadata(f"{s3_bucket}/hf", format="hf")
    assert set(md.files) == {"model.safetensors"}  # the old shards and index were removed
