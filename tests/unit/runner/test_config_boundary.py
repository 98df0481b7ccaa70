"""One config boundary: every engine knob is parsed and checked once, into the engine's own
option objects, which the jobs receive; the job registry is the one list of jobs."""

from __future__ import annotations

import pytest

from hpdcp_runner.config import JOB_HELP, validate_all
from hpdcp_runner.dcp import BroadcastOptions, ConfigError
from hpdcp_runner.dcp.storage.posix.filesystem import ReaderOptions
from hpdcp_runner.jobs import registry
from tests.unit.runner.test_config import _compose


def test_validation_returns_the_engine_options_parsed():
    c, o = validate_all(_compose(["+job=load", "dcp.broadcast.batch_bytes=64MiB", "dcp.storage.read_gap_bytes=1KiB",
                                  "dcp.storage.max_read_bytes_per_s=2MB", "dcp.storage.files_kept=3",
                                  "planner=minimum_rank"]), 1)
    assert o.broadcast == BroadcastOptions("auto", 64 << 20, 4)
    assert o.reader == ReaderOptions(files_kept=3, max_metadata_bytes=256 << 20, verify_checksums=True,
                                     shared_storage=False, max_read_bytes_per_s=2_000_000, read_gap_bytes=1024)
    assert o.planner == "minimum_rank" and o.fsync and o.timeout_s == c.dcp.timeout_s
    assert o.knobs()["dcp.broadcast.batch_bytes"] == 64 << 20


def test_every_bad_engine_knob_is_named_once():
    with pytest.raises(ConfigError) as e:
        validate_all(_compose(["+job=load", "dcp.broadcast.batch_bytes=lots", "dcp.storage.max_request_bytes=0",
                               "dcp.broadcast.max_in_flight=0", "dcp.storage.files_kept=0"]), 1)
    msg = str(e.value)
    for key in ("dcp.broadcast.batch_bytes", "dcp.storage.max_request_bytes", "dcp.broadcast.max_in_flight",
                "dcp.storage.files_kept"):
        assert msg.count(key) == 1, (key, msg)


def test_the_registry_is_the_list_of_jobs():
    assert sorted(registry()) == sorted(JOB_HELP)
    assert all(callable(f) for f in registry().values())


def test_each_job_has_its_own_schema():
    from hpdcp_runner.config import BenchJob, ReshardJob, TrainJob

    assert isinstance(validate_all(_compose(["+job=reshard"]), 1)[0].job, ReshardJob)
    assert isinstance(validate_all(_compose(["+job=bench", "job.repeats=2"]), 1)[0].job, BenchJob)
    assert isinstance(validate_all(_compose(["+job=train", "layout=fsdp"]), 1)[0].job, TrainJob)
    with pytest.raises(ConfigError) as e:  # a train key on a reshard: named, with the job's own keys
        validate_all(_compose(["+job=reshard", "+job.steps=3"]), 1)
    assert "job.steps" in str(e.value) and "the reshard job has no such key" in str(e.value)
    assert "output_format" in str(e.value)


def test_object_store_knobs_reach_the_engine_and_bad_ones_are_named():
    c, o = validate_all(_compose(["+job=load", "dcp.storage.endpoint=http://127.0.0.1:9", "dcp.storage.part_size=8MiB",
                                  "dcp.storage.concurrency=3", "dcp.storage.coalesce_bytes=0"]), 1)
    assert (o.store.endpoint, o.store.part_size, o.store.concurrency, o.store.coalesce_bytes) == \
        ("http://127.0.0.1:9", 8 << 20, 3, 0)
    assert o.knobs()["dcp.storage.part_size"] == 8 << 20
    with pytest.raises(ConfigError, match=r"dcp.storage: part_size must be >= 5MiB"):
        validate_all(_compose(["+job=load", "dcp.storage.part_size=1MiB"]), 1)
