"""The operator's load ceiling on speculation, with hysteresis: one state machine for the engine (every
iteration, over its decoding rows) and the served repository's gate (every arrival and departure, over the
requests in flight). Pure: no torch."""

from __future__ import annotations

from pipeline.policy.gate_policy import GatePolicy


class SpeculationGate:
    """Decides, every engine iteration, whether auto requests may draft at all (which of them do, and how
    many tokens, is the planner's choice: policy/draft_plan.py).

    Off when the decoding batch grows past `max_batch_size`; back on only once it has fallen to
    `max_batch_size - hysteresis`, so a batch hovering at the threshold doesn't flip every step.
    Only requests already decoding count: prefills are not part of the batch the draft serves.
    """

    def __init__(self, policy: GatePolicy):
        self.policy = policy
        self.on = policy.max_batch_size > 0
        self.flips = 0

    def update(self, batch_size: int) -> bool:
        """The load now (decoding rows, or requests in flight): whether auto requests may speculate."""
        p = self.policy
        if p.max_batch_size == 0:
            return False
        was = self.on
        if self.on and batch_size > p.max_batch_size:
            self.on = False
        elif not self.on and batch_size <= p.max_batch_size - p.hysteresis:
            self.on = True
        self.flips += was != self.on
        return self.on
