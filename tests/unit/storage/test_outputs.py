"""Offline tools' outputs (storage/outputs.py): a directory appears whole or not at all locally, and
what is published has been opened by the safetensors library itself, in a store through its header
read back by range (checked here on a local file read the same way)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from hpdcp_runner.dcp import CorruptCheckpointError, HpdcpError
from hpdcp_runner.dcp.core.rafile import as_random_access, open_regular
from hpdcp_runner.dcp.storage.outputs import RenameOutput, check_remote_with_safetensors, open_output


def test_a_local_output_appears_only_when_committed(tmp_path):
    dst = tmp_path / "out"
    out = open_output(dst, overwrite=False)
    assert isinstance(out, RenameOutput)
    with pytest.raises(HpdcpError, match="not begun"):
        out.staging
    out.begin()
    out.write_safetensors("model.safetensors", [("w", torch.arange(6.0))], {"format": "pt"})
    out.put("config.json", b"{}")
    assert not dst.exists()  # written under the staging name only
    out.commit(["model.safetensors", "config.json"])
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(dst / "model.safetensors"))["w"], torch.arange(6.0))
    again = open_output(dst, overwrite=False)
    with pytest.raises(HpdcpError, match="already exists"):
        again.begin()
    failed = open_output(dst, overwrite=True)
    failed.begin()
    failed.put("config.json", b'{"new": 1}')
    failed.abort(["config.json"])
    assert (dst / "config.json").read_bytes() == b"{}"  # the old output stays, no staging left
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_remote_check_reads_the_header_against_the_real_size(tmp_path):
    out = RenameOutput(str(tmp_path / "o"), overwrite=False)
    out.begin()
    out.write_safetensors("a.safetensors", [("w", torch.ones(1000))], None)
    path = os.path.join(out.staging, "a.safetensors")
    check_remote_with_safetensors(as_random_access(open_regular(path)), "store://a.safetensors")  # whole: fine
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # an upload cut short
    with pytest.raises(CorruptCheckpointError, match="store://a.safetensors: the safetensors library refuses"):
        check_remote_with_safetensors(as_random_access(open_regular(path)), "store://a.safetensors")


def test_a_tool_output_clears_what_a_dead_export_left_and_keeps_a_live_ones(tmp_path):
    """The offline tools share the engine's rename commit: an export killed mid-way leaves its
    staging directory, the next output there removes it; one whose writer is alive (its lock
    held) stays."""
    dst = tmp_path / "out"
    dead = tmp_path / ".out.tmp-0123456789ab"  # a killed export's staging: no lock, untouched for hours
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    os.utime(dead, (0, 0))
    live = open_output(tmp_path / "other", overwrite=False)
    live.begin()  # another export in progress beside it
    out = open_output(dst, overwrite=False)
    out.begin()
    assert not dead.exists()
    assert os.path.isdir(live.staging)
    out.put("config.json", b"{}")
    out.commit(["config.json"])
    live.abort([])
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging, no lock left
