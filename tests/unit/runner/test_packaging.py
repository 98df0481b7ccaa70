"""Every conf group directory ships in the wheel (the packages list must keep up with conf/)."""

import os

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_every_conf_group_is_a_listed_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    groups = [d for d in os.listdir(os.path.join(ROOT, "conf")) if os.path.isdir(os.path.join(ROOT, "conf", d))
              and not d.startswith("__")]
    missing = sorted(f"hpdcp_runner.conf.{g}" for g in groups if f"hpdcp_runner.conf.{g}" not in packages)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_python_package_is_a_listed_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = sorted(os.path.relpath(d, ROOT).replace(os.sep, ".") for top in ("hpdcp_runner", "hydra_plugins")
                   for d, _, files in os.walk(os.path.join(ROOT, top)) if "__init__.py" in files
                   and "__pycache__" not in d and not d.startswith(os.path.join(ROOT, "hpdcp_runner", "conf")))
    missing = [p for p in found if p not in packages]
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
