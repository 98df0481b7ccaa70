"""The progress line (hpdcp_runner.progress): it fits any terminal width, never cuts a word,
shows a rate only while bytes move, and says what it waits for, with the time, once they stop."""

from __future__ import annotations

import io
import itertools

from hpdcp_runner.progress import ProgressLine, render

STATES = [
    ("save (rank 0)", 512 << 20, 1 << 30, 0, "writing", 120e6, 1.0),
    ("save (rank 0)", 1 << 30, 1 << 30, 1, "waiting for the other ranks", 0.0, 6.2),
    ("load (rank 0)", 3 << 40, 4 << 40, 12, "reading", 2.5e9, 0.0),
    ("load (rank 0)", 1 << 30, 1 << 30, 3, "waiting for rank 0's commit", None, 3700),
    ("save (rank 0)", 0, 0, 0, "planning with the other ranks", None, 2),
    ("async_save (rank 0)", 77, 100, 0, "flushing to disk", 1.0, 0.5),
]


def test_every_width_fits_and_no_word_is_cut():
    for (desc, done, total, files, stage, rate, waited), cols in itertools.product(STATES, range(20, 161, 7)):
        full = render(desc, done, total, files, stage, rate, waited, 10_000)
        line = render(desc, done, total, files, stage, rate, waited, cols)
        assert len(line) <= cols - 1, (cols, line)
        words = set(full.split())
        for w in line.split():  # every word whole, or shortened with an ellipsis, or the bar
            assert w in words or w.endswith("…") or set(w) <= set("█·"), (cols, w, line, full)
        assert line.startswith(desc.split()[0]), line


def test_rate_only_while_bytes_move_and_the_wait_is_timed():
    moving = render("save (rank 0)", 1 << 20, 4 << 20, 0, "writing", 1e6, 0.0, 80)
    assert "/s" in moving and "left" in moving and moving.endswith("· writing")
    stopped = render("save (rank 0)", 4 << 20, 4 << 20, 2, "committing", 1e6, 75.0, 80)
    assert "/s" not in stopped and stopped.endswith("· committing 1:15") and "2 files" in stopped
    stalled = render("save (rank 0)", 1 << 20, 4 << 20, 0, "writing", 0.0, 4.0, 80)  # nothing moved lately
    assert "/s" not in stalled and stalled.endswith("· writing 0:04")


def test_the_rate_falls_to_nothing_when_bytes_stop():
    """The rate is measured over a recent window: seconds after the last byte the line no longer
    shows the last rate (tqdm's bar kept it frozen)."""
    state = {"b": 0}
    line = ProgressLine("save (rank 0)", lambda: (state["b"], 0, 100 << 20, "writing"), stream=io.StringIO())
    t = 0.0
    for _ in range(8):  # 10 MiB/s for 2 s
        state["b"] += (10 << 20) // 4
        t += 0.25
        frame = line.frame(t, 80)
    assert "10.0 MiB/s" in frame, frame
    for _ in range(16):  # then nothing for 4 s
        t += 0.25
        frame = line.frame(t, 80)
    assert "/s" not in frame and frame.endswith("· writing 0:05"), frame  # (the stage began at 0.25 s)
