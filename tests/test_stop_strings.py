"""Stop strings: matched on text across token boundaries, cut where OpenAI and vLLM cut, inside a draft run too."""

import pytest

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.request import FinishReason
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.stop_strings import StopStrings
from pipeline.errors import RequestError

PIECES = ["a", "b", "c", "d", " ", "ab", "cd", "xyz"]


def detok(ids):  # a stand-in tokenizer: token id -> piece, cyclically
    return "".join(PIECES[i % len(PIECES)] for i in ids)


def test_a_stop_string_spanning_tokens_cuts_just_before_it():
    stops = StopStrings(("bcd",), detok)
    assert stops.check([0]) is None  # "a"
    assert stops.check([0, 5]) is None  # "aab"
    assert stops.check([0, 5, 6]) == (2, "bcd")  # "aabcd": keep "aa"


def test_the_earliest_stop_wins():
    stops = StopStrings(("zz", "cd", "b"), detok)
    assert stops.check([5, 6]) == (1, "b")  # "abcd": "b" at 1 before "cd" at 2


def cfg() -> EngineConfig:
    return EngineConfig(max_batch_size=8, max_seq_len=128, num_draft_tokens=6, gate=GatePolicy(min_tokens=0))


@pytest.mark.identity
def test_a_stop_inside_an_accepted_draft_run_ends_there(tiny_target):
    prompt = [3, 14, 15, 92, 65]
    plain = LLMEngine.load(tiny_target, cfg())
    plain.detokenize = detok
    [ref] = plain.generate([prompt], SamplingParams(max_tokens=30))
    text = detok(ref.output_ids)
    stop = text[14:17]  # three characters somewhere in the middle of the answer
    cut = text.find(stop)
    end = next(n for n in range(1, 31) if stop in detok(ref.output_ids[:n]))  # the token that completes it
    for draft in (None, tiny_target):  # the target as its own draft: every draft accepted, 6 a step
        engine = LLMEngine.load(tiny_target, cfg(), draft=draft)
        engine.detokenize = detok
        [req] = engine.generate([prompt], SamplingParams(max_tokens=30, stop=(stop,)), speculation="on")
        assert req.finish_reason is FinishReason.STOP
        assert req.output_ids == ref.output_ids[:end]
        assert (req.stop_text_len, req.stop_reason) == (cut, stop)
        assert detok(req.output_ids)[:req.stop_text_len] == text[:cut]
    assert engine.stats.accepted_tokens > 0


def test_stop_strings_need_a_detokenizer_and_sane_values(tiny_target):
    engine = LLMEngine.load(tiny_target, cfg())
    with pytest.raises(RequestError, match="stop strings need the engine's tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=("x",)))
    with pytest.raises(RequestError, match="stop strings must be non-empty"):
        SamplingParams(stop=("",))
    with pytest.raises(RequestError, match="send at most 16"):
        SamplingParams(stop=tuple("abcdefghijklmnopq"))
