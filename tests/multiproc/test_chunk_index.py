"""Format v2 on real gloo groups: each rank reads its own rows of the chunk index, a bad row only
one rank reads fails the load on every rank naming the file and row, and the metadata a save
returns on other ranks (opened lazily from the index) equals the coordinator's."""

from __future__ import annotations

import os
import struct

import torch

from tests.multiproc.harness import run_ranks


def _save_then_tamper(rank: int, ws: int, path: str) -> list:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner.dcp import HpdcpError, load, read_metadata, save
    from hpdcp_runner.dcp.format.chunk_index import INDEX_FILE, ROW_FIELDS
    from hpdcp_runner.dcp.format.safetensors_io import read_header

    mesh = DeviceMesh("cpu", list(range(ws)))
    full = torch.arange(64 * 6, dtype=torch.float32).view(64, 6)
    w = distribute_tensor(full, mesh, [Shard(0)])  # 2 chunks at 2 ranks
    md = save({"w": w, "step": 3}, checkpoint_id=path, timeout=60)
    same = md == read_metadata(path) if rank else True  # rank 1: a DeferredMetadata, its index opened lazily
    got = distribute_tensor(torch.zeros(64, 6), mesh, [Shard(0)])
    load({"w": got}, checkpoint_id=path, timeout=60, strict=False)
    bitwise = torch.equal(got.to_local(), w.to_local())
    torch.distributed.barrier()
    if rank == 0:  # row 1 (rows 32..64) is read by rank 1 only: its offset now lies outside the shape
        _, entries = read_header(os.path.join(path, INDEX_FILE))
        rows = {e.key: e for e in entries}["rows"]
        width = len(ROW_FIELDS) + 2 * 2
        with open(os.path.join(path, INDEX_FILE), "r+b") as f:
            f.seek(rows.byte_offset + 8 * (1 * width + len(ROW_FIELDS)))
            f.write(struct.pack("<q", 1000))
    torch.distributed.barrier()
    mine = distribute_tensor(torch.full((64, 6), 7.0), mesh, [Shard(0)])
    try:
        load({"w": mine}, checkpoint_id=path, timeout=60, strict=False)
        err = None
    except HpdcpError as e:
        err = (type(e).__name__, str(e))
    untouched = bool(torch.all(mine.to_local() == 7.0))
    return [same, bitwise, err, untouched]


def test_a_bad_row_one_rank_reads_fails_the_load_on_every_rank(tmp_path):
    out = run_ranks(2, _save_then_tamper, str(tmp_path / "ck"))
    for rank, (same, bitwise, err, untouched) in enumerate(out):
        assert same and bitwise, rank
        assert err is not None and err[0] == "MetadataError", (rank, err)
        assert "chunk_index.safetensors: row 1" in err[1] and "outside shape" in err[1], (rank, err)
        assert untouched, rank
