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


def test_the_launcher_presets_in_conf_compose(tmp_path):
    """conf/hydra/launcher/*.yaml build on the plugin's schemas (the slurm extra)."""
    import subprocess
    import sys

    import yaml

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")
    r = subprocess.run([sys.executable, "-m", "hpdcp_runner", "+job=save", "hydra/launcher=slurm_gpu_node",
                        "hydra.launcher.nodes=2", "--cfg", "hydra"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    launcher = yaml.safe_load(r.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("HpdcpSlurmLauncher") and launcher["tasks_per_node"] == 8
    assert launcher["nodes"] == 2 and launcher["gpus_per_node"] == 8 and launcher["on_failure"] == "continue"


def test_a_local_launcher_asking_for_more_than_the_machine_is_one_line(capsys):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")
    from hydra_plugins.hpdcp_launcher.submitit_launchers import HpdcpLocalLauncher, _available_bytes

    for params, words in (({"tasks_per_node": 10**6}, ["tasks_per_node=1000000", "cannot start that many ranks"]),
                          ({"nodes": 2}, ["hydra.launcher.nodes=2", "hpdcp_submitit_slurm"]),
                          ({"tasks_per_node": 0}, ["must be >= 1"])):
        with pytest.raises(SystemExit) as e:
            HpdcpLocalLauncher(submitit_folder="x", **params)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and all(w in err for w in words), err
    assert _available_bytes() is None or _available_bytes() > 0
    HpdcpLocalLauncher(submitit_folder="x", tasks_per_node=2)  # what the tests use: fine
