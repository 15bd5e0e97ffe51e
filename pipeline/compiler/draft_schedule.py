"""TensorRT-LLM's draft_len_schedule from a cost model: how many tokens to draft at each batch size, and where to stop.

On releases whose one-model path reads it (reference.LLM_API_TABLES[...].eagle3_gate == "one-model"), the schedule
is the gate: {bound: draft_len, ...} drafts draft_len tokens while at most `bound` requests run, and nothing past
the largest bound (reference.DRAFT_LEN_SCHEDULE). We fill it the way the portable engine plans its drafts
(pipeline.policy.draft_plan): at each batch size b, the k in 0..K with the most expected tokens per second,
E(a, k) / (step_s(b, k + 1) + draft_s(b, k)), for a request of the engine's prior acceptance a. Upstream's rules
shape it: the smallest bound gets max_draft_len, no value exceeds it, and the schedule ends at the first batch
size where drafting doesn't pay, or at the operator's ceiling (--gate-batch-size), whichever comes first. A
draft length never grows with the batch (each extra row makes every drafted token dearer).

The cost model is the roofline of pipeline.policy.cost_model.gpu_profile for the planned GPU (a GPU's step time is
not measurable here); pure, so compile, the plan and the tests compute the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.policy.cost_model import CostModel
from pipeline.policy.draft_plan import PRIOR_ACCEPTANCE, expected_tokens

# Share of a GPU's dense peak a decode step's skinny GEMMs reach (scripts/simulate_scale.py assumes the same).
COMPUTE_EFFICIENCY = 0.25


@dataclass(frozen=True)
class Schedule:
    lengths: dict[int, int]  # bound -> draft length, ascending bounds
    ceiling: int  # the largest bound: above it no drafts
    source: str  # the cost model's

    def note(self, gate: int) -> str:
        why = ("the operator's ceiling (--gate-batch-size)" if self.ceiling == gate else
               f"where the cost model finds drafting stops paying (below --gate-batch-size {gate})")
        pairs = ", ".join(f"{b}: {k}" for b, k in self.lengths.items())
        return (f"draft_len_schedule {{{pairs}}}: draft lengths per batch-size bound from the {self.source} at "
                f"acceptance {PRIOR_ACCEPTANCE}; speculation off above {self.ceiling} requests, {why}")


def best_draft_len(cost: CostModel, rows: int, acceptance: float, max_k: int) -> int:
    """The k in 0..max_k with the most expected tokens per second for `rows` rows each drafting k."""
    def rate(k: int) -> float:
        return rows * expected_tokens(acceptance, k) / (cost.step_s(rows, k + 1) + cost.draft_s(rows, k))

    return max(range(max_k + 1), key=lambda k: (rate(k), -k))  # ties: fewer drafts


def draft_len_schedule(cost: CostModel, max_draft_len: int, ceiling: int,
                       acceptance: float = PRIOR_ACCEPTANCE) -> Schedule:
    lengths: dict[int, int] = {}
    k_prev = max_draft_len
    for b in range(1, ceiling + 1):
        # Batch 1 is always bandwidth-bound, and upstream wants max_draft_len at the smallest bound.
        k = max_draft_len if b == 1 else min(k_prev, best_draft_len(cost, b, acceptance, max_draft_len))
        if k == 0:
            break
        if k != k_prev:
            lengths[b - 1] = k_prev
        k_prev = k
        last = b
    lengths[last] = k_prev
    return Schedule(dict(sorted(lengths.items())), last, cost.source)


def roofline(weight_bytes_per_gpu: float, params: float, tp: int, bandwidth_tb_s: float, tflops: float,
             max_draft_len: int) -> CostModel:
    from pipeline.policy.cost_model import gpu_profile

    return gpu_profile(weight_bytes_per_gpu, params, tp, bandwidth_tb_s, tflops, max_drafts=max_draft_len,
                       compute_efficiency=COMPUTE_EFFICIENCY)
