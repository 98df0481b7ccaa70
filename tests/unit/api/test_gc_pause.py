import gc
import threading

import torch

from hpdcp_runner.dcp import load, save
from hpdcp_runner.dcp.core.utils import gc_paused


def test_collector_paused_during_save_and_load_and_restored(tmp_path, monkeypatch):
    seen = []
    import hpdcp_runner.dcp.protocol as api  # where the save builds its metadata

    real = api.build_metadata
    monkeypatch.setattr(api, "build_metadata", lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1])
    assert gc.isenabled()
    save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "a")
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        load({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "a")
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()
    # from another thread (the async-save writer) the collector is left alone
    out = []
    t = threading.Thread(target=lambda: (save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "b"), out.append(1)))
    t.start()
    t.join()
    assert out == [1] and seen[-1] is True
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
