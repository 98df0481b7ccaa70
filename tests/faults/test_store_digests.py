"""Foreign checkpoints in a bucket are checked against the store's own MD5 (issue 50, item 12):
a Hugging Face model records no checksum, so a byte corrupted between the store and the load
used to load as a wrong value.

The corruption comes from the loopback proxy (tests/s3_proxy.py), which flips one byte of an
object in GET replies: a store serving other bytes than it stored, or a network corrupting them,
is a fault no real server produces on demand. The store behind it (moto) is real, and so are the
ETags it computed when the files were uploaded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner import dcp
from hpdcp_runner.dcp.storage.objects.store_digests import PENDING_CAP, StoreDigests, content_md5
from tests import emulators, s3_server

pytestmark = pytest.mark.usefixtures("s3_endpoint")


def _model() -> dict:
    """Larger than the 64 KiB blocks a header is read in, so a load reads most of it by ranges."""
    g = torch.Generator().manual_seed(5)
    return {"model.embed_tokens.weight": torch.randn(256, 128, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(384, 128, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(128, generator=g)}


def _spans(path) -> dict:
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in head.items()
            if k != "__metadata__"}


def _upload_model(tmp_path, endpoint, uri, with_config=True) -> tuple[dict, int]:
    """An HF model directory uploaded as single-part objects; the offset of a byte inside the
    first tensor's data in model.safetensors."""
    t = _model()
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    save_file(t, str(d / "model.safetensors"))
    if with_config:
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    c = s3_server.client(endpoint)
    bucket, _, prefix = uri[5:].partition("/")
    for name in os.listdir(d):
        c.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(d / name).read_bytes())
    last = max(_spans(d / "model.safetensors").values())
    return t, last[0] + 100  # in the file's last tensor, past the first 64 KiB block


def _load(uri, t, **kw):
    got = {k: torch.zeros_like(v) for k, v in t.items()}
    res = dcp.load(got, checkpoint_id=uri, format="hf", **kw)
    return got, res


def test_etag_forms():
    md5 = hashlib.md5(b"x").hexdigest()
    assert content_md5("s3", f'"{md5}"') == md5 and content_md5("gs", md5.upper()) == md5
    assert content_md5("s3", f'"{md5}-3"') is None  # a multipart object's ETag says nothing of its bytes
    import base64
    b64 = base64.b64encode(hashlib.md5(b"x").digest()).decode()
    assert content_md5("gs", b64) == md5 and content_md5("s3", b64) is None
    assert content_md5("az", "0x8DBF3B1C2A1E2F0") is None and content_md5("az", f'"{md5}"') is None


def test_clean_model_matches(tmp_path, s3_endpoint, s3_bucket):
    uri = f"{s3_bucket}/hf"
    t, _ = _upload_model(tmp_path, s3_endpoint, uri)
    got, res = _load(uri, t)
    assert all(torch.equal(got[k], t[k]) for k in t)
    assert res.counters["store_digests_matched"] == 1  # model.safetensors, read whole


def test_byte_corrupted_on_every_read_fails_the_load(tmp_path, s3_endpoint, s3_bucket, proxied, fault_row):
    proxy, _ = proxied
    uri = f"{s3_bucket}/hf"
    t, at = _upload_model(tmp_path, s3_endpoint, uri)
    proxy.flip = ("model.safetensors", at, -1)
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        _load(uri, t)
    msg = str(e.value)
    assert "hf/model.safetensors" in msg and "stored copy is corrupted" in msg and "read twice" in msg
    assert proxy.flipped >= 2  # the load's read and the second read
    fault_row("a Hugging Face model in a bucket serving one flipped byte (every read; proxy)", "corrupted data",
              "load fails: the object read whole does not match the store's MD5 (ETag), read twice, and another "
              "object of the model matches its own", "CorruptCheckpointError", "file", None, None, None)


def test_byte_corrupted_once_is_named_as_corrupted_on_its_way(tmp_path, s3_endpoint, s3_bucket, proxied, fault_row):
    proxy, _ = proxied
    uri = f"{s3_bucket}/hf"
    t, at = _upload_model(tmp_path, s3_endpoint, uri)
    proxy.flip = ("model.safetensors", at, 1)
    with pytest.raises(dcp.CorruptCheckpointError, match="corrupted on its way"):
        _load(uri, t)
    got, _ = _load(uri, t)  # loading again, as the error says, gives the right values
    assert all(torch.equal(got[k], t[k]) for k in t)
    fault_row("a Hugging Face model in a bucket: one byte corrupted on its way, once (proxy)", "corrupted data",
              "load fails: a second read matches the store's MD5, so the first was corrupted on its way; loading "
              "again succeeds bitwise", "CorruptCheckpointError", "file", None, None, None)


def test_uncalibrated_store_warns_auto_and_fails_strict(tmp_path, s3_endpoint, s3_bucket, proxied, caplog, fault_row):
    """No other object shows this bucket's ETags are MD5s (encrypted objects have other ETags):
    auto names the object as unchecked; strict fails."""
    from hpdcp_runner.dcp.storage.objects import object_store

    proxy, _ = proxied
    uri = f"{s3_bucket}/hf"
    t, at = _upload_model(tmp_path, s3_endpoint, uri, with_config=False)
    proxy.flip = ("model.safetensors", at, -1)
    got, res = _load(uri, t)
    assert res.counters["store_digests_unusable"] == 1
    assert "model.safetensors: its ETag is not the MD5" in caplog.text
    assert not all(torch.equal(got[k], t[k]) for k in t)  # what auto cannot catch
    object_store.configure(object_store.ObjectStoreOptions(endpoint=proxy.endpoint, store_digests="strict"))
    with pytest.raises(dcp.CorruptCheckpointError, match="store_digests=strict"):
        _load(uri, t)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=proxy.endpoint, store_digests="off"))
    _, res = _load(uri, t)
    assert "store_digests_matched" not in res.counters and "store_digests_unusable" not in res.counters
    fault_row("a one-file Hugging Face model in a bucket serving one flipped byte, no other object to show that "
              "the bucket's ETags are MD5s (proxy)", "corrupted data",
              "auto: loads, with a warning naming the object as unchecked (encrypted objects have such ETags); "
              "dcp.storage.store_digests=strict fails", "CorruptCheckpointError (strict)", "file", None, None, None)


def test_part_of_an_object_is_not_checked_and_holds_nothing(tmp_path, s3_endpoint, s3_bucket, proxied):
    """A load of part of a tensor (a reshard's slice) cannot check a whole-object digest: no error,
    no false alarm, and the early pieces are let go when the round ends."""
    from hpdcp_runner.dcp.offline.inspection import iter_full_tensors
    from hpdcp_runner.dcp.storage.checkpoint_io import open_reader

    proxy, _ = proxied
    uri = f"{s3_bucket}/hf"
    t, at = _upload_model(tmp_path, s3_endpoint, uri)
    proxy.flip = ("model.safetensors", at, -1)  # in a byte this read never asks for
    reader = open_reader(uri, "hf")
    keys = ["model.norm.weight"]  # the last tensor only: bytes before it never arrive
    got = dict(iter_full_tensors(uri, keys, reader=reader))
    assert torch.equal(got["model.norm.weight"], t["model.norm.weight"])
    states = reader.files.store_digest_states()
    assert states == {"model.safetensors": "skipped", "config.json": "open"}, states


def test_digests_out_of_order_and_bounded():
    """Pieces arriving out of order are hashed once contiguous; past the bound the object is
    given up (no memory held), never judged on partial bytes."""
    data = os.urandom(3 << 20)
    md5 = hashlib.md5(data).hexdigest()

    def fresh(body, mode="auto"):
        w = StoreDigests(scheme="s3", url="s3://b/p", key_of=lambda n: n, read_range=lambda k, lo, hi: body[lo:hi],
                         mode=mode)
        w.watch({"f": (len(body), f'"{md5}"')})
        return w

    w = fresh(data)
    pieces = [(lo, data[lo:lo + (1 << 20)]) for lo in range(0, len(data), 1 << 20)]
    for lo, piece in (pieces[2], pieces[0], pieces[0], pieces[1]):
        w.feed("f", lo, piece)
    w.settle()
    assert w.states() == {"f": "matched"}
    bad = bytearray(data)
    bad[5] ^= 1
    w = fresh(bytes(bad), "strict")
    w.feed("f", 0, bytes(bad))  # hashed by the watch's thread: the verdict comes at settle
    with pytest.raises(dcp.CorruptCheckpointError, match="read twice"):
        w.settle()
    w.settle()  # raised once
    w.close()
    big = os.urandom(PENDING_CAP + (2 << 20))
    w = StoreDigests(scheme="s3", url="s3://b/p", key_of=lambda n: n, read_range=lambda k, lo, hi: big[lo:hi])
    w.watch({"f": (len(big) + 1, '"' + "0" * 32 + '"')})
    w.feed("f", 1, big)  # byte 0 never came
    assert w.states() == {"f": "skipped"}


def test_gcs_base64_etags_checked(tmp_path, gcs_endpoint, gcs_bucket):
    t = _model()
    save_file(t, str(tmp_path / "model.safetensors"))
    bucket = gcs_bucket[5:] if gcs_bucket.startswith("gs://") else gcs_bucket
    emulators.gcs_upload_dir(gcs_endpoint, bucket, "hf", str(tmp_path))
    got, res = _load(f"gs://{bucket}/hf", t)
    assert all(torch.equal(got[k], t[k]) for k in t)
    assert res.counters["store_digests_matched"] == 1


def test_verify_job_reports_store_digests(tmp_path, s3_endpoint, s3_bucket):
    uri = f"{s3_bucket}/hf"
    _upload_model(tmp_path, s3_endpoint, uri)
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=verify", f"job.source.path={uri}",
                        "job.source.format=hf", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 object(s) matched the store's MD5" in r.stdout, r.stdout


def test_cli_reshard_of_a_corrupted_model_fails_on_every_rank(tmp_path, s3_endpoint, s3_bucket, proxied):
    """Through torchrun on 2 ranks: each rank reads part of the model (nothing to check), the
    reshard's verify reads it whole on rank 0 and fails naming the object; both ranks exit
    non-zero, no hang, and the output the job wrote from those bytes is removed."""
    proxy, _ = proxied
    uri = f"{s3_bucket}/hf"
    _, at = _upload_model(tmp_path, s3_endpoint, uri)
    proxy.flip = ("model.safetensors", at, -1)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "hpdcp_runner",
                        "+job=reshard", f"job.source.path={uri}", f"job.output={tmp_path / 'out'}", "layout=auto",
                        f"dcp.storage.endpoint={proxy.endpoint}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0, r.stdout[-2000:]
    assert "hf/model.safetensors" in r.stderr and "stored copy is corrupted" in r.stderr, r.stderr[-3000:]
    # the output was written from the partial reads before the verify could tell: it is removed
    assert "was removed (this job wrote it" in r.stderr and not (tmp_path / "out").exists()
    assert proxy.flipped >= 2


# -- corrupted at rest, in a real server's own storage (no proxy) -----------------------------------

def _flip_in_files(root, payload: bytes, at: int) -> str:
    """Flip the byte ``at`` of ``payload`` where the server stored it under ``root``; the file."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, "rb") as f:
                raw = f.read()
            i = raw.find(payload)
            if i >= 0:
                with open(path, "r+b") as f:
                    f.seek(i + at)
                    f.write(bytes([raw[i + at] ^ 0x01]))
                return path
    raise AssertionError(f"the payload is not stored in a file under {root}")


@pytest.fixture
def on_disk_store(request, tmp_path, monkeypatch):
    """(URI of a fresh bucket/container, the server's storage directory, upload(key, bytes)) on a
    server of the test's own that keeps objects in files: GCS (fake-gcs-server) or Azure (azurite)."""
    from hpdcp_runner.dcp.storage.objects import object_store
    from hpdcp_runner.dcp.storage.objects.object_store import Bucket

    gcs = request.param == "gs"
    why = emulators.gcs_unavailable() if gcs else emulators.azure_unavailable()
    if why:
        pytest.skip(why)
    root = str(tmp_path / "server")
    os.makedirs(root)
    endpoint, proc = (emulators.start_gcs_on_disk if gcs else emulators.start_azurite_on_disk)(root)
    for k, v in (emulators.gcs_env if gcs else emulators.azure_env)(endpoint).items():
        monkeypatch.setenv(k, v)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=endpoint))
    try:
        name = emulators.new_gcs_bucket(endpoint) if gcs else emulators.new_container(endpoint)

        def upload(key, data):
            if gcs:
                emulators.gcs_upload(endpoint, name, key, data)
            else:
                b = Bucket(f"az://{name}")
                b.put(b.key(key), data)
        yield f"{request.param}://{name}", root, upload
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
        emulators.stop(proc)


@pytest.mark.parametrize("on_disk_store", ["gs", "az"], indirect=True)
def test_object_corrupted_at_rest_in_the_store(tmp_path, on_disk_store, fault_row):
    """A byte flipped in the server's own file of the object (bit rot under a store that keeps the
    MD5 it recorded at upload): the load fails naming the object, and verify does too; before the
    flip both pass. Azure's digest is a Content-MD5 (read by a signed HEAD), GCS's its ETag."""
    uri, root, upload = on_disk_store
    t = _model()
    save_file(t, str(tmp_path / "model.safetensors"))
    payload = (tmp_path / "model.safetensors").read_bytes()
    upload("hf/model.safetensors", payload)
    upload("hf/config.json", json.dumps({"model_type": "llama"}).encode())
    got, res = _load(f"{uri}/hf", t)
    assert all(torch.equal(got[k], t[k]) for k in t) and res.counters["store_digests_matched"] >= 1
    last = max(_spans(tmp_path / "model.safetensors").values())
    _flip_in_files(root, payload, last[0] + 100)
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        _load(f"{uri}/hf", t)
    assert "hf/model.safetensors" in str(e.value) and "stored copy is corrupted" in str(e.value), str(e.value)
    kind = "GCS (fake-gcs-server, ETag)" if uri.startswith("gs") else "Azure (azurite, Content-MD5)"
    fault_row(f"{kind}: a Hugging Face file corrupted at rest in the server's own storage", "corrupted data",
              "load fails naming the object: its bytes, read twice, do not match the MD5 the store recorded",
              "CorruptCheckpointError", "file", None, None, None)
