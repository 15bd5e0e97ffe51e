"""How much of a streamed answer may go out while it could still end at a stop string.

The portable engine ends an answer just before the first stop string in its text (pipeline.engine.stop_strings),
but a stream sends text as it comes. Text that no stop string can still start in is final, whatever comes next;
the rest is a tail of the text that some stop string starts with, and waits. That tail is the longest one: a stop
string completed later starts inside the text, and if it started before the held tail, the text from its start
would be a longer tail that it starts with. So nothing sent is ever past the cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that some stop string starts with (the longest such tail; a whole stop
    string is not partial)."""
    longest = max((len(s) for s in stops), default=0)
    for k in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


def sendable(ids: Sequence[int], stops: Sequence[str], decode: Callable[[list[int]], str]) -> int:
    """How many of `ids` a stream may send now: the most whose text stops before the partial stop string."""
    if not stops:
        return len(ids)
    text = decode(list(ids))
    limit = len(text) - partial_stop(text, stops)
    end = len(ids)
    while end > 0 and len(decode(list(ids[:end]))) > limit:
        end -= 1
    return end
