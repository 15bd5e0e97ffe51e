"""Penalties: the formulas against transformers' and OpenAI's, and greedy speculation still the target's."""

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.penalties import penalize
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError

V = 50


def test_repetition_penalty_is_transformers_on_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 3
    prompt, output = [1, 2, 3, 2], [7, 1, 9]
    got = penalize(logits, SamplingParams(repetition_penalty=1.7), prompt, output)
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    assert torch.equal(got, want)


def test_presence_and_frequency_count_the_output_only():
    logits = torch.zeros(1, V)
    got = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [4, 4], [7, 7, 7, 9])[0]
    assert got[4] == 0  # in the prompt only
    assert got[7] == pytest.approx(-0.5 - 3 * 0.25) and got[9] == pytest.approx(-0.5 - 0.25)
    assert int((got != 0).sum()) == 2


def test_each_verify_row_is_penalised_by_the_drafts_before_it():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, V, generator=g)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.3)
    prompt, output, drafts = [3, 5], [5, 8], [8, 11, 3]
    got = penalize(rows, params, prompt, output, drafts)
    for j in range(4):  # exactly what plain decoding would have computed at that position, bit for bit
        assert torch.equal(got[j], penalize(rows[j:j + 1], params, prompt, output + drafts[:j])[0])
    assert not torch.equal(got[3], penalize(rows[3:4], params, prompt, output)[0])


@pytest.mark.parametrize("kwargs, message", [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty must be in [-2, 2]"),
])
def test_penalties_out_of_range_are_refused(kwargs, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


@pytest.mark.identity
@pytest.mark.parametrize("draft", ["ngram", "self-draft"])
def test_greedy_with_penalties_is_the_same_with_and_without_speculation(tiny_target, draft):
    # The target drafting for itself: its unpenalised drafts are right until a penalty changes the argmax.
    # Repetitive prompts, so n-gram drafts propose repeats that the penalties then accept or reject. (Strong
    # penalties steer a tiny model off every earlier token: an n-gram lookup then finds nothing to draft.)
    prompts = [[5, 6, 7] * 6, [9, 9, 9, 9], [1, 2, 3, 4, 5, 1, 2, 3], [200, 17, 44]]
    params = SamplingParams(max_tokens=40, repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)
    cfg = EngineConfig(max_batch_size=8, max_seq_len=128, num_draft_tokens=4, gate=GatePolicy(min_tokens=0))
    alone = [LLMEngine.load(tiny_target, cfg).generate([p], params)[0].output_ids for p in prompts]
    engine = LLMEngine.load(tiny_target, cfg, draft="ngram" if draft == "ngram" else tiny_target)
    batched = [r.output_ids for r in engine.generate(prompts, params, speculation="on")]
    assert batched == alone
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    plain = [r.output_ids for r in LLMEngine.load(tiny_target, cfg).generate(prompts, SamplingParams(max_tokens=40))]
    assert plain != alone  # the penalties changed the answers
