"""A request resumed with the tokens its client already had (LLMEngine.add_request's `resume`, after a restart cut it
off) ends exactly as the uninterrupted run: greedy, and sampled with a seed (sampling.sample_keyed), with penalties,
min_tokens, a guide and log probs, speculated and batched."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_guide import REGEX, engine, target, tokenizer  # noqa: F401  (target and tokenizer are fixtures)

from pipeline.engine.guide import GuideSpec
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError

PENALISED = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_tokens=12)
CASES = {
    "greedy, penalised": SamplingParams(max_tokens=28, logprobs=2, **PENALISED),
    "seeded, penalised": SamplingParams(max_tokens=28, temperature=0.9, top_k=40, seed=11, logprobs=2, **PENALISED),
    "greedy, guided": SamplingParams(max_tokens=28, guide=GuideSpec("regex", REGEX)),
    "seeded, guided": SamplingParams(max_tokens=28, temperature=1.0, seed=12, guide=GuideSpec("regex", REGEX)),
}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [9]]


@pytest.mark.identity
@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_ends_as_the_uninterrupted_one(target, tokenizer, case):  # noqa: F811
    params = CASES[case]
    e = engine(target, tokenizer, draft="ngram")
    full = [r for r in e.generate(PROMPTS, params, speculation="on")]
    assert all(r.error is None and len(r.output_ids) > 4 for r in full), [r.error for r in full]
    for cut in (1, 4, 9):
        reqs = []
        for prompt, whole in zip(PROMPTS, full):
            if cut < len(whole.output_ids):
                reqs.append((whole, e.add_request(prompt, params, resume=whole.output_ids[:cut], speculation="on")))
        while e.has_unfinished():
            e.step()
        for whole, resumed in reqs:
            assert resumed.error is None, resumed.error
            assert resumed.output_ids == whole.output_ids, (case, cut)
            assert resumed.finish_reason == whole.finish_reason and resumed.num_resumed == cut
            if params.logprobs is not None:  # log probs for the tokens it made, as the first run gave them
                assert resumed.logprobs == [None] * cut + whole.logprobs[cut:]


def test_a_resume_that_cannot_be_the_answers_start_is_refused(target, tokenizer):  # noqa: F811
    e = engine(target, tokenizer)
    params = SamplingParams(max_tokens=8)
    eos = next(iter(e.eos_token_ids))
    for resume, message in (([5, eos, 6], f"resume holds the stop token {eos}"),
                            ([5] * 8, "resume holds 8 tokens and max_tokens is 8"),
                            ([10 ** 6], "resume has token ids outside the vocabulary"),
                            ([5] * 300, r"prompt is 3 tokens \+ 300 resumed but the engine's max_seq_len is 256")):
        with pytest.raises(RequestError, match=message):
            e.add_request([5, 6, 7], params, resume=resume)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    with pytest.raises(RequestError, match="resume holds tokens its guide refuses"):
        e.add_request([5], replace(params, guide=GuideSpec("regex", REGEX)), resume=yes[:1] + yes[:1])
    assert not e.has_unfinished()  # nothing refused was queued


def test_a_resumed_request_queues_ahead_of_new_ones_and_ends_as_the_uninterrupted_one(target, tokenizer):  # noqa: F811
    """A restarted server meets every request it held at once, beside new requests: the resumed ones, and the retries
    that had no token yet (`ahead`), take the next free slots (serving_gate.queue_is_full lets them past the queue's
    bound too), in their own order."""
    e = engine(target, tokenizer)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole = e.generate([[9]], params)[0]
    holders = [e.add_request([5, 6, i], params) for i in range(4)]
    e.step()  # the four slots are taken
    new = [e.add_request([40 + i], params) for i in range(2)]
    resumed = [e.add_request([9], params, resume=whole.output_ids[:cut]) for cut in (3, 5)]
    resumed.append(e.add_request([9], params, ahead=True))  # a retry that had no token yet: ahead all the same
    assert list(e.waiting) == [*resumed, *new]
    admitted = []
    while e.has_unfinished():
        e.step()
        admitted += [r for r in e.running if r not in admitted]
    assert admitted == [*holders, *resumed, *new]
    assert all(r.output_ids == whole.output_ids for r in resumed)
