"""Defects found reviewing the engine's seams, each pinned by a test that failed before its fix."""

from __future__ import annotations

import errno
import json

import pytest

from hpdcp_runner.dcp import ConfigError, FileSystemReader, FileSystemWriter, KeyMismatchError, faults
from hpdcp_runner.dcp.api import _checkpoint_path
from hpdcp_runner.dcp.comm.collectives import _attempt, agreed_error
from hpdcp_runner.dcp.format.metadata import DeferredMetadata, Metadata, MetadataError
from hpdcp_runner.dcp.offline.sources import open_source
from hpdcp_runner.dcp.planning.load_replicas import plan_replica_reads
from tests.multiproc.harness import run_ranks


def _raise(e: BaseException):
    raise e


def test_an_agreed_key_mismatch_keeps_its_key_lists():
    payload, _ = _attempt("load: plan", lambda: _raise(KeyMismatchError("strict load: ...", ["a", "b"], ["z"])))
    err = agreed_error("load: plan", {1: payload["err"]})
    assert isinstance(err, KeyMismatchError) and err.missing == ["a", "b"] and err.unexpected == ["z"]
    assert "rank 1: strict load" in str(err)


def _agree_mismatch(rank: int, ws: int) -> dict:
    from hpdcp_runner.dcp.comm.collectives import Comm

    comm = Comm.create(None, 30)
    try:
        comm.agree("step", lambda: _raise(KeyMismatchError("bad", ["m"], [])) if rank == 1 else None)
    except KeyMismatchError as e:
        return {"missing": e.missing, "unexpected": e.unexpected}
    return {}


def test_every_rank_gets_the_attributes_of_an_agreed_error():
    assert run_ranks(2, _agree_mismatch) == [{"missing": ["m"], "unexpected": []}] * 2


def test_deferred_metadata_parses_before_answering_defaulted_fields():
    doc = json.loads(Metadata(1, {}, {}, {}).to_json())
    assert DeferredMetadata(json.dumps(doc)).format_version == 1
    with pytest.raises(MetadataError, match="unsupported format version 7"):
        DeferredMetadata(json.dumps(dict(doc, format_version=7))).format_version
    with pytest.raises(MetadataError, match="unknown checksum_algorithm 'md5'"):
        DeferredMetadata(json.dumps(dict(doc, checksum_algorithm="md5"))).checksum_algorithm


def test_two_fault_specs_for_one_point_both_apply():
    faults.arm_from_env("x.point@0:eio;x.point@1:enospc")
    try:
        for rank, code in ((0, errno.EIO), (1, errno.ENOSPC)):
            with pytest.raises(OSError) as e:
                faults.point("x.point", rank=rank)
            assert e.value.errno == code
        faults.point("x.point", rank=2)  # neither spec names rank 2
    finally:
        faults.disarm("x.point")
    with pytest.raises(ConfigError, match="bad spec 'x@1:explode'"):
        faults.arm_from_env("x@1:explode")


def test_user_input_errors_are_in_the_hierarchy(tmp_path):
    for make in (lambda: FileSystemReader(tmp_path, files_kept=0),
                 lambda: FileSystemReader(tmp_path, read_gap_bytes=-1),
                 lambda: FileSystemReader(tmp_path, max_read_bytes_per_s=-1),
                 lambda: _checkpoint_path(None, None),
                 lambda: open_source(tmp_path, "zip"),
                 lambda: plan_replica_reads([], mode="sometimes", nodes=[], slow_storage=False)):
        with pytest.raises(ConfigError):
            make()


def test_a_storage_given_alone_names_the_checkpoint(tmp_path):
    assert _checkpoint_path(None, FileSystemWriter(tmp_path / "ck")) == str(tmp_path / "ck")
    assert _checkpoint_path(None, FileSystemReader(tmp_path / "ck")) == str(tmp_path / "ck")
