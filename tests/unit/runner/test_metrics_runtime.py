"""Metrics summaries and the launch-directory rule."""

from __future__ import annotations

import json
import os

from hpdcp_runner import runtime
from hpdcp_runner.metrics import config_digest, summarize, summary_table, write_metrics


def test_summary_is_the_max_over_ranks_with_rates(tmp_path):
    records = [{"phases_s": {"load": 2.0, "warmup.load": 9.0}, "counters": {"load.bytes_read": 10**9},
                "peak_rss_mib": 300.0},
               {"phases_s": {"load": 4.0}, "counters": {"load.bytes_read": 10**9}, "peak_rss_mib": 512.4}]
    s = summarize(records)
    assert s["load"] == {"seconds_max": 4.0, "bytes": 2 * 10**9, "GB_per_s": 0.5}
    doc = {"job": "load", "world_size": 2, "layout": "fsdp", "model": None, "source": "/ck/x", "summary": s,
           "ranks": records, "result": {"ok": True, "keys": ["a"]}}
    doc["metrics_path"] = write_metrics(str(tmp_path), doc)
    assert json.loads((tmp_path / "metrics.json").read_text())["summary"]["load"]["bytes"] == 2 * 10**9
    table = summary_table(doc)
    assert table.splitlines()[0] == "hpdcp load: world_size=2 layout=fsdp source=/ck/x"
    assert "warmup." not in table and "peak RSS (max over ranks): 512 MiB" in table
    assert 'ok: true' in table and 'keys: ["a"]' in table
    assert config_digest({"a": 1, "b": [2]}) == config_digest({"b": [2], "a": 1})


def test_relative_paths_resolve_against_the_launch_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.LAUNCH_DIR_ENV, "")  # recorded, so the test's own setting is undone after it
    monkeypatch.delenv(runtime.LAUNCH_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    assert runtime.remember_launch_dir() == str(tmp_path)
    os.chdir("/")
    assert runtime.launch_dir() == str(tmp_path)  # workers inherit it even after a chdir
