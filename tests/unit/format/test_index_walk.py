"""Walking a whole format-v2 chunk index in bounded memory (verify, inspect): a few rows at a time,
whatever the budget, every row seen once and every problem found across block boundaries."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import MetadataError, read_metadata
from hpdcp_runner.dcp.format.chunk_index import BYTE_OFFSET, INDEX_FILE, encode_header
from hpdcp_runner.dcp.format.metadata import validate_index
from hpdcp_runner.dcp.offline.inspection import describe, verify
from hpdcp_runner.dcp.offline.transforms import import_checkpoint

SHAPES = {"a": (8, 3), "b": (5,), "c": (6, 2), "d": (4, 4), "e": (9,)}


def _checkpoint(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    save_file({k: torch.arange(int(torch.tensor(s).prod()), dtype=torch.float32).view(s) + i
               for i, (k, s) in enumerate(SHAPES.items())}, str(src / "model.safetensors"))
    import_checkpoint(src, tmp_path / "ck", world_size=4, fsync=False)
    return tmp_path / "ck"


@pytest.mark.parametrize("budget", [1, 2, 3, 1000])
def test_every_row_once_per_file_in_offset_order_whatever_the_budget(tmp_path, budget):
    ck = _checkpoint(tmp_path)
    md = read_metadata(ck)
    validate_index(md, budget)
    want: dict[str, list] = {}
    for k, t in md.tensors.items():
        for c in t.chunks:
            want.setdefault(c.file, []).append((c.byte_offset, k, c.offsets))
    names = sorted(md.files)
    tensor_of = {t.chunks.tid: k for k, t in md.tensors.items()}
    got = {}
    for f, rows, at in md.index.rows_by_file(len(names), budget):
        got[names[f]] = [(r[BYTE_OFFSET], tensor_of[r[0]], tuple(r[6:6 + len(SHAPES[tensor_of[r[0]]])]))
                         for r in rows.tolist()]
        assert torch.equal(md.index.rows_tensor(0, md.index.nrows)[at], rows)  # their row numbers
    assert {n: sorted(v) for n, v in want.items()} == {n: v for n, v in got.items() if v}
    assert all(v == sorted(v) for v in got.values())
    assert len(got) == len(names)  # every file, with or without rows


def _poke_row(ck, md, row, col, value):
    ix = md.index
    header, starts = encode_header(ix.tensors, ix.nrows, ix.ndim, ix.nblocks)
    pos = 8 + len(header) + starts["rows"] + (row * ix.width + col) * 8
    with open(os.path.join(ck, INDEX_FILE), "r+b") as f:
        f.seek(pos)
        f.write(struct.pack("<q", value))


@pytest.mark.parametrize("budget", [1, 1000])
def test_two_chunks_on_the_same_bytes_are_found_across_blocks(tmp_path, budget):
    ck = _checkpoint(tmp_path)
    md = read_metadata(ck)
    rows = md.index.rows_tensor(0, md.index.nrows)
    # two rows of different tensors in one file: the later one moved onto the earlier one's bytes
    by_file: dict[int, list[int]] = {}
    for i, r in enumerate(rows.tolist()):
        by_file.setdefault(r[1], []).append(i)
    f, members = next((f, m) for f, m in by_file.items() if len({rows[i, 0].item() for i in m}) > 1)
    a, b = members[0], next(i for i in members if rows[i, 0] != rows[members[0], 0])
    _poke_row(ck, md, b, BYTE_OFFSET, int(rows[a, BYTE_OFFSET]))
    md = read_metadata(ck)
    with pytest.raises(MetadataError, match="share bytes of rank0000"):
        validate_index(md, budget)
    assert any("share bytes" in p or "checksum" in p for p in verify(ck).problems)


def test_a_row_outside_its_tensor_is_worded_by_the_per_row_check(tmp_path):
    ck = _checkpoint(tmp_path)
    md = read_metadata(ck)
    _poke_row(ck, md, 0, 6, 10_000)  # the first row's first offset far outside its shape
    with pytest.raises(MetadataError, match=r"row 0 \(tensor 'a'\).*outside shape \[8, 3\]"):
        validate_index(read_metadata(ck), 2)


def test_describe_lists_files_per_tensor_from_the_index(tmp_path):
    ck = _checkpoint(tmp_path)
    d = describe(ck)
    assert d["tensors"]["a"]["file_count"] == 4 and d["tensors"]["a"]["files"] == [
        f"rank{r:05d}.safetensors" for r in range(4)]
    assert d["tensors"]["b"]["chunks"] == 3  # 5 rows in pieces of 2: 2, 2, 1 and an empty one
    assert verify(ck).ok
    json.dumps(d)


def test_walking_every_tensor_keeps_no_chunk_table(tmp_path):
    """A whole-checkpoint walk (digests, verify in a store) describes each tensor's chunks as it
    reads them and keeps none: memory follows one tensor, not the checkpoint."""
    from hpdcp_runner.dcp.offline.inspection import files_of, full_tensor_digests

    ck = _checkpoint(tmp_path)
    md = read_metadata(ck)
    assert [c.offsets for c in md.tensors["a"].chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert all(not t.chunks._cache for t in md.tensors.values())
    assert files_of(md, ["b"]) == [f"rank{r:05d}.safetensors" for r in range(3)]  # its 4th piece is empty
    digests = full_tensor_digests(ck)
    assert sorted(digests) == sorted(SHAPES)
