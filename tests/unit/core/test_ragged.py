import itertools
import math

import pytest
import torch

from hpdcp_runner.dcp.core.errors import StateDictError
from hpdcp_runner.dcp.core.geometry import Box
from hpdcp_runner.dcp.core.ragged import FlatShard, decompose_flat_interval


def _elements(shape, boxes):
    full = torch.arange(math.prod(shape)).reshape(shape)
    out = []
    for b in boxes:
        idx = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
        out += full[idx].reshape(-1).tolist()
    return out


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 5, 1), (2, 1, 3, 2)])
def test_decomposition_reproduces_every_interval(shape):
    n = math.prod(shape)
    for start, stop in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = decompose_flat_interval(shape, start, stop)
        assert _elements(shape, boxes) == list(range(start, stop)), (shape, start, stop)
        assert all(b.within(shape) and b.numel > 0 for b in boxes)


def test_reference_example():
    assert decompose_flat_interval((3, 4), 2, 8) == [Box((0, 2), (1, 2)), Box((1, 0), (1, 4))]


def test_bad_intervals_are_errors():
    with pytest.raises(StateDictError, match="outside"):
        decompose_flat_interval((3, 4), 5, 13)
    with pytest.raises(StateDictError, match="at least one dimension"):
        decompose_flat_interval((), 0, 1)


def test_flat_shard_units_and_piece_views():
    full = torch.arange(6 * 4 * 8, dtype=torch.float32).reshape(6, 4, 8)
    shard = FlatShard.from_units(full, full.shape, 2, (1, 3), 0)
    assert [(p.box, p.local_start, p.local_stop) for p in shard.pieces] == [
        (Box((0, 0, 0), (1, 4, 8)), 0, 32), (Box((1, 0, 0), (1, 2, 8)), 32, 48)]
    for p in shard.pieces:
        idx = tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))
        assert torch.equal(shard.piece_view(p), full[idx])
    with pytest.raises(StateDictError, match="cannot be split"):
        FlatShard.from_units(full, full.shape, 1, (2, 2), 0)
