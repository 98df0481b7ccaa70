"""An async save still in flight when the interpreter exits is finished, not lost."""

import os
import subprocess
import sys
import textwrap

from hpdcp_runner.dcp import read_metadata


def test_interpreter_exit_waits_for_in_flight_async_save(tmp_path):
    script = textwrap.dedent(f"""
        import time, torch
        from hpdcp_runner.dcp import async_save, faults
        faults.arm("save.write", lambda **_: time.sleep(1.0))  # still writing when the script ends
        resp = async_save({{"w": torch.arange(6.0)}}, checkpoint_id={str(tmp_path / "ck")!r})
        print("returned", resp.done(), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert "returned False" in r.stdout
    assert list(read_metadata(tmp_path / "ck").tensors) == ["w"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]
