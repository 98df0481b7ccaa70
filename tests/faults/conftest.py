"""The fault suite records one row per fault (what happened, and the checks that passed) into the
JSON-lines file named by HPDCP_FAULT_TABLE, so scripts/fault_table.py can build docs/fault_table.md
from what the tests actually observed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpdcp_runner.dcp import load, save


def state(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "meta": {"step": k}}


def zeros() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32), "meta": {"step": 0}}


def loads_bitwise(path, k: int) -> bool:
    """The checkpoint at ``path`` loads and equals ``state(k)`` bit for bit."""
    tgt = zeros()
    load(tgt, checkpoint_id=path)
    ref = state(k)
    return torch.equal(tgt["w"], ref["w"]) and torch.equal(tgt["b"], ref["b"]) and tgt["meta"] == ref["meta"]


def raises_naming(fn, exc_type, *needles) -> str:
    """``fn()`` raises ``exc_type`` whose message contains every needle; returns the message."""
    with pytest.raises(exc_type) as ei:
        fn()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


@pytest.fixture
def two_checkpoints(tmp_path):
    """``step_1`` (the previous checkpoint, never touched) and ``step_2`` (the one faults hit)."""
    save(state(1), checkpoint_id=tmp_path / "step_1")
    save(state(2), checkpoint_id=tmp_path / "step_2")
    return tmp_path


@pytest.fixture
def two_v1_checkpoints(tmp_path):
    """As ``two_checkpoints``, with ``step_2`` in format v1 (every chunk in metadata.json): the
    faults that tamper with the inline chunk table, which v1 readers must keep refusing."""
    save(state(1), checkpoint_id=tmp_path / "step_1")
    save(state(2), checkpoint_id=tmp_path / "step_2", format_version=1)
    return tmp_path


@pytest.fixture
def fault_row():
    def record(fault: str, category: str, behaviour: str, error: str | None = None, named: str | None = None,
               previous_intact: bool | None = None, marker_absent: bool | None = None, verify: str | None = None):
        # what the table reports is asserted here too: a row never records a loss as a fact
        assert previous_intact is not False, f"{fault}: the previous checkpoint no longer loads bitwise"
        assert marker_absent is not False, f"{fault}: a commit marker was left behind"
        path = os.environ.get("HPDCP_FAULT_TABLE")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"fault": fault, "category": category, "behaviour": behaviour, "error": error,
                                    "named": named, "previous_intact": previous_intact,
                                    "marker_absent": marker_absent, "verify": verify}) + "\n")

    return record


@pytest.fixture
def proxied(s3_endpoint, s3_bucket):
    """(the loopback proxy in front of the S3 test server, a fresh bucket), with the object-store
    client pointed at the proxy (tests/s3_proxy.py: faults the real server will not produce)."""
    from hpdcp_runner.dcp.storage.objects import object_store
    from tests.s3_proxy import Proxy

    p = Proxy(s3_endpoint)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint, max_retries=3, retry_timeout_s=20))
    try:
        yield p, s3_bucket
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
        p.close()


@pytest.fixture(params=["s3", "az"])
def proxied_store(request):
    """``proxied`` for each store whose faults the proxy can make (it forwards any HTTP; what
    it answers on its own, e.g. 503, is what every store's client retries): (proxy, container URI)."""
    from hpdcp_runner.dcp.storage.objects import object_store
    from tests.s3_proxy import Proxy

    if request.param == "s3":
        upstream, uri = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        suffix = ""
    else:
        upstream, uri = request.getfixturevalue("az_endpoint"), request.getfixturevalue("az_container")
        suffix = "/" + upstream.rstrip("/").rsplit("/", 1)[1]  # azurite's path-style account
    p = Proxy(upstream)
    object_store.configure(object_store.ObjectStoreOptions(endpoint=p.endpoint + suffix, max_retries=3,
                                                           retry_timeout_s=20))
    try:
        yield p, uri
    finally:
        object_store.configure(object_store.ObjectStoreOptions())
        p.close()
