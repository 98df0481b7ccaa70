"""Write DeepSpeed checkpoints with DeepSpeed itself, for the reader's tests (tests/fixtures/deepspeed).

Run in a virtualenv of its own holding the pinned writers (never the runner's dependencies)::

    python3 -m venv /tmp/dsvenv && . /tmp/dsvenv/bin/activate
    pip install torch==2.13.0 && DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed==0.19.8 transformers==5.25.0
    python scripts/write_deepspeed_fixtures.py --out tests/fixtures/deepspeed

The script launches itself under torchrun (gloo ranks on CPU) once per configuration (ZeRO
stage 1, 2 and 3; bf16 and fp32, on 2 ranks; and DeepSpeed's AutoTP training at tensor-parallel 2,
ZeRO 1 bf16 on 2 ranks and ZeRO 2 fp32 beside 2 data-parallel ranks on 4), trains a tiny
Llama-family model (grouped-query attention) for two steps and saves it with
``engine.save_checkpoint``. Next to each checkpoint it writes what the
tests compare with, made by DeepSpeed's own tools: ``reference/zero_to_fp32.safetensors`` (its
``get_fp32_state_dict_from_zero_checkpoint``; for AutoTP, which that does not merge,
``reference/universal_fp32.safetensors``: ``ds_to_universal``'s merged fp32 weights), ``reference/universal.safetensors`` (what
``ds_to_universal --inject_missing_state`` wrote: every parameter's exp_avg and exp_avg_sq; the
universal checkpoint itself is kept as ``_universal`` for ZeRO 2 and 3),
``reference/logits.safetensors`` (the model's logits with the fp32 weights on a fixed
input) and the model's ``config.json``. ``versions.json`` records what wrote them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from fixture_launch import torchrun_self  # (scripts/: run by path, its own directory is on the path)

#: (ZeRO stage, dtype, tensor-parallel size, ranks): every stage, both kinds of optimizer file; and
#: AutoTP training (``tensor_parallel.autotp_size``: a set of files per model-parallel rank), alone
#: and beside 2 data-parallel ranks (ZeRO 3 with AutoTP is not supported by DeepSpeed 0.19.8)
CONFIGS = [(1, "bf16", 1, 2), (2, "fp32", 1, 2), (3, "bf16", 1, 2), (1, "bf16", 2, 2), (2, "fp32", 2, 4),
           (0, "fp32", 1, 2), (0, "bf16", 1, 2)]
#: without ZeRO (stage 0, DeepSpeed's default): no optimizer-states files, the optimizer's state
#: dict inside the model states; DeepSpeed's tools (zero_to_fp32, ds_to_universal) read none of it,
#: so the reference is what the engine held when it saved (``reference/live.safetensors``). The
#: model ties its output head to its embedding (one parameter under two names), as many do.
UNTOOLED = 0


def config_name(stage: int, dtype: str, tp: int, nproc: int) -> str:
    return f"zero{stage}_{dtype}" + (f"_tp{tp}" if tp > 1 else "") + (f"_dp{nproc // tp}" if nproc // tp > 1 and tp > 1 else "")


#: the configurations whose universal checkpoint (``_universal``, ds_to_universal's output) is kept
#: as a fixture of its own: ZeRO 2 (whole tensors, a step.pt each), ZeRO 3 (flat tensors, no step)
#: and AutoTP's (whole tensors beside model states that give one model-parallel rank's slices)
KEEP_UNIVERSAL = ("zero2_fp32", "zero3_bf16", "zero1_bf16_tp2")
#: pipeline-parallel training (``deepspeed.pipe.PipelineModule``, which takes ZeRO 0 or 1 only):
#: (ZeRO stage, dtype, pipeline stages, ranks): bf16 across 2 stages x 2 data-parallel ranks, fp32
#: across 2 stages alone, each with ZeRO 1 and without; its tied embedding (``TiedLayerSpec``) is
#: held by the first and last stage. (fp32 without ZeRO names no parameter of a stage: the reader
#: refuses it, and the fixture is there to show that it does.)
PIPE_CONFIGS = [(1, "bf16", 2, 4), (1, "fp32", 2, 2), (0, "bf16", 2, 4), (0, "fp32", 2, 2)]
PINNED = {"deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.25.0"}


def pipe_name(stage: int, dtype: str, pp: int, nproc: int) -> str:
    return f"pipe_zero{stage}_{dtype}_pp{pp}" + (f"_dp{nproc // pp}" if nproc // pp > 1 else "")


def pipe_model(pp: int):
    """A GPT-like model as DeepSpeed pipeline layers (what Megatron-DeepSpeed and GPT-NeoX train):
    a token embedding tied to the output head, MLP blocks with a pre-norm, a final norm. Odd sizes
    (vocabulary 67, hidden 24, inner 40) so the ranks' flat partitions end inside rows."""
    import torch.nn as nn
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(67, 24)

        def forward(self, ids):
            return self.tok(ids)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(24), nn.Linear(24, 40), nn.Linear(40, 24)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    def head(embed, x):
        return x @ embed.tok.weight.t()

    def loss(logits, labels):
        return nn.functional.cross_entropy(logits.float().reshape(-1, 67), labels.reshape(-1))

    layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="tok.weight"), *(LayerSpec(Block) for _ in range(4)), LayerSpec(nn.LayerNorm, 24),
              TiedLayerSpec("embed", Embed, forward_fn=head, tied_weight_attr="tok.weight")]
    return PipelineModule(layers=layers, num_stages=pp, loss_fn=loss, partition_method="uniform")


def train_and_save_pipe(out: str, stage: int, dtype: str, pp: int) -> None:
    """Under torchrun: two steps of Adam through DeepSpeed's pipeline engine (two micro-batches a
    step), then ``save_checkpoint``; each stage's first data-parallel rank also writes the weights
    it holds (``reference/stage<S>.safetensors``: the module's own state dict, as the layer files
    should give it)."""
    import deepspeed
    import torch
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = pipe_model(pp)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)

    def batches():
        i = torch.distributed.get_rank() // pp
        while True:
            ids = (fixed_input()[i % 2: i % 2 + 1] + i) % 67
            yield ids, ids
            i += 2

    data = batches()
    for _ in range(2):
        engine.train_batch(data_iter=data)
    engine.save_checkpoint(out, tag="global_step2")
    ref = os.path.join(out, "reference")
    os.makedirs(ref, exist_ok=True)
    live = pipe_live_state(engine) if stage == UNTOOLED else {}  # (collective over the data-parallel ranks)
    if engine.grid.data_parallel_id == 0:
        s = engine.grid.get_stage_id()
        sd = {k: v.detach().clone().contiguous() for k, v in engine.module.state_dict().items()}
        save_file(sd, os.path.join(ref, f"stage{s}.safetensors"))
        if live:
            save_file(live, os.path.join(ref, f"live_stage{s}.safetensors"))
    torch.distributed.barrier()


def pipe_live_state(engine) -> dict:
    """Without ZeRO, ds_to_universal reads no pipeline checkpoint (its model states name no
    parameter): the reference is the stage's fp32 master weights and Adam moments as the engine
    holds them, assembled by DeepSpeed's own ``safe_get_full_*`` across the data-parallel ranks."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if safe_get_full_fp32_param(p) is None:  # (fp32 without ZeRO: no optimizer of DeepSpeed's holds it)
            return {}
        out[name] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for m in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{m}"] = safe_get_full_optimizer_state(p, m).detach().clone().contiguous()
    return out


def pipe_references(out: str) -> None:
    """``ds_to_universal``'s merge of a pipeline checkpoint: fp32 weights and moments by name."""
    import torch
    from safetensors.torch import save_file

    uni = os.path.join(out, "_universal")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(out, "global_step2"), "--output_folder", uni, "--inject_missing_state"],
                   check=True, capture_output=True)
    found = {}
    zero = os.path.join(uni, "zero")
    for name in sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))):
        for what in ("fp32", "exp_avg", "exp_avg_sq"):
            t = torch.load(os.path.join(zero, name, f"{what}.pt"), weights_only=False)
            found[name if what == "fp32" else f"{name}.{what}"] = (t["param"] if isinstance(t, dict) else t).contiguous()
    save_file(found, os.path.join(out, "reference", "universal.safetensors"))
    shutil.rmtree(uni)


def tiny_config(big: bool = False, tied: bool = False):
    from transformers import LlamaConfig

    if big:  # the benchmark's (scripts/bench_deepspeed_export.py): 336 M parameters, 1.25 GiB in fp32
        return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                           tie_word_embeddings=False)

    # odd sizes (67 rows of embeddings): the ranks' partitions end inside rows, not only between them
    return LlamaConfig(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=6, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def fixed_input():
    import torch

    return torch.arange(12).reshape(2, 6) % 67


def train_and_save(out: str, stage: int, dtype: str, big: bool = False, tp: int = 1) -> None:
    """Under torchrun: two steps of Adam through DeepSpeed (its AutoTP across ``tp`` ranks when
    more than 1: the ranks of a tensor-parallel group see the same batch), then ``save_checkpoint``."""
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(big, tied=stage == UNTOOLED))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = torch.distributed.get_rank() // tp % 2  # (the data-parallel rank's sample)
    for step in range(2):
        ids = (fixed_input()[rank:rank + 1] + step) % 67
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out, tag="global_step2")
    if stage == UNTOOLED and torch.distributed.get_rank() == 0:
        live_reference(engine, os.path.join(out, "reference"))
    torch.distributed.barrier()


def live_reference(engine, ref: str) -> None:
    """What the engine holds when it saved, by parameter name: the fp32 master weight (the fp16/bf16
    optimizer's copy, else the parameter itself) and Adam's moments and step, taken from the
    optimizer objects themselves (never from the files)."""
    import torch
    from safetensors.torch import save_file

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    master = {}
    for low, high in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
        master.update({id(p): m for p, m in zip(low, high)})  # (FP16_Optimizer: fp16 or bf16 without ZeRO)
    out = {}
    for name, p in engine.module.named_parameters():  # (a tied parameter once, under its first name)
        m = master.get(id(p), p)
        out[name] = m.detach().float().clone()
        st = inner.state[m]
        out[f"{name}.exp_avg"], out[f"{name}.exp_avg_sq"] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
        out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(())
    os.makedirs(ref, exist_ok=True)
    save_file(out, os.path.join(ref, "live.safetensors"))


def references(out: str, tp: int = 1) -> None:
    """DeepSpeed's own consolidations of the checkpoint at ``out``, as safetensors: ``zero_to_fp32``'s
    weights (``ds_to_universal``'s for a tensor-parallel checkpoint, which ``zero_to_fp32`` does not
    merge: ``universal_fp32.safetensors``) and ``ds_to_universal``'s moments."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file, save_file

    ref = os.path.join(out, "reference")
    os.makedirs(ref, exist_ok=True)
    if os.path.basename(out).startswith(f"zero{UNTOOLED}_"):
        live = load_file(os.path.join(ref, "live.safetensors"))
        return model_references(ref, {k: v for k, v in live.items() if not k.endswith(("exp_avg", "exp_avg_sq", "step"))},
                                tied=True)
    uni = os.path.join(out, "_universal")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(out, "global_step2"), "--output_folder", uni, "--inject_missing_state"],
                   check=True, capture_output=True)
    moments, merged = {}, {}
    zero = os.path.join(uni, "zero")
    for name in sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))):
        t = torch.load(os.path.join(zero, name, "fp32.pt"), weights_only=False)
        merged[name] = (t["param"] if isinstance(t, dict) else t).contiguous()
        for what in ("exp_avg", "exp_avg_sq"):  # (its fp32 weights are zero_to_fp32's, flattened in ZeRO 3)
            f = os.path.join(zero, name, f"{what}.pt")
            if os.path.exists(f):
                t = torch.load(f, weights_only=False)
                t = t["param"] if isinstance(t, dict) else t
                moments[f"{name}.{what}"] = t.contiguous()
    save_file(moments, os.path.join(ref, "universal.safetensors"))
    if tp > 1:
        fp32 = merged
        save_file(fp32, os.path.join(ref, "universal_fp32.safetensors"))
    else:
        fp32 = {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(out).items()}
        save_file(fp32, os.path.join(ref, "zero_to_fp32.safetensors"))
    if os.path.basename(out) not in KEEP_UNIVERSAL:
        shutil.rmtree(uni)
    model_references(ref, fp32)


def model_references(ref: str, fp32: dict, tied: bool = False) -> None:
    """The model's logits with the fp32 weights on a fixed input, and its ``config.json``."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg = tiny_config(tied=tied)
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(fp32, strict=False)
    with torch.no_grad():
        save_file({"logits": model(input_ids=fixed_input()).logits.contiguous()}, os.path.join(ref, "logits.safetensors"))
    cfg.save_pretrained(ref)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", help="one configuration, e.g. zero3_bf16")
    p.add_argument("--big", action="store_true", help="one ZeRO-3 bf16 checkpoint of a 336 M-parameter model, "
                   "no references (for scripts/bench_deepspeed_export.py)")
    p.add_argument("--worker", nargs=5, metavar=("DIR", "STAGE", "DTYPE", "BIG", "TP"), help=argparse.SUPPRESS)
    p.add_argument("--pipe-worker", nargs=4, metavar=("DIR", "STAGE", "DTYPE", "PP"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.pipe_worker:
        train_and_save_pipe(a.pipe_worker[0], int(a.pipe_worker[1]), a.pipe_worker[2], int(a.pipe_worker[3]))
        return
    if a.worker:
        train_and_save(a.worker[0], int(a.worker[1]), a.worker[2], a.worker[3] == "1", int(a.worker[4]))
        return
    import deepspeed
    import torch
    import transformers

    versions = {"deepspeed": deepspeed.__version__, "torch": torch.__version__.split("+")[0],
                "transformers": transformers.__version__}
    if versions != PINNED:
        print(f"warning: pinned {PINNED}, running {versions}", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    if a.big:
        out = os.path.abspath(a.out)
        shutil.rmtree(out, ignore_errors=True)
        torchrun_self(__file__, ["--out", out, "--worker", out, "3", "bf16", "1", "1"], env)
        tiny_config(big=True).save_pretrained(os.path.join(out, "reference"))
        print(f"wrote {out}")
        return
    for stage, dtype, tp, nproc in CONFIGS:
        name = config_name(stage, dtype, tp, nproc)
        if a.only and a.only != name:
            continue
        out = os.path.abspath(os.path.join(a.out, name))
        shutil.rmtree(out, ignore_errors=True)
        torchrun_self(__file__, ["--out", out, "--worker", out, str(stage), dtype, "0", str(tp)], env, nproc=nproc)
        references(out, tp)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its tools: not data
            if os.path.exists(os.path.join(out, script)):
                os.remove(os.path.join(out, script))
        print(f"wrote {out}")
    for stage, dtype, pp, nproc in PIPE_CONFIGS:
        name = pipe_name(stage, dtype, pp, nproc)
        if a.only and a.only != name:
            continue
        out = os.path.abspath(os.path.join(a.out, name))
        shutil.rmtree(out, ignore_errors=True)
        torchrun_self(__file__, ["--out", out, "--pipe-worker", out, str(stage), dtype, str(pp)], env, nproc=nproc)
        if stage != UNTOOLED:
            pipe_references(out)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(out, script)):
                os.remove(os.path.join(out, script))
        print(f"wrote {out}")
    if a.only:
        return  # (versions.json lists every configuration: written by a whole run only)
    with open(os.path.join(a.out, "versions.json"), "w") as f:
        json.dump({**versions, "python": sys.version.split()[0],
                   "configs": [config_name(*c) for c in CONFIGS] + [pipe_name(*c) for c in PIPE_CONFIGS]},
                  f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
