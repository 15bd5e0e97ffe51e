"""Stop strings matched on the answer's text as the engine makes it, across token boundaries.

OpenAI's and vLLM's rule: the answer ends just before the first occurrence of any stop string, which is
not returned. The engine checks after every token it keeps, so a stop string completed inside an
accepted draft run ends the answer at that token: the tokens after it were never the answer. The text
is the whole output decoded again each time (a token's text can depend on the ones before it, as with
byte-fallback pieces), searched only where a new match could end.
"""

from __future__ import annotations

from typing import Callable

Detokenize = Callable[[list[int]], str]


class StopStrings:
    def __init__(self, stops: tuple[str, ...], detokenize: Detokenize):
        self.stops, self.detokenize = stops, detokenize
        self.longest = max(len(s) for s in stops)
        self.checked = 0  # characters of the text already searched for a match ending in them

    def check(self, output_ids: list[int]) -> tuple[int, str] | None:
        """After a new token: (characters of the text to keep, the stop string) if one now appears, else None."""
        text = self.detokenize(output_ids)
        start = max(0, self.checked - self.longest + 1)
        self.checked = len(text)
        found = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(found) if found else None
