"""Where the packaged Hydra configs live: a checkout, an editable install or an installed wheel."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def find_conf_dir() -> str:
    """``hpdcp_runner/conf`` inside an installed wheel (setuptools maps the top-level ``conf/``
    there), else ``conf/`` beside the package in a checkout or editable install."""
    for candidate in (os.path.join(_HERE, "conf"), os.path.join(os.path.dirname(_HERE), "conf")):
        if os.path.isfile(os.path.join(candidate, "config.yaml")):
            return candidate
    raise FileNotFoundError(f"cannot find the hpdcp_runner conf directory near {_HERE}")
