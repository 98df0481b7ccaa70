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
    steps = _on_the_test_stores(steps, env, request)
    exports: list[str] = []  # a reader's shell keeps what they exported
    for kind, cmd in steps:
        if kind == "bash" and cmd.startswith("export "):
            exports.append(cmd)
            continue
        argv = ["bash", "-c", "; ".join(exports + [cmd])] if kind == "bash" else [sys.executable, "-c", cmd]
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc}: {cmd}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"


STORE_VARS = ("AWS_", "AZURE_", "GOOGLE_")


def _on_the_test_stores(steps: list[tuple[str, str]], env: dict, request) -> list[tuple[str, str]]:
    """The steps pointed at the loopback stores: a fresh S3 bucket for ``s3://ckpts``, a fresh
    Azure container for ``az://ckpts``, a new GCS bucket name for ``models`` (the page creates
    it), and each emulator's port for its default one (9000, 10000, 4443). A page that exports a
    store's variables itself runs without any set beforehand (its set-up is what is tested);
    a page that does not gets them from the test's servers."""
    import uuid
    from urllib.parse import urlparse

    text = "\n".join(c for _, c in steps)
    subs: list[tuple[str, str]] = []
    if "s3://" in text:
        subs += [("s3://ckpts", request.getfixturevalue("s3_bucket")),
                 ("http://127.0.0.1:9000", request.getfixturevalue("s3_endpoint"))]
    if "az://" in text:
        subs += [("az://ckpts", request.getfixturevalue("az_container")),
                 ("http://127.0.0.1:10000/devstoreaccount1", request.getfixturevalue("az_endpoint"))]
    if "gs://" in text:
        gcs, bucket = request.getfixturevalue("gcs_endpoint"), f"models-{uuid.uuid4().hex[:10]}"
        assert urlparse(gcs).path in ("", "/")
        subs += [("http://127.0.0.1:4443", gcs.rstrip("/")), ("gs://models", f"gs://{bucket}"),
                 ("/b/models/", f"/b/{bucket}/"), ('{"name": "models"}', f'{{"name": "{bucket}"}}')]
    if any(c.startswith("export ") for _, c in steps):
        for k in [k for k in env if k.startswith(STORE_VARS)]:
            del env[k]
    else:
        env.update({k: os.environ[k] for k in os.environ if k.startswith(STORE_VARS)})
    for a, b in subs:
        steps = [(kind, c.replace(a, b)) for kind, c in steps]
    return steps


def test_the_object_store_page_sets_up_every_store_itself():
    """The object-store page's set-up exports each store's variables (the run above strips the
    test's own, so a missing one fails it): S3, Azure and GCS, with the variables a user of each
    emulator needs."""
    text = "\n".join(c for _, c in _steps("docs/object_storage.md"))
    for var in ("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_ENDPOINT=http://127.0.0.1:10000/devstoreaccount1",
                "AZURE_ALLOW_HTTP", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "GOOGLE_BASE_URL",
                "GOOGLE_ALLOW_HTTP", "GOOGLE_SKIP_SIGNATURE"):
        assert var in text, var
    for scheme in ("s3://", "az://", "gs://"):
        assert scheme in text, scheme
