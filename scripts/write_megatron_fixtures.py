"""Write Megatron-Core checkpoints with Megatron-Core itself, for the readers' tests
(tests/fixtures/megatron): its ``torch_dist`` format, and Megatron-LM's legacy format.

Run in a virtualenv of its own holding the pinned writer (never the runner's dependencies)::

    python3 -m venv /tmp/mcvenv && . /tmp/mcvenv/bin/activate
    pip install torch==2.13.0 "numpy<2.4" safetensors
    pip install --ignore-requires-python megatron-core==0.19.2 triton psutil "numpy<2.4"
    python scripts/write_megatron_fixtures.py --out tests/fixtures/megatron

(megatron-core's wheels declare Python 3.12; it runs on 3.11 for this, with NumPy held to a release
that has 3.11 wheels.) The script launches itself under torchrun on gloo ranks (CPU; 2, or 4 for
tensor- and pipeline-parallel 2 x 2) once per configuration (tensor-parallel 1 and 2, and 2
with biases on the QKV projection as Qwen2 has them; pipeline-parallel 2, a layer per stage; two mixtures of experts: expert-parallel 2
shaped as Mixtral, tensor-parallel 2 with a gated shared expert shaped as Qwen2-MoE whose first
layer is dense, expert-parallel 2 with RMSNorm on each query and key head shaped as Qwen3-MoE), builds a tiny
GPT model (grouped-query attention, SwiGLU, RMSNorm, rotary positions, untied output) with the
local (non Transformer-Engine) layer spec (the experts as ``SequentialMLP``, tokens dispatched by
all-gather: the all-to-all dispatcher builds a CUDA stream), and saves its
``sharded_state_dict()`` with ``dist_checkpointing.save`` (backend ``torch_dist``). The ``legacy_*``
configurations (tensor-parallel 2; tensor- and pipeline-parallel 2 x 2, also with 2 interleaved
virtual stages per pipeline rank and 4 layers; Mixtral-shaped at expert-parallel 2) save the same models through Megatron-LM's own training-loop save
(``megatron.training.checkpointing.save_checkpoint`` with ``--ckpt-format torch``, its arguments
parsed from the command line that trains the model): one ``torch.save`` archive per
model-parallel rank with the run's ``args`` and RNG states. Stand-ins let it run without CUDA:
``torch.cuda.current_device`` returns "cpu", ``torch.cuda.synchronize`` does nothing,
``torch.cuda.get_rng_state`` returns the CPU generator's state, and ``typing.override`` (Python
3.12's, which ``megatron.training`` imports) is the identity. Next to each checkpoint, ``reference/`` holds every
tensor-parallel rank's own ``model.state_dict()`` (``tp_rank<R>.safetensors``; with experts, one
per tensor- and expert-parallel pair, ``tp_rank<R>_ep_rank<E>.safetensors``; with pipeline stages,
one per stage, ``tp_rank<R>_pp_rank<P>.safetensors``, and per model chunk with interleaved ones,
``tp_rank<R>_pp_rank<P>_vp_rank<V>.safetensors``: the tensors the test maps to Hugging Face names by hand) and ``config.json``, the Hugging Face configuration of the same
shape. (The model's forward needs CUDA in this version, so no logits are recorded: the test
compares the exported weights with Megatron's own tensors, bitwise.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib

from fixture_launch import torchrun_self  # (scripts/: run by path, its own directory is on the path)

#: (directory, tensor-parallel size, expert-parallel size, pipeline-parallel size, the Hugging Face
#: family it is shaped as)
#: Mixtral: 4 experts, no biases; Qwen2-MoE: biases on q, k and v, 4 experts plus a gated shared expert;
#: Qwen3-MoE: 4 experts, RMSNorm on each query and key head
CONFIGS = (("gpt_tp1", 1, 1, 1, "llama"), ("gpt_tp2", 2, 1, 1, "llama"), ("gpt_tp2_qkv_bias", 2, 1, 1, "qwen2"),
           ("gpt_pp2", 1, 1, 2, "llama"), ("moe_ep2", 1, 2, 1, "mixtral"), ("moe_tp2_shared", 2, 1, 1, "qwen2_moe"),
           ("moe_qk_norm", 1, 2, 1, "qwen3_moe"))
#: the same models saved by Megatron-LM's own training loop in its legacy format (``--ckpt-format
#: torch``: ``megatron.training.checkpointing.save_checkpoint``, a ``torch.save`` archive per
#: tensor-, pipeline- and expert-parallel rank, ``mp_rank_<TP>[_<PP>][_<EP>]/model_optim_rng.pt``)
LEGACY = (("legacy_tp2", 2, 1, 1, "llama"), ("legacy_tp2_pp2", 2, 1, 2, "llama"), ("legacy_moe_ep2", 1, 2, 1, "mixtral"),
          ("legacy_tp2_pp2_vp2", 2, 1, 2, "llama"))
#: interleaved pipeline stages (``--num-layers-per-virtual-pipeline-stage``): the virtual stages per
#: pipeline rank, a model chunk each (``model0``, ``model1`` in the archive), one layer per chunk;
#: each chunk's weights perturbed by its own seed (chunks hold the same local names)
VIRTUAL = {"legacy_tp2_pp2_vp2": 2}
PINNED = {"megatron-core": "0.19.2", "torch": "2.13.0"}
SHAPE = dict(num_layers=2, hidden_size=24, num_attention_heads=4, num_query_groups=2, kv_channels=6,
             ffn_hidden_size=40, vocab_size=68, max_sequence_length=64)
MOE = dict(experts=4, topk=2, ffn=16, shared_ffn=20)


def hf_config(family: str = "llama", layers: int = SHAPE["num_layers"]) -> dict:
    """The Hugging Face ``config.json`` of the same shape, for the families the fixtures are."""
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": SHAPE["vocab_size"],
            "hidden_size": SHAPE["hidden_size"], "intermediate_size": SHAPE["ffn_hidden_size"],
            "num_hidden_layers": layers, "num_attention_heads": SHAPE["num_attention_heads"],
            "num_key_value_heads": SHAPE["num_query_groups"], "head_dim": SHAPE["kv_channels"],
            "max_position_embeddings": SHAPE["max_sequence_length"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
            "torch_dtype": "float32"}
    if family == "qwen2":  # biases on q, k and v only
        return {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    if family == "mixtral":
        return {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": MOE["ffn"], "num_local_experts": MOE["experts"],
                "num_experts_per_tok": MOE["topk"]}
    if family == "qwen2_moe":
        return {**base, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": True,
                "moe_intermediate_size": MOE["ffn"], "num_experts": MOE["experts"],
                "num_experts_per_tok": MOE["topk"], "shared_expert_intermediate_size": MOE["shared_ffn"],
                "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False}
    if family == "qwen3_moe":
        return {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "moe_intermediate_size": MOE["ffn"], "num_experts": MOE["experts"], "num_experts_per_tok": MOE["topk"],
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return base


def worker(out: str, tp: int, ep: int, pp: int, family: str, legacy: bool = False) -> None:
    import typing

    import torch

    torch.cuda.current_device = lambda: "cpu"  # the stand-ins (see the docstring)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # (the legacy save records it)
    if not hasattr(typing, "override"):  # (megatron.training imports Python 3.12's decorator)
        typing.override = lambda f: f
    torch.distributed.init_process_group("gloo")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from safetensors.torch import save_file

    vpp = VIRTUAL.get(os.path.basename(out))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0) if torch.cuda.is_available() else None
    moe = family in ("mixtral", "qwen2_moe", "qwen3_moe")
    moe_args = {} if not moe else dict(
        num_moe_experts=MOE["experts"], moe_router_topk=MOE["topk"], moe_ffn_hidden_size=MOE["ffn"],
        expert_model_parallel_size=ep, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",  # (alltoall builds a CUDA stream)
        **(dict(moe_shared_expert_intermediate_size=MOE["shared_ffn"], moe_shared_expert_gate=True,
                moe_layer_freq=[0, 1])  # layer 0 dense, layer 1 experts (Qwen2-MoE's decoder_sparse_step 2)
           if family == "qwen2_moe" else {}))
    cfg = TransformerConfig(num_layers=SHAPE["num_layers"] * (vpp or 1), hidden_size=SHAPE["hidden_size"],
                            num_attention_heads=SHAPE["num_attention_heads"],
                            num_query_groups=SHAPE["num_query_groups"], kv_channels=SHAPE["kv_channels"],
                            ffn_hidden_size=SHAPE["ffn_hidden_size"], gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=1e-5,
                            add_bias_linear=False, add_qkv_bias=family in ("qwen2", "qwen2_moe"), use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                            params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
                            qk_layernorm=family == "qwen3_moe", virtual_pipeline_model_parallel_size=vpp, **moe_args)
    spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm") if moe
            else get_gpt_layer_local_spec(qk_layernorm=False))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for v in range(vpp or 1):  # (a model chunk per virtual stage; one model without them)
        vp = {} if vpp is None else {"ignore_virtual": False, "vp_stage": v}
        chunks.append(GPTModel(cfg, spec, vocab_size=SHAPE["vocab_size"],
                               max_sequence_length=SHAPE["max_sequence_length"], position_embedding_type="rope",
                               share_embeddings_and_output_weights=False,
                               pre_process=parallel_state.is_pipeline_first_stage(**vp),  # a stage: its layers only
                               post_process=parallel_state.is_pipeline_last_stage(**vp),
                               **({} if vpp is None else {"vp_stage": v})))
        with torch.no_grad():  # weights that are not all equal (norms start at ones)
            for name, p in chunks[-1].named_parameters():
                seed = name if vpp is None else f"{pp_rank}.{v}.{name}"
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(seed.encode()))) * 0.02)
    model = chunks[0]
    rank, tp_rank = torch.distributed.get_rank(), parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    if legacy:
        _legacy_save(out, chunks, tp, ep, pp, moe, vpp)
    else:
        ckpt = os.path.join(out, "iter_0000002")
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    ref = os.path.join(out, "reference")
    os.makedirs(ref, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    if vpp:  # every chunk's own layers, numbered from 0 (chunk v of stage s: the model's (v * pp + s) * per + j)
        for v, chunk in enumerate(chunks):
            sd = {k: t.contiguous() for k, t in chunk.state_dict().items()
                  if isinstance(t, torch.Tensor) and not k.endswith("_extra_state")}
            save_file(sd, os.path.join(ref, f"tp_rank{tp_rank}_pp_rank{pp_rank}_vp_rank{v}.safetensors"))
    elif pp > 1:  # every stage's own layers, numbered from 0 (stage s's layer j is the model's s * layers / pp + j)
        save_file(sd, os.path.join(ref, f"tp_rank{tp_rank}_pp_rank{pp_rank}.safetensors"))
    elif not moe and rank == tp_rank:  # the first data-parallel replica's ranks
        save_file(sd, os.path.join(ref, f"tp_rank{tp_rank}.safetensors"))
    elif moe and rank == tp_rank + tp * ep_rank:  # one rank of each (tensor, expert)-parallel pair; its
        # local_experts.<j> is the model's expert ep_rank * experts / ep + j
        save_file(sd, os.path.join(ref, f"tp_rank{tp_rank}_ep_rank{ep_rank}.safetensors"))
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    torch.distributed.barrier()


def _legacy_save(out: str, chunks: list, tp: int, ep: int, pp: int, moe: bool, vpp: int | None) -> None:
    """Megatron-LM's own checkpoint save, as ``pretrain_gpt.py --ckpt-format torch`` calls it: its
    arguments parsed from the command line that trains this model (so the archive holds the
    ``args`` a real run records), the RNG states, no optimizer."""
    import torch
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_args

    argv = ["--num-layers", SHAPE["num_layers"] * (vpp or 1), "--hidden-size", SHAPE["hidden_size"],
            "--num-attention-heads", SHAPE["num_attention_heads"], "--group-query-attention",
            "--num-query-groups", SHAPE["num_query_groups"], "--kv-channels", SHAPE["kv_channels"],
            "--ffn-hidden-size", SHAPE["ffn_hidden_size"], "--swiglu", "--normalization", "RMSNorm",
            "--disable-bias-linear", "--seq-length", SHAPE["max_sequence_length"],
            "--max-position-embeddings", SHAPE["max_sequence_length"], "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", tp,
            "--pipeline-model-parallel-size", pp, "--save", out, "--ckpt-format", "torch", "--no-save-optim",
            "--micro-batch-size", 1]
    if vpp:
        argv += ["--num-layers-per-virtual-pipeline-stage", SHAPE["num_layers"] // pp]
    if moe:
        argv += ["--num-experts", MOE["experts"], "--moe-router-topk", MOE["topk"], "--moe-ffn-hidden-size",
                 MOE["ffn"], "--expert-model-parallel-size", ep]
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *map(str, argv)]
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    args.use_dist_ckpt = False  # (what validate_args derives from --ckpt-format torch)
    args.world_size = torch.distributed.get_world_size()
    args.data_parallel_size = args.world_size // (tp * pp)
    args.virtual_pipeline_model_parallel_size = vpp  # (what validate_args derives from the layers per virtual stage)
    set_args(args)
    save_checkpoint(2, chunks, None, None, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--worker", nargs=6, metavar=("DIR", "TP", "EP", "PP", "FAMILY", "FORMAT"), help=argparse.SUPPRESS)
    p.add_argument("--only", nargs="*", help="write only these configurations (default: all)")
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), int(a.worker[3]), a.worker[4], a.worker[5] == "torch")
        return
    from importlib.metadata import version

    import torch

    versions = {"megatron-core": version("megatron-core"), "torch": torch.__version__.split("+")[0]}
    if versions != PINNED:
        print(f"warning: pinned {PINNED}, running {versions}", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    for name, tp, ep, pp, family in CONFIGS + LEGACY:
        if a.only and name not in a.only:
            continue
        out = os.path.abspath(os.path.join(a.out, name))
        shutil.rmtree(out, ignore_errors=True)
        fmt = "torch" if (name, tp, ep, pp, family) in LEGACY else "torch_dist"
        torchrun_self(__file__, ["--out", out, "--worker", out, str(tp), str(ep), str(pp), family, fmt],
                      env, nproc=max(2, tp * pp))
        with open(os.path.join(out, "reference", "config.json"), "w") as f:
            json.dump(hf_config(family, SHAPE["num_layers"] * VIRTUAL.get(name, 1)), f, indent=1)
        print(f"wrote {out}")
    with open(os.path.join(a.out, "versions.json"), "w") as f:
        json.dump({**versions, "python": sys.version.split()[0], "configs": [c[0] for c in CONFIGS + LEGACY]}, f, indent=1,
                  sort_keys=True)


if __name__ == "__main__":
    main()
