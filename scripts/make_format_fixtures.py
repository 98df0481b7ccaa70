"""Write the committed fixtures of the format version this build writes
(tests/fixtures/format_v<N>/<case>/), once per version.

    OMP_NUM_THREADS=1 python scripts/make_format_fixtures.py            # refuses to overwrite
    OMP_NUM_THREADS=1 python scripts/make_format_fixtures.py --force    # only for a NEW version's set

Cases: ``ws1_plain`` (one process: every dtype, a 0-d and an empty tensor, nested paths, every
object kind); ``ws2_sharded`` (2 gloo ranks: uneven Shard(0), Shard(1), a replicated tensor
written once, a >1 MiB chunk with block digests); ``ws4_mesh_flat`` (4 ranks: a 2x2 mesh with
[Shard(0), Shard(1)] and [Replicate, Shard(0)], ragged flat shards).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.format_fixtures import objects, tensors  # noqa: E402
from tests.multiproc.harness import run_ranks  # noqa: E402

from hpdcp_runner.dcp.format.metadata import FORMAT_VERSION  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", f"format_v{FORMAT_VERSION}")


def _ws2(rank: int, ws: int, path: str) -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner.dcp import save

    t, mesh = tensors(), DeviceMesh("cpu", [0, 1])
    state = {"model": {"f32": distribute_tensor(t["f32"], mesh, [Shard(0)]),   # rows 3 + 2
                       "wide": distribute_tensor(t["wide"], mesh, [Shard(1)]),
                       "bf16": t["bf16"].clone()},                                # replicated: written once
             "u8_big": t["u8_big"].clone(), "step": objects()["step"]}
    save(state, checkpoint_id=path, timeout=60)
    return True


def _ws4(rank: int, ws: int, path: str) -> bool:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hpdcp_runner.dcp import FlatShard, save

    t = tensors()
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2))
    flat = t["i64"].reshape(-1)
    cuts = [0, 1, 5, 5, 12]  # ragged, one rank empty
    state = {"wide": distribute_tensor(t["wide"], mesh, [Shard(0), Shard(1)]),
             "bf16": distribute_tensor(t["bf16"], mesh, [Replicate(), Shard(0)]),
             "i64": FlatShard(flat[cuts[rank]:cuts[rank + 1]].clone(), t["i64"].shape, cuts[rank]),
             "meta": {"name": objects()["name"]}}
    save(state, checkpoint_id=path, timeout=60)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if os.path.exists(OUT) and not args.force:
        raise SystemExit(f"{OUT} exists: committed fixtures are never rewritten (use --force only for a new version)")
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    from hpdcp_runner.dcp import save

    t = tensors()
    save({"tensors": {k: v for k, v in t.items() if k != "u8_big"}, "list": [t["f16"], {"deep": t["bool"]}],
          "objects": objects()}, checkpoint_id=os.path.join(OUT, "ws1_plain"))
    run_ranks(2, _ws2, os.path.join(OUT, "ws2_sharded"))
    run_ranks(4, _ws4, os.path.join(OUT, "ws4_mesh_flat"))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
