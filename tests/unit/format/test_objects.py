import math
import os

import pytest
import torch

from hpdcp_runner.dcp.format import objects as codec
from hpdcp_runner.dcp.core.errors import MetadataError, PickleNotAllowedError

VALUES = [None, True, False, 0, -1, 2**100, 1.5, -0.0, float("inf"), 1e-310, "", "ünï", b"", b"\x00\xff",
          [1, [2, (3, "x")]], (), {"a": 1, 2: "b", (1, 2): None}, torch.Size([2, 3]), torch.bfloat16]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip_keeps_value_and_type(value):
    got = codec.decode(codec.encode(value, key="k"), key="k", source="f")
    assert got == value and type(got) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, got) == math.copysign(1, value)


def test_nan_round_trips():
    assert math.isnan(codec.decode(codec.encode(float("nan"), key="k"), key="k", source="f"))


class _Custom:
    pass


def test_arbitrary_object_needs_pickle_at_save():
    with pytest.raises(PickleNotAllowedError, match="key 'opt.thing' holds a _Custom"):
        codec.encode(_Custom(), key="opt.thing")
    assert codec.encode(_Custom(), key="x", allow_pickle=True)[0] == "p"


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hpdcp_pwned_unit",))


def test_pickle_payload_is_not_run_without_allow_pickle():
    enc = codec.encode(_Evil(), key="x", allow_pickle=True)
    if os.path.exists("/tmp/hpdcp_pwned_unit"):
        os.remove("/tmp/hpdcp_pwned_unit")
    with pytest.raises(PickleNotAllowedError, match="refusing to unpickle"):
        codec.decode(enc, key="x", source="ckpt/rank00000.objects.json")
    assert not os.path.exists("/tmp/hpdcp_pwned_unit")


@pytest.mark.parametrize("bad", [["zz", 1], ["i", 5], "plain", [], ["d", [[1]]], ["y", "***"]])
def test_malformed_encoding_is_a_metadata_error(bad):
    with pytest.raises(MetadataError, match="malformed object encoding"):
        codec.decode(bad, key="k", source="f")
