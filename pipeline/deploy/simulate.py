"""A day of bursty traffic against autoscaled replicas: what each autoscaling policy delivers and costs.

A fluid model in one-second ticks, pure and seeded:
- traffic: a diurnal curve (quietest at 03:00, busiest at 15:00) times bursts (2-4x for 1-10 minutes,
  a dozen a day), Poisson arrivals; every request asks for `output_tokens` tokens;
- a replica decodes min(n, max_batch) of its n requests (the Service spreads them evenly); the rest wait.
  A step costs cost.step_s(b, W); with speculation on (the engine's own gate: b <= gate) a step is K+1 wide
  and gives each request expected_tokens(acceptance, K) tokens, else one;
- the HorizontalPodAutoscaler every 15 s: desired = ceil(ready x metric / target), a 10% tolerance, scale up
  at once but by at most max(100%, 4 pods) a period (its default policy; a pod serves after `startup_s`),
  scale down to the highest desired count of the last 5 minutes, one pod a minute at most (the manifests'
  behavior: in-flight counts fall faster than the load when speculation turns back on, so an unhurried
  scale-down keeps the HPA from dropping to a pod count that can't carry the load with speculation off).
  Policy "gate": metric = requests in flight per pod, target = the gate's ceiling. Policy "queue": Triton's
  queue time over compute time, target 1 (NVIDIA's tutorial).
GPU-hours count every pod from the moment it is scheduled (a loading pod is paid for too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.policy.cost_model import CostModel, gpu_profile  # noqa: F401  (the replica a GPU profile gives)
from pipeline.policy.draft_plan import expected_tokens

DAY_S = 86_400
HPA_PERIOD_S = 15
HPA_TOLERANCE = 0.1
SCALE_DOWN_WINDOW_S = 300
SCALE_DOWN_PODS, SCALE_DOWN_PERIOD_S = 1, 60  # the manifests' scaleDown policy (pipeline/deploy/kubernetes.py)
POLICIES = ("gate", "queue")


@dataclass(frozen=True)
class Replica:
    cost: CostModel  # one replica's decode step: measured (`pipeline bench`) or a GPU profile
    acceptance: float  # the draft's per-token acceptance (0: no speculation)
    num_draft_tokens: int  # K
    gate: int  # the engine speculates while at most this many requests decode
    max_batch: int  # requests one replica decodes at once
    gpus: int
    startup_s: float  # scheduled to serving

    def speculates(self, b: float) -> bool:
        """Whether the engine's own gate lets b decoding requests draft."""
        return self.acceptance > 0 and self.num_draft_tokens > 0 and b <= self.gate

    def per_request_tokens_per_s(self, b: float) -> float:
        """Tokens per second each of b decoding requests gets."""
        if b <= 0:
            return 0.0
        rows = max(1, round(b))
        if self.speculates(b):
            k = self.num_draft_tokens
            return expected_tokens(self.acceptance, k) / self.cost.step_s(rows, k + 1)
        return 1.0 / self.cost.step_s(rows, 1)


def crossover(cost: CostModel, acceptance: float, num_draft_tokens: int, max_batch: int) -> int:
    """The largest batch at which speculating gives a replica more tokens per second than plain decoding: the
    gate ceiling `pipeline bench --apply` would fit on that machine (1 when it never pays)."""
    best = 1
    k = num_draft_tokens
    for b in range(1, max_batch + 1):
        if expected_tokens(acceptance, k) / cost.step_s(b, k + 1) > 1.0 / cost.step_s(b, 1):
            best = b
    return best


@dataclass(frozen=True)
class Traffic:
    arrivals: np.ndarray  # requests arriving in each second
    output_tokens: int


def day_of_traffic(peak_rps: float, output_tokens: int = 400, seed: int = 0, bursts: int = 12,
                   seconds: int = DAY_S) -> Traffic:
    rng = np.random.default_rng(seed)
    t = np.arange(seconds)
    diurnal = 0.1 + 0.9 * 0.5 * (1 - np.cos(2 * np.pi * (t - 3 * 3600) / DAY_S))  # min 03:00, max 15:00
    factor = np.ones(seconds)
    for _ in range(bursts):
        start, length = int(rng.integers(0, seconds)), int(rng.integers(60, 600))
        factor[start:start + length] *= rng.uniform(2.0, 4.0)
    return Traffic(rng.poisson(peak_rps * diurnal * factor).astype(float), output_tokens)


@dataclass(frozen=True)
class Result:
    policy: str
    tokens: float
    tokens_per_s: float
    itl_p50_ms: float  # token-weighted: what a typical token waited
    itl_p99_ms: float
    mean_replicas: float
    gpu_hours: float
    cost_per_m_tokens: float
    speculated_share: float  # of the tokens, those decoded with speculation on
    queue_p99_s: float  # wait before a slot, p99 over the day's requests
    replicas: np.ndarray  # per second, scheduled pods


def simulate(replica: Replica, traffic: Traffic, policy: str, *, min_replicas: int = 1, max_replicas: int = 16,
             gpu_hour_usd: float = 2.5) -> Result:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    L = traffic.output_tokens
    ready_at: list[float] = [0.0] * min_replicas  # when each scheduled pod serves
    history: list[tuple[int, int]] = []  # (second, desired) for the scale-down window
    last_down = -SCALE_DOWN_PERIOD_S
    in_system = 0.0  # requests decoding or waiting, all replicas
    tokens = spec_tokens = 0.0
    itl, itl_w, queue_wait, queue_w = [], [], [], []
    seconds = len(traffic.arrivals)
    scheduled = np.zeros(seconds)
    for s in range(seconds):
        ready = sum(1 for r in ready_at if r <= s)
        in_system += traffic.arrivals[s]
        n = in_system / ready if ready else in_system
        b = min(n, replica.max_batch) if ready else 0.0
        rate = replica.per_request_tokens_per_s(b)
        produced = min(ready * b * rate, in_system * L)
        tokens += produced
        if replica.speculates(b):
            spec_tokens += produced
        in_system -= produced / L
        if produced > 0:
            itl.append(1.0 / rate)
            itl_w.append(produced)
            completions = produced / L / max(ready, 1)
            queue_wait.append(max(0.0, n - b) / completions)
            queue_w.append(traffic.arrivals[s])
        scheduled[s] = len(ready_at)
        if s % HPA_PERIOD_S == 0 and ready:
            if policy == "gate":
                metric, target = n, float(replica.gate)
            else:
                # Queue time over compute time: waiting n - b requests drain at b * rate / L a second, and one
                # takes L / rate to compute, so the ratio is (n - b) / b.
                metric, target = max(0.0, n - b) / max(b, 1e-9), 1.0
            ratio = metric / target
            desired = ready if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(ready * ratio)
            desired = min(max(desired, min_replicas), max_replicas)
            history = [(t, d) for t, d in history if s - t < SCALE_DOWN_WINDOW_S] + [(s, desired)]
            current = len(ready_at)
            if desired > current:
                desired = min(desired, max(2 * current, current + 4))
                ready_at += [s + replica.startup_s] * (desired - current)
            elif s - last_down >= SCALE_DOWN_PERIOD_S:
                keep = max(max(d for _, d in history), current - SCALE_DOWN_PODS, min_replicas)
                if keep < current:  # the newest pods go first
                    ready_at = sorted(ready_at)[:keep]
                    last_down = s
    gpu_hours = float(scheduled.sum()) * replica.gpus / 3600
    return Result(policy, tokens, tokens / seconds, 1000 * _weighted_quantile(itl, itl_w, 0.5),
                  1000 * _weighted_quantile(itl, itl_w, 0.99),
                  float(scheduled.mean()), gpu_hours, gpu_hours * gpu_hour_usd / (tokens / 1e6),
                  spec_tokens / tokens if tokens else 0.0, _weighted_quantile(queue_wait, queue_w, 0.99), scheduled)


def _weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    if not values:
        return 0.0
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights, dtype=float)[order]
    cum = np.cumsum(w)
    return float(v[np.searchsorted(cum, q * cum[-1])]) if cum[-1] > 0 else float(v[-1])
