"""Measure the cost model (policy/cost_model.py) on this machine, with the engine that will serve.

- The target: one verify forward per (rows B, width W) on the grid, every W from 1 to K + 1, the rows
  attending to CONTEXT tokens each. The widths of one B are timed in turn, round after round (at least
  REPS), and each keeps its fastest run: on a shared machine interference only ever adds time, and a
  slow spell then lands on every width alike instead of on one (medians of runs in a row, made monotone,
  read B=16 as 312 ms at widths 1 to 4 alike during a CI run). Made monotone in B and W (noise must not
  make a wider step look cheaper). It writes into the engine's own cache slots: calibrate a fresh engine,
  before it serves.
- The context term: one-token steps of CONTEXT_ROWS rows at CONTEXT and at LONG_CONTEXT cached tokens;
  what each token past CONTEXT adds to a row is the difference over the tokens and rows (at least 0).
- The proposer: real engine steps over B requests that always draft (speculation "on"), first K tokens a
  step and then one, timing only the proposer's calls (the fastest step of each). Its cost per step is
  then fixed + per_token * k.

Rows past the time budget are left out (the model extrapolates from the last two), so a slow machine
still gets a model, and a note says so.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.policy.cost_model import CostModel

ROW_GRID = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 64  # tokens each row attends to while timed: a short chat turn
LONG_CONTEXT = 1024  # the context term's second point (capped by max_seq_len)
CONTEXT_ROWS = 4  # rows of the context term's steps: enough for both threads to share the attention
REPS = 3  # timed runs per shape at least; more while a shape has run under MIN_SHAPE_S
MAX_REPS = 12
MIN_SHAPE_S = 0.3
PROPOSER_STEPS = 4  # timed steps per draft length, after one untimed (a draft model's catch-up)
BUDGET_S = 60.0


@dataclass(frozen=True)
class Calibration:
    cost: CostModel
    seconds: float
    note: str  # what was left out, or ""


def calibrate(engine: LLMEngine, budget_s: float = BUDGET_S) -> Calibration:
    """Measure on `engine` (which must have nothing running) and return the model with what it took."""
    if engine.has_unfinished():
        raise RuntimeError("calibrate a fresh engine: this one has requests")
    t0 = time.perf_counter()
    cfg = engine.config
    K = cfg.num_draft_tokens
    widths = tuple(range(1, K + 2))
    context = max(1, min(CONTEXT, cfg.max_seq_len - 2 * (K + 2)))
    grid = [r for r in ROW_GRID if r <= cfg.max_batch_size]
    if cfg.max_batch_size not in grid and cfg.max_batch_size < ROW_GRID[-1]:
        grid.append(cfg.max_batch_size)

    # The rows are measured smallest first; past half the budget the rest is left to extrapolation
    # (the proposer's share needs the other half).
    rows: list[int] = []
    target: list[tuple[float, ...]] = []
    for b in grid:
        if len(rows) >= 2 and time.perf_counter() - t0 > budget_s / 2:
            break
        target.append(_time_target(engine, b, widths, context))
        rows.append(b)

    n = min(CONTEXT_ROWS, cfg.max_batch_size)
    cache = engine.cache  # the timed rows are slots 0..n-1: the last one's blocks must lie inside the pool
    in_pool = (cache.num_blocks - (n - 1) * cache.blocks_per_slot) * cache.block_size
    long_context = min(LONG_CONTEXT, cfg.max_seq_len - 8, in_pool - 8)
    context_token_s = 0.0
    if long_context > context:
        (short,), (long,) = (_time_target(engine, n, (1,), c) for c in (context, long_context))
        context_token_s = max(0.0, (long - short) / (n * (long_context - context)))

    fixed, per_token = [0.0] * len(rows), [0.0] * len(rows)
    if engine.proposer is not None:
        measured = []
        for b in rows:
            if len(measured) >= 2 and time.perf_counter() - t0 > budget_s:
                break
            measured.append(_time_proposer(engine, b, K, context))
        for i in range(len(rows)):
            if i < len(measured):
                fixed[i], per_token[i] = measured[i]
            else:  # extrapolate linearly in rows from the last two measured
                (b0, (f0, p0)), (b1, (f1, p1)) = (rows[len(measured) - 2], measured[-2]), (rows[len(measured) - 1], measured[-1])
                scale = (rows[i] - b0) / (b1 - b0)
                fixed[i], per_token[i] = max(0.0, f0 + (f1 - f0) * scale), max(0.0, p0 + (p1 - p0) * scale)
    left = [b for b in grid if b not in rows]
    note = f"rows {left} extrapolated (over the {budget_s:g} s budget)" if left else ""
    source = (f"measured on {platform.machine()} {torch.get_num_threads()} threads, {cfg.device}, {cfg.dtype}, "
              f"context {context}")
    cost = CostModel(tuple(rows), widths, tuple(monotone(target)), tuple(fixed), tuple(per_token),
                     proposer=engine.proposer.name if engine.proposer is not None else "", source=source,
                     context=context, context_token_s=context_token_s)
    return Calibration(cost, time.perf_counter() - t0, note)


def _time_target(engine: LLMEngine, rows: int, widths: tuple[int, ...], context: int) -> tuple[float, ...]:
    """Fastest seconds of one verify forward per width: `rows` rows of `width` tokens, after `context` cached
    ones (stale cache contents: the time doesn't depend on them). The widths take turns, round by round."""
    dev = engine.config.device
    vocab = engine.model.cfg.vocab_size
    shapes = []
    for width in widths:
        ids = torch.randint(vocab, (rows, width), generator=torch.Generator().manual_seed(rows * 100 + width)).to(dev)
        # Rows a few positions apart, as running requests are: the masked attention path, not the uniform one.
        fb = ForwardBatch.build(list(range(rows)), [context + i % 4 for i in range(rows)], [width] * rows,
                                engine.cache, dev)
        engine._target_forward(ids, fb)  # warms up kernels and allocations
        shapes.append((ids, fb))
    times: list[list[float]] = [[] for _ in widths]
    rounds = 0
    while rounds < REPS or (sum(map(sum, times)) < MIN_SHAPE_S * len(widths) and rounds < MAX_REPS):
        for j, (ids, fb) in enumerate(shapes):
            start = time.perf_counter()
            engine._target_forward(ids, fb)
            times[j].append(time.perf_counter() - start)
        rounds += 1
    return tuple(min(t) for t in times)


def monotone(table: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """A wider or larger forward never costs less: running maxima along the widths, then the rows, so
    timing noise can't make the planner prefer a wider step for being cheaper."""
    out: list[tuple[float, ...]] = []
    for row in table:
        widths = [max(row[: j + 1]) for j in range(len(row))]
        out.append(tuple(max(v, above) for v, above in zip(widths, out[-1])) if out else tuple(widths))
    return out


def _time_proposer(engine: LLMEngine, rows: int, K: int, context: int) -> tuple[float, float]:
    """(fixed, per token) seconds of one proposal for `rows` rows, from engine steps drafting K then 1."""
    gen = torch.Generator().manual_seed(rows)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=2 * (PROPOSER_STEPS + 1) * (K + 1) + 2)
    reqs = [engine.add_request(torch.randint(vocab, (context,), generator=gen).tolist(), params,
                               speculation="on", num_draft_tokens=K) for _ in range(rows)]
    # Behind n-gram lookup (NgramFirst) the inner proposer is timed alone: what a step costs where the lookup
    # finds nothing, and random prompts would make that a matter of chance.
    wrapper = engine.proposer
    proposer = engine.proposer = getattr(wrapper, "inner", wrapper)
    timed: list[float] = []
    original = proposer.propose

    def propose(batch, ks):
        start = time.perf_counter()
        out = original(batch, ks)
        timed.append(time.perf_counter() - start)
        return out

    fastest = {}
    proposer.propose = propose
    try:
        engine.step()  # prefill
        for k in (K, 1):
            for r in reqs:
                r.num_draft_tokens = k
            timed.clear()
            for _ in range(PROPOSER_STEPS + 1):
                engine.step()
            fastest[k] = min(timed[1:]) if len(timed) > 1 else (timed[0] if timed else 0.0)
    finally:
        del proposer.propose  # the instance attribute goes; the class's method is back
        for r in reqs:
            engine.cancel(r)
        engine.proposer = wrapper
    per_token = max(0.0, (fastest[K] - fastest[1]) / (K - 1)) if K > 1 else 0.0
    return max(0.0, fastest[1] - per_token), per_token
