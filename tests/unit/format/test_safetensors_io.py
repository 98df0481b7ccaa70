"""Our safetensors writer and header reader: files the safetensors library reads bitwise, and
headers that are refused with the file named."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from hpdcp_runner.dcp import CorruptCheckpointError
from hpdcp_runner.dcp.format.safetensors_io import SafetensorsStreamWriter, pread_into, read_header, write_file


def test_written_files_are_read_bitwise_by_safetensors(tmp_path):
    entries = [("a", torch.arange(12, dtype=torch.int32).view(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
               ("empty", torch.zeros(0, 3)), ("s", torch.tensor(2.5, dtype=torch.float64))]
    done = []
    written = write_file(str(tmp_path / "f.safetensors"), entries, meta={"format": "pt"}, on_tensor=done.append)
    got = load_file(str(tmp_path / "f.safetensors"))
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in entries)
    assert done == [48, 10, 0, 8]
    _, header = read_header(str(tmp_path / "f.safetensors"))
    by_key = {e.key: e for e in header}
    assert by_key["a"].shape == (3, 4) and by_key["a"].nbytes == 48 and written.size == (tmp_path / "f.safetensors").stat().st_size


def test_the_stream_writer_refuses_what_its_header_does_not_declare(tmp_path):
    w = SafetensorsStreamWriter(str(tmp_path / "g.safetensors"), [("x", "float32", (2,)), ("y", "float32", (3,))])
    with pytest.raises(ValueError, match="appended 'y' but the header declares 'x' next"):
        w.append("y", torch.zeros(3))
    with pytest.raises(ValueError, match="is float32 \\[3\\]"):
        w.append("x", torch.zeros(3))
    w.abort()


def _raw(tmp_path, header: dict, data: bytes = b"\0" * 16):
    body = json.dumps(header).encode()
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(p)


@pytest.mark.parametrize("header,match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlap"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "declares float32 \\[4\\] \\(16 bytes\\) but spans 8"),
    ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "exceed the file"),
    ({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "must be non-negative integers"),
    ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, "bad header entry"),
])
def test_hostile_headers_name_the_file(tmp_path, header, match):
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        read_header(_raw(tmp_path, header))
    assert "h.safetensors" in str(e.value)


def test_a_short_read_names_the_file(tmp_path):
    p = tmp_path / "short"
    p.write_bytes(b"abc")
    import os

    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match="short: unexpected end of file reading 8 bytes at offset 0"):
            pread_into(fd, 0, memoryview(bytearray(8)), name="short")
    finally:
        os.close(fd)


def test_hashing_while_writing_gives_the_digests_of_the_bytes_and_keeps_file_offsets(tmp_path):
    """Large tensors are hashed and written block by block, bypassing the file's buffer; small
    ones go through it. Digests equal those of the whole bytes, and every entry lands at its
    declared offset whatever the mix (a small entry after a large one, sizes around a block)."""
    from hpdcp_runner.dcp.core.utils import byte_view
    from hpdcp_runner.dcp.format.checksums import BLOCK_BYTES, block_digests, digest

    g = torch.Generator().manual_seed(5)
    sizes = [3, BLOCK_BYTES // 4, BLOCK_BYTES // 4 + 1, 7, 3 * BLOCK_BYTES // 4 - 5, 0, 2 * BLOCK_BYTES // 4 + 1, 1]
    tensors = [(f"t{i}", torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g))
               for i, n in enumerate(sizes)]
    path = str(tmp_path / "f.safetensors")
    wf = write_file(path, tensors)
    back = load_file(path)
    data = open(path, "rb").read()
    for (key, t), e in zip(tensors, wf.entries):
        assert torch.equal(back[key], t)
        view = byte_view(t)
        assert e.checksum == digest(view) and e.blocks == block_digests(view)
        assert data[e.byte_offset:e.byte_offset + e.nbytes] == bytes(view)
    assert wf.size == len(data)
