"""The per-request draft planner and the cost model it reads: pure, with synthetic costs and acceptance."""

import dataclasses
import itertools
import json

import pytest

from pipeline.errors import ConfigError
from pipeline.policy.cost_model import CostModel, default_cost_model
from pipeline.policy.draft_plan import (
    ACCEPTANCE, COST, END, LOAD, OVERRIDE, PROBE_EVERY, PROBE_K, SHORT, AcceptanceEstimate, Row, _step_time,
    expected_tokens, plan_drafts)

K = 4


def cost_model(fixed: float, per_token: float, draft_fixed=0.0, draft_per_token=0.0) -> CostModel:
    """step_s(B, W) = fixed + per_token * B * W: memory-bound while fixed dominates, compute-bound after."""
    rows = (1, 2, 4, 8, 16, 32, 64)
    widths = tuple(range(1, K + 2))
    return CostModel(rows, widths, tuple(tuple(fixed + per_token * b * w for w in widths) for b in rows),
                     tuple(draft_fixed for _ in rows), tuple(draft_per_token * b for b in rows))


# A CPU-like machine: 10 ms to read the weights, 0.1 ms per token computed.
CPU = cost_model(fixed=0.010, per_token=0.0001, draft_fixed=0.0002, draft_per_token=0.00005)


def test_expected_tokens_is_the_geometric_sum_and_later_drafts_may_run_at_their_own_rate():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) == expected_tokens(0.5, 2, continuation=0.5)
    assert expected_tokens(0.5, 3, continuation=1.0) == 2.5 and expected_tokens(0.5, 0, continuation=0.9) == 1.0
    assert expected_tokens(0.5, 2, continuation=0.8) == pytest.approx(1 + 0.5 + 0.5 * 0.8)


def test_later_drafts_that_pass_more_often_than_the_first_earn_a_longer_draft():
    """A 60-minute EAGLE-3 head on SmolLM2, drafting 4 every step, passed its first draft 58% of the time and each
    later one 64-70% given the one before: one rate for every position undervalues the later drafts and plans a
    shorter run."""
    cost = cost_model(fixed=0.008, per_token=0.0002, draft_fixed=0.0005, draft_per_token=0.0004)
    one_rate = plan_drafts([Row(cap=K, acceptance=0.46)], cost)
    two_rates = plan_drafts([Row(cap=K, acceptance=0.46, continuation=0.75)], cost)
    assert 0 < one_rate.ks[0] < two_rates.ks[0] == K


def test_at_batch_one_good_drafts_take_the_full_length():
    plan = plan_drafts([Row(cap=K, acceptance=0.7)], CPU)
    assert plan.ks == (K,) and plan.reasons == (None,)


def test_a_large_batch_on_a_compute_bound_machine_drafts_nothing_and_says_it_is_the_cost():
    plan = plan_drafts([Row(cap=K, acceptance=0.3)] * 64, CPU)
    assert set(plan.ks) == {0} and set(plan.reasons) == {COST}


def test_a_row_with_bad_acceptance_is_left_out_while_the_others_draft():
    rows = [Row(cap=K, acceptance=0.8), Row(cap=K, acceptance=0.02), Row(cap=K, acceptance=0.8)]
    plan = plan_drafts(rows, CPU)
    assert plan.ks[0] > 0 and plan.ks[2] > 0
    assert plan.ks[1] == 0 and plan.reasons[1] == ACCEPTANCE


def test_a_row_whose_drafts_never_pay_even_alone_is_acceptance_not_cost():
    plan = plan_drafts([Row(cap=K, acceptance=0.0)], CPU)
    assert plan.ks == (0,) and plan.reasons == (ACCEPTANCE,)


def test_overrides_short_outputs_the_load_ceiling_and_the_last_token_each_have_their_reason():
    rows = [Row(cap=K, acceptance=0.9, mode="off"), Row(cap=K, acceptance=0.9, short=True),
            Row(cap=0, acceptance=0.9), Row(cap=K, acceptance=0.0, mode="on")]
    plan = plan_drafts(rows, CPU)
    assert plan.reasons[:3] == (OVERRIDE, SHORT, END) and plan.ks[:3] == (0, 0, 0)
    assert plan.ks[3] == K and plan.reasons[3] is None  # "on" drafts whatever its acceptance
    closed = plan_drafts([Row(cap=K, acceptance=0.9), Row(cap=K, acceptance=0.9, mode="on")], CPU, load_open=False)
    assert closed.ks == (0, K) and closed.reasons == (LOAD, None)


def test_a_proposer_that_rarely_has_drafts_for_a_row_makes_its_drafts_worth_less():
    """An n-gram lookup without a match proposes nothing, but the row still pays the step's width: at
    the same acceptance, a row whose lookups rarely hit is left out where one that always hits drafts."""
    rows = [Row(cap=K, acceptance=0.5, hit=1.0), Row(cap=K, acceptance=0.5, hit=0.05)] * 4
    plan = plan_drafts(rows, CPU)
    assert all(k > 0 for k in plan.ks[::2]) and plan.ks[1::2] == (0, 0, 0, 0)
    assert set(plan.reasons[1::2]) == {ACCEPTANCE}
    est = AcceptanceEstimate()
    for _ in range(10):
        est.proposed(False)
    assert est.hit_rate < 0.25


def test_a_probe_drafts_a_little_even_when_its_acceptance_says_no():
    plan = plan_drafts([Row(cap=K, acceptance=0.0, probe=True)], CPU)
    assert plan.ks == (PROBE_K,)


def test_a_rows_cap_limits_its_drafts():
    plan = plan_drafts([Row(cap=1, acceptance=0.9), Row(cap=K, acceptance=0.9)], CPU)
    assert plan.ks == (1, K)


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_best_of_every_draft_length_vector(seed):
    """Brute force over every k per row (0..cap) with the same objective: the planner's search over a
    common width and the rows with most to gain loses nothing."""
    import random

    rng = random.Random(seed)
    cost = cost_model(fixed=rng.uniform(0.001, 0.02), per_token=rng.uniform(1e-5, 1e-3),
                      draft_fixed=rng.uniform(0, 0.002), draft_per_token=rng.uniform(0, 0.001))
    rows = [Row(cap=rng.randint(0, K), acceptance=rng.random(), continuation=rng.choice([None, rng.random()]),
                hit=rng.choice([1.0, rng.random()]), free=rng.random() < 0.3) for _ in range(rng.randint(1, 4))]
    B = len(rows)

    def rate(ks):
        tokens = sum(1 + r.hit * (expected_tokens(r.acceptance, k, r.continuation) - 1) for r, k in zip(rows, ks))
        return tokens / _step_time(cost, B, max(ks), sum(k > 0 for k in ks),
                                   sum(k > 0 and not r.free for r, k in zip(rows, ks)))

    best = max(rate(ks) for ks in itertools.product(*[range(r.cap + 1) for r in rows]))
    plan = plan_drafts(rows, cost)
    assert rate(plan.ks) == pytest.approx(best, rel=1e-9)
    assert plan.expected_tokens_per_s == pytest.approx(best, rel=1e-9)


def test_a_free_row_drafts_longer_than_a_paid_one_that_accepts_as_well():
    """A lookup row's drafts cost only the verify's width; a head's cost a proposal per token too."""
    cost = cost_model(fixed=0.010, per_token=0.0001, draft_fixed=0.0005, draft_per_token=0.002)
    paid = plan_drafts([Row(cap=K, acceptance=0.6)], cost)
    free = plan_drafts([Row(cap=K, acceptance=0.6, free=True)], cost)
    assert 0 < paid.ks[0] < free.ks[0] == K
    assert free.expected_tokens_per_s > paid.expected_tokens_per_s
    # At a width both take, the free row drafts while a paid row whose gain doesn't cover its proposal doesn't.
    both = plan_drafts([Row(cap=K, acceptance=0.3), Row(cap=K, acceptance=0.3, free=True)], cost)
    assert both.ks[1] > 0 and both.ks[0] == 0


def test_acceptance_estimate_falls_with_rejections_and_a_probe_comes_due():
    est = AcceptanceEstimate()
    start = est.first
    for _ in range(5):
        est.update(drafted=4, accepted=0)
    assert est.first < 0.2 < start
    assert est.continuation == est.first  # no later draft was checked: the first draft's rate
    est.skipped = PROBE_EVERY
    assert est.probe_due
    for _ in range(10):
        est.update(drafted=4, accepted=4)
    assert est.first > 0.7 and not est.probe_due  # drafting resets the count; good drafts win it back


def test_a_greedy_requests_prior_is_the_engines_recent_acceptance_and_thin_evidence_says_so():
    from pipeline.policy.draft_plan import EXPLORE_CHECKS, PRIOR_ACCEPTANCE, SharedAcceptance

    shared = SharedAcceptance()
    assert shared.first == PRIOR_ACCEPTANCE and shared.thin
    for _ in range(20):
        shared.update(drafted=4, accepted=4)
    assert shared.first > 0.9 and shared.checks >= EXPLORE_CHECKS and not shared.thin
    fresh = AcceptanceEstimate(shared=shared)
    assert fresh.first == pytest.approx(shared.first) and AcceptanceEstimate().first == PRIOR_ACCEPTANCE
    fresh.update(drafted=4, accepted=0)  # its own evidence still counts first
    assert fresh.first < shared.first
    for _ in range(100):
        shared.update(drafted=2, accepted=0)
    assert shared.first < 0.1  # it follows the workload


def test_acceptance_estimate_keeps_the_first_draft_and_the_later_ones_apart():
    est = AcceptanceEstimate()
    for _ in range(30):  # half the steps reject the first draft; the other half accept 3 of 4
        est.update(drafted=4, accepted=0)
        est.update(drafted=4, accepted=3)
    assert est.first == pytest.approx(0.5, abs=0.05)
    assert est.continuation == pytest.approx(2 / 3, abs=0.05)  # 2 passed of 3 checked (the 4th after a 3rd)


def test_cost_model_interpolates_in_rows_and_extrapolates_past_the_grid():
    cost = cost_model(fixed=1.0, per_token=0.5)
    assert cost.step_s(4, 1) == pytest.approx(3.0)
    assert cost.step_s(6, 2) == pytest.approx(1.0 + 0.5 * 6 * 2)
    assert cost.step_s(128, 1) == pytest.approx(1.0 + 0.5 * 128)
    assert cost.draft_s(3, 0) == 0.0 and cost.step_s(0, 3) == 0.0


def test_cost_model_round_trips_through_its_file_and_refuses_nonsense(tmp_path):
    cost = default_cost_model(K, 64)
    cost.save(tmp_path)
    assert CostModel.load(tmp_path) == cost
    assert CostModel.load(tmp_path / "nowhere") is None
    data = json.loads((tmp_path / "cost_model.json").read_text())
    data["target_s"][0][0] = float("nan")
    with pytest.raises(ConfigError, match="finite"):
        CostModel.from_json(data)
    with pytest.raises(ConfigError, match="widths"):
        CostModel((1,), (2, 3), ((1.0, 1.0),), (0.0,), (0.0,))


def test_the_context_term_adds_what_rows_past_the_timed_context_cost_and_older_files_have_none(tmp_path):
    cost = dataclasses.replace(default_cost_model(K, 64), context=64, context_token_s=2e-6)
    assert cost.context_s([10, 64, 564, 1064]) == pytest.approx(2e-6 * (500 + 1000))
    cost.save(tmp_path)
    assert CostModel.load(tmp_path) == cost
    data = json.loads((tmp_path / "cost_model.json").read_text())
    del data["context"], data["context_token_s"]  # a file calibrated before the term: the table alone, as then
    assert CostModel.from_json(data).context_s([2000]) == 0.0
    data["context_token_s"] = -1.0
    with pytest.raises(ConfigError, match="finite"):
        CostModel.from_json(data)


def test_calibration_noise_cannot_make_a_wider_or_larger_step_cheaper():
    from pipeline.engine.calibrate import monotone

    assert monotone([(3.0, 2.0, 4.0), (2.5, 5.0, 4.5)]) == [(3.0, 3.0, 4.0), (3.0, 5.0, 5.0)]
