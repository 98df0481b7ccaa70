"""Sizes checked before memory is taken (reliability round 3): targets built from a checkpoint's
metadata (Hugging Face export, ``+job=load`` / ``+job=reshard`` of a user's checkpoint) first
check that the files hold what the metadata claims, then that what each rank would allocate fits
in the memory its host has (ranks sharing a host counted together), with a clear error instead
of the allocator's ``RuntimeError`` or the OOM killer.

The "fits in memory" cases use sparse files: a real 1 TiB file on disk that costs no blocks, so
the claim is true of the files and only the memory check can refuse it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import CorruptCheckpointError, InsufficientMemoryError, save, tools
from hpdcp_runner.dcp.tools import available_bytes, export_hf
from tests.e2e.conftest import cli  # noqa: F401  (the torchrun fixture)
from tests.e2e.test_cli import _tail

TIB = 1 << 40
RANK0 = "rank00000.safetensors"


def _ours(path, version: int = 1) -> None:
    save({"a": torch.arange(8.0), "o": {"x": 1}}, checkpoint_id=path, format_version=version)


def _claim(path, elements: int, file_size: int | None = None, sparse: bool = False) -> None:
    """Make ``a`` claim ``elements`` float32 elements; ``file_size``: what metadata.json records
    for the rank file; ``sparse``: really extend the file to hold them (no blocks used)."""
    doc = json.loads((path / "metadata.json").read_text())
    chunk = doc["tensors"]["a"]["chunks"][0]
    doc["tensors"]["a"]["shape"] = [elements]
    chunk[1] = [elements]
    if sparse:
        chunk[4] = 4096
        try:
            os.truncate(path / RANK0, 4096 + elements * 4)
        except OSError as e:
            pytest.skip(f"this filesystem has no sparse files ({e})")
        file_size = 4096 + elements * 4
    doc["files"][RANK0]["size"] = file_size
    (path / "metadata.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("elements", [2**38, 2**30, 10**6])
def test_export_hf_refuses_a_claim_its_files_do_not_hold(tmp_path, fault_row, elements):
    _ours(tmp_path / "c")
    _claim(tmp_path / "c", elements, file_size=elements * 4 + 4096)  # metadata lies about the file too
    with pytest.raises(CorruptCheckpointError) as ei:
        export_hf(tmp_path / "c", tmp_path / "hf")
    assert RANK0 in str(ei.value) and "metadata.json records" in str(ei.value)
    assert not (tmp_path / "hf").exists()
    if elements == 2**38:
        fault_row("tiny file, metadata claims a 1 TiB tensor (and a 1 TiB file): export_hf", "sizes before memory",
                  "refused before allocating: the file is not the size recorded", "CorruptCheckpointError", "file")


def test_a_claim_larger_than_the_files_is_refused_even_when_sizes_agree(tmp_path, fault_row):
    """Format v2 keeps chunks in the index, read lazily: a tensor shape edited in metadata.json
    (file sizes honest) is refused by the claims check before the target is allocated."""
    save({"a": torch.arange(8.0)}, checkpoint_id=tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "metadata.json").read_text())
    doc["tensors"]["a"]["shape"] = [2**38]
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError) as ei:
        export_hf(tmp_path / "c", tmp_path / "hf")
    assert "claims 1099511627776 bytes of tensors" in str(ei.value) and "'a'" in str(ei.value)
    assert not (tmp_path / "hf").exists()
    fault_row("metadata.json (v2) claims a 1 TiB tensor over honest file sizes: export_hf", "sizes before memory",
              "refused before allocating: more tensor bytes than the files hold", "CorruptCheckpointError",
              "file and key")


def test_export_hf_refuses_what_memory_cannot_hold(tmp_path, fault_row):
    _ours(tmp_path / "c")
    _claim(tmp_path / "c", 2**38, sparse=True)
    assert (available_bytes("cpu") or 0) < TIB
    with pytest.raises(InsufficientMemoryError) as ei:
        export_hf(tmp_path / "c", tmp_path / "hf")
    msg = str(ei.value)
    assert "1024.00 GiB" in msg and "available" in msg and "model.safetensors" in msg
    assert not (tmp_path / "hf").exists()
    fault_row("1 TiB tensor, really in a (sparse) file: export_hf on a smaller machine", "sizes before memory",
              "refused before allocating: more than the host has available", "InsufficientMemoryError",
              "file and key")


def test_a_hugging_face_file_whose_tensor_exceeds_memory(tmp_path):
    """A valid safetensors header for a 1 TiB tensor over a sparse file: every check of the format
    passes; only memory refuses it."""
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["w"] = {"dtype": "F32", "shape": [2**38], "data_offsets": [0, TIB]}
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body)
    try:
        os.truncate(tmp_path / "model.safetensors", 8 + len(body) + TIB)
    except OSError as e:
        pytest.skip(f"no sparse files here ({e})")
    with pytest.raises(InsufficientMemoryError, match="1024.00 GiB"):
        export_hf(tmp_path, tmp_path / "out", format="hf")
    assert not (tmp_path / "out").exists()


def test_the_claims_check_passes_a_real_checkpoint(tmp_path):
    """The checks refuse only lies: every real checkpoint, any dtype, zero-size tensors included."""
    save({"a": torch.arange(7, dtype=torch.int16), "e": torch.zeros(0, 3), "b": torch.ones(3, 5, dtype=torch.bfloat16)},
         checkpoint_id=tmp_path / "c")
    export_hf(tmp_path / "c", tmp_path / "hf")
    assert tools.describe(tmp_path / "c")["tensor_bytes"] == 7 * 2 + 15 * 2


# -- through the CLI -----------------------------------------------------------------------------

@pytest.mark.parametrize("job", ["load", "reshard"])
def test_cli_load_and_reshard_refuse_a_lying_file_size(cli, tmp_path, job):  # noqa: F811
    _ours(tmp_path / "c")
    _claim(tmp_path / "c", 2**38, file_size=TIB + 4096)
    args = [f"+job={job}", f"job.source.path={tmp_path}/c", f"hydra.run.dir={tmp_path}/r"]
    if job == "reshard":
        args.append(f"job.output={tmp_path}/out")
    r = cli(args)
    assert r.returncode != 0 and "CorruptCheckpointError" in r.stderr and "metadata.json records" in r.stderr, _tail(r)
    assert "Traceback" not in r.stderr and "RuntimeError" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_two_ranks_sharing_a_host_are_counted_together(cli, tmp_path):  # noqa: F811
    """Each of two ranks needs half of a tensor that does not fit twice over... here: 1 TiB
    split in two, so each rank alone (512 GiB) is already over, and the message says they share."""
    _ours(tmp_path / "c")
    _claim(tmp_path / "c", 2**38, sparse=True)
    r = cli(["+job=reshard", f"job.source.path={tmp_path}/c", f"job.output={tmp_path}/out", "layout=fsdp",
             f"hydra.run.dir={tmp_path}/r"], nproc=2)
    assert r.returncode != 0 and "InsufficientMemoryError" in r.stderr, _tail(r)
    assert "2 ranks share it" in r.stderr and "1024.00 GiB together" in r.stderr
    assert "hpdcp_runner/" not in r.stderr  # one line per rank, no traceback of ours (torchrun prints its own)
    assert not (tmp_path / "out").exists()
