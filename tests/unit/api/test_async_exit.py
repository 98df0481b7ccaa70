"""An async save still in flight when the interpreter exits is finished, not lost."""

import os
import subprocess
import sys
import textwrap

from hpdcp_runner.dcp import read_metadata


def test_interpreter_exit_waits_for_in_flight_async_save(tmp_path):
    script = textwrap.dedent(f"""
        import threading, time, torch
        from hpdcp_runner.dcp import async_save, faults

        def after_main_ended(**_):  # the write waits until the script's main thread has finished
            while threading.main_thread().is_alive():
                time.sleep(0.01)
            open({str(tmp_path / "order")!r}, "w").write("written after main ended")

        faults.arm("save.write", after_main_ended)
        resp = async_save({{"w": torch.arange(6.0)}}, checkpoint_id={str(tmp_path / "ck")!r})
        print("returned", resp.done(), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert "returned False" in r.stdout
    assert list(read_metadata(tmp_path / "ck").tensors) == ["w"]
    assert (tmp_path / "order").read_text() == "written after main ended"
    assert sorted(os.listdir(tmp_path)) == ["ck", "order"]
