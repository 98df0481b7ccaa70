"""Vectored reads of many ranges of one file into destination memory (storage/vectored.py), and
the filesystem reader's partial-chunk paths built on them."""

from __future__ import annotations

import os

import pytest
import torch

from hpdcp_runner.dcp import CorruptCheckpointError, FileSystemReader, LocalShard, load, read_metadata, save
from hpdcp_runner.dcp.format.safetensors_io import BLOCK_BYTES
from hpdcp_runner.dcp.storage.vectored import (IOV_MAX, ReadCostModel, Sink, check_destination, measured_cost_model,
                                               read_ranges)


@pytest.fixture
def data_file(tmp_path):
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    p = tmp_path / "f.bin"
    p.write_bytes(data.numpy().tobytes())
    fd = os.open(p, os.O_RDONLY)
    yield p, fd, data
    os.close(fd)


def _read(fd, data, offs, length, gap, **kw):
    offs = torch.tensor(offs, dtype=torch.int64)
    out = torch.zeros(len(offs) * length, dtype=torch.uint8)
    addrs = check_destination(out, torch.arange(len(offs)) * length, length, name="f", what="chunk 'w'")
    st = read_ranges(fd, offs, length, addrs, gap_bytes=gap, sink=Sink(), name="f.bin", what="chunk 'w'",
                     file_size=kw.pop("file_size", data.numel()), **kw)
    want = torch.cat([data[o:o + length] for o in offs.tolist()]) if len(offs) else out
    assert torch.equal(out, want)
    return st


def test_gaps_split_or_read_through_by_the_gap_limit(data_file):
    _, fd, data = data_file
    offs = [0, 300, 600, 5000, 5300]  # gaps 200, 200, 4300, 200 with 100-byte ranges
    st = _read(fd, data, offs, 100, gap=0)
    assert (st.calls, st.bytes_read) == (5, 500)  # exactly the kept bytes
    st = _read(fd, data, offs, 100, gap=200)
    assert (st.calls, st.bytes_read) == (2, 700 + 400)  # the 4300-byte gap splits, the 200s are read through
    st = _read(fd, data, offs, 100, gap=1 << 20)
    assert (st.calls, st.bytes_read) == (1, 5400)


def test_requests_stay_under_iov_max_and_the_request_size(data_file):
    _, fd, data = data_file
    n = 3 * IOV_MAX
    st = _read(fd, data, [16 * i for i in range(n)], 8, gap=1 << 20)
    per = (IOV_MAX - 2) // 2
    assert st.calls == -(-n // per)
    # one range longer than a request is split; ranges are grouped under ~max_request_bytes
    st = _read(fd, data, [0, 100_000], 40_000, gap=1 << 20, max_request_bytes=16_384)
    assert st.calls >= 2 * 5 and st.bytes_read == 80_000  # a gap at a request boundary is never read


def test_reads_past_the_end_overlaps_and_short_files_name_the_file_chunk_and_offset(data_file):
    _, fd, data = data_file
    with pytest.raises(CorruptCheckpointError, match=r"f\.bin: chunk 'w': a read at offset 1048000 would end past"):
        _read(fd, data, [0, 1_048_000], 1000, gap=0)
    with pytest.raises(CorruptCheckpointError, match="overlap or are out of order at offset 50"):
        _read(fd, data, [100, 50], 10, gap=0)
    # the file is shorter than its recorded size (truncated after it was checked): a short read
    with pytest.raises(CorruptCheckpointError, match=r"f\.bin: chunk 'w': unexpected end of file at offset 1048576"):
        _read(fd, data, [1_048_000, 1_049_000], 1000, gap=1 << 20, file_size=2 << 20)


def test_a_destination_too_small_for_the_runs_is_refused():
    out = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(CorruptCheckpointError, match="do not fit the destination"):
        check_destination(out[10:20], torch.tensor([0, 95]), 10, name="f", what="chunk 'w'")
    check_destination(out[10:20], torch.tensor([0]), 10, name="f", what="chunk 'w'")  # inside its own storage


def test_the_cost_model_picks_the_cheapest_way_to_read_runs():
    m = ReadCostModel(call_s=5e-6, run_s=0.2e-6, bytes_per_s=5e9, copy_bytes_per_s=8e9)
    assert m.gap_bytes == 25_000  # a gap is read through when cheaper than one more request
    # page-cache speeds: tiny runs are cheapest as cache-sized slabs and one strided copy,
    # KiB runs as vectored requests reading the gaps through, long runs far apart one by one
    assert m.choose(65536, 512, 4 * 65536 * 512) == "slab"
    assert m.choose(8192, 4096, 2 * 8192 * 4096) == "through"
    assert m.choose(16, 1 << 20, 8 * 16 << 20) == "exact"
    # storage at network rates: bytes cost more than requests, so only the kept bytes are read
    slow = m.capped(200e6)
    assert slow.gap_bytes == 1000 and slow.choose(8192, 4096, 2 * 8192 * 4096) == "exact"
    assert m.capped(None) is m and m.capped(1e12) is m
    measured = measured_cost_model()
    assert min(measured.call_s, measured.run_s, measured.bytes_per_s, measured.copy_bytes_per_s) > 0
    assert measured is measured_cost_model()  # once per process


DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float64]


def _cases():
    g = torch.Generator().manual_seed(7)
    for i in range(24):
        nd = 1 + i % 3
        shape = tuple(int(torch.randint(1, 40, (1,), generator=g)) for _ in range(nd))
        lo = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in shape)
        hi = tuple(int(torch.randint(a + 1, s + 1, (1,), generator=g)) for a, s in zip(lo, shape))
        yield DTYPES[i % len(DTYPES)], shape, lo, hi, bool(i % 2)


@pytest.mark.parametrize("verify", [False, True])
def test_any_sub_box_into_any_destination_view_is_bitwise(tmp_path, verify):
    """Random shapes, dtypes, sub-boxes and destinations that are views inside bigger tensors
    (runs contiguous or not there): the reader's every partial path gives the stored bytes."""
    for n, (dt, shape, lo, hi, padded) in enumerate(_cases()):
        full = (torch.arange(torch.Size(shape).numel()) * 7 + n).reshape(shape).to(dt)
        ck = tmp_path / f"c{n}"
        save({"w": full}, checkpoint_id=ck)
        sizes = tuple(b - a for a, b in zip(lo, hi))
        want = full[tuple(slice(a, b) for a, b in zip(lo, hi))]
        for gap in (0, 1 << 20):
            base = torch.full(tuple(s + (3 if padded else 0) for s in sizes), -1).to(dt)
            dest = base[tuple(slice(1, 1 + s) if padded else slice(0, s) for s in sizes)]
            reader = FileSystemReader(ck, read_gap_bytes=gap, verify_checksums=verify)
            res = load({"w": LocalShard(dest, lo, shape)}, storage_reader=reader)
            assert torch.equal(dest, want), (dt, shape, lo, hi, padded, gap)
            if padded:  # nothing written outside the view
                mask = torch.ones(base.shape, dtype=torch.bool)
                mask[tuple(slice(1, 1 + s) for s in sizes)] = False
                assert bool((base[mask] == -1).all())
            if not verify and gap == 0 and not padded:
                assert res.counters["bytes_read"] == want.numel() * want.element_size()


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_verified_column_reads_catch_a_flipped_byte_anywhere_and_bound_the_scratch_buffer(tmp_path):
    """A 3-MiB chunk read column-wise in windows of 64 KiB: every block read and verified once,
    the scratch buffer bounded by the window plus two blocks, a flipped byte in any block the
    load copies from is caught."""
    full = torch.randn(768, 1024, generator=torch.Generator().manual_seed(3))  # 3 MiB: 3 blocks
    ck = tmp_path / "c"
    save({"w": full}, checkpoint_id=ck)
    byte0 = read_metadata(ck).tensors["w"].chunks[0].byte_offset
    window = 64 << 10

    def cols(a, b):
        t = torch.zeros(768, b - a)
        reader = FileSystemReader(ck, max_request_bytes=window)
        res = load({"w": LocalShard(t, (0, a), (768, 1024))}, storage_reader=reader)
        return t, res, reader

    t, res, reader = cols(100, 612)
    assert torch.equal(t, full[:, 100:612])
    assert reader.copier._scratch.numel() <= window + 2 * BLOCK_BYTES
    assert res.counters["bytes_read"] == 768 * 4096  # each block read once, though windows share blocks
    for at in (0, BLOCK_BYTES + 4 * 100 + 1, 3 * BLOCK_BYTES - 1):
        _flip(ck / "rank00000.safetensors", byte0 + at)
        with pytest.raises(CorruptCheckpointError, match=f"fails the checksum of its block {at // BLOCK_BYTES}"):
            cols(100, 612)
        _flip(ck / "rank00000.safetensors", byte0 + at)  # restored
    assert torch.equal(cols(0, 1024)[0], full)
