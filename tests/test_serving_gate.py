"""The serving gate's policy (pipeline.policy.serving_gate), without a server."""

from __future__ import annotations

import pytest

from pipeline.policy.gate_policy import GatePolicy
from pipeline.policy.serving_gate import LOAD, OPEN, OVERRIDE, SHORT, Busy, ServingGate, queue_is_full


def gate(max_batch=8, hysteresis=3, min_tokens=50, **kw) -> ServingGate:
    return ServingGate(GatePolicy(max_batch_size=max_batch, hysteresis=hysteresis, min_tokens=min_tokens), **kw)


def test_load_turns_speculation_off_above_the_threshold_and_back_on_only_after_the_hysteresis():
    g = gate()
    got = [g.admit("auto", 100) for _ in range(10)]
    assert [d.speculate for d in got] == [True] * 8 + [False] * 2 and got[-1].reason == LOAD
    # 10 in flight -> 6: still above 8 - 3 = 5, so new arrivals (which count themselves) stay off.
    for _ in range(4):
        g.leave()
    assert g.in_flight == 6 and not g.speculating
    assert g.admit("auto", 100).speculate is False  # 7 in flight
    g.leave()
    g.leave()  # 5: at or below 8 - 3, open again
    assert g.speculating and g.admit("auto", 100) == type(got[0])(True, OPEN)
    assert g.flips == 2


def test_short_requests_and_overrides():
    g = gate()
    assert g.admit("auto", 49).reason == SHORT and not g.admit("auto", 49).speculate
    assert g.admit("on", 1) == type(g.admit("off", 500))(True, OVERRIDE)
    assert g.admit("off", 500).speculate is False
    for _ in range(20):
        g.admit("auto", 100)
    assert g.admit("on", 100).speculate is True  # the client's override wins over the load


def test_a_request_the_engine_has_no_room_for_is_refused_as_busy_and_not_counted_in_flight():
    """2 slots + 3 queued: the sixth is refused with the engine's own line; a refusal needs no leave, and
    once one request leaves the next is let in again."""
    g = gate(slots=2, max_queue_size=3)
    for _ in range(5):
        g.admit("auto", 100)
    with pytest.raises(Busy, match=r"^server busy: 3 requests are already waiting for the engine's 2 slots "
                                   r"\(max_queue_size 3\); retry in a moment"):
        g.admit("on", 100)
    assert g.in_flight == 5 and g.rejected == 1
    g.leave()
    assert g.admit("auto", 100).reason == OPEN and g.in_flight == 5
    # No bound without both numbers (the TensorRT-LLM route; a repository from before the check).
    unbounded = gate(slots=2)
    for _ in range(50):
        unbounded.admit("auto", 100)
    assert unbounded.in_flight == 50 and unbounded.rejected == 0


def test_zero_threshold_never_speculates_on_auto():
    g = gate(max_batch=0, hysteresis=0)
    assert not g.admit("auto", 100).speculate and g.admit("on", 100).speculate


def test_bad_acceptance_never_turns_the_server_off():
    """Acceptance is each request's own business (policy/draft_plan.py): however badly drafts have done,
    the next auto request is let in to speculate; the rolling numbers only feed the metrics."""
    g = gate(max_batch=64, window=100)
    for _ in range(10):
        g.record(drafted=40, accepted=0, verify_steps=10)
    assert g.acceptance_rate == 0.0 and g.mean_acceptance_length == 1.0
    assert g.speculating and g.admit("auto", 100) == type(g.admit("auto", 100))(True, OPEN)
    g.record(drafted=30, accepted=3, verify_steps=10)
    assert g.acceptance_rate < 0.1


def test_a_requests_clock_observes_its_first_token_then_the_gaps_spread_over_each_responses_tokens():
    from pipeline.triton.latency import RequestClock

    clock = RequestClock(arrival=10.0, streamed=True)
    assert clock.response(0, 10.5) == (None, None)  # a keepalive while queued carries no token
    assert clock.response(1, 11.0) == (1.0, None)
    ttft, itl = clock.response(4, 11.2)  # a verify step that accepted three drafts
    assert ttft is None and itl == pytest.approx(0.05)
    assert clock.end(12.0) == 2.0
    whole = RequestClock(arrival=0.0, streamed=False)  # its one response is its last, not its first token
    assert whole.response(30, 1.0) == (None, None) and whole.end(1.0) == 1.0


def test_a_resumed_answer_may_queue_one_capacity_past_the_bound_and_no_further():
    """2 slots + 3 queued are full for a new request; an answer a restart cut off still gets in, up to 5 more."""
    g = gate(slots=2, max_queue_size=3)
    for _ in range(5):
        g.admit("auto", 100)
    with pytest.raises(Busy):
        g.admit("auto", 100)
    for _ in range(5):
        g.admit("auto", 100, resumed=True)
    with pytest.raises(Busy, match=r"^server busy: 8 requests are already waiting"):
        g.admit("auto", 100, resumed=True)
    assert g.in_flight == 10 and g.rejected == 2
    assert queue_is_full(3, 3, 2, resumed=False) and not queue_is_full(7, 3, 2, resumed=True)
    assert queue_is_full(8, 3, 2, resumed=True)
