"""Benchmark serving: the same engine folder through Triton gRPC and in process, at several concurrencies.

Each concurrency level C runs N requests (default max(8, 2C)) in a closed loop: C requests in flight,
a new one sent as soon as one ends. Two paths, on one engine folder with the same draft and gate:

- triton: `pipeline serve` of `pipeline assemble` (preprocessing -> speculation gate -> torch_engine ->
  postprocessing), called over gRPC streaming by C client connections (pipeline/client/ensemble.py);
- in process: one LLMEngine from the same folder, stepped by this script, the same prompts (chat
  template applied, as preprocessing does), stops and max tokens, speculation "auto" (the engine's gate).

Reported per path and level: tokens/s (all new tokens / wall time), time to first token (per request)
and inter-token latency (per token: each response's, or engine step's, gap spread over the tokens it
brought) at p50 and p99, and the triton / in-process tokens/s ratio (target: >= 0.90 at C = 1 and 16).
Greedy; timings follow one warm-up request per path and include prefill and (triton) detokenization.

    python scripts/bench_serving.py                                  # smollm2-135m, C = 1 4 16 64, 128 tokens
    python scripts/bench_serving.py --concurrency 1,16 --max-tokens 64 --json
    python scripts/bench_serving.py --engine engines/smol            # an existing `pipeline compile -b torch` folder
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench_engine import CODE  # noqa: E402  (scripts/ is on sys.path when this runs as a script)
from bench_engine import PROMPTS as ENGINE_PROMPTS  # noqa: E402
from bench_engine import print_markdown  # noqa: E402
from pipeline.models.tokenizer import answer_text
from pipeline.triton.ports import free_ports

# bench_engine's prompts (answers that copy from the prompt, where n-gram lookup pays, and free-form ones)
# and four more, cycled over the requests.
PROMPTS = ENGINE_PROMPTS + (
    "Write a Python class for a stack with push, pop and peek, and a short usage example.",
    f"Rename the variables in this function to longer, clearer names:\n\n{CODE}",
    "Describe how a hash map handles collisions, in a few paragraphs.",
    "Write a bash script that counts the lines of every .py file in a folder.",
)


@dataclass
class Trace:
    """One request: when its responses (or engine steps) arrived and how many tokens each brought."""

    prompt: int
    times: list[float] = field(default_factory=list)  # seconds since the request was sent
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    accepted: int = 0
    drafted: int = 0

    @property
    def ttft(self) -> float | None:
        return self.times[0] if self.times else None

    def itl_samples(self) -> list[float]:
        """Per token after the first response: the gap to the previous response divided by its tokens."""
        out = []
        for i in range(1, len(self.times)):
            gap, n = self.times[i] - self.times[i - 1], max(self.tokens[i], 1)
            out += [gap / n] * n
        return out


@dataclass
class Row:
    concurrency: int
    path: str  # triton | in-process
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    acceptance_rate: float | None
    ratio: float | None = None  # triton tok/s over in-process tok/s at this concurrency
    same_text: str = ""  # triton answers equal to the in-process ones


def pct_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def summarize(concurrency: int, path: str, traces: list[Trace], wall: float) -> Row:
    tokens = sum(sum(t.tokens) for t in traces)
    ttfts = [t.ttft for t in traces if t.ttft is not None]
    itls = [x for t in traces for x in t.itl_samples()]
    drafted = sum(t.drafted for t in traces)
    return Row(concurrency, path, len(traces), tokens, round(wall, 3), round(tokens / wall, 1),
               pct_ms(ttfts, 50), pct_ms(ttfts, 99), pct_ms(itls, 50), pct_ms(itls, 99),
               round(sum(t.accepted for t in traces) / drafted, 3) if drafted else None)


# ---- the two paths ------------------------------------------------------------------------------


def run_triton(url: str, concurrency: int, n: int, max_tokens: int) -> tuple[list[Trace], float]:
    """n requests, `concurrency` connections, each sending its next request when the last one ends."""
    from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions

    client, options = ClientOptions(url), RequestOptions(max_tokens=max_tokens)
    traces: list[Trace | None] = [None] * n
    next_i = iter(range(n))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker():
        try:
            with Connection(client) as conn:
                while True:
                    with lock:
                        i = next(next_i, None)
                    if i is None:
                        return
                    result = conn.generate(PROMPTS[i % len(PROMPTS)], options)
                    # Responses that carry tokens: a stream's final one may resend only its prefix.
                    chunks = [c for c in result.chunks if c.tokens]
                    traces[i] = Trace(i, [c.t_s for c in chunks], [c.tokens for c in chunks], result.text,
                                      result.accepted, result.drafted)
        except BaseException as err:  # noqa: BLE001  reported by the main thread
            errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return traces, wall


class InProcess:
    """The same engine folder in this process; prompts tokenized as the server's preprocessing does."""

    def __init__(self, engine_dir: Path):
        from pipeline.engine.config import ModelConfig
        from pipeline.engine.folder import load_engine, read_engine_manifest
        from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

        manifest = read_engine_manifest(engine_dir)
        self.tokenizer = load_tokenizer(engine_dir / manifest["tokenizer"])
        self.stops = stop_token_ids(self.tokenizer, ModelConfig.from_folder(engine_dir / manifest["target"]["path"])
                                    .eos_token_ids, chat=True)
        self.prompt_ids = [encode_prompt(self.tokenizer, p, raw=False) for p in PROMPTS]
        self.engine = load_engine(engine_dir)

    def run(self, concurrency: int, n: int, max_tokens: int) -> tuple[list[Trace], float]:
        from pipeline.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=self.stops)
        engine = self.engine
        traces = [Trace(i) for i in range(n)]
        sent: dict = {}  # Request -> (trace, send time)
        fresh: dict = {}  # Request -> tokens since the last step

        def on_tokens(req, tokens):
            fresh[req] = fresh.get(req, 0) + len(tokens)

        def send(i):
            req = engine.add_request(self.prompt_ids[i % len(PROMPTS)], params, on_tokens=on_tokens)
            sent[req] = (traces[i], time.perf_counter())

        t0 = time.perf_counter()
        queued = iter(range(n))
        for i in range(min(concurrency, n)):
            send(next(queued))
        while sent:
            engine.step()
            now = time.perf_counter()
            for req, count in fresh.items():
                trace, t_sent = sent[req]
                if count:
                    trace.times.append(now - t_sent)
                    trace.tokens.append(count)
            fresh.clear()
            for req in [r for r in sent if r.finished]:
                trace, _ = sent.pop(req)
                trace.text = answer_text(self.tokenizer, req.output_ids)  # as the served answer is written
                trace.accepted, trace.drafted = req.num_accepted, req.num_drafted
                if (i := next(queued, None)) is not None:
                    send(i)
        return traces, time.perf_counter() - t0


# ---- setup ----------------------------------------------------------------------------------------


def build_engine(args, work: Path) -> Path:
    from pipeline.compiler import CompileOptions, compile_model
    from pipeline.models.resolve import resolve_model

    out = work / "engine"
    print(f"compiling {args.model} -> {out} (draft {args.draft}, k={args.num_draft_tokens})", file=sys.stderr)
    compile_model(CompileOptions("torch", resolve_model(args.model).path, out, draft=args.draft,
                                 num_draft_tokens=args.num_draft_tokens, max_batch_size=max(args.concurrency),
                                 max_seq_len=args.max_seq_len, gate_batch_size=args.gate_batch_size,
                                 dtype=args.dtype))
    return out


def fmt(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(rows: list[Row], meta: dict) -> None:
    head = ("concurrency", "path", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "accept", "triton/in-process", "same text")
    lines = [(str(r.concurrency), r.path, str(r.requests), fmt(r.tokens_per_s), fmt(r.ttft_p50_ms),
              fmt(r.ttft_p99_ms), fmt(r.itl_p50_ms), fmt(r.itl_p99_ms), fmt(r.acceptance_rate, ".2f"),
              "" if r.ratio is None else f"{r.ratio:.2f}x", r.same_text) for r in rows]
    print_markdown(head, lines)
    print(f"\n{meta['engine']} ({meta['model']}, draft {meta['draft']}, k={meta['num_draft_tokens']}, "
          f"{meta['dtype']}, gate {meta['gate_batch_size']}), {meta['max_tokens']} max new tokens, greedy, "
          f"best of {meta['repeats']}, {meta['threads']} threads, load average {meta['load_avg'][0]} before, "
          f"{meta['load_avg'][1]} after.\n"
          "TTFT per request; ITL per token (a response's or engine step's gap over the tokens it brought). "
          "Same text: triton answers equal to the in-process ones.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=None, help="a `pipeline compile --backend torch` folder; "
                    "default: compile --model into a temp folder")
    ap.add_argument("--model", default="smollm2-135m", help="target to compile when no --engine is given")
    ap.add_argument("--draft", default="ngram", help="draft to compile with (none, ngram, a model)")
    ap.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--max-seq-len", type=int, default=512, help="KV cache per slot (keep small: slots = max C)")
    ap.add_argument("--gate-batch-size", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(8, 2C))")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--paths", default="triton,in-process", help="which paths to run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per path and level, order alternating; the best "
                    "tokens/s run is reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads on both paths (1 on a box shared with other load: see below)")
    ap.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = ap.parse_args()
    # Both paths get the same thread count: tritonserver's python stubs inherit OMP_NUM_THREADS, which torch
    # reads at start. On an oversubscribed CPU, 2 OpenMP threads spinning at each op's barrier while one of
    # them is descheduled made a bf16 SmolLM2 step 10-60x slower than 1 thread (measured on a 2-core box at
    # load average 8), so use --threads 1 when other work shares the cores.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    paths = args.paths.split(",")

    import torch

    torch.set_num_threads(args.threads)
    from pipeline.engine.folder import read_engine_manifest
    from pipeline.triton.assemble import AssembleOptions, assemble
    from pipeline.triton.server import ServeOptions, TritonServer

    load_before = round(os.getloadavg()[0], 2)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        work = Path(tmp)
        engine_dir = args.engine.absolute() if args.engine else build_engine(args, work)
        manifest = read_engine_manifest(engine_dir)
        # The server's gate gets the engine's own threshold, so both paths speculate under the same rule.
        gate = manifest.get("gate_batch_size") or args.gate_batch_size
        repo = Path(assemble(AssembleOptions(engine=engine_dir, repo=work / "repo", gate_batch_size=gate)).repo)
        grpc, http, metrics = free_ports()
        print(f"starting tritonserver on {repo}", file=sys.stderr)
        with TritonServer(ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics)) as server:
            url = server.endpoints.grpc
            local = InProcess(engine_dir) if "in-process" in paths else None
            # Warm-up: one short request per path (first-call allocations, oneDNN packing).
            if "triton" in paths:
                run_triton(url, 1, 1, 8)
            if local is not None:
                local.run(1, 1, 8)
            for c in args.concurrency:
                n = args.requests or max(8, 2 * c)
                got: dict[str, tuple[list[Trace], float]] = {}
                level: dict[str, Row] = {}
                for r in range(args.repeats):
                    # Alternate the order, and keep each path's best run: load from other work drifts over time.
                    for path in (paths if r % 2 == 0 else paths[::-1]):
                        print(f"C={c}: {n} requests via {path} (run {r + 1}/{args.repeats})", file=sys.stderr)
                        traces, wall = run_triton(url, c, n, args.max_tokens) if path == "triton" else \
                            local.run(c, n, args.max_tokens)
                        row = summarize(c, path, traces, wall)
                        if path not in level or row.tokens_per_s > level[path].tokens_per_s:
                            got[path], level[path] = (traces, wall), row
                level = {path: level[path] for path in paths}
                if len(level) == 2:
                    tri, loc = level["triton"], level["in-process"]
                    tri.ratio = round(tri.tokens_per_s / loc.tokens_per_s, 3)
                    same = sum(a.text == b.text for a, b in zip(got["triton"][0], got["in-process"][0]))
                    tri.same_text = f"{same}/{n}"
                rows += level.values()
    meta = {"engine": str(args.engine or "temp engine"), "model": Path(manifest["target"]["source"]).name,
            "draft": manifest["draft"]["kind"], "num_draft_tokens": manifest["num_draft_tokens"],
            "dtype": manifest["dtype"], "gate_batch_size": gate,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "load_avg": [load_before, round(os.getloadavg()[0], 2)]}
    print_table(rows, meta)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "meta": meta}, indent=2))


if __name__ == "__main__":
    main()
