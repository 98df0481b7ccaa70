"""torch DCP -> ours -> torch DCP and ours -> HF -> ours, each side saved/loaded on 2 gloo ranks
under different layouts; the conversions run offline in this (single) process."""

from __future__ import annotations

import os

import pytest

import torch

from tests.multiproc.harness import run_ranks

from hpdcp_runner.dcp import PickleNotAllowedError, load, save
from hpdcp_runner.dcp.core.geometry import Box, split_piece
from hpdcp_runner.dcp.offline.transforms import export_torch_dcp, import_checkpoint, merge_to_hf

SHAPES = {"emb": (13, 6), "w1": (8, 9), "w2": (9, 8), "bias": (9,), "count": ()}


def _full():
    g = torch.Generator().manual_seed(7)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items() if k != "count"}
    out["count"] = torch.tensor(42, dtype=torch.int64)
    return out


def _dtensors(ws, dim):
    """The reference state as DTensors sharded on ``dim`` (Replicate for tensors without it)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(ws)))
    return {k: (distribute_tensor(v, mesh, [Shard(dim)]) if v.dim() > dim else v.clone()) for k, v in _full().items()}


def _zeros_like(sd):
    from torch.distributed.tensor import DTensor

    return {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride()) if isinstance(v, DTensor) else torch.zeros_like(v))
            for k, v in sd.items()}


def _equal_to_reference(sd) -> bool:
    from torch.distributed.tensor import DTensor

    ref = _full()
    return all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, ref[k]) for k, v in sd.items())


def _save_torch_dcp(rank, ws, path):
    import torch.distributed.checkpoint as tdcp

    tdcp.save(_dtensors(ws, 0), storage_writer=tdcp.FileSystemWriter(path))
    return True


def _load_ours(rank, ws, path, dim):
    tgt = _zeros_like(_dtensors(ws, dim))
    load(tgt, checkpoint_id=path, timeout=60)
    return _equal_to_reference(tgt)


def _load_torch_dcp(rank, ws, path, dim):
    import torch.distributed.checkpoint as tdcp

    tgt = _zeros_like(_dtensors(ws, dim))
    tdcp.load(tgt, storage_reader=tdcp.FileSystemReader(path))
    return _equal_to_reference(tgt)


def _save_ours(rank, ws, path, dim):
    save(_dtensors(ws, dim), checkpoint_id=path, timeout=60)
    return True


def _shard1(ws):
    def boxes(fqn, shape, rank):
        if len(shape) < 2:
            return [Box((0,) * len(shape), tuple(shape))]
        start, size = split_piece(shape[1], ws, rank)
        return [Box((0, start), (shape[0], size))]

    return boxes


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_torch_dcp_to_ours_to_torch_dcp(tmp_path):
    src, ours, back = str(tmp_path / "tdcp"), str(tmp_path / "ours"), str(tmp_path / "back")
    run_ranks(2, _save_torch_dcp, src)  # Shard(0) on 2 ranks, torch DCP
    try:
        import_checkpoint(src, ours)
        raise AssertionError("reading torch DCP metadata without allow_pickle must be refused")
    except PickleNotAllowedError as e:
        assert f"{src}/.metadata" in str(e) and "allow_pickle" in str(e)
    # read in place, it reports the world size its files show (torch DCP records none)
    from hpdcp_runner.dcp import open_reader
    from hpdcp_runner.jobs.inspect import format_table
    from hpdcp_runner.dcp.tools import describe

    reader = open_reader(src, "torch_dcp", allow_pickle=True)
    desc = describe(src, reader, reader.read_metadata_once())
    assert desc["world_size"] == 2 and "saved at world size 2" in format_table(desc)
    md = import_checkpoint(src, ours, allow_pickle=True, world_size=2, boxes=_shard1(2))  # ours: Shard(1) files
    assert md.world_size == 2 and [c.sizes for c in md.tensors["w1"].chunks] == [(8, 5), (8, 4)]
    assert all(run_ranks(2, _load_ours, ours, 1))  # loads directly under Shard(1)
    assert all(run_ranks(2, _load_ours, ours, 0))  # and reshards to Shard(0)
    export_torch_dcp(ours, back)
    assert all(run_ranks(2, _load_torch_dcp, back, 1))  # torch DCP reads it under Shard(1)


def test_ours_to_hf_to_ours_loads_under_another_layout(tmp_path):
    ours, hf, back = str(tmp_path / "ours"), str(tmp_path / "hf"), str(tmp_path / "back")
    run_ranks(2, _save_ours, ours, 1)  # saved Shard(1) on 2 ranks
    merge_to_hf(ours, hf, max_shard_size=200)
    import_checkpoint(hf, back, world_size=2)  # Shard(0) rank files
    assert all(run_ranks(2, _load_ours, back, 0))


def _load_in_place(rank, ws, path, dim, fmt):
    """Load a foreign checkpoint directly (no import step) under Shard(dim); bytes read here."""
    from hpdcp_runner.dcp import open_reader

    tgt = _zeros_like(_dtensors(ws, dim))
    # read_gap_bytes=0: column slices are read as runs even when they are tiny (the default reads
    # through gaps the measured cost model finds cheaper to read than to skip)
    reader = open_reader(path, fmt, allow_pickle=True, read_gap_bytes=0)
    res = load(tgt, storage_reader=reader, checkpoint_id=path, timeout=60, allow_pickle=True)
    return _equal_to_reference(tgt), res.counters["bytes_read"]


def _export_hf(rank, ws, src, dst):
    from hpdcp_runner.dcp.offline.hf_export import export_hf

    return export_hf(src, dst, allow_pickle=True, max_shard_size=300, timeout=60)["files_written_here"]


def _in_place_cases(rank, ws, src, hf):
    """One spawn for all of it: torch DCP written by torch, read in place; exported to Hugging
    Face by both ranks; that read in place."""
    import torch.distributed as dist

    _save_torch_dcp(rank, ws, src)
    out = {"tdcp": _load_in_place(rank, ws, src, 1, "torch_dcp")}
    dist.barrier()
    out["written"] = _export_hf(rank, ws, src, hf)
    out["hf"] = _load_in_place(rank, ws, hf, 0, "hf")
    return out


def test_foreign_checkpoints_load_in_place_reading_only_each_ranks_slices(tmp_path):
    """torch DCP written by torch (Shard(0) on 2 ranks) read in place under Shard(1), and a
    Hugging Face export written by both ranks, read in place under Shard(0): each rank reads
    its own columns/rows only (the replicated 0-d count is read by both)."""
    res = run_ranks(2, _in_place_cases, str(tmp_path / "tdcp"), str(tmp_path / "hf"))
    assert res[0]["written"] and res[1]["written"] and not set(res[0]["written"]) & set(res[1]["written"])
    full = _full()
    for fmt, dim in (("tdcp", 1), ("hf", 0)):
        for rank, r in enumerate(res):
            ok, nbytes = r[fmt]
            kept = sum(split_piece(v.shape[dim], 2, rank)[1] * v.numel() // v.shape[dim] * v.element_size()
                       if v.dim() > dim else v.numel() * v.element_size() for v in full.values())
            assert ok and nbytes == kept, (fmt, rank, nbytes, kept)


def _export_in_small_batches(rank, ws, src, dst):
    """The export with batches of one 128-byte tensor or so: ranks write files of different
    tensor counts, so they take part in different numbers of their own batches."""
    from hpdcp_runner.dcp.offline import hf_export

    hf_export.EXPORT_BATCH_BYTES = 100
    seen = []
    real = hf_export.load

    def counting(state, **kw):
        seen.append(sum(t.numel() * t.element_size() for t in state.values()))
        return real(state, **kw)

    hf_export.load = counting
    written = hf_export.export_hf(src, dst, max_shard_size=700, timeout=60)["files_written_here"]
    return written, seen


def test_export_streams_each_file_a_batch_at_a_time(tmp_path):
    """Memory per rank is a batch, not a file: every collective load holds at most one batch (here
    one tensor), the ranks agree on how many loads each round takes although their files differ,
    and the output equals the source bitwise."""
    import torch
    from safetensors.torch import load_file

    from hpdcp_runner.dcp import save

    src = {f"layers.{i}.w": torch.randn(4 + i % 3, 8) for i in range(9)}
    save(src, checkpoint_id=str(tmp_path / "src"))
    out = run_ranks(2, _export_in_small_batches, str(tmp_path / "src"), str(tmp_path / "hf"))
    files = [f for w, _ in out for f in w]
    assert sorted(files) == sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    assert all(max(s for s in seen) <= 6 * 8 * 4 for _, seen in out)  # one tensor (or nothing) per load
    assert len(out[0][1]) == len(out[1][1])  # as many collective loads on each rank
    got = {}
    for f in files:
        got.update(load_file(str(tmp_path / "hf" / f)))
    assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)
