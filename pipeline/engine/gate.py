"""The per-iteration speculation gate."""

from __future__ import annotations

from pipeline.engine.config import GatePolicy
from pipeline.engine.request import Request


class SpeculationGate:
    """Decides, every engine iteration, whether the batch speculates.

    Off when the decoding batch grows past `max_batch_size`; back on only once it has fallen to
    `max_batch_size - hysteresis`, so a batch hovering at the threshold doesn't flip every step.
    Only requests already decoding count: prefills are not part of the batch the draft serves.
    """

    def __init__(self, policy: GatePolicy):
        self.policy = policy
        self.on = policy.max_batch_size > 0
        self.flips = 0

    def update(self, batch_size: int) -> bool:
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

    def wants(self, req: Request) -> bool:
        """Whether this request speculates this iteration, given the gate's state."""
        if req.speculation == "off":
            return False
        if req.speculation == "on":
            return True
        # Short outputs never pay back the draft's prefill and per-step overhead.
        return self.on and req.params.max_tokens >= self.policy.min_tokens
