"""The load ceiling: threshold with hysteresis (the per-request rules are in test_draft_plan.py)."""

import pytest

from pipeline.engine.config import GatePolicy
from pipeline.errors import ConfigError
from pipeline.policy.gate import SpeculationGate


def test_gate_turns_off_above_threshold_and_back_on_only_below_the_hysteresis_band():
    gate = SpeculationGate(GatePolicy(max_batch_size=32, hysteresis=4))
    assert gate.update(32) is True
    assert gate.update(33) is False
    # Hovering just under the threshold must not flap back on.
    assert [gate.update(n) for n in (32, 31, 29, 33, 30)] == [False] * 5
    assert gate.update(28) is True
    assert gate.flips == 2


def test_gate_without_hysteresis_follows_the_batch():
    gate = SpeculationGate(GatePolicy(max_batch_size=2, hysteresis=0))
    assert [gate.update(n) for n in (1, 2, 3, 2, 3)] == [True, True, False, True, False]


def test_zero_threshold_never_speculates():
    gate = SpeculationGate(GatePolicy(max_batch_size=0, hysteresis=0))
    assert gate.update(1) is False


@pytest.mark.parametrize("kw", [dict(max_batch_size=-1), dict(max_batch_size=4, hysteresis=5), dict(min_tokens=-1)])
def test_bad_policies_are_refused(kw):
    with pytest.raises(ConfigError):
        GatePolicy(**kw)
