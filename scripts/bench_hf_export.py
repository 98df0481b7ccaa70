"""Sharded checkpoint -> one Hugging Face directory, ours vs torch DCP, side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 scripts/bench_hf_export.py --reps 3

Workload: a Llama-shaped bf16 state (``--hidden``, ``--layers``, vocab 32000; 0.55 GiB at the
defaults) as Shard(0) DTensors on every rank. Each side first saves it sharded in its own way,
untimed: ours with ``dcp.save``, torch DCP with ``HuggingFaceStorageWriter(save_distributed=True)``
(per-rank safetensors shards). Then the timed step, the consolidation into Hugging Face files
split into ``--files`` output files written by all ranks at once:

* ours: ``export_hf`` (each rank loads the whole tensors of its files with the distributed load
  and writes them; the coordinator writes the index and commits);
* peer: ``consolidate_safetensors_files_on_every_rank`` (each rank consolidates its share of the
  output files from the shards).

Both outputs are read back with the safetensors library and compared bitwise with the source.
Times are the max over ranks; medians with min-max over repetitions; ratio = peer / ours.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hpdcp_runner import dcp
from hpdcp_runner.dcp.offline.hf_export import export_hf, natural_key
from hpdcp_runner.dcp.offline.transforms import plan_hf_shards


def llama_state(hidden: int, layers: int, ffn: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def t(*s):
        return torch.empty(*s).uniform_(generator=g).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": t(32000, hidden), "model.norm.weight": t(hidden), "lm_head.weight": t(32000, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": t(hidden, hidden), p + "self_attn.k_proj.weight": t(hidden // 4, hidden),
                   p + "self_attn.v_proj.weight": t(hidden // 4, hidden), p + "self_attn.o_proj.weight": t(hidden, hidden),
                   p + "mlp.gate_proj.weight": t(ffn, hidden), p + "mlp.up_proj.weight": t(ffn, hidden),
                   p + "mlp.down_proj.weight": t(hidden, ffn), p + "input_layernorm.weight": t(hidden),
                   p + "post_attention_layernorm.weight": t(hidden)})
    return sd


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    x = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def same_as(full: dict[str, torch.Tensor], out: str) -> bool:
    from safetensors.torch import load_file

    got = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, name)))
    return got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--files", type=int, default=4, help="output files (split among the ranks)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(ws)))
    full = llama_state(args.hidden, args.layers, args.ffn)
    nbytes = sum(v.numel() * v.element_size() for v in full.values())
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    root = [tempfile.mkdtemp(prefix="hfx_", dir=args.dir) if rank == 0 else None]
    dist.broadcast_object_list(root)
    root = root[0]
    ours_src, peer_src = os.path.join(root, "ours"), os.path.join(root, "peer")
    dcp.save(state, checkpoint_id=ours_src)
    # the same output files on both sides: our shard plan, as torch's 1-based file indices
    names = sorted(full, key=natural_key)
    cap = -(-nbytes // args.files)
    shards = plan_hf_shards([(k, full[k].numel() * full[k].element_size()) for k in names], cap)
    index = {k: i + 1 for i, s in enumerate(shards) for k in s}
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    tdcp.save(state, storage_writer=HuggingFaceStorageWriter(path=peer_src, save_distributed=True,
                                                              fqn_to_index_mapping=index))
    times: dict[str, list[float]] = {"ours": [], "ours_nofsync": [], "peer": []}
    for rep in range(args.reps):
        for side in (("ours", "ours_nofsync", "peer") if rep % 2 == 0 else ("peer", "ours_nofsync", "ours")):
            out = os.path.join(root, f"{side}_out")
            if rank == 0:
                shutil.rmtree(out, ignore_errors=True)
            dist.barrier()
            if side.startswith("ours"):
                times[side].append(timed(lambda: export_hf(ours_src, out, max_shard_size=cap,
                                                           fsync=side == "ours")))
            else:
                if rank == 0:
                    os.makedirs(out)
                dist.barrier()
                times[side].append(timed(lambda: consolidate_safetensors_files_on_every_rank(peer_src, out, index)))
            if rep == 0 and rank == 0:
                assert same_as(full, out), f"{side}: consolidated output differs from the source"
    if rank == 0:
        def fmt(xs):
            return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"

        print(f"sharded -> Hugging Face ({len(shards)} files), {nbytes / 2**30:.3f} GiB bf16, {ws} ranks, "
              f"{args.reps} reps, outputs checked bitwise")
        print(f"  ours export_hf (durable: fsync):            {fmt(times['ours'])}")
        print(f"  ours export_hf, fsync=False (as the peer):  {fmt(times['ours_nofsync'])}")
        print(f"  torch consolidate_safetensors_files_on_every_rank: {fmt(times['peer'])}")
        for side in ("ours", "ours_nofsync"):
            print(f"  ratio peer / {side} (medians): "
                  f"{statistics.median(times['peer']) / statistics.median(times[side]):.2f}x")
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
