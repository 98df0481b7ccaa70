"""One protocol suite for every storage: a local directory, S3 (a real moto server on loopback),
Azure Blob (azurite on loopback) and an SFTP server (OpenSSH's sshd on loopback). Each test states
a promise of the commit protocol; every storage must keep it, so they cannot drift."""

import os
import threading

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp import faults, tools
from hpdcp_runner.dcp.storage.objects import object_store
from hpdcp_runner.dcp.storage.store_client import open_client
from hpdcp_runner.dcp.storage.retention import apply_retention, latest_checkpoint, list_checkpoints, series_extra
from hpdcp_runner.dcp.storage.uri import join


class Local:
    kind = "local"

    def __init__(self, tmp_path):
        self.root = str(tmp_path)

    def debris(self, name):
        """What a save killed before its commit leaves."""
        os.makedirs(os.path.join(self.root, f".{name}.tmp-deadbeef0000"))
        with open(os.path.join(self.root, f".{name}.tmp-deadbeef0000", "rank00000.safetensors"), "wb") as f:
            f.write(b"partial")
        open(os.path.join(self.root, f".{name}.tmp-deadbeef0000.lock"), "w").close()  # its holder died

    def debris_left(self, name):
        return any(n.startswith(f".{name}.tmp-") for n in os.listdir(self.root))


class ObjectStore:
    """A store of the registry (S3 on moto, Azure Blob on azurite, SFTP on sshd) at the URI
    ``base``, written and listed through its own client so the debris is what a crashed save of
    that store leaves."""

    def __init__(self, kind, base):
        self.kind = kind
        self.root = f"{base}/runs"
        self.bucket = open_client(base)

    def key(self, *names):
        return self.bucket.key("runs", *names)

    def debris(self, name):
        """What a save killed before its commit leaves: its lease (written at begin, before any
        rank writes) and a partial rank file."""
        base = self.key(name, "save-19700101T000000-deadbeef0000")
        self.bucket.put(f"{base}/.lease", b"{}")
        self.bucket.put(f"{base}/rank00000.safetensors", b"partial")

    def debris_left(self, name):
        return any("deadbeef0000" in k for k in self.keys(name))

    def keys(self, name):
        return sorted(o["path"] for o in self.bucket.list(self.key(name)))


_BASES = {"s3": "s3_bucket", "az": "az_container", "sftp": "sftp_dir"}


@pytest.fixture(params=["local", "s3", "az", "sftp"])
def store(request, tmp_path):
    if request.param == "local":
        return Local(tmp_path)
    return ObjectStore(request.param, request.getfixturevalue(_BASES[request.param]))


@pytest.fixture
def no_grace():
    """Cleanup may take what nothing touched for 0 s (the tests' debris is old)."""
    object_store.configure(object_store.ObjectStoreOptions(orphan_grace_s=0))
    yield
    object_store.configure(object_store.ObjectStoreOptions())


def _state(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "h": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 40, (5,), generator=g), "scalar": torch.tensor(float(seed)),
            "empty": torch.zeros(0, 4), "meta": {"step": seed, "name": f"s{seed}", "ids": list(range(n))}}


def _zeros():
    return {"w": torch.zeros(64, 33), "h": torch.zeros(7, dtype=torch.bfloat16),
            "i": torch.zeros(5, dtype=torch.int64), "scalar": torch.tensor(0.0), "empty": torch.zeros(0, 4),
            "meta": {"step": -1, "name": "", "ids": []}}


def _equal(a, b):
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("version", [1, 2])
def test_save_load_bitwise(store, version):
    path = join(store.root, "ck")
    src = _state(1)
    dcp.save(src, checkpoint_id=path, format_version=version)
    got = _zeros()
    res = dcp.load(got, checkpoint_id=path)
    _equal(src, got)
    assert res.counters["bytes_read"] >= sum(t.numel() * t.element_size() for t in src.values()
                                             if isinstance(t, torch.Tensor))
    assert dcp.read_metadata(path).tensors["w"].shape == (64, 33)


def test_partial_reads_verified(store):
    """A destination that is part of a stored chunk reads (and verifies) only what it needs."""
    path = join(store.root, "big")
    w = torch.arange(4 << 20, dtype=torch.float32).reshape(1024, 4096)  # 16 MiB: several 1 MiB blocks
    dcp.save({"w": w}, checkpoint_id=path)
    from hpdcp_runner.dcp.core.ragged import LocalShard  # noqa: F401  (imports stay valid)
    reader = dcp.open_reader(path)
    md = dcp.Metadata.from_json(reader.read_metadata_text(), source=path, open_file=reader.open_file)
    reader.attach_metadata(md)
    from hpdcp_runner.dcp.core.geometry import Box
    from hpdcp_runner.dcp.storage.interfaces import ReadRequest
    dest = torch.zeros(100, 4096)
    reader.read_tensors([ReadRequest(md.tensors["w"].chunks[0], "float32", Box((500, 0), (100, 4096)), dest)])
    reader.close()
    assert torch.equal(dest, w[500:600])
    assert reader.counters.bytes_read <= 100 * 4096 * 4 + 2 * (1 << 20)


def test_existing_refused_and_overwrite_keeps_old_until_commit(store):
    path = join(store.root, "ck")
    dcp.save(_state(1), checkpoint_id=path)
    with pytest.raises(dcp.CheckpointExistsError):
        dcp.save(_state(2), checkpoint_id=path)

    def boom(**_):
        raise OSError(5, "injected failure just before publishing")

    with faults.armed("commit.rename", boom), pytest.raises(dcp.HpdcpError, match="injected"):
        dcp.save(_state(2), checkpoint_id=path, overwrite=True)
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    _equal(_state(1), got)  # the failed overwrite published nothing
    dcp.save(_state(3), checkpoint_id=path, overwrite=True)
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    _equal(_state(3), got)


def test_failed_write_publishes_nothing(store):
    path = join(store.root, "ck")

    def disk_full(**_):
        raise OSError(28, "No space left on device")

    with faults.armed("file.write", disk_full), pytest.raises(dcp.HpdcpError, match="No space"):
        dcp.save(_state(1), checkpoint_id=path)
    with pytest.raises(dcp.CheckpointNotFoundError, match="no committed checkpoint"):
        dcp.load(_zeros(), checkpoint_id=path)
    if store.kind != "local":
        # the aborted save removed its uploads (its lease stays: a late upload beside it is ours to collect)
        assert [k for k in store.keys("ck") if not k.endswith("/.lease")] == []


def test_crash_debris_is_never_read_and_is_cleaned_by_a_later_save(store, no_grace):
    store.debris("ck")
    with pytest.raises(dcp.CheckpointNotFoundError, match="uncommitted|no committed"):
        dcp.load(_zeros(), checkpoint_id=join(store.root, "ck"))
    dcp.save(_state(1), checkpoint_id=join(store.root, "other"), extra=series_extra("ck", None))
    if store.kind != "local":  # the next save of that name cleans it (locally: retention, below)
        dcp.save(_state(1), checkpoint_id=join(store.root, "ck"))
        assert not store.debris_left("ck")
        got = _zeros()
        dcp.load(got, checkpoint_id=join(store.root, "ck"))
        _equal(_state(1), got)
    else:
        apply_retention(store.root, 1, series="ck")
        assert not store.debris_left("ck")


def test_load_during_overwrite_reads_one_checkpoint(store):
    """A load that read the metadata before an overwrite committed gets the old checkpoint whole,
    or CheckpointChangedError: never a mix, never the new one's bytes under the old metadata."""
    path = join(store.root, "ck")
    dcp.save(_state(1), checkpoint_id=path)
    reader = dcp.open_reader(path)
    md = dcp.Metadata.from_json(reader.read_metadata_text(), source=path, open_file=reader.open_file)
    dcp.save(_state(2), checkpoint_id=path, overwrite=True)
    got = _zeros()
    try:
        dcp.load(got, storage_reader=_Pinned(reader, md), checkpoint_id=path)
    except dcp.CheckpointChangedError:
        return
    _equal(_state(1), got)


class _Pinned:
    """A reader whose metadata was read before the overwrite (the load's own read is replayed)."""

    def __init__(self, reader, md):
        self.r, self.text = reader, md.to_json()

    def read_metadata_text(self):
        return self.text

    def __getattr__(self, name):
        return getattr(self.r, name)


def test_retention_and_latest_by_recorded_step(store):
    for step in (2, 10, 9):
        dcp.save({"w": torch.full((2,), float(step))}, checkpoint_id=join(store.root, f"step_{step}"),
                 extra=series_extra("step_{step}", step))
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=join(store.root, "best"))
    assert [e.name for e in list_checkpoints(store.root, "step_{step}")] == ["step_2", "step_9", "step_10"]
    assert latest_checkpoint(store.root, "step_{step}") == join(store.root, "step_10")
    removed = apply_retention(store.root, 2, series="step_{step}", keep=["step_10"])
    assert removed == ["step_2"]
    assert [e.name for e in list_checkpoints(store.root, "step_{step}")] == ["step_9", "step_10"]
    with pytest.raises(dcp.CheckpointNotFoundError):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=join(store.root, "step_2"))
    got = {"w": torch.zeros(2)}
    dcp.load(got, checkpoint_id=join(store.root, "best"))  # another name: never touched


def test_concurrent_saves_of_one_name_one_wins(store):
    """Two writers racing to create one checkpoint: exactly one commits, the other is refused."""
    path = join(store.root, "ck")
    errors, barrier = [], threading.Barrier(2)

    def pause(**_):
        barrier.wait(timeout=30)

    def run(seed):
        try:
            dcp.save(_state(seed), checkpoint_id=path)
        except dcp.CheckpointExistsError as e:
            errors.append(e)

    with faults.armed("commit.rename", pause):
        ts = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert len(errors) == 1
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    assert got["meta"]["step"] in (1, 2)
    _equal(_state(got["meta"]["step"]), got)


def test_verify_and_describe(store):
    path = join(store.root, "ck")
    dcp.save(_state(1), checkpoint_id=path)
    rep = tools.verify(path)
    assert rep.ok and rep.files_checked >= 2, rep.problems
    d = tools.describe(path)
    assert d["format"] == "hpdcp" and d["tensors"]["w"]["shape"] == [64, 33]


def test_async_save_then_train_on_mutates_nothing_saved(store):
    """async_save stages the state before returning: what training does next is not in it."""
    path = join(store.root, "ck")
    src = _state(4)
    resp = dcp.async_save(src, checkpoint_id=path)
    src["w"].add_(1.0)  # the next training step, while the save runs
    resp.result(timeout=60)
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    _equal(_state(4), got)


def _place(store, local_dir, name):
    """A directory of files as a user would have it on ``store``: local as it is, uploaded as plain
    objects to a store. Returns its path."""
    if store.kind == "local":
        return local_dir
    for f in sorted(os.listdir(local_dir)):
        store.bucket.upload_file(store.key(name, f), os.path.join(local_dir, f))
    return join(store.root, name)


def test_foreign_formats_are_read_in_place_by_one_reader_each(store, tmp_path):
    """A Hugging Face directory, one .safetensors file and a torch DCP checkpoint on any store are
    read by the same reader class (HfReader, TorchDcpReader) over that store's files, partial
    reads included, bitwise."""
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import save_file

    from hpdcp_runner.dcp.storage.formats.foreign import HfReader, TorchDcpReader

    src = {k: v for k, v in _state(4).items() if isinstance(v, torch.Tensor) and v.numel()}
    hf = tmp_path / "hf_src"
    hf.mkdir()
    save_file(src, str(hf / "model.safetensors"))
    tdir = tmp_path / "tdcp_src"
    tdcp.save({k: v.clone() for k, v in src.items()}, storage_writer=tdcp.FileSystemWriter(str(tdir)))
    cases = [(_place(store, str(hf), "hf"), HfReader, False),
             (join(_place(store, str(hf), "hf1"), "model.safetensors"), HfReader, False),
             (_place(store, str(tdir), "tdcp"), TorchDcpReader, True)]
    for path, cls, pickle in cases:
        reader = dcp.open_reader(path, "auto", allow_pickle=pickle)
        assert type(reader) is cls, (path, type(reader))
        got = {k: torch.zeros_like(v) for k, v in src.items()}
        dcp.load(got, checkpoint_id=path, allow_pickle=pickle)
        for k in src:
            assert torch.equal(got[k], src[k]), (path, k)
        rows = dcp.LocalShard(torch.zeros(16, 33), (8, 0), (64, 33))  # rows 8..24 of w only
        dcp.load({"w": rows}, checkpoint_id=path, allow_pickle=pickle, strict=False)
        assert torch.equal(rows.local, src["w"][8:24]), path


def test_verify_and_digests_read_many_tensors_per_request(store):
    """verify and the full-tensor digests (a reshard's final check) read a checkpoint of many
    small tensors in batches: a store fetches a batch's ranges together, coalesced, so the requests
    do not grow with the number of tensors (one ranged GET per tensor made a bucket's verify take
    minutes); every byte is still checked."""
    from hpdcp_runner.dcp.offline.inspection import full_tensor_digests, tensor_digest

    path = join(store.root, "many")
    g = torch.Generator().manual_seed(7)
    state = {f"layer{i:03d}.w": torch.randn(40, 33, generator=g) for i in range(150)}
    dcp.save(state, checkpoint_id=path)
    seen = []
    reader = dcp.open_reader(path, "hpdcp")
    digests = full_tensor_digests(path, reader, progress=lambda done, total: seen.append((done, total)))
    assert digests == {k: tensor_digest(v) for k, v in state.items()}
    total = sum(v.numel() * 4 for v in state.values())
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) > 3
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))  # bytes of a total, growing
    if store.kind != "local":
        assert reader.counters.extra["store_requests"] <= 10, reader.counters.extra  # 150 tensors
    report = tools.verify(path)
    assert report.ok and report.files_checked >= 1, report.problems


def test_a_committed_checkpoint_is_copied_verified_and_committed_there(store, tmp_path):
    """``copy_checkpoint`` (a fast tier's drain): the copy loads bitwise and verifies; a local file
    changed after its commit is caught while it is copied and nothing is published there."""
    src = tmp_path / "fast" / "ck"
    dcp.save(_state(4), checkpoint_id=src)
    dst = join(store.root, "durable")
    md = dcp.copy_checkpoint(src, dst)
    assert sorted(md.files) == ["rank00000.objects.json", "rank00000.safetensors"]
    got = _zeros()
    dcp.load(got, checkpoint_id=dst)
    _equal(_state(4), got)
    assert tools.verify(dst).ok
    with pytest.raises(dcp.CheckpointExistsError):
        dcp.copy_checkpoint(src, dst)  # refused, as a save of an existing name is

    f = src / "rank00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40  # one bit of the last tensor's bytes
    f.write_bytes(bytes(raw))
    bad = join(store.root, "bad")
    with pytest.raises(dcp.CorruptCheckpointError, match="rank00000.safetensors: checksum .* differs"):
        dcp.copy_checkpoint(src, bad)
    with pytest.raises(dcp.CheckpointNotFoundError):
        dcp.read_metadata(bad)
    if store.kind != "local":
        assert [k for k in store.keys("bad") if not k.endswith("/.lease")] == []
    else:
        assert not [n for n in os.listdir(store.root) if "bad" in n]


def test_a_process_mode_async_save_writes_from_its_persisting_process(store):
    """``async_save(mode="process")`` on every store: the persisting process rebuilds the store's
    writer from the URI (and the process's credentials) and its files load bitwise."""
    from hpdcp_runner.dcp.background import process as persister

    path = join(store.root, "proc")
    try:
        assert dcp.start_async_persist("process", wait_s=120)  # ready, so the save is the process's
        response = dcp.async_save(_state(5), checkpoint_id=path, mode="process")
        assert response.mode == "process"
        response.result(timeout=120)
        assert persister.persister().alive()
    finally:
        persister.shutdown()
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    _equal(_state(5), got)


@pytest.mark.parametrize("kind", ["s3", "az", "sftp"])  # (the GCS emulator takes no saves: see tests/emulators.py)
def test_a_streamed_chunk_index_is_the_object_a_whole_put_writes(request, kind, monkeypatch):
    """A large chunk index is uploaded from its columns as they are (multipart), never joined into
    one copy first: the object is byte for byte the one a single PUT writes, and it loads."""
    from hpdcp_runner.dcp.storage.objects import object_checkpoint

    store = ObjectStore(kind, request.getfixturevalue(_BASES[kind]))
    src = _state(3)
    dcp.save(src, checkpoint_id=join(store.root, "whole"))
    monkeypatch.setattr(object_checkpoint, "_JOINED_INDEX", 0)
    dcp.save(src, checkpoint_id=join(store.root, "streamed"))

    def index_of(name):
        key = next(k for k in store.keys(name) if k.endswith("/chunk_index.safetensors"))
        return store.bucket.get(key)[0]

    assert len(index_of("whole")) > 500 and index_of("streamed") == index_of("whole")
    got = _zeros()
    dcp.load(got, checkpoint_id=join(store.root, "streamed"))
    _equal(src, got)


def _index_bytes(store, name):
    if store.kind == "local":
        with open(os.path.join(store.root, name, "chunk_index.safetensors"), "rb") as f:
            return f.read()
    return store.bucket.get(next(k for k in store.keys(name) if k.endswith("/chunk_index.safetensors")))[0]


def test_an_index_written_while_it_is_built_commits_the_same_checkpoint(store, monkeypatch):
    """The coordinator streams a large chunk index into staging while it sorts and checks it
    (forced here for a small one): the committed index is byte for byte the one written whole
    after the build, and the checkpoint loads bitwise."""
    from hpdcp_runner.dcp import protocol

    src = _state(4)
    dcp.save(src, checkpoint_id=join(store.root, "whole"))
    monkeypatch.setattr(protocol, "STREAM_INDEX_BYTES", 0)
    dcp.save(src, checkpoint_id=join(store.root, "streamed"))
    assert _index_bytes(store, "streamed") == _index_bytes(store, "whole")
    got = _zeros()
    dcp.load(got, checkpoint_id=join(store.root, "streamed"))
    _equal(src, got)


def test_an_index_whose_write_fails_while_it_is_built_commits_nothing(store, monkeypatch):
    """The disk or store failing under the streamed index: the save fails naming the cause, the
    checkpoint it was replacing still loads, and its staging is gone."""
    from hpdcp_runner.dcp import protocol
    from hpdcp_runner.dcp.format import safetensors_io

    path = join(store.root, "ck")
    src = _state(5)
    dcp.save(src, checkpoint_id=path)
    monkeypatch.setattr(protocol, "STREAM_INDEX_BYTES", 0)

    def full(self, rows):
        raise OSError(28, "No space left on device (the index)")

    monkeypatch.setattr(safetensors_io.IndexStream, "put", full)
    with pytest.raises(dcp.HpdcpError, match="No space left on device"):
        dcp.save(_state(6), checkpoint_id=path, overwrite=True)
    got = _zeros()
    dcp.load(got, checkpoint_id=path)
    _equal(src, got)
    assert not store.debris_left("ck")
