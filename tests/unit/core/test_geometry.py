import itertools
import math
import random

import pytest
import torch

from hpdcp_runner.dcp.core.geometry import (Box, boxes_tile, flat_span, intersect, span_is_exact, split_piece,
                                             tiling_problem)


def test_intersect_overlap_and_disjoint():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert intersect(a, b) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None  # touching edges share no element
    assert intersect(Box((), ()), Box((), ())) == Box((), ())  # 0-dim: one element, intersects itself


def test_zero_size_box_never_intersects():
    assert intersect(Box((0, 0), (0, 4)), Box((0, 0), (4, 4))) is None


@pytest.mark.parametrize("length,parts", [(7, 4), (3, 4), (16, 4), (0, 2), (5, 1), (6, 4)])
def test_split_piece_matches_torch_chunk(length, parts):
    # DTensor's Shard follows torch.chunk: pieces of ceil(L/n), trailing ones may be empty.
    chunks = list(torch.arange(length).chunk(parts)) if length else []
    for k in range(parts):
        start, size = split_piece(length, parts, k)
        expect = chunks[k].tolist() if k < len(chunks) else []
        assert list(range(start, start + size)) == expect


def test_flat_span_dim0_is_exact_and_dim1_is_a_slab():
    chunk = (8, 6)
    assert flat_span((2, 0), (3, 6), chunk) == (12, 30)
    assert span_is_exact((2, 0), (3, 6), chunk)
    start, stop = flat_span((2, 1), (3, 2), chunk)
    assert (start, stop) == (13, 27) and not span_is_exact((2, 1), (3, 2), chunk)


def test_flat_span_contains_exactly_the_box_elements():
    shape = (3, 4, 5)
    flat = torch.arange(math.prod(shape)).reshape(shape)
    for offs in itertools.product(range(3), range(4), range(5)):
        sizes = (3 - offs[0], 1, 5 - offs[2])
        start, stop = flat_span(offs, sizes, shape)
        box = flat[offs[0]:offs[0] + sizes[0], offs[1]:offs[1] + sizes[1], offs[2]:offs[2] + sizes[2]]
        assert box.min().item() == start and box.max().item() == stop - 1


def test_boxes_tile_detects_gap_overlap_and_escape():
    shape = (4, 4)
    assert boxes_tile(shape, [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]) is None
    assert "overlap" in boxes_tile(shape, [Box((0, 0), (3, 4)), Box((2, 0), (2, 4))])
    assert "cover 8 of 16" in boxes_tile(shape, [Box((0, 0), (2, 4))])
    assert "outside" in boxes_tile(shape, [Box((3, 0), (2, 4))])


def test_overlap_sweep_finds_overlaps_in_any_dimension_and_scales():
    from hpdcp_runner.dcp.core.geometry import first_overlap

    cols = [Box((0, c), (8, 1)) for c in range(8)]
    assert first_overlap(cols) is None
    assert first_overlap(cols + [Box((3, 5), (1, 2))]) is not None  # overlaps two column chunks
    grid = [Box((r, c), (1, 1)) for r in range(4) for c in range(4)]
    assert first_overlap(grid) is None and first_overlap(grid + [Box((1, 1), (2, 2))]) is not None
    assert first_overlap([Box((), ()), Box((), ())]) is not None
    rows = [Box((i, 0), (1, 3)) for i in range(20000)]  # 20k chunks: instant with the sweep
    assert boxes_tile((20000, 3), rows) is None
    assert "overlap" in boxes_tile((20000, 3), rows[:-1] + [Box((19998, 0), (2, 3))])


def test_box_index_returns_exactly_the_intersecting_boxes():
    import random

    from hpdcp_runner.dcp.core.geometry import BoxIndex

    rnd = random.Random(0)
    boxes = [Box((rnd.randrange(50), rnd.randrange(50)), (rnd.randrange(1, 20), rnd.randrange(1, 20)))
             for _ in range(300)]
    index = BoxIndex(boxes)
    for _ in range(200):
        q = Box((rnd.randrange(60), rnd.randrange(60)), (rnd.randrange(1, 30), rnd.randrange(1, 30)))
        assert index.overlapping(q) == [i for i, b in enumerate(boxes) if intersect(b, q) is not None]
    assert BoxIndex([Box((), ())]).overlapping(Box((), ())) == [0]


def _brute_overlap(boxes):
    from hpdcp_runner.dcp.core.geometry import intersect

    return any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_bounded_sweep_matches_brute_force_on_random_2d_layouts():
    import random

    from hpdcp_runner.dcp.core.geometry import Box, _overlap_2d, first_overlap

    rng = random.Random(7)
    for _ in range(300):
        boxes = [Box((rng.randrange(12), rng.randrange(12), 0), (rng.randrange(1, 5), rng.randrange(1, 5), 3))
                 for _ in range(rng.randrange(2, 12))]
        expect = _brute_overlap(boxes)
        for found in (first_overlap(boxes), _overlap_2d(boxes)):
            assert (found is not None) == expect, boxes
            if found is not None:
                assert _brute_overlap(list(found))


def test_hostile_strips_are_checked_exactly_without_the_quadratic_sweep():
    """Column strips of decreasing height keep every strip open in a plain sweep (n^2/2 box
    comparisons); the bounded sweep hands them to the segment-tree sweep. Correctness here; the
    time is measured by scripts/sim_planning_scale.py --hostile."""
    from hpdcp_runner.dcp.core import geometry
    from hpdcp_runner.dcp.core.geometry import Box, boxes_tile

    n = 1500
    boxes = []
    for i in range(n):
        h = n - i
        boxes += [Box((0, i), (h, 1)), Box((h, i), (n + 1 - h, 1))]
    calls = []
    real = geometry.intersect
    geometry.intersect = lambda a, b: calls.append(1) or real(a, b)
    try:
        assert boxes_tile((n + 1, n), boxes) is None
    finally:
        geometry.intersect = real
    assert len(calls) < 40 * len(boxes)  # bounded: the plain sweep makes ~n^2/2 = 1.1M comparisons
    boxes[-1] = Box((0, n - 1), (n + 1, 1))  # now overlaps the strip of its column
    assert "overlap" in boxes_tile((n + 1, n), boxes)


def test_irregular_layouts_in_three_dimensions_are_refused_clearly():
    from hpdcp_runner.dcp.core.geometry import Box, boxes_tile

    n = 300
    boxes = []
    for i in range(n):  # strips that also vary along a third dimension
        h = n - i
        boxes += [Box((0, i, i % 2), (h, 1, 1)), Box((h, i, i % 2), (n + 1 - h, 1, 1)),
                  Box((0, i, 1 - i % 2), (n + 1, 1, 1))]
    problem = boxes_tile((n + 1, n, 2), boxes)
    assert problem is not None and "cannot check the tiling in bounded time" in problem


def _random_layout(rng, k: int, d: int):
    """``k`` tensors of up to ``d`` dims, each cut into random boxes, then perhaps spoiled (a box
    dropped, repeated or moved by one): rows in ``tiling_problem``'s layout and each tensor's truth
    from the exact sweep."""
    shapes, rows, truth = [], [], []
    for i in range(k):
        nd = rng.randint(0, d)
        shp = tuple(rng.randint(0, 6) for _ in range(nd))
        boxes = [Box((0,) * nd, shp)]
        for _ in range(rng.randint(0, 3) if nd else 0):
            b = boxes.pop(rng.randrange(len(boxes)))
            j = rng.randrange(nd)
            c = rng.randint(0, b.sizes[j])
            o2, s1, s2 = list(b.offsets), list(b.sizes), list(b.sizes)
            s1[j], o2[j], s2[j] = c, o2[j] + c, s2[j] - c
            boxes += [Box(b.offsets, tuple(s1)), Box(tuple(o2), tuple(s2))]
        spoil = rng.random()
        if spoil < 0.15:
            boxes.pop(rng.randrange(len(boxes)))
        elif spoil < 0.3:
            boxes.append(boxes[rng.randrange(len(boxes))])
        elif spoil < 0.45 and nd:
            b = boxes.pop(rng.randrange(len(boxes)))
            o = list(b.offsets)
            o[rng.randrange(nd)] += rng.choice([-1, 1])
            boxes.append(Box(tuple(o), b.sizes))
        rng.shuffle(boxes)
        shapes.append(shp)
        truth.append(boxes_tile(shp, boxes))
        rows += [[i, *b.offsets, *(0,) * (d - nd), *b.sizes, *(1,) * (d - nd)] for b in boxes]
    return shapes, torch.tensor(rows, dtype=torch.int64).reshape(-1, 1 + 2 * d), truth


def test_vectorised_tiling_check_agrees_with_the_exact_sweep_on_random_layouts():
    """The column-wise fast path may only pass what the exact sweep passes, and must name the
    first tensor that fails, in row order or sorted, with the ids inline or given apart."""
    rng = random.Random(7)
    failing = 0
    for _ in range(1500):
        shapes, rows, truth = _random_layout(rng, rng.randint(1, 4), rng.randint(1, 3))
        if rng.random() < 0.5:
            rows = rows[torch.argsort(rows[:, 0], stable=True)]
        want = next((i for i, p in enumerate(truth) if p), None)
        got = tiling_problem(shapes, rows)
        assert (got[0] if got else None) == want, (shapes, rows.tolist(), got, truth)
        assert tiling_problem(shapes, rows[:, 1:], rows[:, 0]) == got
        failing += want is not None
    assert 300 < failing < 1200  # both outcomes were exercised
