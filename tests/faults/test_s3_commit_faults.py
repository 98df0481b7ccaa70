"""Issue 40: a bucket's commit that cannot lie. Against the real loopback S3 server; a proxy
(tests/s3_proxy.py) only for what the server cannot do on demand: a reply lost after the store
applied the request. Other harm is made with the server's own API (boto3), as another process
would: a save's files deleted before its commit, a commit object naming nothing, tampered metadata."""

from __future__ import annotations

import json

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp import faults
from hpdcp_runner.dcp.storage.objects import object_store
from hpdcp_runner.dcp.storage.retention import apply_retention, latest_checkpoint, list_checkpoints, series_extra
from tests import s3_server


def _sd(v):
    return {"w": torch.full((64, 32), float(v)), "step": int(v)}


def _loads_as(path, v):
    got = {"w": torch.zeros(64, 32), "step": -1}
    dcp.load(got, checkpoint_id=path)
    return got["step"] == v and torch.equal(got["w"], _sd(v)["w"])


def _keys(endpoint, bucket, prefix):
    got = s3_server.client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in got)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_commit_whose_reply_is_lost_after_it_landed_is_a_success(proxied, s3_endpoint, overwrite, fault_row):
    """The store applied the commit; the reply was lost; the client's retry got 412. The save used
    to say 'nothing was committed' and delete the objects the name now pointed at."""
    p, bucket = proxied
    path = f"{bucket}/ck"
    if overwrite:
        dcp.save(_sd(1), checkpoint_id=path)
    p.lose_reply_next(1, method="PUT", path_contains="hpdcp-commit.json")
    dcp.save(_sd(2), checkpoint_id=path, overwrite=overwrite)  # knows what it published
    assert p.faults_served == 1
    assert _loads_as(path, 2)
    doc = json.loads(s3_server.client(s3_endpoint).get_object(Bucket=bucket[5:], Key="ck/hpdcp-commit.json")["Body"]
                     .read())
    assert any(k.startswith(f"ck/{doc['data']}/rank") for k in _keys(s3_endpoint, bucket[5:], "ck/"))
    fault_row(
        f"object store: the commit's reply lost after the store applied it "
        f"({'overwrite' if overwrite else 'new name'}; proxy)",
        "object-store commit",
        "the save reads the commit back, sees its own save named, and succeeds; the checkpoint loads bitwise",
        None,
        None,
        True if overwrite else None,
        None,
        None)


def test_a_save_whose_files_are_gone_is_never_published(s3_endpoint, s3_bucket, fault_row):
    """Another process deleted this save's objects before its commit: publishing would name
    nothing that loads; the save fails and the old checkpoint stays the one the name loads."""
    path = f"{s3_bucket}/ck"
    dcp.save(_sd(1), checkpoint_id=path)
    client = s3_server.client(s3_endpoint)

    def wipe(**_):
        doc = json.loads(client.get_object(Bucket=s3_bucket[5:], Key="ck/hpdcp-commit.json")["Body"].read())
        for k in _keys(s3_endpoint, s3_bucket[5:], "ck/save-"):
            if not k.startswith(f"ck/{doc['data']}/") and k.endswith(".safetensors"):
                client.delete_object(Bucket=s3_bucket[5:], Key=k)

    with faults.armed("commit.rename", wipe), pytest.raises(dcp.HpdcpError, match="rank00000.safetensors"):
        dcp.save(_sd(2), checkpoint_id=path, overwrite=True)
    assert _loads_as(path, 1)
    fault_row(
        "object store: another process deletes a save's files just before its commit",
        "object-store commit",
        "one listing before the commit finds the file missing; nothing is published; the old checkpoint "
        "stays the one the name loads",
        "CheckpointChangedError",
        "file",
        True,
        None,
        None)


def _fake_commit(client, bucket, name, data, extra, size=10, checksum="0" * 16):
    body = {"format": "hpdcp-commit", "version": 1, "data": data, "metadata_size": size,
            "metadata_checksum": checksum, "extra": extra}
    client.put_object(Bucket=bucket, Key=f"runs/{name}/hpdcp-commit.json", Body=json.dumps(body).encode())


def test_a_commit_alone_is_not_a_member_of_a_series(s3_endpoint, s3_bucket, fault_row):
    """A commit object naming a save that does not exist (or whose metadata disagrees with it)
    used to become latest, and retention deleted real checkpoints for it."""
    root = f"{s3_bucket}/runs"
    for step in (1, 2):
        dcp.save(_sd(step), checkpoint_id=f"{root}/step_{step}", extra=series_extra("step_{step}", step))
    client = s3_server.client(s3_endpoint)
    _fake_commit(client, s3_bucket[5:], "step_9", "save-20260101T000000-000000000000",
                 series_extra("step_{step}", 9))
    # a real save's metadata under a commit that claims another step
    real = json.loads(client.get_object(Bucket=s3_bucket[5:], Key="runs/step_2/hpdcp-commit.json")["Body"].read())
    _fake_commit(client, s3_bucket[5:], "step_7", f"../step_2/{real['data']}", series_extra("step_{step}", 7))
    assert latest_checkpoint(root, "step_{step}") == f"{root}/step_2"
    assert [e.name for e in list_checkpoints(root, "step_{step}")] == ["step_1", "step_2"]
    assert apply_retention(root, 2, series="step_{step}") == []
    assert _loads_as(f"{root}/step_1", 1) and _loads_as(f"{root}/step_2", 2)
    fault_row(
        "object store: a commit object naming a save that does not exist",
        "object-store commit",
        "never latest, never counted by retention; the real checkpoints stay and load bitwise",
        None,
        None,
        True,
        None,
        None)


def test_a_commit_whose_metadata_does_not_match_it_does_not_load(s3_endpoint, s3_bucket, fault_row):
    """The commit records the size and checksum of the metadata it published; a reader compares."""
    path = f"{s3_bucket}/ck"
    dcp.save(_sd(1), checkpoint_id=path)
    client = s3_server.client(s3_endpoint)
    doc = json.loads(client.get_object(Bucket=s3_bucket[5:], Key="ck/hpdcp-commit.json")["Body"].read())
    key = f"ck/{doc['data']}/metadata.json"
    md = json.loads(client.get_object(Bucket=s3_bucket[5:], Key=key)["Body"].read())
    md["extra"] = {"tampered": True}
    client.put_object(Bucket=s3_bucket[5:], Key=key, Body=json.dumps(md).encode())
    with pytest.raises(dcp.CorruptCheckpointError, match="metadata.json.*(does not match|differs from) the commit"):
        _loads_as(path, 1)
    fault_row(
        "object store: metadata.json replaced after its commit",
        "object-store commit",
        "the load compares it with the size and checksum the commit recorded and refuses it",
        "CorruptCheckpointError",
        "file",
        None,
        None,
        None)


@pytest.fixture
def no_grace():
    object_store.configure(object_store.ObjectStoreOptions(orphan_grace_s=0))
    yield
    object_store.configure(object_store.ObjectStoreOptions())


def test_clean_up_deletes_only_what_it_can_prove_ours(s3_endpoint, s3_bucket, no_grace, fault_row):
    """Class 5: clean-up took every ``save-*`` folder no commit names, a user's own included, and
    deleting a checkpoint took everything under its name. Only a save with our lease (or the one
    a commit names) is ours."""
    client, b = s3_server.client(s3_endpoint), s3_bucket[5:]
    root = f"{s3_bucket}/runs"
    mine = {"runs/ck/save-2024-notes/readme.txt": b"a user's folder", "runs/ck/notes.txt": b"beside it",
            "runs/data/save-x/part0": b"another user's data"}
    for k, v in mine.items():
        client.put_object(Bucket=b, Key=k, Body=v)
    dcp.save(_sd(1), checkpoint_id=f"{root}/ck", extra=series_extra("ck", None))
    dcp.save(_sd(2), checkpoint_id=f"{root}/ck", overwrite=True, extra=series_extra("ck", None))  # supersedes 1
    apply_retention(root, 1, series="ck")  # collects the superseded save (it holds our lease), nothing else
    keys = _keys(s3_endpoint, b, "runs/")
    assert all(k in keys for k in mine), keys
    assert sum(1 for k in keys if k.startswith("runs/ck/save-") and k.endswith("rank00000.safetensors")) == 1
    assert _loads_as(f"{root}/ck", 2)
    from hpdcp_runner.dcp.storage.location import locate

    locate(root).catalog().delete("ck")
    keys = _keys(s3_endpoint, b, "runs/")
    assert all(k in keys for k in mine) and not any(k.endswith(".safetensors") for k in keys), keys
    fault_row(
        "object store: a user's own save-* folder and files under a checkpoint name",
        "object-store commit",
        "clean-up and deletion take only saves holding our lease or named by a commit; the user's objects stay",
        None,
        None,
        True,
        None,
        None)


def test_a_cleaner_whose_clock_is_ahead_never_deletes_a_live_save(s3_endpoint, s3_bucket, monkeypatch, fault_row):
    """Class 2: clean-up compared the store's last_modified with the local clock; a second saver
    whose clock ran an hour ahead deleted a live save, which then committed and reported success.
    The skew is simulated in this process (the store's clock cannot be moved): the local clock is
    an hour ahead while another save of the name begins."""
    import datetime as dt

    from hpdcp_runner.dcp.storage.objects import object_checkpoint as oc

    import time

    real_time = time.time
    object_store.configure(object_store.ObjectStoreOptions(orphan_grace_s=600))
    path = f"{s3_bucket}/ck"
    try:
        dcp.save(_sd(1), checkpoint_id=path)

        def second_saver(**_):
            ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
            monkeypatch.setattr(oc, "_now_utc", lambda: ahead, raising=False)  # the old code's clock
            monkeypatch.setattr(oc.time, "time", lambda: real_time() + 3600)  # and any use of time.time
            w = oc.ObjectStoreWriter(path)
            w.begin(overwrite=True)  # runs clean-up of the name's saves
            w.abort()
            monkeypatch.undo()

        with faults.armed("commit.rename", second_saver):
            dcp.save(_sd(2), checkpoint_id=path, overwrite=True)  # alive while the other begins
        assert _loads_as(path, 2)
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
    fault_row(
        "object store: a second saver whose clock is an hour ahead cleans up during a live save (skew simulated)",
        "object-store commit",
        "ages are judged on the store's clock (the lease's own time); the live save is untouched, commits "
        "and loads bitwise",
        None,
        None,
        None,
        None,
        None)


def _save_with_own_id(rank, world_size, root):
    from hpdcp_runner import dcp as d

    try:
        d.save({"w": torch.full((4,), float(rank))}, checkpoint_id=f"{root}/ck_{rank}")
    except d.ConfigError as e:
        return str(e)
    return "saved"


def test_ranks_that_disagree_on_the_checkpoint_are_refused_before_anything_is_written(tmp_path, fault_row):
    """Class 11: two ranks given different checkpoint ids both returned from save normally; rank 0
    committed a checkpoint that lacked rank 1's file. Now every rank gets one error naming the
    ranks, and nothing is written anywhere."""
    import os

    from tests.multiproc.harness import run_ranks

    out = run_ranks(2, _save_with_own_id, str(tmp_path))
    assert all(m.startswith("the ranks do not save one checkpoint: they give different checkpoint ids (ranks 0; "
                            "ranks 1;") for m in out), out
    assert os.listdir(tmp_path) == []
    fault_row(
        "two ranks given different checkpoint ids",
        "object-store commit",
        "one error on every rank naming the groups of ranks, before anything is written",
        "ConfigError",
        "rank",
        None,
        None,
        None)


def test_a_store_that_ignores_conditional_writes_is_refused_unless_allowed(proxied, fault_row):
    """Class 3: some S3-compatible stores ignore If-None-Match/If-Match: two concurrent saves both
    reported success and one was silently lost. The proxy forwards without those headers (what
    such a store does); the first save probes once and refuses, naming the knob."""
    from hpdcp_runner.dcp.storage.objects import object_checkpoint as oc

    p, bucket = proxied
    p.strip_conditions = True
    oc._HONOURS_CONDITIONS.clear()
    try:
        with pytest.raises(dcp.ConfigError, match="ignores conditional creates.*dcp.storage.unconditional_ok=true"):
            dcp.save(_sd(1), checkpoint_id=f"{bucket}/ck")
        assert not _keys_under(bucket, "ck/")
        object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint, unconditional_ok=True))
        dcp.save(_sd(1), checkpoint_id=f"{bucket}/ck")  # allowed: runs, with a warning
        assert _loads_as(f"{bucket}/ck", 1)
    finally:
        oc._HONOURS_CONDITIONS.clear()
    fault_row(
        "object store: a store that ignores If-None-Match / If-Match (proxy)",
        "object-store commit",
        "a once-per-bucket probe finds it; the save is refused unless dcp.storage.unconditional_ok=true",
        "ConfigError",
        "config key",
        None,
        None,
        None)


def _keys_under(bucket, prefix):
    import os

    return _keys(os.environ["AWS_ENDPOINT_URL"], bucket[5:], prefix)


def test_a_rank_removes_its_own_uploads_when_a_save_fails(s3_endpoint, s3_bucket, monkeypatch, fault_row):
    """Class 12: Ctrl-C during a save to a bucket left a rank's 43 MB file behind when its upload
    completed after the coordinator's abort had listed the save. Each rank now removes what it
    uploaded; here the abort is made to see nothing (as when it listed before the upload landed)."""
    from hpdcp_runner.dcp.storage.objects import object_checkpoint as oc

    monkeypatch.setattr(oc.ObjectStoreWriter, "abort", lambda self: self._stop_lease())

    def interrupted(**_):
        raise KeyboardInterrupt

    with faults.armed("save.written", interrupted), pytest.raises(KeyboardInterrupt):
        dcp.save(_sd(1), checkpoint_id=f"{s3_bucket}/ck")
    keys = _keys(s3_endpoint, s3_bucket[5:], "ck/")
    assert not [k for k in keys if k.endswith((".safetensors", ".json"))], keys
    fault_row(
        "object store: a rank's upload lands after the coordinator's abort listed the save",
        "object-store commit",
        "each rank removes its own uploads; nothing of the failed save is left but its lease",
        "KeyboardInterrupt",
        None,
        None,
        None,
        None)

def test_an_hf_export_into_a_bucket_replaces_only_what_it_wrote(s3_endpoint, s3_bucket, fault_row):
    """Class 5: an HF export into a prefix without overwrite deleted unrelated objects there,
    unpublished one of our checkpoints, or destroyed its own source. Now: anything there needs
    overwrite; a prefix holding our checkpoint, or the source, is never written; an overwrite
    deletes only what the previous export recorded in its manifest."""
    from hpdcp_runner.dcp import tools

    client, b = s3_server.client(s3_endpoint), s3_bucket[5:]
    src = f"{s3_bucket}/runs/ck"
    dcp.save({"w": torch.ones(64, 32), "v": torch.zeros(64, 32)}, checkpoint_id=src)
    client.put_object(Bucket=b, Key="out/notes.txt", Body=b"mine")
    with pytest.raises(dcp.CheckpointExistsError, match="already holds 1 object"):
        tools.export_hf(src, f"{s3_bucket}/out")
    assert _keys(s3_endpoint, b, "out/") == ["out/notes.txt"]
    for dst in (f"{s3_bucket}/runs", src, f"{src}/inner"):  # holds our checkpoint / is / lies in the source
        with pytest.raises(dcp.HpdcpError, match="hpdcp checkpoint|its source"):
            tools.export_hf(src, dst, overwrite=True)
    got = {"w": torch.zeros(64, 32), "v": torch.ones(64, 32)}
    dcp.load(got, checkpoint_id=src)
    assert torch.equal(got["w"], torch.ones(64, 32)) and torch.equal(got["v"], torch.zeros(64, 32))
    tools.export_hf(src, f"{s3_bucket}/out", overwrite=True)
    client.put_object(Bucket=b, Key="out/model-00009-of-00009.safetensors", Body=b"a user's, not ours")
    tools.export_hf(src, f"{s3_bucket}/out", overwrite=True, max_shard_size=64 * 32 * 4)  # now 2 shards
    keys = _keys(s3_endpoint, b, "out/")
    assert "out/notes.txt" in keys and "out/model-00009-of-00009.safetensors" in keys
    assert "out/model.safetensors" not in keys and "out/model.safetensors.index.json" in keys, keys
    fault_row("object store: an HF export into a prefix holding other objects, a checkpoint, or its source",
              "object-store commit", "refused without overwrite; never over a checkpoint or the source; an "
              "overwrite deletes only what the previous export's manifest lists", "CheckpointExistsError",
              "file", True, None, None)


def test_a_save_never_shadows_an_uploaded_checkpoint_without_overwrite(s3_endpoint, s3_bucket):
    """Class 5: a save over a checkpoint uploaded as a plain directory (metadata.json, no commit
    object) shadowed it without overwrite."""
    import os
    import subprocess

    path = f"{s3_bucket}/ck"
    local = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"up-{s3_bucket[5:]}")
    dcp.save(_sd(1), checkpoint_id=local)
    client = s3_server.client(s3_endpoint)
    for name in os.listdir(local):
        client.upload_file(os.path.join(local, name), s3_bucket[5:], f"ck/{name}")
    subprocess.run(["rm", "-rf", local], check=True)
    assert _loads_as(path, 1)
    with pytest.raises(dcp.CheckpointExistsError, match="already exists"):
        dcp.save(_sd(2), checkpoint_id=path)
    assert _loads_as(path, 1)


def test_what_cannot_be_listed_or_read_is_skipped_and_our_own_files_are_not_side_files(
        s3_endpoint, s3_bucket, tmp_path):
    """Class 13: a '..' key segment under a series made retention fail; a 2 MiB commit object made
    latest raise; files_from at one of our checkpoints copied its commit object into an HF output;
    a side file with spaces in its name was copied locally but refused in a bucket."""
    from hpdcp_runner.dcp import tools

    client, b = s3_server.client(s3_endpoint), s3_bucket[5:]
    root = f"{s3_bucket}/runs"
    for step in (1, 2):
        dcp.save(_sd(step), checkpoint_id=f"{root}/step_{step}", extra=series_extra("step_{step}", step))
    client.put_object(Bucket=b, Key="runs/step_3/../x", Body=b"x")
    client.put_object(Bucket=b, Key="runs/step_9/hpdcp-commit.json", Body=b"{" + b" " * (2 << 20) + b"}")
    assert latest_checkpoint(root, "step_{step}") == f"{root}/step_2"
    assert apply_retention(root, 1, series="step_{step}") == ["step_1"]
    assert _loads_as(f"{root}/step_2", 2)
    client.put_object(Bucket=b, Key="runs/step_2/tokenizer config.json", Body=b"{}")
    tools.export_hf(f"{root}/step_2", f"{s3_bucket}/hf", files_from=f"{root}/step_2")
    tools.export_hf(f"{root}/step_2", str(tmp_path / "hf"), files_from=f"{root}/step_2")
    keys = [k[3:] for k in _keys(s3_endpoint, b, "hf/")]
    assert "tokenizer config.json" in keys and (tmp_path / "hf" / "tokenizer config.json").is_file(), keys
    assert not any(k in ("hpdcp-commit.json", "metadata.json") or k.startswith("rank") for k in keys), keys
    assert not any(n.startswith(("hpdcp-commit", "rank")) for n in __import__("os").listdir(tmp_path / "hf"))


def test_a_commit_claiming_another_step_than_its_metadata_is_not_a_member(s3_endpoint, s3_bucket):
    """Class 4: a commit object rewritten to claim step 7 for the save of step 2 (its metadata
    size and checksum intact) became latest. The metadata's own series and step must agree."""
    root = f"{s3_bucket}/runs"
    for step in (1, 2):
        dcp.save(_sd(step), checkpoint_id=f"{root}/step_{step}", extra=series_extra("step_{step}", step))
    client, b = s3_server.client(s3_endpoint), s3_bucket[5:]
    doc = json.loads(client.get_object(Bucket=b, Key="runs/step_2/hpdcp-commit.json")["Body"].read())
    doc["extra"] = series_extra("step_{step}", 7)
    for k in _keys(s3_endpoint, b, "runs/step_2/"):  # the same save, copied under step_7 with a forged commit
        body = client.get_object(Bucket=b, Key=k)["Body"].read()
        if k.endswith("hpdcp-commit.json"):
            body = json.dumps(doc).encode()
        client.put_object(Bucket=b, Key=k.replace("step_2", "step_7"), Body=body)
    assert latest_checkpoint(root, "step_{step}") == f"{root}/step_2"
    assert apply_retention(root, 2, series="step_{step}") == []


def test_a_save_of_a_new_name_costs_few_round_trips(proxied):
    """Counted at the proxy, as the store sees them (issue 38: the commit's round trips): a save of
    a new name lists the name once (no GET of a commit, no HEAD of an uploaded directory, no HEAD
    for the store's clock when nothing is old enough to collect), writes its lease, its rank file,
    its index and metadata beside one listing that checks the rank files, then the commit."""
    p, bucket = proxied
    dcp.save(_sd(0), checkpoint_id=f"{bucket}/warm")  # the once-per-process probe of conditional writes
    p.log.clear()
    dcp.save(_sd(3), checkpoint_id=f"{bucket}/new")
    methods = [m for m, _ in p.log]
    lists = [path for m, path in p.log if m == "GET" and "list-type" in path]
    assert "HEAD" not in methods and len(lists) == 2, p.log  # begin's listing, the commit's check
    assert [m for m in methods if m == "GET"] == ["GET", "GET"], p.log  # nothing but the two listings
    puts = [path.split("?")[0].rsplit("/", 1)[-1] for m, path in p.log if m == "PUT"]
    assert sorted(puts) == sorted([".lease", "rank00000.safetensors", "rank00000.objects.json",
                                   "chunk_index.safetensors", "metadata.json", "hpdcp-commit.json"]), p.log
    assert len(p.log) == 8, p.log
    assert _loads_as(f"{bucket}/new", 3)


def test_a_load_reaches_its_first_byte_in_three_round_trips(proxied):
    """Counted at the proxy (issue 38): a load of ours reads the commit object once (it tells the
    format and pins the save: no listing of the name to tell formats apart), then metadata.json
    beside one listing of the save (the chunk index's size comes from it: no HEAD), the index,
    then data (it was seven round trips)."""
    p, bucket = proxied
    dcp.save(_sd(7), checkpoint_id=f"{bucket}/four")
    p.log.clear()
    assert _loads_as(f"{bucket}/four", 7)
    first_data = next(i for i, (m, path) in enumerate(p.log) if "rank00000." in path)
    before = [(m, path.split("?")[0].rsplit("/", 1)[-1] if "list-type" not in path else "LIST")
              for m, path in p.log[:first_data]]
    assert before[0] == ("GET", "hpdcp-commit.json") and before[3] == ("GET", "chunk_index.safetensors"), p.log
    assert sorted(before[1:3]) == [("GET", "LIST"), ("GET", "metadata.json")], p.log  # (side by side)
    assert len(before) == 4 and not [m for m, _ in p.log if m == "HEAD"], p.log


def test_only_the_coordinator_lists_a_save(proxied):
    """Rank 0's pin carries the sizes of the save's files: another rank attached to it checks its
    files and opens the chunk index without a request of its own (one listing per load, not one
    per rank). Two readers in one process stand for rank 0 and rank 1."""
    from hpdcp_runner.dcp.storage.checkpoint_io import open_reader

    p, bucket = proxied
    path = f"{bucket}/pinned"
    dcp.save(_sd(8), checkpoint_id=path)
    rank0, rank1 = open_reader(path, "hpdcp"), open_reader(path, "hpdcp")
    try:
        rank0.read_metadata_text()
        pin = rank0.pin()
        p.log.clear()
        rank1.attach_pin(pin)
        rank1.check_files(["rank00000.safetensors", "rank00000.objects.json"])
        rank1.open_file("chunk_index.safetensors")
        assert p.log == [], p.log
    finally:
        rank0.close()
        rank1.close()


def test_the_lease_is_written_beside_the_first_listing(proxied):
    """The save's lease does not wait for begin's listing: both reach the store within one
    request's latency (one round trip before the first byte of a save, not two)."""
    p, bucket = proxied
    dcp.save(_sd(0), checkpoint_id=f"{bucket}/warm")  # the once-per-process probe of conditional writes
    p.latency_s = 0.25
    p.log.clear()
    p.arrived.clear()
    dcp.save(_sd(4), checkpoint_id=f"{bucket}/beside")
    at = dict(zip(p.log, p.arrived))
    listing = next(t for (m, path), t in at.items() if m == "GET" and "list-type" in path)
    lease = next(t for (m, path), t in at.items() if m == "PUT" and path.endswith("/.lease"))
    assert abs(lease - listing) < 0.15, p.log
    p.latency_s = 0.0
    assert _loads_as(f"{bucket}/beside", 4)


def test_a_refused_save_leaves_no_lease(proxied):
    """A save of an existing name without overwrite is refused in begin; the lease written beside
    its listing is removed again (nothing of the refused save stays in the bucket)."""
    p, bucket = proxied
    path = f"{bucket}/taken"
    dcp.save(_sd(5), checkpoint_id=path)
    before = sorted(o["path"] for o in object_store.Bucket(path).list(object_store.Bucket(path).root))
    with pytest.raises(dcp.CheckpointExistsError):
        dcp.save(_sd(6), checkpoint_id=path)
    after = sorted(o["path"] for o in object_store.Bucket(path).list(object_store.Bucket(path).root))
    assert after == before
    assert _loads_as(path, 5)
