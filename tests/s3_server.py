"""A real S3-compatible server on loopback for the tests: moto in server mode (from the package
index), started once per test session unless ``.ci/run`` already started one
(``HPDCP_TEST_S3_ENDPOINT``). Tests get a fresh bucket each and the standard AWS environment, which
the subprocesses they start (torchrun, the CLI) inherit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret-do-not-log",
               "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


def available() -> str | None:
    """Why the object-store tests cannot run here, or None."""
    for mod in ("obstore", "moto", "boto3"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (pip install -e '.[test]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(endpoint: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> bool:
    """True once the server answers; False when ``proc`` exited first (its port was taken)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
            return True
        except Exception:
            if proc is not None and proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 test server at {endpoint} did not start")
            time.sleep(0.1)


def start() -> tuple[str, subprocess.Popen | None]:
    """(endpoint, process or None when one was already running)."""
    given = os.environ.get("HPDCP_TEST_S3_ENDPOINT")
    if given:
        wait_until_up(given)
        return given, None
    for _ in range(5):  # a port found free can be taken before the server binds it: try another
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{port}"
        if wait_until_up(endpoint, proc=proc):
            return endpoint, proc
    raise RuntimeError("the S3 test server could not bind a port in 5 tries")


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def new_bucket(endpoint: str) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


if __name__ == "__main__":  # .ci/run: start one server for the whole run, print its endpoint
    endpoint, proc = start()
    print(endpoint, proc.pid if proc else "", flush=True)
