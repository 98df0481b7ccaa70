"""Reliability round 5 on object stores (real servers on loopback: moto for S3, azurite for Azure,
fake-gcs-server for GCS): what an export or a benchmark deletes, and what it may not."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp import tools
from hpdcp_runner.dcp.storage.objects.object_store import Bucket


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
    from hpdcp_runner.dcp.storage.objects import object_checkpoint as oc

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
    from hpdcp_runner.dcp.storage.objects import object_store

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


def _cli(args, tmp_path, env=None):
    import subprocess
    import sys

    from tests.e2e.conftest import _env

    return subprocess.run([sys.executable, "-m", "hpdcp_runner", *args], capture_output=True, text=True, timeout=240,
                          env=env or _env(), cwd=str(tmp_path))


def _everything_written(root) -> str:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out.append(fh.read().decode(errors="replace"))
    return "\n".join(out)


def test_a_secret_in_a_uris_query_is_never_printed_or_recorded(tmp_path, az_container, fault_row):
    """Item 9: ``az://c/p?sv=...&sig=SECRET`` was accepted, saved under a key holding the query,
    and SECRET printed and written to ``.hydra/*.yaml`` and ``metrics.json``; an https SAS URL's
    refusal printed SECRET; a missing ``s3://...?X-Amz-Signature=SECRET`` named it. Every form is
    now refused in one line with the query redacted, from the command line, a config file and
    the Python API, and nothing under the run directory holds the secret."""
    secret = "SECRETsig0123456789"
    forms = {"checkpoint.path": f"{az_container}/ck?sv=2022-11-02&sp=rwdl&sig={secret}",
             "job.source.path": f"https://devstoreaccount1.blob.core.windows.net/c/ck?sv=1&sig={secret}",
             "checkpoint.dir": f"s3://bucket/ck?X-Amz-Credential=AK&X-Amz-Signature={secret}"}
    for i, (key, uri) in enumerate(forms.items()):
        job = "+job=load" if key == "job.source.path" else "+job=save"
        r = _cli([job, f"{key}={uri}", f"hydra.run.dir={tmp_path}/run{i}"], tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and secret not in out, out[-2000:]
        assert f"{key}=" in out and "query string" in out and "Traceback" not in out, out[-2000:]
    # a config file (Hydra saves the composed config before the job runs)
    (tmp_path / "cfg" / "site").mkdir(parents=True)
    (tmp_path / "cfg" / "site" / "mine.yaml").write_text(
        f"# @package _global_\ncheckpoint:\n  path: '{forms['checkpoint.path']}'\n")
    r = _cli(["--config-dir", str(tmp_path / "cfg"), "+job=save", "+site=mine", f"hydra.run.dir={tmp_path}/filerun"],
             tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and secret not in out and "query string" in out, out[-2000:]
    assert secret not in _everything_written(tmp_path / "filerun")
    # the Python API
    with pytest.raises(dcp.ConfigError, match="query string") as ei:
        dcp.save(_sd(1), checkpoint_id=forms["checkpoint.path"])
    assert secret not in str(ei.value)
    assert not _names(az_container)  # nothing was written under a key holding the query
    fault_row("a SAS token or presigned signature in a location's query string (command line, config file, API)",
              "secrets", "refused in one line, the query redacted; nothing printed or recorded holds it",
              "ConfigError", "config key", None, None, None)


def test_storage_knobs_are_parsed_as_the_numbers_they_are(tmp_path, s3_endpoint, s3_bucket, fault_row):
    """Item 10: ``request_timeout_s=0.5`` became 0 s (every request failed), ``nan`` gave a
    traceback, ``inf`` a bare OverflowError, and the documented ``dcp.storage.endpoint=http://...``
    was refused on the command line. Here the endpoint comes from the override alone
    (AWS_ENDPOINT_URL removed)."""
    from tests.e2e.conftest import _env

    env = _env()
    env.pop("AWS_ENDPOINT_URL", None)
    ck = f"{s3_bucket}/ck"
    r = _cli(["+job=save", f"checkpoint.path={ck}", f"dcp.storage.endpoint={s3_endpoint}", "dcp.storage.allow_http=true",
              "dcp.storage.request_timeout_s=0.5", f"hydra.run.dir={tmp_path}/ok"], tmp_path, env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "hpdcp-commit.json" in _names(ck)
    for value in ("nan", "inf", "-1", "0"):
        r = _cli(["+job=save", f"checkpoint.path={ck}2", f"dcp.storage.request_timeout_s={value}",
                  f"hydra.run.dir={tmp_path}/{value}"], tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and "dcp.storage.request_timeout_s:" in out and "Traceback" not in out, out[-2000:]
    r = _cli(["+job=save", f"checkpoint.path={ck}3", "dcp.storage.endpoint=ftp://host", f"hydra.run.dir={tmp_path}/e"],
             tmp_path)
    assert r.returncode == 2 and "dcp.storage.endpoint:" in r.stderr + r.stdout, (r.stdout + r.stderr)[-2000:]
    fault_row("dcp.storage.request_timeout_s=0.5 / nan / inf / -1, dcp.storage.endpoint on the command line",
              "config", "fractions kept (milliseconds), non-finite and out-of-range refused naming the key; the "
              "endpoint override accepted", "ConfigError", "config key", None, None, None)


def test_a_copy_into_its_own_source_is_refused_and_the_source_still_verifies(tmp_path, fault_row):
    """Item 12: ``copy_checkpoint(src, src/copy)`` was accepted and left the source failing
    ``verify`` (files its metadata does not name). A destination that is, lies inside, or holds
    the source is now refused before anything is written, links resolved."""
    src = tmp_path / "ck"
    dcp.save(_sd(3), checkpoint_id=src)
    os.symlink(src, tmp_path / "alias")
    for dst in (src / "copy", src, tmp_path, tmp_path / "alias" / "copy"):
        with pytest.raises(dcp.ConfigError, match="is, lies inside, or holds the source"):
            dcp.copy_checkpoint(src, str(dst), overwrite=True)
    assert "copy" not in os.listdir(src)
    assert tools.verify(src).ok and _loads_as(str(src), 3)
    dcp.copy_checkpoint(src, str(tmp_path / "elsewhere"))
    assert _loads_as(str(tmp_path / "elsewhere"), 3)
    fault_row("copy_checkpoint into its own source (src/copy, src, its parent, through a link)", "input checks",
              "refused before anything is written; the source still verifies", "ConfigError", "file", True, None,
              None)


def test_an_hf_export_never_writes_over_a_checkpoint_uploaded_as_plain_files(tmp_path, s3_bucket, fault_row):
    """Item 12: an HF export into a prefix holding one of our checkpoints uploaded as plain files
    (``aws s3 cp --recursive``: metadata.json and rank files, no commit object) wrote beside it
    with overwrite. It is refused like a committed checkpoint, at the prefix or under it."""
    src = tmp_path / "ck"
    dcp.save(_sd(4), checkpoint_id=src)
    for where in ("up", "up/inner/ck"):
        b = Bucket(f"{s3_bucket}/{where}")
        for name in os.listdir(src):
            b.upload_file(f"{b.root}/{name}", str(src / name))
    before = _names(f"{s3_bucket}/up")
    for dst in (f"{s3_bucket}/up", f"{s3_bucket}/up/inner"):
        with pytest.raises(dcp.CheckpointExistsError, match="holds an hpdcp checkpoint"):
            tools.export_hf(str(src), dst, overwrite=True)
    assert _names(f"{s3_bucket}/up").keys() == before.keys()
    assert _loads_as(f"{s3_bucket}/up", 4)
    fault_row("an HF export with overwrite into a prefix holding a checkpoint uploaded as plain files (S3)",
              "export deletes only its own", "refused like a committed checkpoint; nothing written",
              "CheckpointExistsError", "file", True, None, None)
