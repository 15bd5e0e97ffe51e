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


def test_prompt_logprobs_are_the_models_log_softmax_at_each_prompt_position(tiny_target):
    """vLLM's prompt_logprobs (OpenAI's echo with logprobs): token i's log prob under the target's distribution at
    position i - 1, raw logits, with its top-N; transformers' own model gives the reference."""
    from transformers import AutoModelForCausalLM

    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    [req] = LLMEngine.load(tiny_target, cfg()).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(req.prompt_logprobs) == len(prompt) - 1
    for i, lp in enumerate(req.prompt_logprobs):
        assert lp.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=1e-4)
        values, ids = ref[i].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.identity
def test_prompt_logprobs_are_the_same_chunked_batched_and_after_a_prefix_hit(tiny_target):
    """Each position's numbers come from its row alone: the same whether the prompt is prefilled in one chunk or in
    4-token chunks, beside other requests, or after the same prompt filled the prefix cache (a scoring request
    never takes its positions from the cache, which holds no logits); and the answer is the same as without."""
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    params = SamplingParams(max_tokens=8, prompt_logprobs=2)
    [alone] = LLMEngine.load(tiny_target, cfg()).generate([prompt], params)
    engine = LLMEngine.load(tiny_target, EngineConfig(max_batch_size=8, max_seq_len=128, prefill_chunk=4,
                                                      gate=GatePolicy(min_tokens=0)))
    chunked = engine.generate([prompt, [5, 6, 7] * 5], params)
    again = engine.generate([prompt], params)  # the prompt's blocks are cached now
    [plain] = LLMEngine.load(tiny_target, cfg()).generate([prompt], SamplingParams(max_tokens=8))
    assert len(alone.prompt_logprobs) == len(prompt) - 1
    for other in (chunked[0], again[0]):
        assert other.prompt_logprobs == alone.prompt_logprobs and other.output_ids == alone.output_ids
    assert len(chunked[1].prompt_logprobs) == 14 and alone.output_ids == plain.output_ids
    assert LLMEngine.load(tiny_target, cfg()).generate([prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs == []


def test_a_scored_prompts_end_token_is_reported_though_it_is_no_output(tiny_target):
    """An evaluator drops the last log prob of an echoed answer as the answer's own: where the model ends at once,
    that entry is the end token's (vLLM's echo reports it), so the prompt's last token is never the one dropped."""
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1, logit_bias=((256, 100.0),),
                            stop_token_ids=(256,))
    [req] = LLMEngine.load(tiny_target, cfg()).generate([prompt], params)
    assert req.output_ids == [] and req.stop_logprob[0] == 256 and len(req.prompt_logprobs) == 4
    [plain] = LLMEngine.load(tiny_target, cfg()).generate([prompt], SamplingParams(
        max_tokens=1, logprobs=1, logit_bias=((256, 100.0),), stop_token_ids=(256,)))
    assert plain.stop_logprob is None  # only a scored prompt's answer carries it
