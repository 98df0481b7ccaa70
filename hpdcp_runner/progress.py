"""The one-line progress of a save or load on rank 0's terminal.

Why not tqdm's bar here: a save spends seconds after its last byte (flushing to disk, waiting for
the other ranks, the commit), where a byte bar sits at 100% with the last rate frozen and its
hint cut mid-word by a narrow terminal. This line is built to fit the terminal's width (the bar
shrinks first, then the hint is shortened at a word), its rate is measured over the last few
seconds (so it falls to nothing when bytes stop), and once the bytes are done it says what the
operation waits for and for how long instead of a rate.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, TextIO

#: seconds a phase runs before its line appears (short saves print nothing)
SHOW_AFTER_S = 2.0
#: seconds of byte samples the rate is measured over
RATE_WINDOW_S = 3.0
_MIN_BAR = 6


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps a number of at least 1 (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut after a whole word and marked with an
    ellipsis (never mid-word); empty when not even one word fits."""
    if len(text) <= width:
        return text
    words, out = text.split(" "), ""
    for w in words:
        candidate = f"{out} {w}" if out else w
        if len(candidate) + 1 > width:
            break
        out = candidate
    return f"{out}…" if out else ""


def _amount(done: int, total: int) -> str:
    """``0.5/1.0 GiB``: both in the total's unit (one unit, fewer columns)."""
    if not total:
        return human_bytes(done)
    unit = human_bytes(total).split(" ")[1]
    scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
    fmt = "{:.0f}" if unit == "B" else "{:.1f}"
    return f"{fmt.format(done / scale)}/{fmt.format(total / scale)} {unit}"


def render(desc: str, done: int, total: int, files: int, stage: str, rate: float | None,
           stage_s: float, cols: int) -> str:
    """One progress line of at most ``cols - 1`` characters (the last column is left free: some
    terminals wrap a line that fills it).

    ``rate`` (bytes/s over the recent window) is shown while bytes move; when they do not
    (``rate`` None or 0) the line shows what the operation waits for (``stage``) and how long it
    has waited (``stage_s``) instead of a rate that would stand frozen. What does not fit goes
    whole, least useful first (the bar shrinks, then the file count, the time left, the rate;
    the hint is shortened at a word, its time kept): nothing is cut mid-word."""
    width = max(1, cols - 1)
    moving = bool(rate) and (not total or done < total)
    head = f"{desc} {min(100, int(100 * done / total)):3d}%" if total else desc
    # (text, drop order: lower goes first; None: always kept)
    parts: list[tuple[str, int | None]] = [(_amount(done, total), None)]
    if moving:
        parts.append((f"{human_bytes(rate)}/s", 3))
        if total:
            parts.append((f"{_clock((total - done) / rate)} left", 2))
    if files:
        parts.append((f"{files} file{'s' * (files != 1)}", 1))
    clock = "" if moving or not stage else f" {_clock(stage_s)}"

    def compose(bar_width: int, kept: list[str], what: str) -> str:
        bar = ""
        if bar_width:
            filled = round(bar_width * min(done, total) / total)
            bar = " " + "█" * filled + "·" * (bar_width - filled)
        text = f"{head}{bar} {'  '.join(kept)}"
        return f"{text} · {what}{clock}" if what else text

    kept = list(parts)
    what = stage
    while True:
        texts = [t for t, _ in kept]
        room = width - len(compose(0, texts, what))
        if room >= _MIN_BAR + 1 and total:
            return compose(min(room - 1, 30), texts, what)
        if room >= 0:
            return compose(0, texts, what)
        droppable = [p for p in kept if p[1] is not None]
        if droppable:
            kept.remove(min(droppable, key=lambda p: p[1]))
            continue
        if what:  # shorten the hint at a word; its clock stays
            shorter = _shorten(what, len(what) + room)
            if shorter and shorter != what:
                what = shorter
                continue
            what, clock = "", ""
            continue
        if " (" in head:  # a very narrow terminal: "save (rank 0)" becomes "save"
            head = head.split(" (")[0] + (head[head.index(")") + 1:] if ")" in head else "")
            continue
        return _shorten(compose(0, texts, ""), width) or compose(0, texts, "")[:width]


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to, read again at every frame (a resized
    window is followed); ``COLUMNS`` wins as it does for other tools; 80 when nothing says (a
    pseudo-terminal nobody sized reports 0)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        cols = 0
    return cols or 80


class ProgressLine:
    """A line redrawn in place on ``stream`` four times a second while an operation runs.

    ``poll() -> (bytes done, files done, total bytes, stage)`` is read from the drawing thread;
    nothing is drawn before :data:`SHOW_AFTER_S`, and the line is erased when it stops."""

    def __init__(self, desc: str, poll: Callable[[], tuple[int, int, int, str]], stream: TextIO | None = None,
                 interval: float = 0.25, show_after: float = SHOW_AFTER_S) -> None:
        self.desc, self.poll, self.stream = desc, poll, stream or sys.stderr
        self.interval, self.show_after = interval, show_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpdcp-progress", daemon=True)
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._stage, self._stage_since = "", 0.0
        self._drawn = False

    def __enter__(self) -> "ProgressLine":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _rate(self, now: float, done: int) -> float | None:
        self._samples.append((now, done))
        while self._samples and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        return (done - b0) / (now - t0) if now > t0 else None

    def frame(self, now: float, cols: int) -> str:
        """The line for this moment (separate from drawing, so it can be checked)."""
        done, files, total, stage = self.poll()
        if stage != self._stage:
            self._stage, self._stage_since = stage, now
        return render(self.desc, min(done, total) if total else done, total, files, stage,
                      self._rate(now, done), now - self._stage_since, cols)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            text = self.frame(now, terminal_columns(self.stream))
            if now - self._started >= self.show_after:
                self.stream.write(f"\r{text}\x1b[K")
                self.stream.flush()
                self._drawn = True


class Bars:
    """A job's progress display: bars and lines on rank 0, on a terminal only (never in logs or
    under CI), each shown once its phase has run for 2 s."""

    def __init__(self, rank: int, world_size: int, enabled: bool) -> None:
        self.world_size = world_size
        self.shown = rank == 0 and enabled and sys.stderr.isatty() and not os.environ.get("CI")

    def progress(self, iterable: Any, desc: str, total: int | None = None) -> Any:
        """A progress bar over ``iterable`` (see ``show_progress``), once the phase ran 2 s."""
        if not self.shown:
            return iterable
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, leave=False, delay=2.0, **terminal_size())

    @contextlib.contextmanager
    def byte_progress(self, desc: str, done: Callable[[], tuple[int, int]],
                      counters: Any = None) -> Iterator[None]:
        """While the body runs, one line (see :mod:`hpdcp_runner.progress`) of rank 0's bytes done
        of the total (once ``counters`` or the body says it: ``expected_bytes``), polled from
        ``done() -> (bytes, files)``, with what the operation waits for once bytes stop
        (``counters.stage``); shown only once the phase has run for 2 s."""
        if not self.shown:
            yield
            return

        def poll() -> tuple[int, int, int, str]:
            nbytes, files = done()
            total = counters.expected_bytes if counters is not None else 0
            stage = counters.stage if counters is not None else ""
            if stage == "writing" and total and nbytes >= total and self.world_size > 1:
                stage = "waiting for the other ranks"
            return nbytes, files, total, stage

        with ProgressLine(f"{desc} (rank 0)", poll):
            yield

    @contextlib.contextmanager
    def bytes_bar(self, desc: str) -> Iterator[Callable[[int, int], None] | None]:
        """A bar of bytes done of a total that the body reports through the callback it gets,
        ``(done, total)`` (None when no bar is shown): for walks that know their total, such as a
        verify reading every tensor."""
        if not self.shown:
            yield None
            return
        bar = byte_bar(desc)

        def report(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        try:
            yield report
        finally:
            bar.close()


def byte_bar(desc: str) -> Any:
    """A tqdm bar of bytes (KiB, MiB... of a total when it is set), shown once it ran for 2 s."""
    from tqdm import tqdm

    return tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, delay=2.0, leave=False, **terminal_size())


def terminal_size() -> dict:
    """A terminal that reports no size (a pseudo-terminal nobody sized: ``script`` run without a
    terminal, some CI runners and container consoles) makes tqdm print nothing at all (0 rows):
    such a one gets 80 x 24; a real size is left to tqdm (which follows resizes)."""
    try:
        cols, rows = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        return {}
    return {} if cols > 0 and rows > 0 else {"ncols": cols or 80, "nrows": rows or 24}
