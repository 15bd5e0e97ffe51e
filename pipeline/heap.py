"""Handing freed heap back to the system.

glibc keeps what a process frees in its arenas (one per thread that allocates, up to 8 per core), so a burst's
memory stays in its RSS after the burst: three 2 MB prompts left the OpenAI frontend 545 MB up, and a burst of
16 long answers left the gate's process some 50 MB up on the tiny model. `release_memory` after the burst gives it
back: malloc_trim(0) returns every arena's free pages, not only the main heap's top.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_memory() -> None:
    """Hand freed heap back to the system (a no-op off glibc)."""
    if trim := _malloc_trim():
        trim(0)
