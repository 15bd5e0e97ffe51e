"""SamplingParams validation and the logits -> probabilities transform (temperature -> top-k -> top-p)."""

import math
import re

import pytest
import torch

from pipeline.engine.sampling import SamplingParams, probs_from_logits, sample
from pipeline.errors import RequestError


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ---- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5),
    dict(temperature=-0.1), dict(temperature=-1),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.0001), dict(top_p=2),
    dict(top_k=-1),
])
def test_params_validation_rejects(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(max_tokens=1), dict(temperature=0.0), dict(temperature=1e-3), dict(top_p=1.0),
    dict(top_p=1e-6), dict(top_k=0), dict(top_k=1), dict(seed=0),
])
def test_params_validation_accepts_edges(kwargs):
    SamplingParams(**kwargs)


def test_greedy_flag():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


# ---- temperature ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [0.25, 0.8, 1.0, 2.0, 10.0])
def test_temperature_scales_logits(t):
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -4.0])
    got = probs_from_logits(logits, SamplingParams(temperature=t))
    torch.testing.assert_close(got, torch.softmax(logits / t, -1))
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-6)


def test_temperature_orders_entropy():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -4.0])

    def entropy(t):
        p = probs_from_logits(logits, SamplingParams(temperature=t))
        return float(-(p * p.clamp_min(1e-30).log()).sum())

    ents = [entropy(t) for t in (0.1, 0.5, 1.0, 2.0, 8.0)]
    assert ents == sorted(ents)
    assert entropy(0.01) < 1e-6  # near-greedy: all mass on the argmax
    assert entropy(1000.0) == pytest.approx(math.log(6), abs=1e-3)  # near-uniform


def test_batched_rows_are_independent():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)
    got = probs_from_logits(logits, params)
    for i in range(3):
        for j in range(5):
            torch.testing.assert_close(got[i, j], probs_from_logits(logits[i, j], params))


# ---- top-k ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k(k):
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, -0.2, 1.1])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    kept = set(torch.nonzero(got).flatten().tolist())
    assert kept == set(logits.topk(k).indices.tolist())
    # renormalized softmax over the kept set
    full = torch.softmax(logits, -1)
    mask = torch.zeros_like(full, dtype=torch.bool)
    mask[list(kept)] = True
    torch.testing.assert_close(got, torch.where(mask, full, 0.0) / full[mask].sum())


@pytest.mark.parametrize("k", [0, 7, 8, 100])
def test_top_k_disabled_or_at_least_vocab(k):
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, -0.2, 1.1])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    torch.testing.assert_close(got, torch.softmax(logits, -1))


def test_top_k_ties_keep_all_tied():
    logits = torch.tensor([1.0, 3.0, 1.0, 1.0, 0.0])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    # 3.0 and the three tied 1.0s all reach the k-th largest value; none is arbitrarily dropped
    assert torch.nonzero(got).flatten().tolist() == [0, 1, 2, 3]
    assert got[4] == 0


def test_top_k_after_temperature():
    # temperature doesn't change ranks, so the kept set is the same; the kept mass follows logits / t
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9])
    got = probs_from_logits(logits, SamplingParams(temperature=0.5, top_k=2))
    expect = torch.softmax(torch.tensor([2.0, 1.5]) / 0.5, -1)
    torch.testing.assert_close(got[[1, 3]], expect)
    assert float(got.sum()) == pytest.approx(1.0)


# ---- top-p ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p, kept", [
    (1e-6, {0}),       # at least one token, even for a tiny top_p
    (0.3, {0}),
    (0.45, {0}),
    (0.7, {0, 1}),      # 0.5 < 0.7 <= 0.5 + 0.3
    (0.79, {0, 1}),
    (0.81, {0, 1, 2}),  # 0.8 < 0.81 <= 0.95
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_smallest_prefix(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    perm = [2, 0, 3, 1]  # the kept set must not depend on where the tokens sit in the vocabulary
    logits = logits_of([probs[i] for i in perm])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    got_kept = {perm[i] for i in torch.nonzero(got).flatten().tolist()}
    assert got_kept == kept
    mass = sum(probs[i] for i in kept)
    for i, src in enumerate(perm):
        expect = probs[src] / mass if src in kept else 0.0
        assert float(got[i]) == pytest.approx(expect, abs=1e-6)


def test_top_p_applies_after_top_k():
    # top-k(3) renormalizes [.5, .3, .15] to [.526, .316, .158]; top-p 0.8 then needs 2 tokens
    # (0.526 < 0.8 <= 0.842). Applied to the raw probabilities it would also keep 2; with top_p 0.83
    # it differs: raw needs 3 (0.8 < 0.83), after top-k only 2 (0.842 >= 0.83).
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.83))
    assert torch.nonzero(got).flatten().tolist() == [0, 1]
    torch.testing.assert_close(got[:2], torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_after_temperature():
    # At t = 0.5 the probabilities sharpen to p^2 / sum p^2: [.25, .09, .0225, .0025] / .365
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    got = probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.68))
    assert torch.nonzero(got).flatten().tolist() == [0]  # .25/.365 = 0.685 >= 0.68
    got = probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.7))
    assert torch.nonzero(got).flatten().tolist() == [0, 1]


# ---- sample --------------------------------------------------------------------------------------

def test_same_seed_same_samples():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(3)), -1)

    def draw(seed, n=200):
        g = torch.Generator().manual_seed(seed)
        return [sample(probs, g) for _ in range(n)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sample_never_draws_zero_probability():
    probs = probs_from_logits(torch.tensor([0.1, 2.0, -1.0, 1.9, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    g = torch.Generator().manual_seed(0)
    drawn = {sample(probs, g) for _ in range(500)}
    assert drawn == {1, 3}
    one_hot = torch.tensor([0.0, 0.0, 1.0])
    assert {sample(one_hot, g) for _ in range(50)} == {2}


@pytest.mark.parametrize("temperature, top_p, top_k, message", [
    (float("nan"), 1.0, 0, "temperature must be a finite number"),
    (float("inf"), 1.0, 0, "temperature must be a finite number"),
    (-0.5, 1.0, 0, "temperature must be a finite number >= 0"),
    (1e-45, 1.0, 0, "too small to sample with"),
    (1e9, 1.0, 0, "is over 10000"),
    (1.0, float("nan"), 0, "top_p must be in"),
    (1.0, 0.0, 0, "top_p must be in"),
    (1.0, 1.0, -1, "top_k must be >= 0"),
])
def test_sampling_values_are_refused_never_clamped(temperature, top_p, top_k, message):
    """One rule for the engine, the Triton models and the client (pipeline.policy.sampling_limits)."""
    from pipeline.client.ensemble import RequestOptions
    from pipeline.errors import RequestError
    from pipeline.policy.sampling_limits import check_sampling_values

    with pytest.raises(RequestError, match=re.escape(message)):
        check_sampling_values(temperature, top_p, top_k)
    with pytest.raises(RequestError, match=re.escape(message)):
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    with pytest.raises(RequestError, match=re.escape(message)):
        RequestOptions(temperature=temperature, top_p=top_p, top_k=top_k).validate()


def test_the_edges_of_the_sampling_ranges_are_accepted():
    from pipeline.policy.sampling_limits import MAX_TEMPERATURE, MIN_TEMPERATURE, check_sampling_values

    for temperature in (0.0, MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE):
        check_sampling_values(temperature, 1.0, 0)
    check_sampling_values(1.0, 1e-6, 50, vocab_size=50)


def test_sample_draws_each_token_at_its_probability_and_never_one_of_probability_zero():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(probs, g) for _ in range(n)]), minlength=6).double()
    assert counts[probs == 0].sum() == 0
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 4 * sigma + 1e-9).all(), counts
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2 and sample(torch.tensor([1.0, 0.0, 0.0]), g) == 0
    for bad in (torch.tensor([0.5, float("nan")]), torch.zeros(3)):
        with pytest.raises(ValueError, match="finite with a positive sum"):
            sample(bad, g)
