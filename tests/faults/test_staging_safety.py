"""Issue "Reliability round 5", items 1-5: process-mode staging and the persisting process.

Staged weights are private (0600) under names nobody can guess (a file or link planted at a
predictable name neither blocks a save nor receives its bytes); a staging directory too small for
the state is one error naming HPDCP_SHM_DIR, never a SIGBUS (the limit is the kernel's own file
size limit, RLIMIT_FSIZE: a real ENOSPC-like refusal a test can set without a mount); a missing or
read-only HPDCP_SHM_DIR is one line naming it; a persisting process that stops answering
(SIGSTOP) fails the save within the save's timeout; and the persisting process never imports a
module planted in the working directory. Real processes throughout."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.conftest import ROOT


def _run(code: str, cwd: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    script = os.path.join(cwd, "probe_script_dir", "probe.py")
    os.makedirs(os.path.dirname(script), exist_ok=True)
    with open(script, "w") as f:
        f.write(textwrap.dedent(code))
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, script], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def test_segments_are_private_and_unguessable(tmp_path, monkeypatch, fault_row):
    from hpdcp_runner.dcp.background import process as persister

    monkeypatch.setenv("HPDCP_SHM_DIR", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_bytes(b"theirs")
    for i in range(1, 4):  # what the old names were: <prefix><pid>-<n>
        os.symlink(victim, tmp_path / f"hpdcp-stage-{os.getpid()}-{i}")
    path, fd = persister.create_segment(4096)
    os.close(fd)
    try:
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
        assert victim.read_bytes() == b"theirs"
        other, fd = persister.create_segment(4096)
        os.close(fd)
        assert os.path.basename(other) != os.path.basename(path)
        os.unlink(other)
    finally:
        os.unlink(path)
    fault_row("links planted at predictable staging names; another local user reading staged weights",
              "process-mode staging", "staging files are created 0600, exclusively, not following links, under "
              "random names: the planted links neither block the save nor receive its bytes")


@pytest.mark.parametrize("what", ["missing", "read-only"])
def test_a_bad_shm_dir_is_one_line_naming_the_variable(tmp_path, monkeypatch, what, fault_row):
    from hpdcp_runner.dcp.background import process as persister
    from hpdcp_runner.dcp.core.errors import ConfigError

    d = tmp_path / "shm"
    if what == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes through a read-only mode")
        d.mkdir(mode=0o500)
    monkeypatch.setenv("HPDCP_SHM_DIR", str(d))
    with pytest.raises(ConfigError, match=f"HPDCP_SHM_DIR={d} (does not exist|is not writable)"):
        persister.create_segment(4096)
    fault_row(f"HPDCP_SHM_DIR {what}", "process-mode staging", "one line naming the variable", "ConfigError",
              "HPDCP_SHM_DIR")


def test_staging_space_smaller_than_the_state_is_an_error_not_a_sigbus(tmp_path, fault_row):
    """48 MiB to stage where only 16 MiB may be written (RLIMIT_FSIZE): the save fails with a
    line naming HPDCP_SHM_DIR, the process lives on and can save by thread."""
    r = _run(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write is an error, not a signal
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, hard))
        from hpdcp_runner.dcp import async_save, start_async_persist
        from hpdcp_runner.dcp.core.errors import InsufficientMemoryError
        assert start_async_persist("process", wait_s=120)
        state = {{"a": torch.ones(6 << 20), "b": torch.ones(6 << 20)}}
        try:
            async_save(state, checkpoint_id="{tmp_path}/ck", mode="process").result(120)
        except InsufficientMemoryError as e:
            print("REFUSED", e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        async_save(state, checkpoint_id="{tmp_path}/ck2", mode="thread").result(120)
        print("ALIVE")
    """, str(tmp_path), {"HPDCP_SHM_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED" in r.stdout and "HPDCP_SHM_DIR" in r.stdout and "ALIVE" in r.stdout, r.stdout
    fault_row("staging space smaller than the state (the file size limit below what a save stages)",
              "process-mode staging", "the space is reserved before a byte is staged: the save fails, the "
              "training process lives on (no SIGBUS)", "InsufficientMemoryError", "HPDCP_SHM_DIR")


def test_a_stopped_persisting_process_fails_the_save_within_its_timeout(tmp_path, fault_row):
    r = _run(f"""
        import os, signal, time, torch
        from hpdcp_runner.dcp import async_save, start_async_persist
        from hpdcp_runner.dcp.background import process as persister
        from hpdcp_runner.dcp.core.errors import PersistProcessError
        assert start_async_persist("process", wait_s=120)
        pid = persister.persister().proc.pid
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        try:
            async_save({{"w": torch.ones(1000)}}, checkpoint_id="{tmp_path}/ck", mode="process", timeout=5).result(60)
        except PersistProcessError as e:
            print("FAILED_AFTER", round(time.monotonic() - t, 1), e)
        assert not os.path.exists("{tmp_path}/ck")
        assert async_save({{"w": torch.ones(10)}}, checkpoint_id="{tmp_path}/ck3", mode="process",
                          timeout=30).result(120) is not None  # (the next save starts a fresh process)
        print("NEXT_SAVED")
    """, str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("FAILED_AFTER"))
    assert float(line.split()[1]) < 30 and "said nothing for 5 s" in line and "NEXT_SAVED" in r.stdout, r.stdout
    fault_row("the persisting process stops answering (SIGSTOP) during a save with timeout=5", "process-mode staging",
              "the save fails once the process has been silent for the save's timeout; it is killed, nothing is "
              "published, the next save starts a fresh one", "PersistProcessError", "the process's pid")


def test_the_persisting_process_never_imports_the_working_directory(tmp_path, fault_row):
    """An ``xxhash.py`` planted in the working directory (the training script lives elsewhere,
    so the training process never sees it) must not run inside the persisting process."""
    marker = tmp_path / "PLANTED_RAN"
    (tmp_path / "xxhash.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise ImportError('planted')\n")
    r = _run(f"""
        import torch
        from hpdcp_runner.dcp import async_save, start_async_persist
        assert start_async_persist("process", wait_s=120)
        resp = async_save({{"w": torch.ones(100)}}, checkpoint_id="{tmp_path}/ck", mode="process")
        resp.result(120)
        print("MODE", resp.mode)
    """, str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODE process" in r.stdout and not marker.exists(), r.stdout
    fault_row("a module planted in the working directory (xxhash.py)", "process-mode staging",
              "the persisting process's import path holds nothing of the working directory: never imported",
              marker_absent=True)
