"""FileDigest: a file's recorded checksum from its bytes as they pass, in any split into blocks."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hpdcp_runner import dcp
from hpdcp_runner.dcp import CorruptCheckpointError
from hpdcp_runner.dcp.format.checksums import digest
from hpdcp_runner.dcp.format.metadata import METADATA_FILE
from hpdcp_runner.dcp.format.metadata_parse import file_table
from hpdcp_runner.dcp.format.stream_digest import FileDigest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of tensors of several dtypes and sizes, and the files metadata.json records."""
    path = str(tmp_path_factory.mktemp("ck") / "c")
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(300, 77, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
             "i": torch.arange(1000, dtype=torch.int64), "empty": torch.empty(0, 3), "s": torch.tensor(2.5)}
    dcp.save(state, checkpoint_id=path)
    with open(os.path.join(path, METADATA_FILE)) as f:
        files, index = file_table(f.read())
    recorded = {n: (m.size, m.checksum) for n, m in files.items()}
    if index is not None:
        recorded[index["file"]] = (index["size"], index["checksum"])
    return path, recorded


def _digest(name: str, body: bytes, cuts: list[int]) -> str:
    d = FileDigest(name, len(body))
    for lo, hi in zip([0, *cuts], [*cuts, len(body)]):
        d.update(body[lo:hi])
    return d.hexdigest()


def test_any_split_gives_the_recorded_checksum(saved):
    path, recorded = saved
    assert any(n.endswith(".safetensors") for n in recorded)
    rnd = random.Random(0)
    for name, (size, checksum) in recorded.items():
        body = open(os.path.join(path, name), "rb").read()
        assert len(body) == size
        splits = [[], list(range(1, min(size, 200))),  # byte by byte through the header
                  sorted(rnd.sample(range(1, size), min(size - 1, 7))), [4], [9]]
        for cuts in splits:
            assert _digest(name, body, cuts) == checksum, (name, cuts[:5])
    assert _digest("x.bin", b"any other file", [3, 4]) == digest(b"any other file")  # (a chunk index)


def test_a_changed_byte_anywhere_changes_it(saved):
    path, recorded = saved
    name = next(n for n in recorded if n.endswith(".safetensors"))
    size, checksum = recorded[name]
    body = bytearray(open(os.path.join(path, name), "rb").read())
    hlen = int.from_bytes(body[:8], "little")
    for at in (20, 8 + hlen + 3, size - 1):  # the header, the first entry, the last byte
        bad = bytearray(body)
        bad[at] ^= 0x10
        try:
            got = _digest(name, bytes(bad), [])
        except CorruptCheckpointError:
            continue  # a header no longer parseable is refused outright
        assert got != checksum, at


def test_short_long_and_broken_files_are_refused_naming_the_file(saved):
    path, recorded = saved
    name = next(n for n in recorded if n.endswith(".safetensors"))
    size, _ = recorded[name]
    body = open(os.path.join(path, name), "rb").read()
    short = FileDigest(name, size)
    short.update(body[:-1])
    with pytest.raises(CorruptCheckpointError, match=f"{name}: ended at {size - 1} of the {size} bytes"):
        short.hexdigest()
    long = FileDigest(name, size)
    with pytest.raises(CorruptCheckpointError, match=f"{name}: more than the {size} bytes"):
        long.update(body + b"x")
    for head in (b"\x01\x02", (10**12).to_bytes(8, "little") + b"{}"):  # too short; a header past the file
        d = FileDigest(name, size)
        with pytest.raises(CorruptCheckpointError, match=name):
            d.update(head)
            d.hexdigest()
    plain = FileDigest("index.bin", 3)
    plain.update(b"ab")
    with pytest.raises(CorruptCheckpointError, match="index.bin: ended at 2 of the 3 bytes"):
        plain.hexdigest()
