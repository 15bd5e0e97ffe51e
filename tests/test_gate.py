"""The per-iteration gate: load threshold with hysteresis, short-output rule, per-request override."""

import pytest

from pipeline.engine.config import GatePolicy
from pipeline.engine.gate import SpeculationGate
from pipeline.engine.request import Request
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import ConfigError


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


def req(max_tokens: int, speculation: str = "auto") -> Request:
    return Request([1, 2], SamplingParams(max_tokens=max_tokens), speculation=speculation)


def test_short_outputs_never_speculate_unless_forced():
    gate = SpeculationGate(GatePolicy(min_tokens=50))
    assert not gate.wants(req(49)) and gate.wants(req(50))
    assert gate.wants(req(10, "on"))
    assert not gate.wants(req(500, "off"))


def test_override_on_speculates_even_when_the_gate_is_off():
    gate = SpeculationGate(GatePolicy(max_batch_size=1, hysteresis=0))
    gate.update(5)
    assert not gate.wants(req(100)) and gate.wants(req(100, "on"))


@pytest.mark.parametrize("kw", [dict(max_batch_size=-1), dict(max_batch_size=4, hysteresis=5), dict(min_tokens=-1)])
def test_bad_policies_are_refused(kw):
    with pytest.raises(ConfigError):
        GatePolicy(**kw)
