"""Columnar helpers the planners use at scale, against plain Python."""

from __future__ import annotations

import random
from collections import Counter

import torch

from hpdcp_runner.dcp.core.columns import group_rows, padded_boxes, singletons


def test_padded_boxes_of_mixed_ranks_match_python():
    rnd = random.Random(3)
    boxes = [([rnd.randrange(9) for _ in range(k)], [rnd.randrange(1, 9) for _ in range(k)])
             for k in (rnd.choice([0, 1, 2, 3]) for _ in range(200))]
    flat = torch.tensor([x for o, s in boxes for x in o + s], dtype=torch.int64)
    nd = torch.tensor([len(o) for o, _ in boxes], dtype=torch.int64)
    d = 3
    want = [o + [0] * (d - len(o)) + s + [1] * (d - len(s)) for o, s in boxes]
    assert padded_boxes(flat, nd, d).tolist() == want
    same = [([1, 2], [3, 4]), ([5, 6], [7, 8])]  # every box of full rank: a view of the flat list
    assert padded_boxes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([2, 2]), 2).tolist() == \
        [o + s for o, s in same]


def test_singletons_marks_exactly_the_keys_seen_once():
    rnd = random.Random(4)
    rows = torch.tensor([[rnd.randrange(5), rnd.randrange(3), rnd.randrange(-2**62, 2**62)] if rnd.random() < 0.5
                         else [rnd.randrange(5), rnd.randrange(3), 7] for _ in range(500)], dtype=torch.int64)
    seen = Counter(tuple(r) for r in rows.tolist())
    assert singletons(rows).tolist() == [seen[tuple(r)] == 1 for r in rows.tolist()]
    assert singletons(rows[:1]).tolist() == [True]
    # grouping what is left gives the same groups as grouping everything, minus the singletons
    keep = ~singletons(rows)
    _, gid, starts = group_rows(rows[keep])
    assert len(starts) == sum(1 for c in seen.values() if c > 1)
