"""Launcher choices checked before Hydra starts."""

from __future__ import annotations

import importlib.util

import pytest

from hpdcp_runner import __main__ as entry


def test_a_submitit_launcher_without_its_plugin_is_one_line(monkeypatch, capsys):
    # the plugin is installed in CI, so its absence is simulated (the only way to see this path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hydra_plugins.hydra_submitit_launcher" else real(name, *a))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        entry._check_launcher(["-m", "hydra/launcher=hpdcp_submitit_slurm", "+job=bench"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and 'pip install -e ".[slurm]"' in err
    entry._check_launcher(["-m", "hydra/launcher=hpdcp_torchrun", "+job=bench"])  # others pass
