"""Faults in a format-v2 chunk index (docs/format.md): truncated, disagreeing with metadata.json,
rows out of bounds or out of order, unknown files, a link, a newer version. Each is refused naming
the file (and the row), on every rank, before any tensor is written into; verify reports it."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from hpdcp_runner.dcp import CheckpointNotFoundError, CorruptCheckpointError, LocalShard, MetadataError, load
from hpdcp_runner.dcp.format.chunk_index import BYTE_OFFSET, FILE, INDEX_FILE, ROW_FIELDS, TENSOR
from hpdcp_runner.dcp.format.safetensors_io import read_header
from hpdcp_runner.dcp.offline.transforms import shard_dim0
from hpdcp_runner.dcp.tools import verify
from hpdcp_runner.dcp.format import chunk_index
from tests.unit.format.test_chunk_index import _checkpoint


@pytest.fixture(params=["ranged reads", "read whole"], autouse=True)
def index_reads(request, monkeypatch):
    """Every fault both ways a reader meets an index: by ranged reads (large indexes) and read
    whole on open (small ones)."""
    monkeypatch.setattr(chunk_index, "_WHOLE_BELOW", 0 if request.param == "ranged reads" else 1 << 30)
    return request.param


# -- hostile indexes --------------------------------------------------------------------------------

def _index_entries(ck: str) -> dict:
    _, entries = read_header(os.path.join(ck, INDEX_FILE))
    return {e.key: e for e in entries}


def _poke(ck: str, entry: str, element: int, value: int) -> None:
    e = _index_entries(ck)[entry]
    with open(os.path.join(ck, INDEX_FILE), "r+b") as f:
        f.seek(e.byte_offset + 8 * element)
        f.write(struct.pack("<q", value))


def _peek(ck: str, entry: str, element: int) -> int:
    e = _index_entries(ck)[entry]
    with open(os.path.join(ck, INDEX_FILE), "rb") as f:
        f.seek(e.byte_offset + 8 * element)
        return struct.unpack("<q", f.read(8))[0]


W = len(ROW_FIELDS) + 2 * 2  # row width of a 2-D index


def _row_field(row: int, field: int) -> int:
    return row * W + field


def _edit_metadata(ck: str, fn) -> None:
    p = os.path.join(ck, "metadata.json")
    doc = json.load(open(p))
    fn(doc)
    open(p, "w").write(json.dumps(doc))


def _swap_rows(ck: str, a: int, b: int) -> None:
    ra = [_peek(ck, "rows", a * W + j) for j in range(W)]
    rb = [_peek(ck, "rows", b * W + j) for j in range(W)]
    ka, kb = _peek(ck, "keys", a), _peek(ck, "keys", b)
    for j in range(W):
        _poke(ck, "rows", a * W + j, rb[j])
        _poke(ck, "rows", b * W + j, ra[j])
    _poke(ck, "keys", a, kb)
    _poke(ck, "keys", b, ka)


def _truncate(ck):
    p = os.path.join(ck, INDEX_FILE)
    os.truncate(p, os.path.getsize(p) - 8)


def _symlink(ck):
    p = os.path.join(ck, INDEX_FILE)
    os.rename(p, p + ".real")
    os.symlink(p + ".real", p)


def _header(ck):
    p = os.path.join(ck, INDEX_FILE)
    body = open(p, "rb").read()
    open(p, "wb").write(body.replace(b'"keys"', b'"kays"', 1))


HOSTILE = {
    # name: (tamper, error type, words the message must hold)
    "truncated": (_truncate, CorruptCheckpointError, [INDEX_FILE, "truncated"]),
    "row count disagrees with metadata.json": (
        lambda ck: _edit_metadata(ck, lambda d: d["index"].update(rows=d["index"]["rows"] + 1)),
        CorruptCheckpointError, [INDEX_FILE, "metadata.json records"]),
    "a tensor metadata.json lacks": (
        lambda ck: _edit_metadata(ck, lambda d: d["tensors"].update(zz={"dtype": "float32", "shape": [2], "path": ["zz"]})),
        CorruptCheckpointError, [INDEX_FILE, "3 tensors"]),
    "header renamed": (_header, MetadataError, [INDEX_FILE, "header disagrees with metadata.json"]),
    "offsets out of bounds": (lambda ck: _poke(ck, "rows", _row_field(2, 6), 1000), MetadataError,
                              [INDEX_FILE, "row 2", "outside shape"]),
    "rows out of order": (lambda ck: _swap_rows(ck, 1, 2), MetadataError, [INDEX_FILE, "row", "out of order"]),
    "unknown file id": (lambda ck: _poke(ck, "rows", _row_field(2, FILE), 99), MetadataError,
                        [INDEX_FILE, "row 2", "file id 99"]),
    "bytes past the file's end": (lambda ck: _poke(ck, "rows", _row_field(2, BYTE_OFFSET), 1 << 40), MetadataError,
                                  [INDEX_FILE, "row 2", "beyond the end"]),
    "row of another tensor": (lambda ck: _poke(ck, "rows", _row_field(2, TENSOR), 1), MetadataError,
                              [INDEX_FILE, "row 2", "belongs to tensor id 1"]),
    "tensor_rows decreasing": (lambda ck: _poke(ck, "tensor_rows", 1, 20), MetadataError,
                               [INDEX_FILE, "tensor_rows decreases"]),
    "tensor_rows shifted": (lambda ck: _poke(ck, "tensor_rows", 1, 5), MetadataError, [INDEX_FILE, "row"]),
    "index missing": (lambda ck: os.remove(os.path.join(ck, INDEX_FILE)), CheckpointNotFoundError, [INDEX_FILE]),
    "index a symbolic link": (_symlink, CorruptCheckpointError, [INDEX_FILE, "symbolic link"]),
    "format version 3": (lambda ck: _edit_metadata(ck, lambda d: d.update(format_version=3)), MetadataError,
                         ["metadata.json", "unsupported format version 3"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_index_is_refused_naming_the_file_and_row_before_anything_is_written(tmp_path, fault_row, case,
                                                                                      index_reads):
    """w [64, 8] in 8 chunks of 8 rows; the load wants rows 16..24 (chunk row 2) and b."""
    full = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), "x": torch.arange(6.0)}
    ck = _checkpoint(tmp_path, full, 8, shard_dim0(8))
    tamper, exc, words = HOSTILE[case]
    tamper(ck)
    got, x = torch.full((8, 8), 7.0), torch.full((6,), 7.0)
    with pytest.raises(exc) as e:
        load({"w": LocalShard(got, (16, 0), (64, 8)), "x": x}, checkpoint_id=ck)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert torch.all(got == 7.0) and torch.all(x == 7.0)  # nothing written into
    report = verify(ck)
    assert not report.ok
    fault_row(f"chunk index: {case} ({index_reads})", "tampered metadata", "load refused before any tensor is written into",
              exc.__name__, "file and row" if "row" in " ".join(words) else "file", None, None,
              "reports the problem")


def test_verify_reads_every_row_a_load_never_touches(tmp_path):
    """A bad row the load does not need is loaded around (the load checks what it reads) but
    verify, which checks every row and the index's checksum, reports it."""
    full = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(2))}
    ck = _checkpoint(tmp_path, full, 8, shard_dim0(8))
    assert verify(ck).ok
    _poke(ck, "rows", _row_field(6, 6 + 2 + 1), 1)  # row 6's size along dim 0: 8 -> 1 (a gap)
    got = torch.zeros(8, 8)
    load({"w": LocalShard(got, (16, 0), (64, 8))}, checkpoint_id=ck, strict=False)
    assert torch.equal(got, full["w"][16:24])
    problems = " ".join(verify(ck).problems)
    assert INDEX_FILE in problems
