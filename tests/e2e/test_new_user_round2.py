"""Issue 41, a new user's hour round 2: each surprise they met, through the CLI where they met it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpdcp_runner.dcp import read_metadata
from hpdcp_runner.dcp.storage.stores import examples

from tests.e2e.conftest import _env


def _hpdcp(args, cwd, timeout=240):
    """``hpdcp ...`` as a user types it (the console script's module, torchrun in-process)."""
    return subprocess.run([sys.executable, "-m", "hpdcp_runner", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(cwd))


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_a_mistyped_key_is_one_line_naming_the_nearest_keys_printed_once(cli, tmp_path):
    r = cli(["+job=save", "checkpoint.kep_last=1"])
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == ["error: ConfigError: checkpoint.kep_last: no such config key (did you mean "
                                "checkpoint.keep_last or checkpoint.path?)"], r.stderr
    r = cli(["+job=save", "checkpoint.keep=2"])
    assert r.returncode == 2 and len(_lines(r.stderr)) == 1 and "checkpoint.keep_last" in r.stderr, r.stderr
    # nothing close: the section's real keys
    r = cli(["+job=save", "dcp.broadcast.zzzzzz=1"])
    assert r.returncode == 2 and "dcp.broadcast has: mode, batch_bytes, max_in_flight" in r.stderr, r.stderr
    # a bad override's syntax names the override
    r = cli(["+job=save", "checkpoint.dir=[a"])
    assert r.returncode == 2 and _lines(r.stderr)[0].startswith("error: ConfigError: checkpoint.dir=[a: "), r.stderr
    # two ranks compose the same config: the line once, exit 2
    r = _hpdcp(["--nproc-per-node=2", "+job=save", "checkpoint.kep_last=1"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == ["error: ConfigError: checkpoint.kep_last: no such config key (did you mean "
                                "checkpoint.keep_last or checkpoint.path?)"], r.stderr


def _ranks_and_pid(rank, world_size):
    return rank, world_size, os.getpid()


def test_the_rank_harness_cannot_lose_a_port_race(monkeypatch):
    """Item 2: the harness chose a free port, closed it, and another process could take it before
    the ranks bound it (EADDRINUSE under load). Here that race is forced: the port any port-picking
    helper returns is held by another socket the whole time; the ranks still form their group."""
    import socket

    from tests.multiproc import harness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(harness, "free_port", lambda: taken)
        out = harness.run_ranks(2, _ranks_and_pid, timeout=120)
    assert [(r, w) for r, w, _ in out] == [(0, 2), (1, 2)] and out[0][2] != out[1][2]


def test_the_readme_test_command_installs_what_the_object_store_tests_need():
    """Item 1: the README's test command installed ``.[test,interop]`` without the object-store
    client, so every S3 test skipped. The extras it names must bring every package the loopback
    server and the client need (the fixtures then start the server themselves)."""
    import re

    import pytest

    from tests.e2e.conftest import ROOT

    tomllib = pytest.importorskip("tomllib")
    readme = open(os.path.join(ROOT, "README.md")).read()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c)  # the second set-up command
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', test_cmd).group(1).split(",")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ;]", req, maxsplit=1)[0].lower() for e in extras for req in optional[e]}
    needed = {"obstore", "moto", "boto3"}  # what s3_server.available() imports
    assert needed <= names, f"the README's test command ({extras}) lacks {needed - names}"
    assert "HPDCP_SKIP" not in test_cmd and "-m 'not" not in test_cmd


@pytest.mark.slow  # the slow tier (bash .ci/run runs it after the default tier)
def test_errors_point_the_right_way(cli, tmp_path, s3_endpoint, s3_bucket):
    """Item 5: a verify of nothing is 'not found' (local and in a bucket), not 'corrupt'; a Hugging
    Face output that exists promises nothing it cannot keep; an endpoint nobody listens on says so
    and names AWS_ENDPOINT_URL; an unsupported scheme is refused before any rank starts."""
    for where in (str(tmp_path / "nothing"), f"{s3_bucket}/nothing"):
        r = cli(["+job=verify", f"checkpoint.path={where}", f"hydra.run.dir={tmp_path}/v"])
        assert r.returncode == 1, r.stderr
        assert _lines(r.stderr) == [f"error: CheckpointNotFoundError: no committed checkpoint at {where} "
                                    f"(check checkpoint.path)"], r.stderr
    # an HF export into a bucket replaces files in place: the message says so, not "stays loadable"
    r = cli(["+job=save", f"checkpoint.dir={s3_bucket}/ck", f"hydra.run.dir={tmp_path}/s"])
    assert r.returncode == 0, r.stderr
    args = ["+job=reshard", f"job.source.path={s3_bucket}/ck/step_0", "job.output_format=hf", "job.verify=false"]
    for out in (f"{s3_bucket}/hf", str(tmp_path / "hf")):
        for n in range(2):
            r = cli([*args, f"job.output={out}", f"hydra.run.dir={tmp_path}/h{n}"])
        assert r.returncode == 1, r.stderr
        line = _lines(r.stderr)[-1]
        assert "CheckpointExistsError" in line and "checkpoint.overwrite=true" in line, line
        assert "until the new one commits" not in line, line  # an HF output has no commit
        assert ("replaced in place, not atomically" in line) == out.startswith("s3://"), line
    # nothing listens at the endpoint
    env = dict(_env(), AWS_ENDPOINT_URL="http://127.0.0.1:1")
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", f"checkpoint.dir={s3_bucket}/x",
                        "dcp.storage.max_retries=0", f"hydra.run.dir={tmp_path}/c"], capture_output=True, text=True,
                       env=env, timeout=120)
    line = _lines(r.stderr)[-1]
    assert r.returncode == 1 and "cannot reach the object store at http://127.0.0.1:1" in line, r.stderr
    assert "connection was refused" in line and "AWS_ENDPOINT_URL" in line and "error sending request" not in line
    # hdfs:// (a scheme no storage serves): one line before any rank starts, so no run directory
    r = _hpdcp(["--nproc-per-node=2", "+job=verify", "checkpoint.path=hdfs://b/x"], tmp_path)
    assert r.returncode == 2 and _lines(r.stderr) == [
        "error: ConfigError: checkpoint.path=hdfs://b/x: the hdfs:// scheme is not supported; a checkpoint location is a "
        f"local directory or {examples()}"], r.stderr  # (every store of the registry, sftp:// included)
    assert "sftp://host/prefix" in examples()
    assert not (tmp_path / "outputs").exists()


def _deepseek_v2_dir(path):
    """A tiny DeepSeek-V2-shaped Hugging Face directory: a family the presets do not name (MLA
    attention: q_a/q_b/kv_a/kv_b projections), recognised as moe from its expert keys."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    h, r, e = 16, 8, 4
    shapes = {"model.embed_tokens.weight": (32, h), "model.norm.weight": (h,), "lm_head.weight": (32, h)}
    p = "model.layers.0."
    shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_a_proj.weight": (r, h), p + "self_attn.q_a_layernorm.weight": (r,),
                   p + "self_attn.q_b_proj.weight": (2 * h, r), p + "self_attn.kv_a_proj_with_mqa.weight": (r + 4, h),
                   p + "self_attn.kv_a_layernorm.weight": (r,), p + "self_attn.kv_b_proj.weight": (2 * h, r),
                   p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate.weight": (e, h)})
    for x in range(e):
        shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (8, h), f"{p}mlp.experts.{x}.up_proj.weight": (8, h),
                       f"{p}mlp.experts.{x}.down_proj.weight": (h, 8)})
    os.makedirs(path)
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v2", "hidden_size": h, "num_attention_heads": 2, "n_routed_experts": e}, f)


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_a_layout_that_splits_attention_in_part_says_so(cli, tmp_path):
    """Item 4: layout=auto on DeepSeek-V2 once picked the MoE preset from its key names, which split
    o_proj by rows while its q/kv projections fell to the catch-all (replicated), with no word.
    Now auto follows DeepSeek-V2's own plan (q_b/kv_b column-parallel, o_proj row-parallel, the
    low-rank q_a/kv_a projections whole, as its runtime keeps them), and the preset, named by
    hand, fails naming the block unless layout.strict=false (then a warning and a metrics entry)."""
    import json

    pytest.importorskip("transformers", minversion="5.0")
    src = tmp_path / "ds"
    _deepseek_v2_dir(str(src))
    args = ["+job=reshard", f"job.source.path={src}"]
    r = cli([*args, "layout=auto", "layout.parallel=ep_tp", f"job.output={tmp_path}/o", f"hydra.run.dir={tmp_path}/a"],
            nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [ln for ln in r.stderr.splitlines() if "only in part" in ln], r.stderr[-3000:]
    with open(tmp_path / "a" / "metrics.json") as f:
        result = json.load(f)["result"]
    assert "the deepseek_v2 family's own expert- and tensor-parallel plans" in result["layout_recognised"]
    assert "partly_split" not in result
    md = read_metadata(str(tmp_path / "o"))
    pieces = lambda k: len(md.tensors[k].chunks)  # noqa: E731
    p = "model.layers.0.self_attn."
    assert [pieces(p + n + ".weight") for n in ("q_b_proj", "kv_b_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa")] \
        == [2, 2, 2, 1, 1]
    preset = [*args, "layout=moe_ep_tp"]
    r = _hpdcp(["--nproc-per-node=2", *preset, f"hydra.run.dir={tmp_path}/b"], tmp_path)
    assert r.returncode == 2 and "layout 'moe_ep_tp' splits 1 block(s) only in part" in r.stderr and \
        "'model.layers.0.self_attn'" in r.stderr and "layout.strict=false" in r.stderr, r.stderr[-3000:]
    r = cli([*preset, "layout.strict=false", f"hydra.run.dir={tmp_path}/c"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in r.stderr.splitlines() if "only in part" in ln]
    assert len(warned) == 1 and "o_proj.weight are split while kv_a_proj_with_mqa.weight, kv_b_proj.weight, " \
        "q_a_proj.weight, q_b_proj.weight fall to the default" in warned[0], warned
    with open(tmp_path / "c" / "metrics.json") as f:
        partly = json.load(f)["result"]["partly_split"]
    assert partly["first"] == "model.layers.0.self_attn"
    assert partly["split"] == ["model.layers.0.self_attn.o_proj.weight"]


@pytest.mark.slow  # the slow tier (bash .ci/run runs it after the default tier)
def test_progress_bars_show_bytes_of_a_total_with_rate_eta_and_what_they_wait_for(tmp_path):
    """Item 6: the load bar showed ``0.00B [00:33, ?B/s, 2 files]`` with no total, and the
    reshard's verify counted tensors (``87it``). Every byte bar now has its total (a percentage,
    done/total and the time left) and says what it is doing."""
    import re

    from tests.e2e.test_new_user import _on_a_terminal

    ck = tmp_path / "ck"
    env = _env()
    env.pop("CI", None)
    model = ["model.vocab=2048", "model.hidden=128", "model.ffn=512"]  # 3.7 MB in 20 tensors
    subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", f"checkpoint.dir={ck}", "checkpoint.name=s",
                    *model], check=True, env=env, cwd=str(tmp_path), capture_output=True, timeout=240)
    slow = "dcp.storage.max_read_bytes_per_s=1MiB"  # ~4 s of reading, for the load and the source's verify
    code, shown = _on_a_terminal([sys.executable, "-m", "hpdcp_runner", "+job=reshard", f"job.source.path={ck}/s",
                                  "job.output=out", slow, *model], env, tmp_path, rows=24, cols=160)
    assert code == 0, shown[-3000:]
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", shown))  # (the line's erase-to-end code out)
    load = [f for f in frames if "reshard.load (rank 0)" in f and "%" in f]
    assert load, shown[-3000:]
    # bytes of the total, the rate, the time left, and what it is doing (hpdcp_runner.progress's line)
    assert any(re.search(r"\d+% [█·]+ [\d.]+/3\.\d MiB  [\d.]+ (B|KiB|MiB)/s  \d+:\d\d left(  \d+ files?)? · reading$", f)
               for f in load), load[-3:]
    verify = [f for f in frames if "verify: reading the source s" in f]
    assert any(re.search(r"\d+%\|.*/3\.5[0-9]M \[", f) for f in verify), verify[-3:] or shown[-3000:]
    assert not any(re.search(r"\d+it\b", f) for f in frames if "verify" in f)


def test_the_sweep_report_shows_overrides_as_typed_and_the_lowest_apart_from_its_ties(tmp_path):
    """Item 7: the report printed Hydra's escaped ``s3\\://`` and listed the lowest point among
    those "within noise" of itself."""
    from tests.e2e.test_new_user import _fake_sweep, _report

    root = tmp_path / "sweep"
    _fake_sweep(root, [([r"checkpoint.dir=s3\://b/x", "k=1"], 1.00, [0.9, 1.2]),
                       ([r"checkpoint.dir=s3\://b/x", "k=2"], 1.05, [0.95, 1.3]),
                       ([r"checkpoint.dir=s3\://b/x", "k=3"], 2.0, [1.9, 2.1])])
    r = _report(root, "--no-plot")
    assert r.returncode == 0, r.stderr
    assert "\\:" not in r.stdout and "checkpoint.dir=s3://b/x k=1" in r.stdout, r.stdout
    line = next(ln for ln in r.stdout.splitlines() if "within noise of it" in ln)
    assert line == ("no single best point; lowest median: checkpoint.dir=s3://b/x k=1 | within noise of it: "
                    "checkpoint.dir=s3://b/x k=2"), line
    assert "\\:" not in (root / "report.md").read_text() + (root / "report.csv").read_text()


def test_the_summary_says_when_the_model_preset_was_changed(cli, tmp_path):
    """Item 7: ``model=tiny`` in the summary although its dimensions were overridden."""
    import json

    r = cli(["+job=save", "model.hidden=48", "model.layers=1", f"hydra.run.dir={tmp_path}/r"])
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[0]
    assert head.endswith("model=tiny (model.hidden=48 model.layers=1)"), head
    with open(tmp_path / "r" / "metrics.json") as f:
        assert json.load(f)["model_overridden"] == ["model.hidden=48", "model.layers=1"]
    r = cli(["+job=save", f"hydra.run.dir={tmp_path}/plain"])
    assert r.stdout.splitlines()[0].endswith("model=tiny"), r.stdout


def test_help_names_the_launcher_and_its_choices_and_never_cuts_a_word(cli):
    """Item 7: --help said it lists every group but left out hydra/launcher and the launcher's
    --nproc-per-node, and cut descriptions mid-sentence at the first line of their comment."""
    import re

    r = cli(["--help"])
    assert r.returncode == 0
    out = r.stdout
    assert "--nproc-per-node=N +job=<name>" in out and "hydra/launcher=<choice>" in out
    for launcher in ("hpdcp_torchrun", "hpdcp_submitit_local", "hpdcp_submitit_slurm", "local_2ranks",
                     "slurm_gpu_node"):
        assert re.search(rf"^  {launcher} +\S", out, re.M), launcher
    # every description is its whole first sentence: auto's used to stop at "or its key"
    assert "or its key names: llama" in " ".join(out.split())
    from hpdcp_runner.config import JOB_HELP

    jobs = dict(re.findall(r"^  (\w+) {2,}(.+(?:\n {13}\S.*)*)", out.split("\n\n", 2)[1], re.M))
    assert {k: " ".join(v.split()) for k, v in jobs.items() if k in JOB_HELP} == JOB_HELP  # whole, wrapped
    entries = re.findall(r"^  (\w+) +(.+(?:\n {25}\S.*)*)", out.split("Jobs (+job=<name>):", 1)[1].split("\n\n", 1)[1],
                         re.M)
    assert len(entries) > 30
    for name, text in entries:
        text = " ".join(text.split())
        assert text.endswith((".", ")", "]")) or len(text) < 60 or name in ("local_2ranks", "slurm_gpu_node"), \
            (name, text)


@pytest.mark.slow  # the slow tier (bash .ci/run runs it after the default tier)
def test_a_bench_leaves_no_empty_checkpoints_folder(cli, tmp_path):
    """Item 7: a bench (of a user's checkpoint or of the synthetic model) left an empty
    ``checkpoints/`` folder in every point's run directory."""
    r = cli(["+job=save", f"checkpoint.dir={tmp_path}/ck", f"hydra.run.dir={tmp_path}/s"])
    assert r.returncode == 0, r.stderr
    for args, run in (([f"job.source.path={tmp_path}/ck/step_0"], "b1"), ([], "b2")):
        r = cli(["+job=bench", "job.repeats=1", "job.warmup=0", *args, f"hydra.run.dir={tmp_path}/{run}"], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        assert not (tmp_path / run / "checkpoints").exists(), os.listdir(tmp_path / run)
    # a checkpoint.dir the user named and that exists stays, with what else it holds
    r = cli(["+job=bench", "job.repeats=1", "job.warmup=0", f"checkpoint.dir={tmp_path}/ck",
             f"hydra.run.dir={tmp_path}/b3"])
    assert r.returncode == 0 and sorted(os.listdir(tmp_path / "ck")) == ["step_0"], r.stderr[-3000:]


def test_generation_config_travels_through_our_format_to_an_hf_export(cli, tmp_path):
    """Item 7: HF -> ours -> HF without job.hf_files_from wrote config.json (recorded at save)
    but not generation_config.json."""
    import json

    src = tmp_path / "ds"
    _deepseek_v2_dir(str(src))
    gen = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    r = cli(["+job=reshard", f"job.source.path={src}", "layout=fsdp", f"job.output={tmp_path}/ours",
             f"hydra.run.dir={tmp_path}/a"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(["+job=reshard", f"job.source.path={tmp_path}/ours", "job.output_format=hf", f"job.output={tmp_path}/hf",
             f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == gen
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "deepseek_v2"


def test_pictures_name_the_extra_that_installs_matplotlib():
    """Item 7: docs/write_a_layout.md used job.picture without saying it needs matplotlib."""
    import re

    from tests.e2e.conftest import ROOT

    text = open(os.path.join(ROOT, "docs", "write_a_layout.md")).read()
    at = text.index("`job.picture=<file.png>`")
    assert re.search(r"needs matplotlib, which the\s+`report` extra installs", text[at:at + 600])
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert re.search(r'^report = \["matplotlib', pyproject, re.M)
    from hpdcp_runner.layout_picture import check_available  # the same extra named when it is missing

    import inspect

    assert "hpdcp_runner[report]" in inspect.getsource(check_available)
