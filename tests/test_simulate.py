"""pipeline.deploy.simulate: the autoscaling simulation behind scripts/simulate_scale.py."""

import numpy as np
import pytest

from pipeline.deploy.simulate import Replica, Traffic, crossover, day_of_traffic, gpu_profile, simulate
from pipeline.policy.draft_plan import expected_tokens

# A replica whose step is 10 ms memory-bound until 100 tokens, then 0.1 ms a token (plus 1 ms overhead).
COST = gpu_profile(8e9, 1e9, 1, 1.0, 40.0, bandwidth_efficiency=0.8, compute_efficiency=0.5, overhead_s=0.001)


def test_the_profile_is_the_roofline_it_says():
    assert COST.step_s(1, 1) == pytest.approx(0.011)  # 8 GB at 0.8 TB/s + 1 ms
    assert COST.step_s(64, 5) == pytest.approx(2e9 * 320 / 20e12 + 0.001)  # compute-bound past 100 tokens


def test_crossover_is_where_drafting_stops_paying():
    a, k = 0.75, 4
    b = crossover(COST, a, k, 128)
    gain = expected_tokens(a, k)
    assert gain / COST.step_s(b, k + 1) > 1 / COST.step_s(b, 1)
    assert gain / COST.step_s(b + 1, k + 1) <= 1 / COST.step_s(b + 1, 1)
    # By hand: drafting pays while 3.05 / (b * 5 * 0.1 ms + 1 ms) > 1 / 11 ms, so b <= 65.
    assert b == 65
    assert crossover(COST, 0.0, k, 128) == 1  # a draft that is never accepted never pays


def steady(rps: float, seconds: int = 3600) -> Traffic:
    return Traffic(np.full(seconds, rps), output_tokens=200)


def test_steady_load_is_served_and_the_gate_policy_keeps_speculation_on():
    replica = Replica(COST, 0.75, 4, gate=65, max_batch=128, gpus=2, startup_s=60)
    res = simulate(replica, steady(40.0), "gate", max_replicas=16)
    demand = 40.0 * 3600 * 200
    assert res.tokens == pytest.approx(demand, rel=0.02)  # what came in went out (a little still in flight)
    # The queue policy packs pods until requests wait as long as they compute: past the ceiling, drafts off.
    packed = simulate(replica, steady(40.0), "queue", max_replicas=16)
    assert res.speculated_share > 0.75 and packed.speculated_share < 0.25
    assert res.gpu_hours == pytest.approx(res.mean_replicas * 2, rel=1e-6)  # one hour, two GPUs a pod
    assert res.itl_p50_ms < 1000 * COST.step_s(1, 1)  # speculation beats one token per plain step


def test_without_drafts_nothing_is_speculated_and_latency_is_the_plain_step():
    replica = Replica(COST, 0.0, 4, gate=65, max_batch=128, gpus=1, startup_s=60)
    res = simulate(replica, steady(5.0), "queue")
    assert res.speculated_share == 0.0
    assert res.itl_p50_ms == pytest.approx(1000 * COST.step_s(1, 1), rel=0.2)


@pytest.mark.parametrize("policy", ["gate", "queue"])
def test_pods_leave_one_a_minute_at_most(policy):
    replica = Replica(COST, 0.75, 4, gate=65, max_batch=128, gpus=1, startup_s=120)
    traffic = day_of_traffic(peak_rps=60, output_tokens=200, seed=1, seconds=6 * 3600)
    pods = simulate(replica, traffic, policy, max_replicas=32).replicas
    drops = -np.diff(pods)
    assert drops.max() <= 1
    down = np.flatnonzero(drops > 0)
    assert (np.diff(down) >= 60).all()  # the manifests' scaleDown policy: one pod per 60 s
    assert pods.max() > pods.min()  # it did scale


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(Replica(COST, 0.5, 4, 8, 16, 1, 1), steady(1.0, 10), "cpu")
