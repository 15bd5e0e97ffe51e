"""TensorRT-LLM's draft_len_schedule from a cost model (pipeline.compiler.draft_schedule): upstream's rules hold,
and the schedule follows the cost model rather than a fixed shape."""

import pytest

from pipeline.compiler.draft_schedule import best_draft_len, draft_len_schedule, roofline
from pipeline.policy.cost_model import CostModel


def flat(k: int, rows=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
    """Bandwidth-bound at every batch size: a step costs the same however wide."""
    return CostModel(rows, tuple(range(1, k + 2)), tuple(tuple(1.0 for _ in range(k + 1)) for _ in rows),
                     tuple(0.0 for _ in rows), tuple(0.0 for _ in rows), source="flat")


def compute_bound_from(b0: int, k: int, rows=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
    """Flat until b0 tokens, then time grows with the tokens computed (rows x width)."""
    target = tuple(tuple(max(1.0, r * w / b0) for w in range(1, k + 2)) for r in rows)
    return CostModel(rows, tuple(range(1, k + 2)), target, tuple(0.0 for _ in rows), tuple(0.0 for _ in rows),
                     source="compute-bound")


def check_upstream_rules(lengths: dict[int, int], k: int) -> None:
    bounds = sorted(lengths)
    assert bounds == list(lengths) and bounds[0] >= 1
    assert lengths[bounds[0]] == k  # the smallest bound maps to max_draft_len
    assert all(1 <= v <= k for v in lengths.values())  # 0 is implicit past the largest bound
    assert [lengths[b] for b in bounds] == sorted(lengths.values(), reverse=True)


def test_a_step_that_costs_the_same_at_any_width_drafts_everything_up_to_the_ceiling():
    s = draft_len_schedule(flat(4), 4, 32)
    assert s.lengths == {32: 4} and s.ceiling == 32
    check_upstream_rules(s.lengths, 4)


@pytest.mark.parametrize("b0", [8, 16, 32])
def test_drafts_shorten_then_stop_where_the_step_turns_compute_bound(b0):
    cost = compute_bound_from(b0, 4)
    s = draft_len_schedule(cost, 4, 128)
    check_upstream_rules(s.lengths, 4)
    assert len(s.lengths) > 1  # shorter drafts before none
    assert s.ceiling < 128  # drafting stops paying before the operator's ceiling
    # Past the ceiling no k pays; just inside it the chosen k pays better than none.
    assert best_draft_len(cost, s.ceiling + 1, 0.6, 4) == 0
    assert best_draft_len(cost, s.ceiling, 0.6, 4) >= 1
    # A later turn to compute-bound keeps drafting to a larger batch.
    assert draft_len_schedule(compute_bound_from(2 * b0, 4), 4, 128).ceiling > s.ceiling


def test_the_h100_roofline_for_a_70b_fp8_target_shortens_drafts_with_load():
    cost = roofline(38.8e9, 70.6e9, 2, 3.35, 1979.0, 4)
    s = draft_len_schedule(cost, 4, 32)
    check_upstream_rules(s.lengths, 4)
    assert s.lengths[min(s.lengths)] == 4 and min(s.lengths.values()) < 4
    assert "roofline" in s.note(32) and "speculation off above" in s.note(32)
