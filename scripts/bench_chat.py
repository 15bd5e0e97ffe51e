"""Benchmark the portable engine on chat traffic: prefix caching and chunked prefill, each on and off in one run.

1. Multi-turn chat. C conversations run at once, each `--turns` turns long, every turn resending the whole
   history (a shared system prompt, the earlier questions and answers) plus a new question, as a chat client
   does. For C = 1, 8 and 32, with the prefix cache on and off: time to first token (TTFT) p50 and p99 of turn 1
   and of turns >= 2, output tokens/s, and the share of prompt tokens found cached. The target: TTFT p50 on
   turns >= 2 at least 3x lower with the cache on.
2. A long prompt beside streams. 8 requests are decoding when a --long-prompt-token prompt arrives. The
   inter-token latency (ITL) of the 8 streams until the long prompt's first token, with chunked prefill
   (each of --prefill-chunks tokens a step) and with the whole prompt prefilled in one step.

Everything runs in this process on the engine itself (no server), greedy, timed with the engine's token
callbacks; the clock starts when a request is queued. Loading is excluded; each engine runs one warm-up.

    python scripts/bench_chat.py                  # SmolLM2-135M bf16, C = 1 8 32, 3 turns
    python scripts/bench_chat.py --concurrency 1 8 --turns 4 --json
    python scripts/bench_chat.py --concurrency --prefill-chunks 128 256 512   # part 2 only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.weights import load_transformer
from pipeline.models.resolve import resolve_model
from pipeline.models.tokenizer import load_tokenizer

SYSTEM = (
    "You are a careful senior software engineer who answers questions about Python, databases, networking and "
    "distributed systems. Answer in plain English, briefly, and give a short code example when one helps. When a "
    "question is ambiguous, say which reading you answer. Prefer the standard library. Mention the complexity of "
    "any algorithm you show, and the failure modes of any system you describe: timeouts, retries, partial "
    "failures, and what the caller sees. Never invent an API; if you are unsure a function exists, say so. Keep "
    "answers under two hundred words unless asked for more. Use code blocks for code, and name the Python "
    "version when a feature is recent. If the user pastes an error, explain its cause before the fix. "
)
QUESTIONS = (
    "How do I read a large CSV file without loading it all into memory?",
    "What is the difference between a process and a thread in Python?",
    "How should a client retry a request to a flaky HTTP service?",
    "When is an index on a database column a bad idea?",
    "Explain what a context manager is and write a small one.",
    "How do I merge two sorted lists in linear time?",
    "What does the GIL prevent, and what does it not prevent?",
    "How can two services agree on an order of events without a shared clock?",
)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


@dataclass
class Tracked:
    """One request's clock: queued at `t0`, one timestamp per token."""

    t0: float
    times: list[float] = field(default_factory=list)


class Driver:
    """Runs an engine to completion while clients submit requests between steps (single thread)."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.track = engine, {}

    def submit(self, ids: list[int], params: SamplingParams):
        req = self.engine.add_request(ids, params, on_tokens=self._on_tokens)
        self.track[req.id] = Tracked(time.perf_counter())
        return req

    def _on_tokens(self, req, tokens):
        now = time.perf_counter()
        self.track[req.id].times += [now] * len(tokens)


@dataclass
class ChatRow:
    concurrency: int
    prefix_cache: bool
    requests: int
    ttft_turn1_p50_ms: float | None
    ttft_later_p50_ms: float | None
    ttft_later_p99_ms: float | None
    output_tokens_per_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    hit_rate: float
    vs_off_ttft_later_p50: float | None = None  # off / on: how many times faster with the cache


def chat_workload(engine: LLMEngine, tok, conversations: int, turns: int, max_tokens: int, seed: int) -> ChatRow:
    system = tok(SYSTEM, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=max_tokens)
    driver = Driver(engine)
    # Each conversation: its history so far, its turn, and its request in flight (None when done).
    state = [{"history": list(system), "turn": 0, "req": None} for _ in range(conversations)]
    ttft1, ttft_later = [], []
    start = time.perf_counter()
    hit0, queried0, out0 = engine.blocks.hit_tokens, engine.blocks.queried_tokens, engine.stats.generated_tokens

    def ask(i: int):
        c = state[i]
        q = QUESTIONS[(seed + i * turns + c["turn"]) % len(QUESTIONS)]
        c["history"] += tok(f"\nUser {i}: {q}\nAssistant:", add_special_tokens=False).input_ids
        c["req"] = driver.submit(list(c["history"]), params)

    for i in range(conversations):
        ask(i)
    while engine.has_unfinished():
        engine.step()
        for i, c in enumerate(state):
            r = c["req"]
            if r is None or not r.finished:
                continue
            t = driver.track[r.id]
            if t.times:
                (ttft1 if c["turn"] == 0 else ttft_later).append((t.times[0] - t.t0) * 1000)
            c["history"] += r.output_ids
            c["turn"] += 1
            c["req"] = None
            if c["turn"] < turns:
                ask(i)
    wall = time.perf_counter() - start
    hits, queried = engine.blocks.hit_tokens - hit0, engine.blocks.queried_tokens - queried0
    return ChatRow(conversations, engine.config.prefix_caching, conversations * turns, pct(ttft1, 50),
                   pct(ttft_later, 50), pct(ttft_later, 99), (engine.stats.generated_tokens - out0) / wall, queried,
                   hits, hits / queried if queried else 0.0)


@dataclass
class LongPromptRow:
    prefill: str
    long_prompt_tokens: int
    streams: int
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    itl_max_ms: float | None
    long_prompt_ttft_ms: float | None


def long_prompt_workload(engine: LLMEngine, tok, streams: int, long_tokens: int) -> LongPromptRow:
    engine.eos_token_ids = ()  # the streams must outlast the long prefill: no early end-of-sequence
    driver = Driver(engine)
    short = [driver.submit(tok(f"Tell me a long story about the number {i}.", add_special_tokens=False).input_ids,
                           SamplingParams(max_tokens=4096)) for i in range(streams)]
    for _ in range(3):  # the streams are decoding
        engine.step()
    text = (SYSTEM * (long_tokens // 150 + 1))
    long_ids = tok(text, add_special_tokens=False).input_ids[:long_tokens]
    long = driver.submit(long_ids, SamplingParams(max_tokens=1))
    while not long.finished:
        engine.step()
    t_arrive, t_first = driver.track[long.id].t0, driver.track[long.id].times[0]
    gaps = []
    for r in short:
        times = driver.track[r.id].times
        # gaps between consecutive tokens, from the long prompt's arrival to its first token
        last = max((t for t in times if t <= t_arrive), default=t_arrive)
        for t in times:
            if t_arrive < t <= t_first:
                gaps.append((t - last) * 1000)
                last = t
        if last < t_first:  # still waiting for its next token when the long prompt's came
            gaps.append((t_first - last) * 1000)
    for r in short:
        engine.cancel(r)
    chunk = engine.config.prefill_chunk
    return LongPromptRow("whole prompt" if chunk >= long_tokens else f"chunks of {chunk}", len(long_ids), streams,
                         pct(gaps, 50), pct(gaps, 99), max(gaps) if gaps else None, (t_first - t_arrive) * 1000)


def fmt(x, spec=".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_markdown(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for line in lines:
        print("| " + " | ".join(line) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="target: preset, folder, .gguf or hub id")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32], help="part 1's (none: skip it)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length per turn")
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[256],
                    help="chunk sizes for part 2; part 1 runs at the first")
    ap.add_argument("--long-prompt", type=int, default=4000, help="tokens of the long prompt (0: skip part 2)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = resolve_model(args.model)
    tok = load_tokenizer(target.path)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    max_seq_len = max(2048, args.long_prompt + 256)
    model = load_transformer(target.path, max_seq_len, dtype, "cpu", keep_plain=False)
    base = EngineConfig(max_batch_size=max([*args.concurrency, args.streams + 1]), max_seq_len=max_seq_len,
                        dtype=args.dtype, gate=GatePolicy(min_tokens=0), prefill_chunk=args.prefill_chunks[0])
    load_before = os.getloadavg()[0]

    def engine(**kw) -> LLMEngine:
        e = LLMEngine(model, replace(base, **kw), None, model.cfg.eos_token_ids)
        e.generate([tok("Hello", add_special_tokens=False).input_ids], SamplingParams(max_tokens=4))  # warm-up
        return e

    chat: list[ChatRow] = []
    for c in args.concurrency:
        rows = {on: chat_workload(engine(prefix_caching=on), tok, c, args.turns, args.max_tokens, seed=c)
                for on in (False, True)}
        if rows[True].ttft_later_p50_ms and rows[False].ttft_later_p50_ms:
            rows[True].vs_off_ttft_later_p50 = rows[False].ttft_later_p50_ms / rows[True].ttft_later_p50_ms
        chat += [rows[False], rows[True]]
    long_rows: list[LongPromptRow] = []
    if args.long_prompt:
        for chunk in (*args.prefill_chunks, max_seq_len):
            long_rows.append(long_prompt_workload(engine(prefill_chunk=chunk, prefix_caching=False), tok,
                                                  args.streams, args.long_prompt))
    load = (round(load_before, 2), round(os.getloadavg()[0], 2))

    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, greedy, no draft; load avg {load[0]} -> "
          f"{load[1]}")
    if chat:
        print(f"\n{args.turns} turns of {args.max_tokens} tokens, every turn resending the history, prefill chunks of "
              f"{args.prefill_chunks[0]}\n")
        print_markdown(("C", "prefix cache", "requests", "TTFT turn 1 p50 ms", "TTFT turns>=2 p50 ms",
                        "TTFT turns>=2 p99 ms", "out tok/s", "prompt tokens cached", "turns>=2 p50: off/on"),
                       [(str(r.concurrency), "on" if r.prefix_cache else "off", str(r.requests),
                         fmt(r.ttft_turn1_p50_ms), fmt(r.ttft_later_p50_ms), fmt(r.ttft_later_p99_ms),
                         fmt(r.output_tokens_per_s, ".1f"), f"{r.hit_rate:.0%}",
                         fmt(r.vs_off_ttft_later_p50, ".1f") + ("x" if r.vs_off_ttft_later_p50 else ""))
                        for r in chat])
    if long_rows:
        print(f"\nA {long_rows[0].long_prompt_tokens}-token prompt arriving beside {args.streams} decoding streams: "
              f"their inter-token latency until its first token\n")
        print_markdown(("prefill", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long prompt TTFT ms"),
                       [(r.prefill, fmt(r.itl_p50_ms), fmt(r.itl_p99_ms), fmt(r.itl_max_ms),
                         fmt(r.long_prompt_ttft_ms)) for r in long_rows])
    if args.json:
        print(json.dumps({"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "load_avg": load, "turns": args.turns, "max_tokens": args.max_tokens,
                          "chat": [asdict(r) for r in chat], "long_prompt": [asdict(r) for r in long_rows]}, indent=2))


if __name__ == "__main__":
    main()
