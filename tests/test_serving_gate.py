"""The serving gate's policy (pipeline.triton.serving_gate), without a server."""

from __future__ import annotations

from pipeline.engine.gate_policy import GatePolicy
from pipeline.triton.serving_gate import ACCEPTANCE, LOAD, OPEN, OVERRIDE, PROBE, SHORT, ServingGate


def gate(max_batch=8, hysteresis=3, min_tokens=50, floor=0.5, **kw) -> ServingGate:
    return ServingGate(GatePolicy(max_batch_size=max_batch, hysteresis=hysteresis, min_tokens=min_tokens),
                       acceptance_floor=floor, **kw)


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


def test_zero_threshold_never_speculates_on_auto():
    g = gate(max_batch=0, hysteresis=0)
    assert not g.admit("auto", 100).speculate and g.admit("on", 100).speculate


def test_acceptance_floor_holds_off_auto_requests_but_probes_so_it_can_reopen():
    g = gate(max_batch=64, floor=0.5, window=100, min_samples=40, probe_every=4)
    g.record(drafted=30, accepted=3, verify_steps=10)
    assert g.admit("auto", 100).reason == OPEN  # too few samples to judge yet
    g.record(drafted=30, accepted=3, verify_steps=10)
    assert g.acceptance_rate == 0.1 and abs(g.mean_acceptance_length - 1.3) < 1e-9
    reasons = [g.admit("auto", 100).reason for _ in range(8)]
    assert reasons == [ACCEPTANCE] * 3 + [PROBE] + [ACCEPTANCE] * 3 + [PROBE]
    # Probes bring back good numbers; the old ones fall out of the 100-token window.
    for _ in range(4):
        g.record(drafted=40, accepted=36, verify_steps=10)
    assert g.acceptance_rate >= 0.85 and g.speculating and g.admit("auto", 100).reason == OPEN


def test_floor_zero_is_off():
    g = gate(floor=0.0, min_samples=1)
    g.record(drafted=100, accepted=0, verify_steps=25)
    assert g.admit("auto", 100).speculate
