"""pipeline.triton.stop_text: what a stream may send while the answer could still end at a stop string."""

from __future__ import annotations

import random

import pytest

from pipeline.triton.stop_text import partial_stop, sendable

PIECES = ["a", "b", "ab", "ba", "c", " ", "bc", "xy"]  # a toy vocabulary: token i decodes to PIECES[i]


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3),
    ("xaba", ["abab"], 3),  # "aba" starts "abab"; so would "a", but the longest tail counts
    ("xab", ["abab", "b!"], 2),
    ("xyz", ["abc"], 0),  # nothing a stop string starts with: all of it goes out
    ("xabc", ["abc"], 0),  # a whole stop string is the engine's to cut, not a partial one
    ("ab", ["abc"], 2),
    ("", ["abc"], 0),
    ("abc", [], 0),
])
def test_the_held_tail_is_the_longest_that_a_stop_string_starts_with(text, stops, held):
    assert partial_stop(text, stops) == held


def stream(ids: list[int], stops: list[str], rule) -> tuple[int, int]:
    """Feed the tokens one at a time as the engine keeps them; the answer ends at the first token whose text holds a
    stop string. Returns (characters ever sent before the end, where the text is cut)."""
    sent = 0
    for i in range(1, len(ids) + 1):
        text = decode(ids[:i])
        found = [j for j in (text.find(s) for s in stops) if j >= 0]
        if found:
            return sent, min(found)
        sent = max(sent, len(decode(ids[:rule(ids[:i], stops, decode)])))
    return sent, len(decode(ids))


def test_a_stream_never_sends_text_past_where_a_stop_string_later_cuts_it():
    rng = random.Random(29)
    stops = ["abc", "ba b", "cc", "xyxy"]
    cut_inside = 0
    for _ in range(3000):
        ids = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 14))]
        sent, cut = stream(ids, stops, sendable)
        assert sent <= cut, decode(ids)
        cut_inside += cut < len(decode(ids))
    assert cut_inside > 500  # most sequences really met a stop string


def test_sending_everything_at_once_would_pass_the_cut():
    """Negative control: the same streams, sending every token at once, send text the answer doesn't have."""
    rng = random.Random(29)
    stops = ["abc", "ba b", "cc", "xyxy"]
    past = sum(stream(ids, stops, lambda ids, s, d: len(ids))[0] > stream(ids, stops, sendable)[1]
               for ids in ([rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 14))] for _ in range(300)))
    assert past > 30


def test_text_no_stop_string_can_start_in_goes_out_at_once():
    ids = [PIECES.index("xy"), PIECES.index("a"), PIECES.index(" ")]
    assert sendable(ids, ["abc"], decode) == 3
    assert sendable(ids[:2], ["abc"], decode) == 1  # "a" may begin "abc"
    assert sendable(ids, [], decode) == 3
