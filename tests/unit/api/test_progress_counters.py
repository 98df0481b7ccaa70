"""Issue 41 item 6: what a progress bar reads from the engine's counters while a save or a load
runs: the bytes this rank will move (its total) and what the operation is doing."""

from __future__ import annotations

import torch

from hpdcp_runner.dcp import FileSystemReader, FileSystemWriter, load, save


class _Watched(FileSystemWriter):
    seen: list

    def write(self, tensors, objects):
        self.seen.append((self.counters.stage, self.counters.expected_bytes))
        return super().write(tensors, objects)


class _WatchedReader(FileSystemReader):
    seen: list

    def read_tensors(self, requests, on_done=None, keep_order=False):
        self.seen.append((self.counters.stage, self.counters.expected_bytes))
        return super().read_tensors(requests, on_done, keep_order)


def test_a_save_and_a_load_say_their_total_and_stage(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, 3, dtype=torch.bfloat16), "n": 3}
    w = _Watched(tmp_path / "ck")
    w.seen = []
    save(state, storage_writer=w, checkpoint_id=tmp_path / "ck")
    assert w.seen == [("writing", 4000 + 42)]
    assert w.counters.stage == "" and w.counters.bytes_written >= 4042
    assert "stage" not in w.counters.as_dict() and w.counters.as_dict()["expected_bytes"] == 4042
    r = _WatchedReader(tmp_path / "ck")
    r.seen = []
    target = {"a": torch.zeros(1000), "b": torch.zeros(7, 3, dtype=torch.bfloat16), "n": 0}
    load(target, storage_reader=r, checkpoint_id=tmp_path / "ck")
    assert r.seen and all(s == ("reading", 4042) for s in r.seen), r.seen
    assert torch.equal(target["a"], state["a"]) and r.bytes_moved() == r.counters.bytes_read >= 4042
