"""Time-of-check races on files read or copied by name (reliability round 3).

A thread swaps a file between a regular file and a symbolic link to a secret (a file the user can
read, outside the checkpoint) as fast as it can while the tool runs over and over. Every file is
opened without following links and checked on the descriptor it is then read from, so the
secret never reaches the output, whatever the timing."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from hpdcp_runner.dcp import HpdcpError, open_reader, save
from hpdcp_runner.dcp.tools import export_hf

SECRET = b'{"secret": "the user\'s ssh key"}'


class Flipper:
    """Swap ``path`` between a regular file holding ``good`` and a link to ``target``."""

    def __init__(self, path, good: bytes, target) -> None:
        self.path, self.good, self.target = str(path), good, str(target)
        self.stop = threading.Event()
        self.flips = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tmp_file, tmp_link = self.path + ".f", self.path + ".l"
        while not self.stop.is_set():
            with open(tmp_file, "wb") as f:
                f.write(self.good)
            os.replace(tmp_file, self.path)
            try:
                os.symlink(self.target, tmp_link)
            except FileExistsError:
                os.unlink(tmp_link)
                continue
            os.replace(tmp_link, self.path)
            self.flips += 1

    def __enter__(self) -> "Flipper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "secret.json"
    p.write_bytes(SECRET)
    return p


def test_export_hf_never_copies_a_side_file_through_a_swapped_link(tmp_path, secret, fault_row):
    save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "c")
    side = tmp_path / "model_files"
    side.mkdir()
    (side / "tokenizer.json").write_text("{}")
    leaked = copied = runs = 0
    with Flipper(side / "config.json", b'{"model_type": "llama"}', secret) as flip:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            out = tmp_path / f"hf{runs}"
            export_hf(tmp_path / "c", out, files_from=side)
            runs += 1
            if (out / "config.json").exists():
                copied += 1
                leaked += (out / "config.json").read_bytes() == SECRET
                assert not (out / "config.json").is_symlink()
            assert (out / "tokenizer.json").read_text() == "{}"
    assert flip.flips > runs and runs >= 5
    assert leaked == 0, f"the secret was copied in {leaked} of {runs} exports"
    assert copied > 0  # the regular file is still copied when it is one
    fault_row(f"config.json swapped with a link to a secret during export_hf ({runs} exports, {flip.flips} swaps)",
              "time-of-check races", "the link is never followed: config.json copied only as a regular file, or "
              "skipped", named=None)


def test_a_hugging_face_index_swapped_to_a_link_is_never_read_through_it(tmp_path, secret):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "model-00001-of-00001.safetensors"))
    index = json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}).encode()
    # the secret is a valid index naming a file only the secret knows
    secret.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    save_file({"a": torch.zeros(2)}, str(d / "model-00002-of-00002.safetensors"))
    seen = set()
    with Flipper(d / "model.safetensors.index.json", index, secret):
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                md = open_reader(str(d), "hf").read_metadata_once()
            except HpdcpError as e:
                seen.add("refused: " + ("link" if "symbolic link" in str(e) else type(e).__name__))
                continue
            seen.add(md.tensors["a"].chunks[0].file)
    assert "model-00002-of-00002.safetensors" not in seen, seen
    assert "model-00001-of-00001.safetensors" in seen


def test_verify_never_reads_a_rank_file_through_a_swapped_link(tmp_path):
    from hpdcp_runner.dcp.offline.inspection import verify

    save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "c")
    save({"w": torch.arange(6.0) + 1}, checkpoint_id=tmp_path / "other")
    f = tmp_path / "c" / "rank00000.safetensors"
    good = f.read_bytes()
    outcomes = set()
    with Flipper(f, good, tmp_path / "other" / "rank00000.safetensors"):
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            rep = verify(tmp_path / "c")
            outcomes.add("; ".join(p for p in rep.problems if p.startswith("rank00000.safetensors:"))[:60] or "ok")
    # either the real file was verified, or the link was named as one; never a checksum mismatch
    # (which would mean the other checkpoint's bytes were read)
    assert all(o == "ok" or "symbolic link" in o or "missing" in o for o in outcomes), outcomes
