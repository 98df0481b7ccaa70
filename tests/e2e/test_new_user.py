"""The CLI as a new user meets it: relative paths, one-line errors naming the CLI key, rank logs,
help and completion, machine-readable output, progress on a terminal, no stray warnings."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from tests.e2e.conftest import ROOT, _env, metrics
from tests.e2e.test_cli import _tail


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_relative_paths_resolve_against_the_launch_directory(cli, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    r = cli(["+job=save", "checkpoint.dir=rel_ck", "checkpoint.name=step_1", f"hydra.run.dir={tmp_path}/r1"],
            cwd=str(work))
    assert r.returncode == 0, _tail(r)
    assert (work / "rel_ck" / "step_1" / "metadata.json").is_file()
    assert not (tmp_path / "r1" / "rel_ck").exists()  # the run dir holds only the run's own outputs
    r = cli(["+job=reshard", "job.source.path=rel_ck/step_1", "job.output=out/resharded", "layout=tp",
             f"hydra.run.dir={tmp_path}/r2"], cwd=str(work), nproc=2)
    assert r.returncode == 0, _tail(r)
    assert (work / "out" / "resharded" / "metadata.json").is_file()
    assert metrics(tmp_path / "r2")["result"]["source"] == str(work / "rel_ck" / "step_1")
    r = cli(["+job=transform", "transform.src=rel_ck/step_1", "transform.dst=hf_out", f"hydra.run.dir={tmp_path}/r3"],
            cwd=str(work))
    assert r.returncode == 0 and (work / "hf_out" / "model.safetensors").is_file(), _tail(r)
    # the default checkpoint.dir is the run's own outputs
    r = cli(["+job=save", f"hydra.run.dir={tmp_path}/r4"], cwd=str(work))
    assert r.returncode == 0 and (tmp_path / "r4" / "checkpoints" / "step_0" / "metadata.json").is_file(), _tail(r)


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if " error: " in f" {ln}" or ln.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow  # the slow tier (CI runs it too): keeps the default run near 10 minutes
def test_user_mistakes_are_one_line_naming_the_cli_key(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_1", f"hydra.run.dir={tmp_path}/r0"])
    assert r.returncode == 0, _tail(r)
    # an existing checkpoint, under torchrun: one line from rank 0, the CLI key, no Python keyword,
    # no traceback of ours and no torchrun error-file dump (its own launcher summary remains)
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=step_1", f"hydra.run.dir={tmp_path}/r1"], nproc=2)
    assert r.returncode != 0
    line = _one_error_line(r.stderr)
    assert "CheckpointExistsError" in line and "checkpoint.overwrite=true" in line and str(ck / "step_1") in line
    assert "overwrite=True" not in r.stderr and "hpdcp_runner/jobs" not in r.stderr, r.stderr[-3000:]
    # the rank log has the phases and the failure with its traceback; FAILED holds the cause
    log1 = (tmp_path / "r1" / "hpdcp_rank1.log").read_text()
    assert "phase save: started" in log1 and "job failed: CheckpointExistsError" in log1 and "Traceback" in log1
    assert "checkpoint.overwrite=true" in (tmp_path / "r1" / "FAILED").read_text()
    # one process: no traceback at all
    for args, words in (
        ([f"checkpoint.path={tmp_path}/nope"], ["CheckpointNotFoundError", f"{tmp_path}/nope", "checkpoint.path"]),
        ([f"checkpoint.path={ck}/step_1/metadata.json"], ["is a file, not a checkpoint directory", "checkpoint.path"]),
    ):
        r = cli(["+job=load", *args, f"hydra.run.dir={tmp_path}/r2"])
        assert r.returncode == 1 and "Traceback" not in r.stderr, _tail(r)
        line = _one_error_line(r.stderr)
        assert all(w in line for w in words), line
    (tmp_path / "a_file").write_text("x")
    for where, words in ((tmp_path / "a_file", ["a file is in the way", "checkpoint.dir"]),
                         ("/sys/hpdcp_no_such_dir", ["StorageAccessError", "/sys/hpdcp_no_such_dir", "checkpoint.dir"])):
        r = cli(["+job=save", f"checkpoint.dir={where}", f"hydra.run.dir={tmp_path}/r3"])
        assert r.returncode == 1 and "Traceback" not in r.stderr, _tail(r)
        line = _one_error_line(r.stderr)
        assert "DistributedError" not in line and all(w in line for w in words), line


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_help_completion_and_schema_entries(cli, tmp_path):
    r = cli(["--help"], nproc=2)  # under torchrun: printed once
    assert r.returncode == 0 and r.stdout.count("Jobs (+job=<name>):") == 1, _tail(r)
    for job in ("save", "load", "reshard", "inspect", "verify", "bench", "train", "transform"):
        assert f"\n  {job} " in r.stdout
    assert "_schema" not in r.stdout and "fsdp" in r.stdout and "mlp_adamw" in r.stdout
    r = cli(["+job=save", "--cfg", "job"], nproc=2)
    assert r.returncode == 0 and r.stdout.count("checkpoint:") == 1, _tail(r)
    for bad in (["+job=save_schema"], ["+job=save", "layout=layout_schema"]):
        r = cli(bad + [f"hydra.run.dir={tmp_path}/x"])
        assert r.returncode == 2 and "no such choice" in r.stderr and "_schema," not in r.stderr, _tail(r)
    # a wrong choice under torchrun: one line (once, not per rank), exit 2, the real choices listed
    r = cli(["+job=save", "layout=fsdpp", f"hydra.run.dir={tmp_path}/y"], nproc=2)
    assert r.returncode != 0 and r.stderr.count("layout=fsdpp: no such choice") == 1, _tail(r)
    assert "fsdp, gpt2_fsdp_tp" in r.stderr and "layout_schema" not in r.stderr and "Config search path" not in r.stderr
    r = cli(["+job=save", "layout=fsdpp", f"hydra.run.dir={tmp_path}/z"])
    assert r.returncode == 2 and r.stderr.count("no such choice") == 1, _tail(r)
    script = tmp_path / "comp.sh"
    script.write_text(f"""cd {tmp_path}
eval "$({sys.executable} -m hpdcp_runner -sc install=bash)"
COMP_LINE="{sys.executable} -m hpdcp_runner +job=sa"; COMP_POINT=${{#COMP_LINE}}
COMP_WORDS=({sys.executable} -m hpdcp_runner +job = sa); COMP_CWORD=5
_hpdcp_runner_complete; echo "job:${{COMPREPLY[*]}}"
COMP_LINE="{sys.executable} -m hpdcp_runner checkpoint.keep_la"; COMP_POINT=${{#COMP_LINE}}
COMP_WORDS=({sys.executable} -m hpdcp_runner checkpoint.keep_la); COMP_CWORD=3
_hpdcp_runner_complete; echo "key:${{COMPREPLY[*]}}"
""")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, env=_env())
    assert "job:save" in out.stdout and "key:checkpoint.keep_last=" in out.stdout, out.stdout + out.stderr


def test_bench_table_leaves_out_warmups_and_records_noise(cli, tmp_path):
    r = cli(["+job=bench", "job.warmup=1", "job.repeats=2", f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode == 0, _tail(r)
    table = r.stdout.split("peak RSS")[0]
    assert "\nsave " in table and "\nload " in table and "warmup" not in table
    m = metrics(tmp_path / "b")
    assert "warmup.save" in m["summary"] and m["result"]["load"]["n"] == 2
    lo, hi = m["result"]["objective_range"]
    assert lo <= m["result"]["objective"] <= hi


def test_first_run_prints_no_warnings(tmp_path):
    env = _env()
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save"], capture_output=True, text=True,
                       timeout=240, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, _tail(r)
    assert "Warning" not in r.stderr and "Failed to initialize NumPy" not in r.stderr, r.stderr


@pytest.mark.slow  # the slow tier (CI runs it too): keeps the default run near 10 minutes
def test_existing_output_unwritable_run_dir_and_full_disk_name_what_to_change(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=s", f"hydra.run.dir={tmp_path}/r0"])
    assert r.returncode == 0, _tail(r)
    (tmp_path / "taken").mkdir()
    # an existing job.output: that key, not checkpoint.name / checkpoint.dir nor the engine's keyword
    r = cli(["+job=reshard", f"job.source.path={ck}/s", "job.output=taken", "job.output_format=hf",
             f"hydra.run.dir={tmp_path}/r1"])
    line = _one_error_line(r.stderr)
    assert r.returncode == 1 and "(job.output)" in line and "pick another job.output" in line, line
    assert "checkpoint.name" not in line and "pass overwrite" not in line, line
    r = cli(["+job=transform", f"transform.src={ck}/s", "transform.dst=taken", f"hydra.run.dir={tmp_path}/r2"])
    line = _one_error_line(r.stderr)
    assert r.returncode == 1 and "transform.overwrite=true" in line and "pass overwrite" not in line, line
    # a run directory that cannot be made (the default one, under a working directory nobody may
    # write, even root: /sys): one line naming hydra.run.dir, exit 2 (a config error), no traceback
    try:
        os.mkdir("/sys/hpdcp_probe")
    except OSError:
        pass
    else:
        os.rmdir("/sys/hpdcp_probe")
        pytest.skip("/sys is writable here")
    r = cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=t"], cwd="/sys")
    assert r.returncode == 2 and "Traceback" not in r.stderr, _tail(r)
    line = _one_error_line(r.stderr)
    assert "hydra.run.dir" in line and "/sys/outputs/" in line, line
    # a full disk: a storage error saying where, not a DistributedError around an OSError
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", f"checkpoint.dir={ck}", "checkpoint.name=u",
                        f"hydra.run.dir={tmp_path}/r3"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env=dict(_env(), HPDCP_FAULTS="file.write:enospc"))
    line = _one_error_line(r.stderr)
    assert r.returncode == 1 and line.startswith("error: StorageAccessError") and f"no space left on {ck}" in line, line
    assert "DistributedError" not in r.stderr and sorted(os.listdir(ck)) == ["s"]


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_progress_on_a_terminal_only(tmp_path):
    """A load throttled to ~4 s shows rank 0's bytes, files and rate on a terminal; piped, nothing."""
    ck = tmp_path / "ck"
    env = _env()
    env.pop("CI", None)
    base = [sys.executable, "-m", "hpdcp_runner"]
    model = ["model.vocab=2048", "model.hidden=128", "model.ffn=512"]  # 3.7 MB in 20 tensors
    subprocess.run(base + ["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=s", *model], check=True, env=env,
                   cwd=str(tmp_path), capture_output=True, timeout=240)
    load = base + ["+job=load", f"checkpoint.path={ck}/s", "dcp.storage.max_read_bytes_per_s=1MiB", *model]
    code, shown = _on_a_terminal(load, env, tmp_path, rows=24, cols=100)  # sized like a real one
    assert code == 0, shown[-2000:]
    import re

    assert "load (rank 0)" in shown and "B/s" in shown and re.search(r"\d+ files? · ", shown), shown[-2000:]
    piped = subprocess.run(load, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=240)
    assert piped.returncode == 0 and "(rank 0)" not in piped.stderr + piped.stdout


def _on_a_terminal(cmd, env, cwd, rows=0, cols=0) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as its stdout/stderr, sized rows x cols (0 x 0: one
    nobody sized, as under ``script`` without a terminal); (exit code, what it showed)."""
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        os.chdir(cwd)
        os.execvpe(cmd[0], cmd, env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
def test_progress_through_torchrun_and_hpdcp_on_an_unsized_terminal(tmp_path):
    """Progress shows under torchrun and the hpdcp launcher, also on a terminal that reports no
    size (tqdm alone prints nothing there), and the reshard's verify phase has its own."""
    ck = tmp_path / "ck"
    env = _env()
    env.pop("CI", None)
    model = ["model.vocab=2048", "model.hidden=128", "model.ffn=512"]  # 3.7 MB in 20 tensors
    subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", f"checkpoint.dir={ck}", "checkpoint.name=s",
                    *model], check=True, env=env, cwd=str(tmp_path), capture_output=True, timeout=240)
    slow = "dcp.storage.max_read_bytes_per_s=600KiB"  # ~3 s of reading per rank
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "hpdcp_runner"]
    code, shown = _on_a_terminal(torchrun + ["+job=load", f"checkpoint.path={ck}/s", slow, *model], env, tmp_path)
    assert code == 0 and "load (rank 0)" in shown and "B/s" in shown, shown[-2000:]
    hpdcp = [sys.executable, "-m", "hpdcp_runner", "--nproc-per-node=2"]
    code, shown = _on_a_terminal(hpdcp + ["+job=reshard", f"job.source.path={ck}/s", "job.output=out", slow],
                                 env, tmp_path)
    assert code == 0 and "reshard.load (rank 0)" in shown and "verify: reading the source s" in shown, shown[-2000:]


def _fake_sweep(root, points):
    for i, (ov, obj, rng) in enumerate(points):
        d = root / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in ov))
        if obj is None:
            (d / "FAILED").write_text("StorageAccessError: cannot create the checkpoint /x: Permission denied\n")
        else:
            (d / "metrics.json").write_text(json.dumps({"result": {"objective": obj, "objective_range": rng}}))


def _report(root, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep_report.py"), str(root), *extra],
                          capture_output=True, text=True, timeout=120)


def test_sweep_report_marks_noise_instead_of_naming_a_best(tmp_path):
    noisy = tmp_path / "noisy"
    _fake_sweep(noisy, [(["k=1"], 1.00, [0.90, 1.20]), (["k=2"], 1.05, [0.95, 1.30]), (["k=3"], 2.0, [1.9, 2.1]),
                        (["k=4"], None, None)])
    r = _report(noisy, "--no-plot")
    assert r.returncode == 0, r.stderr
    assert "best:" not in r.stdout and "lowest median: k=1 | within noise of it: k=2" in r.stdout
    md = (noisy / "report.md").read_text()
    assert "No single best point" in md and "clearly different" in md and "Permission denied" in md
    assert not (noisy / "report.png").exists()
    clear = tmp_path / "clear"
    _fake_sweep(clear, [(["k=1"], 1.0, [0.9, 1.1]), (["k=2"], 2.0, [1.9, 2.1])])
    r = _report(clear)
    assert r.returncode == 0 and "best: k=1" in r.stdout, r.stderr
    assert (clear / "report.png").read_bytes()[:4] == b"\x89PNG"
    # without matplotlib: said up front, nothing written
    bare = tmp_path / "bare"
    _fake_sweep(bare, [(["k=1"], 1.0, [0.9, 1.1])])
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['sweep_report.py', {str(bare)!r}]; "
            f"runpy.run_path({os.path.join(ROOT, 'scripts', 'sweep_report.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs matplotlib" in r.stderr and "--no-plot" in r.stderr, r.stderr
    assert not (bare / "report.md").exists() and not (bare / "report.csv").exists()


def test_sweep_report_names_no_best_from_single_samples_and_keeps_points_without_the_objective(tmp_path):
    """One sample per point (no spread, or a spread of zero): the lowest is shown, no best is
    named; a point whose metrics lack the objective is listed as such with what it has."""
    root = tmp_path / "single"
    _fake_sweep(root, [(["k=1"], 1.00, None), (["k=2"], 1.05, [1.05, 1.05]), (["k=3"], 0.9, None)])
    d = root / "3"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("- k=4\n")
    (d / "metrics.json").write_text(json.dumps({"job": "inspect", "result": {"tensors": 3},
                                                "summary": {"inspect": {"seconds_max": 0.1}}}))
    r = _report(root, "--no-plot")
    assert r.returncode == 0, r.stderr
    assert "best:" not in r.stdout and "lowest: k=3" in r.stdout, r.stdout
    md = (root / "report.md").read_text()
    assert "No best point named" in md and "point 2 (k=3)" in md
    assert "no objective" in md and "summary.inspect.seconds_max" in md and "result.tensors" in md
    noisy = tmp_path / "noisy"
    _fake_sweep(noisy, [(["k=1"], 1.00, [0.90, 1.20]), (["k=2"], 1.05, [0.95, 1.30])])
    _report(noisy, "--no-plot")
    assert "point 0 (k=1): point 1 (k=2)" in (noisy / "report.md").read_text()


@pytest.mark.slow
def test_bench_script_drops_the_page_cache_only_when_asked(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           os.path.join(ROOT, "scripts", "bench_vs_torch_dcp.py"), "--reps", "1", "--scale", "0.002",
           "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "b.md")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert r.returncode == 0, _tail(r)
    text = (tmp_path / "b.md").read_text()
    assert "Cold loads: not run" in text and "load cold" not in text


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_load_a_subset_from_the_cli(cli, tmp_path):
    ck = tmp_path / "ck"
    r = cli(["+job=save", "model=mlp_adamw", f"checkpoint.dir={ck}", "checkpoint.name=s", f"hydra.run.dir={tmp_path}/a"])
    assert r.returncode == 0, _tail(r)
    r = cli(["+job=load", "model=mlp_adamw", f"checkpoint.path={ck}/s", "job.include='^model\\.'",
             f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode == 1 and "job.strict=false" in r.stderr and "strict=False" not in r.stderr, _tail(r)
    r = cli(["+job=load", "model=mlp_adamw", f"checkpoint.path={ck}/s", "job.include='^model\\.'", "job.strict=false",
             f"hydra.run.dir={tmp_path}/c"])
    assert r.returncode == 0, _tail(r)
    res = metrics(tmp_path / "c")["result"]
    assert res["verified"] and res["missing_keys"] == [] and res["loaded_keys"] == 4
    assert res["unused_checkpoint_keys"] and all(k.startswith(("optim.", "meta.")) for k in res["unused_checkpoint_keys"])
    # results print as JSON values, not Python reprs
    assert 'unused_checkpoint_keys: ["' in r.stdout and "verified: true" in r.stdout, r.stdout


@pytest.mark.parametrize("fmt", ["json"])
def test_inspect_json_is_alone_on_stdout(cli, tmp_path, fmt):
    ck = tmp_path / "ck"
    assert cli(["+job=save", f"checkpoint.dir={ck}", "checkpoint.name=s", f"hydra.run.dir={tmp_path}/a"]).returncode == 0
    r = cli(["+job=inspect", f"checkpoint.path={ck}/s", f"job.format={fmt}", f"hydra.run.dir={tmp_path}/b"])
    assert r.returncode == 0, _tail(r)
    assert json.loads(r.stdout)["state"] == "committed"
    assert "hpdcp inspect:" in r.stderr


@pytest.mark.slow  # 17-34 s of launches on 2 cores: the default tier keeps its siblings
def test_hpdcp_launches_ranks_and_fails_with_one_line(tmp_path):
    """``python -m hpdcp_runner --nproc-per-node=2 ...``: torchrun's launcher in-process, so a
    user mistake ends with the workers' one line and their exit code, no launcher traceback."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "hpdcp_runner", "--nproc-per-node=2", "+job=save", f"checkpoint.dir={ck}",
           "layout=tp"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and "hpdcp save: world_size=2" in r.stdout, _tail(r)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=str(tmp_path))
    assert r.returncode == 1, _tail(r)
    assert r.stderr.strip().splitlines() == [_one_error_line(r.stderr)], r.stderr  # that line and nothing else
    assert "checkpoint.overwrite=true" in r.stderr and "Traceback" not in r.stderr


def test_launcher_options_are_split_from_the_job_arguments():
    from hpdcp_runner.rank_launcher import split_launcher_args

    assert split_launcher_args(["--nproc-per-node=4", "--nnodes", "2", "--rdzv-endpoint=h:1", "+job=save", "a=1"]) \
        == (["--nproc-per-node=4", "--nnodes", "2", "--rdzv-endpoint=h:1"], ["+job=save", "a=1"])
    assert split_launcher_args(["--nproc-per-node=2", "--cfg", "job", "+job=save"]) == \
        (["--nproc-per-node=2"], ["--cfg", "job", "+job=save"])
    assert split_launcher_args(["--nproc-per-node=2", "-m", "+job=bench", "x=1,2"]) == \
        (["--nproc-per-node=2"], ["-m", "+job=bench", "x=1,2"])
