"""Format v2's chunk index: a rank reads the rows of its own shards, any grid layout loads
bitwise (a hostile index: tests/faults/test_index_faults.py)."""

from __future__ import annotations

import math
import os
import random
import threading

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import LocalShard, StandardLoadPlanner, load, read_metadata
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.format import chunk_index, indexed_chunks, safetensors_io
from hpdcp_runner.dcp.format.chunk_index import INDEX_FILE
from hpdcp_runner.dcp.offline.transforms import import_checkpoint, shard_dim0
from hpdcp_runner.dcp.tools import verify


def _grid(parts: dict[str, tuple[int, ...]]):
    """Boxes of a grid layout: tensor ``k`` cut into ``parts[k]`` pieces per dimension (torch.chunk
    sizes), cell ``r`` written by rank ``r``."""

    def cuts(n: int, p: int) -> list[tuple[int, int]]:
        step = -(-n // p)
        return [(a, min(step, n - a)) for a in range(0, n, step)]

    def boxes(fqn, shape, rank):
        if not shape:
            return [Box((), ())] if rank == 0 else []
        per_dim = [cuts(n, p) for n, p in zip(shape, parts[fqn])]
        cells = [[]]
        for options in per_dim:
            cells = [c + [o] for c in cells for o in options]
        if rank >= len(cells):
            return []
        cell = cells[rank]
        return [Box(tuple(a for a, _ in cell), tuple(z for _, z in cell))]

    return boxes


def _checkpoint(tmp_path, full: dict[str, torch.Tensor], world_size: int, boxes) -> str:
    src = tmp_path / "src.safetensors"
    save_file(full, str(src))
    ck = str(tmp_path / "ck")
    import_checkpoint(str(src), ck, world_size=world_size, boxes=boxes, fsync=False)
    return ck


def _plan(md, sd) -> None:
    p = StandardLoadPlanner()
    p.configure(sd, md, rank=0, world_size=1)
    p.create_local_plan()


def test_a_rank_reads_the_rows_of_its_own_shards_only(tmp_path, monkeypatch):
    """4,096 chunks of one tensor: planning one 4-row shard reads a few KiB of a ~330 KiB index
    (one page of sort keys, the candidate rows) and loads bitwise; a whole-tensor load reads all.
    (Indexes under 1 MiB are read whole on open; this one is read in ranges as a large one is.)"""
    monkeypatch.setattr(chunk_index, "_WHOLE_BELOW", 0)
    full = {"w": torch.randn(16384, 4, generator=torch.Generator().manual_seed(0)),
            "b": torch.arange(12, dtype=torch.int16)}
    ck = _checkpoint(tmp_path, full, 4096, shard_dim0(4096))
    md = read_metadata(ck)
    assert md.format_version == 2 and len(md.tensors["w"].chunks) == 4096
    size = os.path.getsize(os.path.join(ck, INDEX_FILE))
    before = md.index.bytes_read
    box = (5000, 0)
    _plan(md, {"w": LocalShard(torch.zeros(4, 4), box, (16384, 4))})
    assert md.index.bytes_read - before <= 8 << 10 < size // 40
    assert len(md.tensors["w"].chunks._cache) <= 3  # the chunk and its sorted neighbours at most
    got = torch.full((4, 4), 7.0)
    load({"w": LocalShard(got, box, (16384, 4))}, checkpoint_id=ck, strict=False)
    assert torch.equal(got, full["w"][5000:5004])
    whole = {"w": torch.zeros(16384, 4), "b": torch.zeros(12, dtype=torch.int16)}
    load(whole, checkpoint_id=ck)
    assert all(torch.equal(whole[k], full[k]) for k in full)


@pytest.mark.parametrize("seed", range(10))
def test_any_grid_layout_loads_bitwise_reading_few_rows(tmp_path, seed, monkeypatch):
    """Random shapes, dtypes and grid layouts (split along any dimensions), random destination
    boxes: every load is bitwise, and the rows read are bounded by the bands the box meets along
    the sort dimension times the cells of the other dimensions."""
    monkeypatch.setattr(chunk_index, "_WHOLE_BELOW", 0 if seed % 2 else 1 << 30)  # both ways of reading
    if seed % 2:  # bisect every tensor (by default tensors of <= 16 chunks are scanned whole)
        monkeypatch.setattr(indexed_chunks, "_SCAN_ROWS", 0)
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]
    full, parts = {}, {}
    for i in range(3):
        nd = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 24) for _ in range(nd))
        dt = rng.choice(dtypes)
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 10 + i)) * 50
        full[f"t{i}"] = t.to(dt)
        parts[f"t{i}"] = tuple(rng.randint(1, min(n, 6)) for n in shape)
    ws = max(math.prod(p) for p in parts.values())
    ck = _checkpoint(tmp_path, full, ws, _grid(parts))
    assert verify(ck).ok
    for _ in range(4):
        key = rng.choice(sorted(full))
        t = full[key]
        offs = tuple(rng.randint(0, n - 1) for n in t.shape)
        sizes = tuple(rng.randint(1, n - o) for n, o in zip(t.shape, offs))
        md = read_metadata(ck)
        got = torch.zeros(sizes, dtype=t.dtype)
        _plan(md, {key: LocalShard(got, offs, t.shape)})
        chunks = md.tensors[key].chunks
        dim, span = md.index.tensor_sort[chunks.tid]
        step = -(-t.shape[dim] // parts[key][dim])
        bands = (offs[dim] + sizes[dim] - 1) // step - offs[dim] // step + 1
        bound = (bands + 1) * math.prod(len(range(0, n, -(-n // p)))
                                        for d, (n, p) in enumerate(zip(t.shape, parts[key])) if d != dim)
        assert len(chunks._cache) <= (bound if len(chunks) > indexed_chunks._SCAN_ROWS else len(chunks))
        load({key: LocalShard(got, offs, t.shape)}, checkpoint_id=ck, strict=False)
        want = t[tuple(slice(o, o + z) for o, z in zip(offs, sizes))]
        assert torch.equal(got, want), (seed, key, offs, sizes)


def _random_rows(rng: random.Random, ntensors: int, d: int, per_tensor: int, mixed: bool):
    """Rows in the index's layout, in any order: each tensor cut along one dimension (all along
    dim 0 unless ``mixed``), with the other columns random; and the dimension each tensor's
    index must sort along (the cut one; dim 0 for a tensor left whole)."""
    rows, dims = [], []
    for t in range(ntensors):
        j = rng.randrange(d) if mixed else 0
        pieces = rng.randint(1, per_tensor)
        dims.append(j if pieces > 1 else 0)
        for c in range(pieces):
            off, size = [0] * d, [4] * d
            off[j], size[j] = 4 * c, 4
            rows.append([t, rng.randrange(8), rng.randrange(1 << 40), rng.randrange(1 << 40), 0, 0] + off + size)
    rng.shuffle(rows)
    return torch.tensor(rows, dtype=torch.int64), dims


@pytest.mark.parametrize("mixed", [False, True])
def test_the_sorted_index_is_the_same_whether_checked_block_by_block_or_not(mixed):
    """The sort's row gather runs on a worker thread a block ahead of the check: the rows come out
    in (tensor, offset along the sort dimension) order, identical to one gather, every tensor is
    handed to the check exactly once and in order, and each block is already filled when seen."""
    rng = random.Random(3)
    rows, dims = _random_rows(rng, 40, 2, 9, mixed)
    ndims = torch.full((40,), 2, dtype=torch.int64)
    plain = chunk_index.ChunkIndex.from_rows(40, ndims, rows.clone(), torch.zeros(0, dtype=torch.int64))
    seen = []

    def check(t0, t1, part):
        assert torch.equal(part[:, 0].unique_consecutive(), torch.arange(t0, t1)[torch.bincount(
            part[:, 0], minlength=t1)[t0:t1] > 0])
        seen.append((t0, t1, part.clone()))

    blocked = chunk_index.ChunkIndex.from_rows(40, ndims, rows.clone(), torch.zeros(0, dtype=torch.int64),
                                               on_block=check, block_rows=16)
    assert len(seen) > 5 and [s[0] for s in seen] == [0] + [s[1] for s in seen[:-1]] and seen[-1][1] == 40
    assert torch.equal(torch.cat([s[2] for s in seen]), blocked.sorted_rows())
    assert torch.equal(blocked.sorted_rows(), plain.sorted_rows())
    assert [dim for dim, _ in plain.tensor_sort] == dims and (mixed or not any(dims))
    assert plain.sorted_rows().tolist() == sorted(rows.tolist(), key=lambda r: (r[0], r[6 + dims[r[0]]]))
    assert blocked.describe() == plain.describe()


def test_a_failing_block_check_ends_the_build_and_its_gather_thread():
    rows, _ = _random_rows(random.Random(5), 30, 2, 9, False)
    calls = []

    def check(t0, t1, part):
        calls.append(t0)
        if len(calls) == 2:
            raise ValueError("tensor 7 does not tile")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="tensor 7 does not tile"):
        chunk_index.ChunkIndex.from_rows(30, torch.full((30,), 2, dtype=torch.int64), rows,
                                         torch.zeros(0, dtype=torch.int64), on_block=check, block_rows=16)
    assert len(calls) == 2
    assert {t.name for t in threading.enumerate()} - before == set()


class _ListSink:
    """A sink that keeps what it is given (``fail_at``: the write that raises)."""

    def __init__(self, fail_at=None):
        self.parts, self.closed, self.aborted, self.fail_at = [], False, False, fail_at

    def write(self, data):
        if self.fail_at is not None and len(self.parts) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.parts.append(bytes(data))

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True


def _streamed(rows, ntensors, sink, block_rows=16):
    stream = safetensors_io.IndexStream(sink, ntensors, len(rows), (rows.shape[1] - 6) // 2, 0)
    try:
        index = chunk_index.ChunkIndex.from_rows(ntensors, torch.full((ntensors,), 2, dtype=torch.int64), rows,
                                                 torch.zeros(0, dtype=torch.int64),
                                                 on_block=lambda t0, t1, part: stream.put(part), block_rows=block_rows)
        stream.finish(index)
    except BaseException:
        stream.abort()
        raise
    return index


def test_an_index_streamed_while_it_is_built_is_the_file_written_whole():
    rows, _ = _random_rows(random.Random(11), 40, 2, 9, True)
    sink = _ListSink()
    index = _streamed(rows.clone(), 40, sink)
    whole = b"".join(bytes(p) for p in safetensors_io.index_parts(index))
    assert sink.closed and not sink.aborted and len(sink.parts) > 8
    assert b"".join(sink.parts) == whole
    assert len(whole) == safetensors_io.IndexStream.size(40, len(rows), 2, 0)


def test_a_failed_index_write_fails_the_build_and_drops_the_sink():
    rows, _ = _random_rows(random.Random(12), 40, 2, 9, False)
    sink = _ListSink(fail_at=3)
    with pytest.raises(OSError, match="No space left"):
        _streamed(rows, 40, sink)
    assert sink.aborted and not sink.closed
    assert not any(t.name == "hpdcp-index-write" for t in threading.enumerate())


@pytest.mark.parametrize("parts", [(3, 2), (40, 1), (1, 33), (5, 7)])
def test_overlaps_are_every_chunk_that_meets_the_box_and_describe_only_those(tmp_path, parts):
    """What a plan asks of a tensor's chunks: each chunk meeting the box with its exact overlap
    (the same as intersecting every chunk), through the scan (<= 16 chunks) and the bisection;
    rows that miss the box are never described (a plan touches every tensor of the checkpoint)."""
    shape = (97, 61)
    full = {"w": torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape),
            "s": torch.tensor(3.5)}
    ck = _checkpoint(tmp_path, full, parts[0] * parts[1], _grid({"w": parts, "s": ()}))
    md = read_metadata(ck)
    chunks = md.tensors["w"].chunks
    assert isinstance(chunks, indexed_chunks.IndexedChunks)
    assert (len(chunks) > indexed_chunks._SCAN_ROWS) == (parts[0] * parts[1] > 16)  # both paths taken
    every = [c.box for c in chunks]  # (a second read: the cache is reset below)
    rng = random.Random(sum(parts))
    for _ in range(25):
        md = read_metadata(ck)
        chunks = md.tensors["w"].chunks
        o = (rng.randrange(shape[0]), rng.randrange(shape[1]))
        box = Box(o, (rng.randint(1, shape[0] - o[0]), rng.randint(1, shape[1] - o[1])))
        got = chunks.overlaps(box)
        want = [(i, ov) for i, b in enumerate(every) if (ov := indexed_chunks.intersect(b, box)) is not None]
        assert got == want
        assert set(chunks._cache) == {i for i, _ in want}
    scalar = md.tensors["s"].chunks
    assert scalar.overlaps(Box((), ())) == [(0, Box((), ()))]
    assert chunks.overlaps(Box((0, 0), (0, 5))) == []
