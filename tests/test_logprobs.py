"""Log probs: the target's distribution after the sampling transforms, the same with and without speculation."""

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.logprobs import token_logprobs
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError


def cfg(k: int = 4) -> EngineConfig:
    return EngineConfig(max_batch_size=8, max_seq_len=128, num_draft_tokens=k, gate=GatePolicy(min_tokens=0))


@pytest.mark.identity
@pytest.mark.parametrize("draft", ["ngram", "self-draft"])
def test_greedy_logprobs_are_identical_with_and_without_speculation(tiny_target, draft):
    prompts = [[5, 6, 7] * 6, [1, 2, 3, 4, 5, 1, 2, 3], [200, 17, 44]]
    params = SamplingParams(max_tokens=30, logprobs=5, repetition_penalty=1.2)
    alone = [LLMEngine.load(tiny_target, cfg()).generate([p], params)[0] for p in prompts]
    engine = LLMEngine.load(tiny_target, cfg(), draft="ngram" if draft == "ngram" else tiny_target)
    spec = engine.generate(prompts, params, speculation="on")
    assert engine.stats.accepted_tokens > 0
    for a, s in zip(alone, spec):
        assert s.output_ids == a.output_ids
        assert s.logprobs == a.logprobs  # every float, every alternative, bit for bit
        assert len(s.logprobs) == len(s.output_ids)
        for tok, lp in zip(s.output_ids, s.logprobs):
            assert lp.top[0] == (tok, lp.logprob)  # greedy: the chosen token is the most likely
            assert len(lp.top) == 5 and all(x[1] >= y[1] for x, y in zip(lp.top, lp.top[1:]))


def test_greedy_logprobs_are_the_models_log_softmax(tiny_target):
    from transformers import AutoModelForCausalLM

    prompt = [3, 14, 15, 92, 65]
    [req] = LLMEngine.load(tiny_target, cfg()).generate([prompt], SamplingParams(max_tokens=6, logprobs=2))
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + req.output_ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits.double(), -1)
    for i, (tok, lp) in enumerate(zip(req.output_ids, req.logprobs)):
        assert lp.logprob == pytest.approx(float(want[i, tok]), abs=1e-4)


def test_sampled_logprobs_follow_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    [lp] = token_logprobs(logits, [1], SamplingParams(temperature=0.5, top_k=2, logprobs=4))
    p = torch.softmax(logits[0, :2] / 0.5, -1)
    assert lp.logprob == pytest.approx(float(p[1].log()))
    assert [t for t, _ in lp.top[:2]] == [0, 1] and lp.top[2][1] == lp.top[3][1] == -9999.0  # top-k dropped 2, 3


def test_no_logprobs_unless_asked(tiny_target):
    [req] = LLMEngine.load(tiny_target, cfg()).generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert req.logprobs == []


@pytest.mark.parametrize("n", [-1, 21, 2.5, True])
def test_logprobs_out_of_range_are_refused(n):
    with pytest.raises(RequestError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=n)
