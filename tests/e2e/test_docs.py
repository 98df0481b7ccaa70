"""Every command of the README and of the docs/ guides runs, as written, so they cannot rot.

Each document's ```bash and ```python blocks run in order in a fresh empty directory (later
commands use what earlier ones wrote, as a reader following the page would). A command fails the
test by exiting non-zero (a command that shows an expected failure says so itself with
``|| echo ...``). Left out, and only these: the set-up parts of the quick start (creating a
virtualenv, ``pip install``: the test runs inside the installed project) and the test-suite
command (it is what runs this test). ```text blocks are templates with placeholders, not run.
A ```yaml file=<name> block is a file the reader saves: it is written as <name>.
The S3 page runs against the loopback S3 server, its bucket ``ckpts`` replaced by a fresh one.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, _env

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SETUP = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate|pip install|python -m pip install)")
TEST_SUITE = re.compile(r"python -m pytest")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block; a ``yaml file=<name>`` block is ("file:<name>", body)."""
    out = []
    for m in re.finditer(r"^```(\w*)([^\n]*)\n(.*?)^```$", text, re.S | re.M):
        f = re.search(r"\bfile=(\S+)", m.group(2))
        out.append((f"file:{f.group(1)}" if f else m.group(1), m.group(3)))
    return out


def commands(body: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments and set-up dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" && ")]
        kept = [p for p in parts if not SETUP.match(p) and not TEST_SUITE.search(p)]
        if kept:
            out.append(" && ".join(kept))
    return out


def test_the_extraction_keeps_what_a_reader_runs():
    body = "# a comment\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . && torchrun -m x \\\n  +job=a\n" \
           "python -m pytest -q\n"
    assert [c.split() for c in commands(body)] == [["torchrun", "-m", "x", "+job=a"]]
    assert [b[0] for b in blocks("```bash\na\n```\ntext\n```text\nb\n```\n")] == ["bash", "text"]
    assert blocks("```yaml file=a.yaml\nk: 1\n```\n") == [("file:a.yaml", "k: 1\n")]
    assert len(DOCS) > 5 and all(os.path.isfile(os.path.join(ROOT, d)) for d in DOCS)


def _steps(doc: str) -> list[tuple[str, str]]:
    text = open(os.path.join(ROOT, doc)).read()
    steps = []
    for lang, body in blocks(text):
        if lang == "bash":
            steps += [("bash", c) for c in commands(body)]
        elif lang == "python":
            steps.append(("python", body))
        elif lang.startswith("file:"):
            steps.append(("python", f"open({lang[5:]!r}, 'w').write({body!r})"))
    return steps


@pytest.mark.slow  # the slow tier: bash .ci/run runs it after the default tier
@pytest.mark.parametrize("doc", [d for d in DOCS if _steps(d)])
def test_every_command_of_the_document_runs(doc, tmp_path, request):
    env = _env()
    env["CI"] = "1"  # no progress bars in the captured output
    steps = _steps(doc)
    if any("submitit" in c for _, c in steps):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra (.ci/run has it)")
    if any("s3://" in c for _, c in steps):
        bucket = request.getfixturevalue("s3_bucket")  # a fresh bucket on the loopback S3 server
        steps = [(kind, c.replace("s3://ckpts", bucket)) for kind, c in steps]
        env.update({k: os.environ[k] for k in os.environ if k.startswith("AWS_")})
    for kind, cmd in steps:
        argv = ["bash", "-c", cmd] if kind == "bash" else [sys.executable, "-c", cmd]
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc}: {cmd}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"
