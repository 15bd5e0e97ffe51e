"""Stop strings matched on the answer's text, wherever the token and chunk boundaries fall.

OpenAI's and vLLM's rule: the answer ends just before the first occurrence of any stop string, which is
not returned. While streaming, a tail that could still grow into a stop string is held back until the
next chunk says whether it does; everything before it goes out at once.
"""

from __future__ import annotations

from pipeline.triton.stop_text import partial_stop


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the whole answer so far, as the engine sent it
        self.sent = 0  # characters of it already released
        self.stopped = False

    def feed(self, new: str) -> str:
        """Take the engine's next text; return what may be sent now ("" once a stop string matched)."""
        if self.stopped:
            return ""
        self.text += new
        if not self.stops:
            return self._release(len(self.text))
        # A stop string that ends in the new text starts at most longest - 1 characters before it.
        start = max(0, len(self.text) - len(new) - self.longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._release(max(min(found), self.sent))
        # The longest unreleased tail that a stop string starts with waits for the next chunk.
        return self._release(len(self.text) - partial_stop(self.text[self.sent:], self.stops))

    def flush(self) -> str:
        """The answer ended: release what was held back (it never became a stop string)."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
