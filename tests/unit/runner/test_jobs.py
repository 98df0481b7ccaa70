"""Job helpers that run without a process group: key selection, the inspect table and layout
report, and the registry."""

from __future__ import annotations

import re

import pytest
import torch

from hpdcp_runner.config import load_preset
from hpdcp_runner.dcp import HpdcpError, Metadata, save, read_metadata
from hpdcp_runner.jobs.inspect import format_table, layout_report
from hpdcp_runner.jobs.load import select


def test_include_keeps_the_matching_leaves_of_a_nested_state():
    state = {"model": {"a": 1, "b": {"c": 2}}, "optim": {"a": 3}}
    assert select(state, re.compile(r"^model\.").search) == {"model": {"a": 1, "b": {"c": 2}}}
    assert select(state, lambda k: not k.endswith(".a")) == {"model": {"b": {"c": 2}}}
    assert select(state, None) is state
    with pytest.raises(HpdcpError, match="job.exclude='x' matches none"):
        select(state, lambda k: False, "job.exclude='x'")


class _Ctx:
    model_config = model_config_from = layout_note = layout_plan = None

    class cfg:
        layout = load_preset("titan_tp")

    def use_source_layout(self, md, path, ranks, every_rank=True):
        pass


def test_inspect_layout_report_shows_rule_and_shard_per_rank(tmp_path):
    save({"layers.0.attention.wq.weight": torch.zeros(6, 2), "norm.weight": torch.zeros(2),
          "mystery": torch.zeros(3)}, checkpoint_id=tmp_path / "c")
    md: Metadata = read_metadata(tmp_path / "c")
    rep = layout_report(_Ctx(), md, 2)
    wq = rep["tensors"]["layers.0.attention.wq.weight"]
    assert wq["rule"] == 0 and wq["placements"] == ["S0"] and wq["shards"] == [[[0, 0], [3, 2]], [[3, 0], [3, 2]]]
    assert rep["unmatched"] == ["mystery"] and rep["tensors"]["mystery"]["rule"] is None
    d = {"path": str(tmp_path / "c"), "state": "committed", "format": "hpdcp", "format_version": 1, "world_size": 1,
         "tensor_bytes": 0, "files": {}, "tensors": {}, "objects": [], "layout": rep}
    text = format_table(d)
    assert "layers.0.attention.wq.weight" in text and "0:[0+3,0+2] 1:[3+3,0+2]" in text
    assert "1 tensor(s) match no rule" in text


def test_inspect_columns_fit_long_key_names(tmp_path):
    long = "model.layers.12.mixture_of_experts.experts.63.feed_forward.down_projection.weight_scale_inv"
    save({long: torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.ones(7), "opt": {"lr_schedule_name_long": 1}},
         checkpoint_id=tmp_path / "c")
    from hpdcp_runner.dcp.tools import describe

    text = format_table(describe(tmp_path / "c"))
    rows = {line.split()[0]: line for line in text.splitlines()[1:] if line.split()}
    header = text.splitlines()[1]
    for key in (long, "b"):
        line = rows[key]
        assert line.split()[1] in ("bfloat16", "float32")  # key and dtype never run together
        assert line.index(line.split()[1]) == header.index("dtype")  # dtype column aligned
    assert rows["opt.lr_schedule_name_long"].index("object") == header.index("dtype")


def test_unknown_group_choices_are_one_line_each():
    from hpdcp_runner.cli_help import handle_early_flags, unknown_choices

    assert unknown_choices(["+job=save", "layout=fsdp", "model=tiny", "checkpoint.dir=x", "hydra/launcher=basic"]) == []
    bad = unknown_choices(["+job=sav", "layout=fsdp,tpp", "layout=layout_schema"])
    assert len(bad) == 3 and bad[0].startswith("ConfigError: job=sav: no such choice; job is one of: bench,")
    assert "layout=tpp" in bad[1] and all("layout_schema," not in b for b in bad)
    assert unknown_choices(["layout=custom", "hydra.searchpath=[file:///mine]"]) == []  # their own choices
    assert unknown_choices(["layout=null", "model=choice(tiny,mlp)"]) == []
    assert handle_early_flags(["+job=save", "layout=nope"], 1) == 2  # every rank exits 2, rank 0 prints
