# CUDA/NCCL check of the fused, expert and auto layouts, of the engine's explicit shards and of the save protocol
# (unique shards, frames, rows reported to the coordinator) on one GPU (world size 1). Run from the repo root on a machine with torch+CUDA, transformers and safetensors;
# hydra-core/omegaconf/antlr4 wheels in .whl/ are installed to /tmp/site first (machines without pip access).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CI=1
W=/tmp/w; mkdir -p $W; cd $W
nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"
python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
for fam, kw in {"phi3": dict(pad_token_id=0)}.items():
    cfg = AutoConfig.for_model(fam, vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, **kw)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{fam}_hf")
PY
R="python3 -m torch.distributed.run --nproc-per-node=1 -m hpdcp_runner runtime.device=cuda runtime.backend=nccl"
$R +job=reshard job.source.path=phi3_hf layout=phi3_tp layout.strict=true job.output=phi3_tp hydra.run.dir=r1 || exit 2
$R +job=load job.source.path=phi3_tp layout=auto hydra.run.dir=r4 || exit 5
$R +job=bench job.source.path=phi3_tp layout=phi3_tp job.repeats=2 hydra.run.dir=r5 || exit 6
python3 -m hpdcp_runner +job=verify checkpoint.path=phi3_tp hydra.run.dir=r6 || exit 8
python3 -m hpdcp_runner +job=inspect checkpoint.path=phi3_tp hydra.run.dir=r7 | head -5
cd $OLDPWD
python3 - <<'PY' || exit 7
# engine on CUDA in one process: FusedShard / ShardPieces saved sync and async (pinned staging), loaded back
import torch
from hpdcp_runner.dcp import FusedShard, ShardPieces, async_save, load, save
from hpdcp_runner.dcp.tools import Box
full = torch.randn(8, 3, device="cuda")
f = FusedShard(torch.cat([full[5:], full[:5]]), (8, 3), [Box((5, 0), (3, 3)), Box((0, 0), (5, 3))], 0)
p = ShardPieces((2, 4), [(Box((1, 0), (1, 4)), torch.ones(1, 4, device="cuda")), (Box((0, 0), (1, 4)), torch.zeros(1, 4, device="cuda"))])
save({"f": f, "p": p}, checkpoint_id="/tmp/ck_a")
async_save({"f": f, "p": p}, checkpoint_id="/tmp/ck_b").result()
for c in ("/tmp/ck_a", "/tmp/ck_b"):
    g = FusedShard(torch.zeros(8, 3, device="cuda"), (8, 3), [Box((0, 0), (8, 3))], 0)
    out = {"f": g, "p": torch.full((2, 4), 9.0, device="cuda")}
    load(out, checkpoint_id=c)
    assert torch.equal(out["f"].local, full) and out["p"].tolist() == [[0.0] * 4, [1.0] * 4], c
print("cuda engine FusedShard/ShardPieces OK")
PY
OMP_NUM_THREADS=4 timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/unit/runner/test_fused_layouts.py tests/unit/runner/test_experts.py tests/unit/api/test_fused_and_pieces.py tests/unit/comm tests/unit/planning tests/unit/format/test_index_walk.py tests/multiproc/test_protocol.py 2>&1 | tail -3
echo ALL-DONE
