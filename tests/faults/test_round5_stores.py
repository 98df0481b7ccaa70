"""Reliability round 5 on object stores (real servers on loopback: moto for S3, azurite for Azure,
fake-gcs-server for GCS): what an export or a benchmark deletes, and what it may not."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp import tools
from hpdcp_runner.dcp.storage.object_store import Bucket


@pytest.fixture(params=["s3", "az"])
def store(request):
    """A fresh bucket (S3) or container (Azure) URI."""
    return request.getfixturevalue({"s3": "s3_bucket", "az": "az_container"}[request.param])


def _names(uri: str) -> dict[str, dict]:
    b = Bucket(uri)
    return {o["path"][len(b.root) + 1:]: o for o in b.list(b.root)}


def test_a_planted_export_manifest_deletes_nothing_of_the_users(store, fault_row):
    """Item 6: a ``.hpdcp-export.json`` planted beside a user's objects (naming them, even with
    their true sizes and ETags) made ``export_hf(overwrite=True)`` delete them. A manifest now
    retires only files named as an export names its weight files, and only while the store holds
    the very object it recorded."""
    src, out = f"{store}/runs/ck", f"{store}/out"
    dcp.save({"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), "v": torch.ones(64, 32)},
             checkpoint_id=src)
    tools.export_hf(src, out, max_shard_size=64 * 32 * 4)  # two shards and an index
    first = _names(out)
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json", ".hpdcp-export.json"} <= set(first), sorted(first)
    ob = Bucket(out)
    users = {"notes.txt": b"mine", "data/train.bin": b"\x01" * 1000, "config.json": b'{"mine": true}'}
    for name, body in users.items():
        ob.put(f"{ob.root}/{name}", body)
    now = _names(out)
    planted = {"format": "hpdcp-export", "version": 2,
               "files": {n: {"size": now[n]["size"], "e_tag": now[n]["e_tag"]} for n in users}}
    planted["files"]["model-00002-of-00002.safetensors"] = {"size": 1, "e_tag": "not-the-one-we-wrote"}
    ob.put(f"{ob.root}/.hpdcp-export.json", json.dumps(planted).encode())
    tools.export_hf(src, out, overwrite=True)  # now one model.safetensors: the old shards are not in it
    after = _names(out)
    for name, body in users.items():
        assert name in after, sorted(after)
        assert bytes(ob.get(f"{ob.root}/{name}")[0]) == body
    # the shard the planted manifest misdescribed is kept (a reader never sees it: the index is ours)
    assert "model-00002-of-00002.safetensors" in after and "model.safetensors" in after
    # an honest manifest (this export's) retires exactly its own weight files on the next overwrite
    mine = json.loads(bytes(ob.get(f"{ob.root}/.hpdcp-export.json")[0]))["files"]
    assert set(mine) >= {"model.safetensors"} and all(set(r) == {"size", "e_tag"} for r in mine.values())
    tools.export_hf(src, out, overwrite=True, max_shard_size=64 * 32 * 4)
    final = _names(out)
    assert "model.safetensors" not in final and "model-00001-of-00002.safetensors" in final
    assert set(users) <= set(final)
    fault_row(f"{store.split(':')[0]}: a planted .hpdcp-export.json naming a user's objects (true sizes and ETags) "
              "before export_hf(overwrite=True)", "export deletes only its own",
              "the user's objects kept; only weight files the store still holds as recorded are retired", None,
              "file", True, None, None)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_bench_never_touches_what_was_in_its_directory(where, tmp_path, request, fault_row):
    """Item 7: ``+job=bench`` with ``checkpoint.dir`` holding the user's own ``bench_0`` (a
    checkpoint, and a file of theirs inside it) saved over it and deleted it, exit 0. The timed
    checkpoints now go into a fresh prefix of the bench's own, and only that prefix goes."""
    import subprocess
    import sys

    from tests.e2e.conftest import _env, metrics

    base = str(tmp_path / "ckpts") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/ckpts"
    users = f"{base}/bench_0"
    ref = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(ref, checkpoint_id=users)
    if where == "local":
        (tmp_path / "ckpts" / "bench_0" / "NOTES.md").write_text("mine")
    else:
        b = Bucket(users)
        b.put(f"{b.root}/NOTES.md", b"mine")
    before = sorted(_names(base)) if where != "local" else sorted(os.listdir(tmp_path / "ckpts" / "bench_0"))
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=bench", "job.repeats=1", "job.warmup=1",
                        f"checkpoint.dir={base}", f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True,
                       timeout=240, env=_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    timed = metrics(tmp_path / "run")["result"]["store_timed"]
    assert "/ckpts/hpdcp-bench-" in timed, timed
    got = {"w": torch.zeros(3, 4)}
    dcp.load(got, checkpoint_id=users)
    assert torch.equal(got["w"], ref["w"])
    after = sorted(_names(base)) if where != "local" else sorted(os.listdir(tmp_path / "ckpts" / "bench_0"))
    assert after == before and any(n.endswith("NOTES.md") for n in after), after
    if where == "local":
        assert sorted(os.listdir(tmp_path / "ckpts")) == ["bench_0"]  # its own folder went with its checkpoints
    fault_row(f"{where}: +job=bench with checkpoint.dir holding the user's bench_0 (and a file of theirs)",
              "deletes only its own", "the timed checkpoints go to a fresh prefix of the bench's; the user's bench_0 "
              "loads bitwise and keeps its file", None, "file", True, None, None)


def _sd(k: int) -> dict:
    return {"w": torch.full((16, 8), float(k)), "step": k}


def _loads_as(path: str, k: int) -> bool:
    got = {"w": torch.zeros(16, 8), "step": 0}
    dcp.load(got, checkpoint_id=path)
    return torch.equal(got["w"], torch.full((16, 8), float(k))) and got["step"] == k


@pytest.fixture
def fresh_verdicts():
    from hpdcp_runner.dcp.storage import object_checkpoint as oc

    oc._HONOURS_CONDITIONS.clear()
    yield
    oc._HONOURS_CONDITIONS.clear()


def test_a_verdict_on_conditional_writes_belongs_to_one_kind_of_store(s3_endpoint, az_container, monkeypatch,
                                                                      fresh_verdicts, fault_row):
    """Item 8: the verdict was cached per (endpoint option or AWS_ENDPOINT_URL, name) whatever the
    store, so an Azure container's "honours conditions" was reused for an S3 bucket of the same
    name behind an endpoint that ignores them. The S3 endpoint here is a proxy that strips the
    condition headers (what such a store does; a proxy because no server ignores them on demand)."""
    from tests import s3_server
    from tests.s3_proxy import Proxy

    name = az_container[len("az://"):]
    s3_server.client(s3_endpoint).create_bucket(Bucket=name)
    p = Proxy(s3_endpoint)
    try:
        p.strip_conditions = True
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        dcp.save(_sd(1), checkpoint_id=f"{az_container}/ck")  # azurite honours them
        with pytest.raises(dcp.ConfigError, match=r"ignores conditional creates \(If-None-Match\)"):
            dcp.save(_sd(1), checkpoint_id=f"s3://{name}/ck")
        assert _loads_as(f"{az_container}/ck", 1)
    finally:
        p.close()
    fault_row("an Azure container's verdict on conditional writes, then an S3 bucket of the same name behind a store "
              "that ignores them (proxy)", "object-store commit", "the verdict is per store kind, endpoint and "
              "bucket: the S3 save probes and is refused", "ConfigError", "config key", True, None, None)


def test_a_store_that_ignores_if_match_refuses_overwrites_not_new_saves(proxied, fresh_verdicts, fault_row):
    """Item 8: the probe tested conditional creates only; behind a store that honours
    If-None-Match but ignores If-Match, two racing overwrites of one name both reported success
    and one was lost. The probe now replaces a stale version too; a new name still saves, an
    overwrite is refused unless ``dcp.storage.unconditional_ok=true``."""
    from hpdcp_runner.dcp.storage import object_store

    p, bucket = proxied
    p.strip_conditions = "if-match"
    dcp.save(_sd(1), checkpoint_id=f"{bucket}/ck")  # a create: If-None-Match is honoured
    assert _loads_as(f"{bucket}/ck", 1)
    with pytest.raises(dcp.ConfigError, match=r"ignores conditional replaces \(If-Match\).*unconditional_ok=true"):
        dcp.save(_sd(2), checkpoint_id=f"{bucket}/ck", overwrite=True)
    assert _loads_as(f"{bucket}/ck", 1)  # the previous checkpoint stands
    object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint, unconditional_ok=True))
    dcp.save(_sd(2), checkpoint_id=f"{bucket}/ck", overwrite=True)  # allowed, with a warning
    assert _loads_as(f"{bucket}/ck", 2)
    fault_row("object store: a store that honours If-None-Match but ignores If-Match (proxy)", "object-store commit",
              "the probe replaces a stale version too: new names save, overwrites are refused unless "
              "dcp.storage.unconditional_ok=true", "ConfigError", "config key", True, None, None)
