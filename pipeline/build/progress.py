"""A progress bar with an ETA per stage, on stderr.

Stages are single library calls with no progress callbacks, so the bar runs on time: the fraction is
elapsed / expected, where expected is the stage's last duration in build.json, else a rough estimate.
It never claims 100% before the stage ends, and shows "overdue" past the estimate. Silent unless stderr
is a terminal (and not --quiet), so logs and pipes get only the summary.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

WIDTH = 24
TICK_S = 0.25


def format_bar(label: str, elapsed: float, expected: float, done: bool = False) -> str:
    """`label [#####-----]  42%  0:12 elapsed, ETA 0:17` (pure, for the tests)."""
    if done:
        frac = 1.0
    else:
        frac = min(elapsed / expected, 0.99) if expected > 0 else 0.0
    filled = int(round(frac * WIDTH))
    bar = "#" * filled + "-" * (WIDTH - filled)
    if done:
        tail = f"done in {_clock(elapsed)}"
    elif expected > elapsed:
        tail = f"{_clock(elapsed)} elapsed, ETA {_clock(expected - elapsed)}"
    else:
        tail = f"{_clock(elapsed)} elapsed, overdue (estimate was {_clock(expected)})"
    return f"{label:<16} [{bar}] {frac * 100:3.0f}%  {tail}"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class StageProgress:
    """`with StageProgress("compile", expected_s=5): run()`: redraws one stderr line until the block ends."""

    def __init__(self, label: str, expected_s: float, enabled: bool, stream: TextIO | None = None):
        self.label, self.expected, self.enabled = label, expected_s, enabled
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> StageProgress:
        self._start = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            elapsed = time.monotonic() - self._start
            end = format_bar(self.label, elapsed, self.expected, done=True) if exc_type is None else \
                f"{self.label:<16} failed after {_clock(elapsed)}"
            self._draw(end + "\n")

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self._draw(format_bar(self.label, time.monotonic() - self._start, self.expected))

    def _draw(self, text: str) -> None:
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()


def progress_enabled(quiet: bool, stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return not quiet and hasattr(stream, "isatty") and stream.isatty()
