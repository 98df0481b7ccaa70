"""Run under torchrun: ``save`` (at any world size) or ``load`` a checkpoint of DTensors with
random shapes and placements, the way a torch DCP user would, then ``destroy_process_group()``
and exit. The test checks the exit code: the engine's groups must not make the exit abort."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hpdcp_runner.dcp import BroadcastOptions, load, save


def state(world: int, seed: int, zeros: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i in range(12):
        nd = 1 + int(torch.randint(0, 3, (1,), generator=g))
        shape = tuple(int(x) for x in torch.randint(1, 9, (nd,), generator=g))
        full = torch.randn(shape, generator=g)
        pick = int(torch.randint(0, nd + 1, (1,), generator=g))
        placement = Replicate() if pick == nd else Shard(pick)
        # the placement is drawn from the seed and the world size: save and load differ
        placement = placement if (seed + world + i) % 3 else Replicate()
        out[f"t{i}"] = distribute_tensor(torch.zeros(shape) if zeros else full, mesh, [placement])
    return out


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if mode == "save":
        save(state(world, 7, False), checkpoint_id=path)
    else:
        tgt = state(world, 7, True)
        # broadcasts on: the replica subgroups are what the engine creates and must not keep
        load(tgt, checkpoint_id=path, broadcast=BroadcastOptions(mode="always"))
        ref = state(world, 7, False)
        for k in ref:  # bitwise, whatever the placements
            assert torch.equal(tgt[k].full_tensor(), ref[k].full_tensor()), k
        if dist.get_rank() == 0:
            with open(os.path.join(path, f"loaded_{sys.argv[3]}"), "w") as f:
                f.write("ok")
    dist.destroy_process_group()  # what torch DCP users do; nothing of the engine's released first
    import gc

    from hpdcp_runner.dcp.comm.broadcast import GROUPS
    from hpdcp_runner.dcp.comm.collectives import _GROUP_CACHE

    gc.collect()
    # weak: what the destroy left alive, and how many the load created (the check means nothing
    # if it created none)
    alive = f"{len(GROUPS.owned) + len(_GROUP_CACHE)} {GROUPS.created}"
    if mode == "load" and dist.is_available():
        with open(os.path.join(path, f"groups_{sys.argv[3]}_{os.environ['RANK']}"), "w") as f:
            f.write(str(alive))
    return 0


if __name__ == "__main__":
    sys.exit(main())
