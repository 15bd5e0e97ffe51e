"""A seeded sampled request draws its token at each position from (seed, position) alone (sampling.sample_keyed).

Two claims make it lossless and resumable: the keyed draw follows p exactly (checked here by chi-square against p,
with a wrong draw as the negative control), and a seeded request's tokens are the same token for token whether it
decoded alone, beside others, speculated with any draft, chunked, cached, or continued from its prompt plus the
tokens it already had. Together: speculative output is plain decoding's, which follows p.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_engine import config, make_prompts
from test_speculative import FAIL_P, PASS_P, chi_square

from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import KEY_BLOCK, SamplingParams, gumbel_noise, noise_key, sample_keyed

V = 700  # three blocks of KEY_BLOCK: the last one part padding


def spread() -> torch.Tensor:
    """p over V tokens with some mass in every block, a zero-probability stretch, and one block nearly empty."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    logits[100:140] = float("-inf")
    logits[KEY_BLOCK:2 * KEY_BLOCK] -= 6.0
    return torch.softmax(logits, 0)


def test_the_keyed_draw_follows_p_over_seeds_and_over_positions():
    p = spread()
    exact = {t: float(p[t]) for t in range(V)}
    by_seed = Counter(sample_keyed(p, seed, 17) for seed in range(20_000))
    by_position = Counter(sample_keyed(p, 5, position) for position in range(20_000))
    for what, counts in (("seeds", by_seed), ("positions", by_position)):
        pv, _, df, bad = chi_square(counts, exact)
        assert bad == 0, f"over {what}: a zero-probability token was drawn"
        assert df > 50 and pv > PASS_P, f"over {what}: the keyed draw does not follow p (p={pv:.3g})"


def test_a_wrong_keyed_draw_fails_the_same_check():
    """Negative control: the block picked by Gumbel-max over its token count (not its mass) is not p's sample."""
    p = spread()
    padded = np.zeros(3 * KEY_BLOCK)
    padded[:V] = p.double().numpy()
    blocks = padded.reshape(3, KEY_BLOCK)

    def wrong(seed: int) -> int:
        key = noise_key(seed, 17)
        block = int(np.argmax(np.log([KEY_BLOCK, KEY_BLOCK, V - 2 * KEY_BLOCK]) + gumbel_noise(key, 3)))
        with np.errstate(divide="ignore"):
            return block * KEY_BLOCK + int(np.argmax(np.log(blocks[block]) + gumbel_noise(noise_key(key, block),
                                                                                          KEY_BLOCK)))

    pv, *_ = chi_square(Counter(wrong(seed) for seed in range(4_000)), {t: float(p[t]) for t in range(V)})
    assert pv < FAIL_P


def test_the_noise_is_a_pure_function_of_its_key():
    """Pinned: a request resumed on another machine, or by another release, must draw what the first one would
    have. The key is integer arithmetic (exact everywhere); the draws only pass through float64 logs."""
    assert noise_key(0) != noise_key(1) != noise_key(0, 0)
    assert noise_key(7, 3) == 8339970170765327861
    noise = gumbel_noise(noise_key(7, 3), 4)
    np.testing.assert_allclose(noise, [0.4309856301, -0.6425732194, -0.6931159599, 2.0675606947], rtol=1e-9)
    p = spread()
    assert [sample_keyed(p, 7, i) for i in range(8)] == [245, 227, 72, 170, 13, 25, 242, 556]


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_target):
    from tiny_models import make_tiny_eagle3_head

    return make_tiny_eagle3_head(tmp_path_factory.mktemp("keyed_head"), tiny_target, seed=4)


MAX_TOKENS = 24
CUT = 9  # tokens a resumed request already had


@pytest.mark.identity
def test_a_seeded_request_is_the_same_alone_batched_speculated_chunked_cached_and_resumed(tiny_target, tiny_draft,
                                                                                           head):
    prompts = make_prompts(6, seed=31)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=500 + i)
              for i in range(len(prompts))]
    alone = LLMEngine.load(tiny_target, config(max_batch_size=1))
    solo = [alone.generate([p], [sp], speculation="off")[0].output_ids for p, sp in zip(prompts, params)]
    assert len({tuple(s) for s in solo}) == len(solo) and all(len(s) == MAX_TOKENS for s in solo)
    for name, draft in (("ngram", "ngram"), ("small draft", tiny_draft), ("self draft", tiny_target),
                        ("eagle3", f"eagle3:{head}")):
        engine = LLMEngine.load(tiny_target, config(num_draft_tokens=3, prefill_chunk=16), draft=draft)
        out = [r.output_ids for r in engine.generate(prompts, params, speculation="on")]
        assert out == solo, name
        stats = engine.stats
        assert stats.drafted_tokens > 0, name
        assert name == "ngram" or 0 < stats.accepted_tokens, name  # a random tiny model's lookups rarely match
        if name == "self draft":  # its q is p, drawn with the same noise: every draft is the target's token
            assert stats.acceptance_rate == 1.0
        # Resumed: the prompt plus the first CUT tokens, the same seed, the rest of the budget; beside the
        # originals' cached blocks (a prefix hit) and batched with each other.
        resumed = engine.generate([p + s[:CUT] for p, s in zip(prompts, solo)],
                                  [SamplingParams(max_tokens=MAX_TOKENS - CUT, temperature=0.8, top_p=0.95,
                                                  seed=sp.seed) for sp in params], speculation="on")
        assert [r.output_ids for r in resumed] == [s[CUT:] for s in solo], name
        assert sum(r.num_cached_tokens for r in resumed) > 0, name
    # Unseeded requests are not keyed: the same prompt twice gives two answers.
    twice = alone.generate([prompts[0]] * 2, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)] * 2)
    assert twice[0].output_ids != twice[1].output_ids
