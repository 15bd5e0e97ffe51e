"""A progress bar with an ETA per stage, on stderr, drawn by tqdm.

Stages are single library calls with no progress callbacks, so the bar runs on time: its count is the seconds
elapsed out of the seconds expected (the stage's last duration in build.json, else a rough estimate), which makes
tqdm's own rate 1 and its ETA the time left. It never claims 100% before the stage ends, and shows "overdue"
past the estimate. Silent unless stderr is a terminal (and not --quiet), so logs and pipes get only the summary.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from tqdm import tqdm

TICK_S = 0.25
_HEAD = "{desc:<16} [{bar:24}] {percentage:3.0f}%  "
_RUNNING = _HEAD + "{elapsed} elapsed, ETA {remaining}"
_DONE = _HEAD + "done in {elapsed}"


def _shown(elapsed: float, expected: float, done: bool) -> tuple[float, str]:
    """(the bar's count, its format): the count stops at 99% until the stage ends."""
    if done:
        return expected, _DONE
    overdue = _HEAD + f"{{elapsed}} elapsed, overdue (estimate was {_clock(expected)})"
    return min(elapsed, 0.99 * expected), (_RUNNING if expected > elapsed else overdue)


def format_bar(label: str, elapsed: float, expected: float, done: bool = False) -> str:
    """`label [#####-----]  42%  00:12 elapsed, ETA 00:17` (pure, for the tests)."""
    expected = max(expected, 1e-9)
    n, bar_format = _shown(elapsed, expected, done)
    return tqdm.format_meter(n, expected, elapsed, prefix=label, ascii="-#", bar_format=bar_format, rate=1)


def _clock(seconds: float) -> str:
    return tqdm.format_interval(seconds)


class StageProgress:
    """`with StageProgress("compile", expected_s=5): run()`: redraws one stderr line until the block ends."""

    def __init__(self, label: str, expected_s: float, enabled: bool, stream: TextIO | None = None):
        self.label, self.expected, self.enabled = label, max(expected_s, 1e-9), enabled
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: tqdm | None = None

    def __enter__(self) -> StageProgress:
        if self.enabled:
            self._bar = tqdm(total=self.expected, desc=self.label, file=self.stream, ascii="-#", bar_format=_RUNNING,
                             mininterval=TICK_S, leave=True)
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._bar is None:
            return
        self._thread.join()
        if exc_type is None:
            self._show(done=True)
        else:
            self._bar.bar_format = "{desc:<16} failed after {elapsed}"
            self._bar.refresh()
        self._bar.close()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self._show(done=False)

    def _show(self, done: bool) -> None:
        self._bar.n, self._bar.bar_format = _shown(self._bar.format_dict["elapsed"], self.expected, done)
        self._bar.refresh()


def progress_enabled(quiet: bool, stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return not quiet and hasattr(stream, "isatty") and stream.isatty()
