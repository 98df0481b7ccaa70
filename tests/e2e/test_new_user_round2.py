"""Issue 41, a new user's hour round 2: each surprise they met, through the CLI where they met it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e.conftest import _env


def _hpdcp(args, cwd, timeout=240):
    """``hpdcp ...`` as a user types it (the console script's module, torchrun in-process)."""
    return subprocess.run([sys.executable, "-m", "hpdcp_runner", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(cwd))


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_a_mistyped_key_is_one_line_naming_the_nearest_keys_printed_once(cli, tmp_path):
    r = cli(["+job=save", "checkpoint.kep_last=1"])
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == ["error: ConfigError: checkpoint.kep_last: no such config key (did you mean "
                                "checkpoint.keep_last or checkpoint.path?)"], r.stderr
    r = cli(["+job=save", "checkpoint.keep=2"])
    assert r.returncode == 2 and len(_lines(r.stderr)) == 1 and "checkpoint.keep_last" in r.stderr, r.stderr
    # nothing close: the section's real keys
    r = cli(["+job=save", "dcp.broadcast.zzzzzz=1"])
    assert r.returncode == 2 and "dcp.broadcast has: mode, batch_bytes, max_in_flight" in r.stderr, r.stderr
    # a bad override's syntax names the override
    r = cli(["+job=save", "checkpoint.dir=[a"])
    assert r.returncode == 2 and _lines(r.stderr)[0].startswith("error: ConfigError: checkpoint.dir=[a: "), r.stderr
    # two ranks compose the same config: the line once, exit 2
    r = _hpdcp(["--nproc-per-node=2", "+job=save", "checkpoint.kep_last=1"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == ["error: ConfigError: checkpoint.kep_last: no such config key (did you mean "
                                "checkpoint.keep_last or checkpoint.path?)"], r.stderr


def _ranks_and_pid(rank, world_size):
    return rank, world_size, os.getpid()


def test_the_rank_harness_cannot_lose_a_port_race(monkeypatch):
    """Item 2: the harness chose a free port, closed it, and another process could take it before
    the ranks bound it (EADDRINUSE under load). Here that race is forced: the port any port-picking
    helper returns is held by another socket the whole time; the ranks still form their group."""
    import socket

    from tests.multiproc import harness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(harness, "free_port", lambda: taken)
        out = harness.run_ranks(2, _ranks_and_pid, timeout=120)
    assert [(r, w) for r, w, _ in out] == [(0, 2), (1, 2)] and out[0][2] != out[1][2]


def test_the_readme_test_command_installs_what_the_object_store_tests_need():
    """Item 1: the README's test command installed ``.[test,interop]`` without the object-store
    client, so every S3 test skipped. The extras it names must bring every package the loopback
    server and the client need (the fixtures then start the server themselves)."""
    import re

    import pytest

    from tests.e2e.conftest import ROOT

    tomllib = pytest.importorskip("tomllib")
    readme = open(os.path.join(ROOT, "README.md")).read()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c)  # the second set-up command
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', test_cmd).group(1).split(",")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ;]", req, maxsplit=1)[0].lower() for e in extras for req in optional[e]}
    needed = {"obstore", "moto", "boto3"}  # what s3_server.available() imports
    assert needed <= names, f"the README's test command ({extras}) lacks {needed - names}"
    assert "HPDCP_SKIP" not in test_cmd and "-m 'not" not in test_cmd
