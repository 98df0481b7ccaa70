"""Session-wide fixtures: a real S3-compatible server on loopback (see tests/s3_server.py)."""

import os

import pytest

from tests import s3_server


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint of the loopback S3 server, with the AWS environment set for this process and
    every subprocess it starts. Without the `s3` extra the tests skip, unless
    HPDCP_REQUIRE_S3=1 (CI), where they fail."""
    why = s3_server.available()
    if why:
        if os.environ.get("HPDCP_REQUIRE_S3"):
            pytest.fail(why)
        pytest.skip(why)
    endpoint, proc = s3_server.start()
    saved = {k: os.environ.get(k) for k in (*s3_server.CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(s3_server.CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket's URI, ``s3://<bucket>``."""
    return f"s3://{s3_server.new_bucket(s3_endpoint)}"
