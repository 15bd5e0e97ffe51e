"""Run the sweep: for each prompt set, each concurrency and each mode, keep that many greedy requests in flight
until `requests` have finished, and measure tokens/s, TTFT, ITL and acceptance.

Modes: off (speculation "off" on every request), on (always "on": every request drafts its full length,
whatever the load) and gated (the default "auto": the gate's ceiling and the per-request planner decide).
Greedy output is the same in all three, so each mode does the same work and tokens/s compare like for like.

Two targets: the portable engine in this process (an engine folder), or a served repository over gRPC
(`--url`), through pipeline.client.ensemble. The engine is loaded with as many slots as the largest
concurrency, so requests queue only where they would on a server sized for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.bench.prompts import PromptSet
from pipeline.errors import ConfigError
from pipeline.policy.draft_plan import add_counts

MODES = ("off", "on", "gated")
SPECULATION = {"off": "off", "on": "on", "gated": "auto"}
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class BenchOptions:
    engine: Path | None = None  # a portable engine folder (in-process)
    url: str | None = None  # or a served repository's gRPC endpoint
    sets: tuple[str, ...] = ("code", "chat")
    concurrency: tuple[int, ...] = DEFAULT_LEVELS
    modes: tuple[str, ...] = MODES
    requests: int | None = None  # per point; None: 2 x concurrency, at least 8
    repeats: int = 1  # rounds per concurrency, the modes interleaved in each; each point keeps its fastest round
    max_tokens: int | None = None  # None: the set's own
    calibrate: bool = True  # in-process: measure the cost model for this many slots when the engine's doesn't cover it

    def validate(self) -> BenchOptions:
        if (self.engine is None) == (self.url is None):
            raise ConfigError("give an engine folder (--engine) or a server (--url), one of the two")
        levels = list(self.concurrency)
        if not levels or any(c < 1 for c in levels) or levels != sorted(set(levels)):
            raise ConfigError(f"--concurrency must be distinct whole numbers >= 1, ascending (got {levels})")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"unknown mode {bad[0] if bad else '(none)'}; use off, on and gated")
        if self.requests is not None and self.requests < 1:
            raise ConfigError("--requests must be >= 1")
        if self.repeats < 1:
            raise ConfigError("--repeats must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("--max-tokens must be >= 1")
        return self

    def requests_at(self, concurrency: int) -> int:
        return self.requests or max(2 * concurrency, 8)


@dataclass
class Trace:
    """One request: seconds from sending to each response (or engine step) with tokens, and its counters."""

    sent: float = 0.0
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)
    accepted: int = 0
    drafted: int = 0
    draft_steps: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Point:
    set: str
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None  # per token: a response's gap over the tokens it brought
    itl_p99_s: float | None
    acceptance: float | None
    draft_steps: int
    skipped_steps: dict[str, int]
    busy_retries: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(set_name: str, mode: str, concurrency: int, traces: list[Trace], wall_s: float,
              busy_retries: int = 0) -> Point:
    tokens = sum(n for t in traces for _, n in t.events)
    ttfts = [t.events[0][0] - t.sent for t in traces if t.events]
    itls = [(b[0] - a[0]) / b[1] for t in traces for a, b in zip(t.events, t.events[1:]) if b[1] > 0]
    drafted, accepted = sum(t.drafted for t in traces), sum(t.accepted for t in traces)
    return Point(set_name, mode, concurrency, len(traces), tokens, round(wall_s, 4),
                 round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
                 _r(percentile(ttfts, 0.5)), _r(percentile(ttfts, 0.99)), _r(percentile(itls, 0.5)),
                 _r(percentile(itls, 0.99)), round(accepted / drafted, 4) if drafted else None,
                 sum(t.draft_steps for t in traces), add_counts(t.skipped for t in traces), busy_retries)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


# ---- in process -----------------------------------------------------------------------------------

class EngineTarget:
    """The portable engine folder, loaded here with `slots` KV-cache slots."""

    def __init__(self, engine_dir: Path, slots: int, calibrate: bool, say: Callable[[str], None]):
        from pipeline.engine.calibrate import calibrate as measure
        from pipeline.engine.folder import load_engine, read_engine_manifest
        from pipeline.models.tokenizer import load_tokenizer

        manifest = read_engine_manifest(engine_dir)
        if manifest["draft"]["kind"] == "none":
            raise ConfigError(f"{engine_dir} has no draft (built with --draft none): there is no speculation to "
                              "bench; build one with --draft ngram, eagle3 or a draft model")
        self.engine = load_engine(engine_dir, max_batch_size=max(slots, 1))
        cost = self.engine.cost_model if self.engine.cost_model.measured else None
        self.tokenizer = load_tokenizer(engine_dir / manifest["tokenizer"])
        self.calibration = None
        if calibrate and (cost is None or cost.rows[-1] < slots):
            say(f"measuring the cost model for {slots} slots (the engine's covers "
                f"{'none' if cost is None else f'up to {cost.rows[-1]}'})")
            self.calibration = measure(self.engine)
            self.engine.cost_model = self.calibration.cost
            say(f"measured in {self.calibration.seconds:.0f} s" + (f"; {self.calibration.note}"
                                                                     if self.calibration.note else ""))
        self.name = str(engine_dir)
        self._ids: dict[tuple[str, ...], list[list[int]]] = {}  # a set's prompts -> their token ids

    def run(self, prompts: PromptSet, mode: str, concurrency: int, n: int) -> Point:
        from pipeline.engine.sampling import SamplingParams
        from pipeline.models.tokenizer import encode_prompt

        engine = self.engine
        if prompts.prompts not in self._ids:
            self._ids[prompts.prompts] = [encode_prompt(self.tokenizer, p, raw=False) for p in prompts.prompts]
        ids = self._ids[prompts.prompts]
        params = SamplingParams(max_tokens=prompts.max_tokens)
        traces = [Trace() for _ in range(n)]
        index: dict[int, int] = {}  # request id -> its trace
        last_step: dict[int, int] = {}  # request id -> the step of its last callback
        step_no = [0]

        def on_tokens(req, tokens):
            trace = traces[index[req.id]]
            # One callback per token; the tokens of one step are one response.
            if trace.events and last_step.get(req.id) == step_no[0]:
                trace.events[-1] = (trace.events[-1][0], trace.events[-1][1] + len(tokens))
            elif tokens:
                trace.events.append((time.perf_counter(), len(tokens)))
            last_step[req.id] = step_no[0]

        pending, running = deque(range(n)), []
        t0 = time.perf_counter()
        while pending or running:
            while pending and len(running) < concurrency:
                i = pending.popleft()
                traces[i].sent = time.perf_counter()
                req = engine.add_request(ids[i % len(ids)], params, speculation=SPECULATION[mode],
                                         on_tokens=on_tokens)
                index[req.id] = i
                running.append(req)
            engine.step()
            step_no[0] += 1
            for req in [r for r in running if r.finished]:
                running.remove(req)
                trace = traces[index[req.id]]
                trace.accepted, trace.drafted = req.num_accepted, req.num_drafted
                trace.draft_steps, trace.skipped = req.num_verify_steps, dict(req.skip_reasons)
        return summarize(prompts.name, mode, concurrency, traces, time.perf_counter() - t0)


# ---- served ---------------------------------------------------------------------------------------

class ServedTarget:
    """A served repository over gRPC: one connection per concurrent client. A "server busy" refusal (the
    engine's queue is full) is retried after a short wait and counted."""

    BUSY_WAIT_S = 0.5

    def __init__(self, url: str):
        from pipeline.client.ensemble import ClientOptions, Connection

        # A lost server fails the point: a resumed request's time would measure the restart, not the serving.
        self.options = ClientOptions(url, response_timeout_s=600.0, wait_s=30.0, resume_s=0.0)
        with Connection(self.options) as conn:
            conn.check_ready()
        self.name = url

    def run(self, prompts: PromptSet, mode: str, concurrency: int, n: int) -> Point:
        from pipeline.client.ensemble import Connection, RequestOptions
        from pipeline.errors import PipelineError

        options = RequestOptions(max_tokens=prompts.max_tokens, speculation=SPECULATION[mode], stream=True)
        traces = [Trace() for _ in range(n)]
        todo = deque(range(n))
        lock = threading.Lock()
        busy = [0]
        errors: list[Exception] = []

        def worker():
            with Connection(self.options) as conn:
                while True:
                    with lock:
                        if not todo or errors:
                            return
                        i = todo.popleft()
                    while True:
                        trace = traces[i] = Trace(sent=time.perf_counter())
                        try:
                            result = conn.generate(prompts.prompts[i % len(prompts.prompts)], options)
                            break
                        except PipelineError as err:
                            if "server busy" not in str(err):
                                with lock:
                                    errors.append(err)
                                return
                            with lock:
                                busy[0] += 1
                            time.sleep(self.BUSY_WAIT_S)
                    trace.events = [(trace.sent + c.t_s, c.tokens) for c in result.chunks if c.tokens]
                    trace.accepted, trace.drafted = result.accepted, result.drafted
                    trace.draft_steps, trace.skipped = result.draft_steps, result.skipped_steps

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return summarize(prompts.name, mode, concurrency, traces, time.perf_counter() - t0, busy[0])


# ---- the sweep ------------------------------------------------------------------------------------

def sweep(target, sets: list[PromptSet], options: BenchOptions,
          progress: Callable[[Point], None] = lambda p: None) -> list[Point]:
    """Every set x concurrency x mode on `target` (EngineTarget or ServedTarget). Before each concurrency's
    rounds, every mode runs that many short requests untimed: the first batch of a new size builds its kernels
    and buffers, and that cost went to whichever mode ran first (identical work measured 236 tok/s in the
    first round and 287 in the second)."""
    points = []
    for prompts in sets:
        for c in options.concurrency:
            for mode in options.modes:
                target.run(warmup_set(prompts), mode, c, c)
            # Modes interleaved round by round, and each round starting with the next mode, so a slow spell
            # of a noisy machine, or a round's own start, hits every mode alike.
            rounds: dict[str, list[Point]] = {m: [] for m in options.modes}
            for r in range(options.repeats):
                for mode in round_order(options.modes, r):
                    rounds[mode].append(target.run(prompts, mode, c, options.requests_at(c)))
            for mode in options.modes:
                point = fastest_round(rounds[mode])
                points.append(point)
                progress(point)
    return points


def round_order(modes: tuple[str, ...], r: int) -> tuple[str, ...]:
    """Round r's order: the modes rotated by r (off, on, gated; then on, gated, off; ...)."""
    k = r % len(modes)
    return tuple(modes[k:]) + tuple(modes[:k])


def fastest_round(rounds: list[Point]) -> Point:
    """The round with the most tokens/s (a whole round, so its latencies and counts stay consistent). On a
    shared machine interference only ever slows a round down, so the fastest is the nearest to what the
    mode costs; a median kept one slow spell in whichever mode it hit."""
    return max(rounds, key=lambda p: p.tokens_per_s)


def warmup_set(prompts: PromptSet) -> PromptSet:
    """A set's first prompt, 16 tokens: enough to warm kernels and connections up."""
    return PromptSet(prompts.name, prompts.prompts[:1], min(prompts.max_tokens, 16))
