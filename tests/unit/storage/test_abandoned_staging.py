"""Which staging directories a save may remove: only those whose save is gone, told by the lock
and by the holder (host, pid) written in it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from hpdcp_runner.dcp.storage.posix.commit import clear_abandoned, hold_staging_lock, staging_is_abandoned


def _staging(root, name, holder=None, age_s=0.0):
    d = root / f".{name}.tmp-0123456789ab"
    d.mkdir()
    (d / "rank00000.safetensors").write_bytes(b"x" * 10)
    if holder is not None:
        (root / f"{d.name}.lock").write_text(holder)
    if age_s:
        t = time.time() - age_s
        for p in (d, d / "rank00000.safetensors", root / f"{d.name}.lock"):
            if p.exists():
                os.utime(p, (t, t))
    return d


def test_held_dead_foreign_and_old_locks(tmp_path):
    live = tmp_path / ".live.tmp-aaaaaaaaaaaa"
    live.mkdir()
    fd = hold_staging_lock(str(live))  # this process saves into it
    try:
        assert (tmp_path / ".live.tmp-aaaaaaaaaaaa.lock").read_text().split() == [socket.gethostname(), str(os.getpid())]
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead = _staging(tmp_path, "dead", f"{socket.gethostname()} {gone.stdout.strip()}\n")
        # another host's save: its flock may not reach this host, so its age decides
        busy = _staging(tmp_path, "busy", "node-17 4242\n")
        old = _staging(tmp_path, "old", "node-17 4242\n", age_s=7200)
        legacy = _staging(tmp_path, "legacy", "")  # a free lock without a holder: from before holders
        assert not staging_is_abandoned(str(live))
        assert staging_is_abandoned(str(dead)) and not staging_is_abandoned(str(busy))
        assert staging_is_abandoned(str(old)) and staging_is_abandoned(str(legacy))
        removed = clear_abandoned(str(tmp_path))
        assert sorted(removed) == sorted(d.name for d in (dead, old, legacy))
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, live.name + ".lock", busy.name, busy.name + ".lock"])
    finally:
        os.close(fd)
