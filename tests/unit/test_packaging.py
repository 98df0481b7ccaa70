"""Every conf group directory ships in the wheel (the packages list must keep up with conf/)."""

import os

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_conf_group_is_a_listed_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    groups = [d for d in os.listdir(os.path.join(ROOT, "conf")) if os.path.isdir(os.path.join(ROOT, "conf", d))
              and not d.startswith("__")]
    missing = sorted(f"hpdcp_runner.conf.{g}" for g in groups if f"hpdcp_runner.conf.{g}" not in packages)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
