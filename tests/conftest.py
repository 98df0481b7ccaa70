"""Session-wide fixtures: real object stores on loopback: S3 (moto, tests/s3_server.py), Azure Blob
(azurite) and GCS (fake-gcs-server) (tests/emulators.py), and an SFTP server (OpenSSH's sshd,
tests/sftp_server.py)."""

import os

import pytest

from tests import emulators, s3_server, sftp_server


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint of the loopback S3 server, with the AWS environment set for this process and
    every subprocess it starts. Without the `s3` extra the tests skip, unless
    HPDCP_REQUIRE_S3=1 (CI), where they fail."""
    yield from _session_store(s3_server.available, s3_server.start,
                              lambda endpoint: {**s3_server.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket's URI, ``s3://<bucket>``."""
    return f"s3://{s3_server.new_bucket(s3_endpoint)}"


def _session_store(unavailable, start, env_of):
    """Start an emulator (or take the one .ci/run started), with its environment set for this
    process and the subprocesses it starts; skip without it, fail under HPDCP_REQUIRE_S3=1 (CI)."""
    why = unavailable()
    if why:
        if os.environ.get("HPDCP_REQUIRE_S3"):
            pytest.fail(why)
        pytest.skip(why)
    endpoint, proc = start()
    env = env_of(endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        emulators.stop(proc)


@pytest.fixture(scope="session")
def az_endpoint():
    """The blob endpoint of a loopback azurite (Azure Blob Storage's emulator)."""
    yield from _session_store(emulators.azure_unavailable, emulators.start_azurite, emulators.azure_env)


@pytest.fixture
def az_container(az_endpoint):
    """A fresh container's URI, ``az://<container>``."""
    return f"az://{emulators.new_container(az_endpoint)}"


@pytest.fixture(scope="session")
def gcs_endpoint():
    """The endpoint of a loopback fake-gcs-server (reads through GCS's XML API; see tests/emulators.py)."""
    yield from _session_store(emulators.gcs_unavailable, emulators.start_gcs, emulators.gcs_env)


@pytest.fixture
def gcs_bucket(gcs_endpoint):
    """A fresh bucket's name (``gs://<name>``): written through the emulator's JSON API."""
    return emulators.new_gcs_bucket(gcs_endpoint)


@pytest.fixture(scope="session")
def sftp_endpoint():
    """``127.0.0.1:PORT`` of a loopback OpenSSH server with our client's environment set
    (``SFTP_USER``, ``SFTP_KEY_FILE``, ``SFTP_KNOWN_HOSTS``)."""
    yield from _session_store(sftp_server.unavailable, sftp_server.start, sftp_server.env)


@pytest.fixture
def sftp_dir(sftp_endpoint, tmp_path):
    """A fresh directory's URI on that server, ``sftp://127.0.0.1:PORT/<absolute path>`` (the
    server runs here, so the test sees the same directory at ``tmp_path / "sftp"``)."""
    return f"sftp://{sftp_endpoint}{tmp_path}/sftp"
