"""async_save(mode="process"): a persisting process per rank writes the files from shared memory;
one that is killed fails the save on every rank, publishes nothing, and the next save recovers.
Real gloo ranks, real persisting processes, a real SIGKILL (the ``persist.write`` fault point,
armed through HPDCP_FAULTS in the persisting process only)."""

from __future__ import annotations

import glob
import os
import threading

import pytest
import torch

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import ConfigError, FileSystemWriter, async_save, faults, load, start_async_persist
from hpdcp_runner.dcp.background import process as persister


def _ready() -> None:
    """Start this rank's persisting process and wait until it finished starting (a save made
    before then is written by a thread instead, which these tests are not about)."""
    assert start_async_persist("process", wait_s=120)


def _mesh(ws):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(ws)))


def _process_cases(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict = {}
    full = torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33)
    state = {"w": distribute_tensor(full.clone(), _mesh(ws), [Shard(0)]), "h": torch.arange(7, dtype=torch.bfloat16),
             "step": 3, "odd": torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, 1]}  # a non-contiguous leaf
    gate = threading.Event()
    _ready()
    with faults.armed("save.write", lambda **_: gate.wait(60)):  # hold the write until the state is mutated
        resp = async_save(state, checkpoint_id=f"{root}/p1", timeout=60, mode="process")
        with torch.no_grad():
            state["w"].to_local().add_(1000)
            state["h"].add_(5)
        gate.set()
        resp.result(timeout=120)
    pid = persister.persister().proc.pid
    tgt = {"w": torch.zeros(64, 33), "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0,
           "odd": torch.zeros(3, dtype=torch.int16)}
    load(tgt, checkpoint_id=f"{root}/p1", timeout=60)
    out["staged_values"] = (torch.equal(tgt["w"], full) and torch.equal(tgt["h"], torch.arange(7, dtype=torch.bfloat16))
                            and tgt["step"] == 3 and torch.equal(tgt["odd"], torch.tensor([1, 5, 9], dtype=torch.int16)))
    async_save({"v": torch.full((5,), 2.0)}, checkpoint_id=f"{root}/p2", timeout=60, mode="process").result(120)
    out["same_process"] = persister.persister().proc.pid == pid  # kept between saves

    # rank 1's persisting process is SIGKILLed at its write: every rank fails, nothing is published
    persister.shutdown()
    os.environ["HPDCP_FAULTS"] = "persist.write@1:kill"
    try:
        _ready()
        resp = async_save({"v": torch.full((5,), 3.0)}, checkpoint_id=f"{root}/p3", timeout=60, mode="process")
        try:
            resp.result(timeout=120)
            out["failure"] = None
        except Exception as e:
            out["failure"] = f"{type(e).__name__}: {e}"
    finally:
        del os.environ["HPDCP_FAULTS"]
    # the next save starts a fresh persisting process and commits
    async_save({"v": torch.full((5,), 4.0)}, checkpoint_id=f"{root}/p3", timeout=60, mode="process").result(120)
    v = {"v": torch.zeros(5)}
    load(v, checkpoint_id=f"{root}/p3", timeout=60)
    out["after"] = v["v"].tolist()
    persister.shutdown()
    out["segments_left"] = glob.glob(os.path.join(persister.shm_dir(), f"hpdcp-stage-{os.getpid()}-*"))
    return out


def test_process_mode_persists_from_shared_memory_and_survives_a_killed_persister(tmp_path):
    res = run_ranks(2, _process_cases, str(tmp_path), timeout=300)
    for r in res:
        assert r["staged_values"], "the checkpoint must hold the values staged at async_save time"
        assert r["same_process"]
        f = r["failure"]
        assert f is not None and "rank 1" in f and "persisting process" in f and "killed by signal 9" in f, f
        assert r["after"] == [4.0] * 5
        assert r["segments_left"] == []
    # p3 committed once (the killed attempt left no staging directory or half-written checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["p1", "p2", "p3"]


class _OwnWriter(FileSystemWriter):
    pass


def test_process_mode_refuses_a_writer_it_cannot_rebuild(tmp_path):
    with pytest.raises(ConfigError, match="mode='thread'"):
        persister.WriterSpec.of(_OwnWriter(tmp_path / "x"))
    with pytest.raises(ConfigError, match="thread, process"):
        async_save({"v": torch.ones(2)}, checkpoint_id=tmp_path / "y", mode="fork")


def test_tensors_outside_the_staging_go_through_scratch_segments(tmp_path):
    """A writer given tensors that are not staged buffers (a planner's copies, a direct use of the
    writer) copies them into scratch segments for the persisting process, and removes them."""
    from hpdcp_runner.dcp import load, open_writer, save

    state = {"a": torch.arange(40, dtype=torch.float64).reshape(5, 8)[:, ::2], "b": torch.ones(3, dtype=torch.bfloat16),
             "empty": torch.zeros(0, 3), "n": 7}
    try:
        persister.prepare()
        save(state, storage_writer=persister.ProcessWriter(open_writer(str(tmp_path / "s"))))
    finally:
        persister.shutdown()
    got = {"a": torch.zeros(5, 4, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.bfloat16),
           "empty": torch.ones(0, 3), "n": 0}
    load(got, checkpoint_id=tmp_path / "s")
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"]) and got["n"] == 7
    assert glob.glob(os.path.join(persister.shm_dir(), f"hpdcp-stage-{os.getpid()}-*")) == []


def test_a_failure_in_the_persisting_process_arrives_as_the_same_error(tmp_path, monkeypatch):
    """A full disk met by the persisting process is the StorageAccessError a thread-mode save
    raises, naming the file (rebuilt from its class name and text, nothing unpickled)."""
    from hpdcp_runner.dcp import StorageAccessError

    persister.shutdown()
    monkeypatch.setenv("HPDCP_FAULTS", "file.write:enospc")
    try:
        _ready()
        response = async_save({"w": torch.ones(8)}, checkpoint_id=tmp_path / "full", mode="process")
        with pytest.raises(StorageAccessError, match=r"No space left on device \(.*rank00000.safetensors\)"):
            response.result(timeout=120)
    finally:
        monkeypatch.delenv("HPDCP_FAULTS")
        persister.shutdown()
    assert not (tmp_path / "full").exists()


def test_every_dtype_of_the_format_round_trips_through_shared_memory(tmp_path):
    from hpdcp_runner.dcp import load
    from hpdcp_runner.dcp.tools import DTYPES

    g = torch.Generator().manual_seed(0)
    state = {}
    for name, (dt, _) in sorted(DTYPES.items()):
        raw = torch.randint(0, 2 if dt == torch.bool else 256, (3, 5 * torch.empty((), dtype=dt).element_size()),
                            dtype=torch.uint8, generator=g)
        state[name] = raw.view(dt)  # any bit pattern (NaNs too), odd sizes: 3 x 5 elements
    try:
        _ready()
        response = async_save(state, checkpoint_id=tmp_path / "all", mode="process")
        assert response.mode == "process"
        response.result(timeout=120)
    finally:
        persister.shutdown()
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, checkpoint_id=tmp_path / "all")
    for k in state:
        assert torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8)), k


def test_a_save_made_while_the_persisting_process_starts_is_written_by_a_thread(tmp_path):
    """The persisting process imports torch for seconds (more on a busy host); a save made before
    it finished starting must not wait for it on the training loop (it once blocked the next save
    for 4-6 s): that save is written by a thread, the next ones by the process."""
    persister.shutdown()
    try:
        assert start_async_persist("process") is False  # just started: still importing
        first = async_save({"v": torch.full((4,), 1.0)}, checkpoint_id=tmp_path / "a", mode="process")
        assert first.mode == "thread"
        first.result(timeout=120)
        _ready()
        second = async_save({"v": torch.full((4,), 2.0)}, checkpoint_id=tmp_path / "b", mode="process")
        assert second.mode == "process"
        second.result(timeout=120)
    finally:
        persister.shutdown()
    for name, value in (("a", 1.0), ("b", 2.0)):
        got = {"v": torch.zeros(4)}
        load(got, checkpoint_id=tmp_path / name)
        assert got["v"].tolist() == [value] * 4


@pytest.mark.parametrize("nice", [None, 0, 5])
def test_the_persisting_process_runs_nicer_than_training(tmp_path, nice):
    """Its writes and checksums yield the cores to the steps: it runs at this process's niceness
    plus ``nice`` (default 10), and a save through it still lands."""
    persister.shutdown()
    before = persister.persister().nice
    try:
        assert start_async_persist("process", wait_s=120, nice=nice)
        pid = persister.persister().proc.pid
        want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + (persister.DEFAULT_NICE if nice is None else nice))
        assert os.getpriority(os.PRIO_PROCESS, pid) == want
        async_save({"v": torch.full((4,), 3.0)}, checkpoint_id=tmp_path / "n", mode="process").result(timeout=120)
    finally:
        persister.shutdown()
        persister.persister().nice = before
    got = {"v": torch.zeros(4)}
    load(got, checkpoint_id=tmp_path / "n")
    assert got["v"].tolist() == [3.0] * 4
    with pytest.raises(ConfigError, match="nice must be an integer from 0 to 19"):
        start_async_persist("process", nice=20)
