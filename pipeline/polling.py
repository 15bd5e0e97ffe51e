"""Waiting for something to come up: a server's readiness, a model's, a frontend's /health."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout_s: float, every_s: float) -> T | None:
    """probe() every every_s seconds until it returns something other than None, for at most timeout_s (probed once
    at least); None when it never did. A probe raises to stop early: a process that exited won't come up."""
    deadline = time.monotonic() + timeout_s
    while True:
        if (got := probe()) is not None:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(every_s)
