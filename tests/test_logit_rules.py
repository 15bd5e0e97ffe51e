"""logit_bias, min_tokens and ignore_eos (pipeline/engine/logit_rules.py): what each does to an answer, that a
verify row gets each rule as plain decoding would have there (speculation changes no token), and the one-line
refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.request import FinishReason
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_llama  # noqa: E402

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [9] * 12]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("rules-target"), seed=4, layers=2)


def engine(target, draft=None) -> LLMEngine:
    return LLMEngine.load(target, EngineConfig(max_batch_size=4, max_seq_len=128, num_draft_tokens=3,
                                               gate=GatePolicy(min_tokens=0)), draft=draft)


def outputs(e, params, speculation="off"):
    return [(r.output_ids, r.finish_reason) for r in e.generate(PROMPTS, params, speculation=speculation)]


def test_each_rule_does_what_it_says(target):
    e = engine(target)
    eos = e.eos_token_ids[0]
    ends = SamplingParams(max_tokens=12, logit_bias=((eos, 100.0),))  # the end token all but forced
    assert all(out == [] and why is FinishReason.STOP for out, why in outputs(e, ends))
    held = SamplingParams(max_tokens=12, logit_bias=((eos, 100.0),), min_tokens=5)
    for out, why in outputs(e, held):  # five tokens none of which is a stop token, then the end token
        assert len(out) == 5 and eos not in out and why is FinishReason.STOP
    ignored = SamplingParams(max_tokens=12, logit_bias=((eos, 100.0),), ignore_eos=True)
    assert all(out == [eos] * 12 and why is FinishReason.LENGTH for out, why in outputs(e, ignored))
    plain = outputs(e, SamplingParams(max_tokens=12))
    liked = plain[0][0][3]  # a token the first answer has at its 4th place
    biased = outputs(e, SamplingParams(max_tokens=12, logit_bias=((liked, 100.0),)))
    assert all(out == [liked] * 12 for out, _ in biased)
    banned = outputs(e, SamplingParams(max_tokens=12, logit_bias=((liked, -100.0),)))
    assert all(liked not in out for out, _ in banned) and banned != plain


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, logit_bias=((17, 1.5), (33, -1.0), (90, 1.0))),
    SamplingParams(max_tokens=16, min_tokens=9, logit_bias=((256, 3.0),)),  # the end token likely, held off 9
    SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=((256, 1.5),), repetition_penalty=1.3),
], ids=["bias", "min_tokens", "ignore_eos"])
def test_speculation_changes_no_token_under_the_rules(target, params):
    expected = outputs(engine(target), params)
    assert len({tuple(o) for o, _ in expected}) > 1  # the prompts' answers differ
    for draft in ("ngram", str(target)):
        spec = engine(target, draft)
        assert outputs(spec, params, speculation="on") == expected, draft
        assert spec.stats.drafted_tokens > 0 or draft == "ngram"


def test_the_refusals_name_the_value(target):
    with pytest.raises(RequestError, match="logit_bias for token 3 must be a number in \\[-100, 100\\]"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(RequestError, match="send at most 300"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301)))
    with pytest.raises(RequestError, match="min_tokens 9 is over max_tokens 8"):
        SamplingParams(max_tokens=8, min_tokens=9)
    from pipeline.engine.guide import GuideSpec

    with pytest.raises(RequestError, match="min_tokens with a guide"):
        SamplingParams(min_tokens=3, guide=GuideSpec("json"))
    with pytest.raises(RequestError, match="token 320, not a token id of the vocabulary \\[0, 320\\)"):
        engine(target).add_request([5], SamplingParams(logit_bias=((320, 1.0),)))
