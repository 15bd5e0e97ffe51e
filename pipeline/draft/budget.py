"""The wall-clock budget of `pipeline draft train`: M minutes for the whole run, split into phases.

On a loaded 2-core box the target's answers and hidden states alone can outlast the budget, and the
acceptance measurement after training, left unbounded, made a 10-minute run take 20 minutes and train 0
steps. So the phases are planned up front from the deadline, and every long loop (answer
decoding, target forwards, training steps, acceptance decoding) stops at its own phase's end:

    data: answers (with their hidden     at most DATA_SHARE of what setup left (answers: ANSWER_SHARE)
          states), then the text's
    training                            the rest until the evaluation reserve: half, for a budget over 50 s
    export + acceptance                 EVAL_SHARE (at least MIN_EVAL_S); acceptance stops at the deadline

A loop checks before each unit of work (one decode step, one forward, one training step), so a run can
end past the deadline by at most the last unit and the export: allowed_overrun_s bounds that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DATA_SHARE = 0.4
ANSWER_SHARE = 0.35  # the answers' states come with them; the built-in text's take the rest
EVAL_SHARE = 0.1
MIN_EVAL_S = 5.0  # the export and one engine load for the acceptance run, even in a tiny budget
OVERRUN_SHARE = 0.05
OVERRUN_MIN_S = 3.0


def now() -> float:
    """The budget's clock (time.monotonic): every deadline of a run is read here, so a test can drive it instead
    of the wall, and its outcome doesn't depend on how fast the machine is."""
    return time.monotonic()


def allowed_overrun_s(budget_s: float) -> float:
    """How far past its budget a run may end: 5%, or a few seconds for a short one."""
    return max(OVERRUN_MIN_S, OVERRUN_SHARE * budget_s)


@dataclass(frozen=True)
class PhasePlan:
    """Phase ends on the budget's clock (now()), planned at `start` (after setup) for `deadline`."""

    start: float
    deadline: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.deadline - self.start)

    @property
    def answers_end(self) -> float:
        return self.start + ANSWER_SHARE * self.seconds

    @property
    def data_end(self) -> float:
        return self.start + DATA_SHARE * self.seconds

    @property
    def train_end(self) -> float:
        return self.deadline - max(MIN_EVAL_S, EVAL_SHARE * self.seconds)
