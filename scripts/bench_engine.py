"""Benchmark the portable engine against transformers `generate`, in one run, on one model.

Rows: transformers generate (greedy, left-padded batch), this engine without speculation, with
n-gram (prompt lookup) speculation, and with a draft model (--draft; n/a when none is given: the
embedded SmolLM2-135M has no smaller family member). Every row decodes exactly --max-tokens new
tokens per prompt (end-of-sequence is ignored) from the same fixed, chat-templated prompts, so
tokens/s compare like for like. Timings include prefill, exclude loading, and follow one warm-up.

Also prints the memory-bandwidth floor: at batch 1 each new token reads every weight once, so
tokens/s <= copy bandwidth / weight bytes. The bandwidth is measured here with a large tensor copy,
counting read + write bytes.

    python scripts/bench_engine.py                       # smollm2-135m, bf16, batch 1 4 16, 128 tokens
    python scripts/bench_engine.py --dtype both --batch-sizes 1 --json
    python scripts/bench_engine.py --eagle3 DIR          # + an EAGLE-3 head row, and its acceptance
                                                         #   per position at K=1..6 on held-out prompts

With --eagle3, a second table reports the head on the built-in held-out prompts (the ones
`pipeline draft train` never trains on), greedy, one engine run per K: the share of verify steps
whose first j drafts were all accepted, and the mean acceptance length (tokens per target forward).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from pipeline.engine.config import EngineConfig, GatePolicy, ModelConfig
from pipeline.engine.eagle3 import Eagle3Proposer, load_eagle3_head
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.proposers import DraftModelProposer, NgramProposer
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.weights import load_transformer, weight_bytes
from pipeline.models.resolve import resolve_model
from pipeline.bench.prompts import MERGE_INTERVALS
from pipeline.models.tokenizer import check_draft_compatible, encode_prompt, load_tokenizer, stop_token_ids

SEED = 0
CODE = MERGE_INTERVALS  # the code the built-in `pipeline bench` code-edit set edits too
# Two prompts whose answers copy from the prompt (where n-gram lookup pays) and two free-form ones.
PROMPTS = (
    f"Rewrite this code with comments:\n\n{CODE}",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    f"Add type hints to this function and return the full code:\n\n{CODE}",
    "Explain the difference between a list and a tuple in Python, with examples.",
)


@dataclass
class Row:
    dtype: str
    method: str
    batch: int
    tokens_per_s: float | None  # None: not run (n/a)
    vs_transformers: float | None = None
    vs_engine: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    same_as_engine: str | None = None  # rows whose greedy output matches the no-speculation engine's up to EOS


def copy_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` large copies, counting read + write bytes."""
    src = torch.ones(mbytes * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def batch_prompts(prompt_ids: list[list[int]], batch: int) -> list[list[int]]:
    return [prompt_ids[i % len(prompt_ids)] for i in range(batch)]


def bench_transformers(folder, dtype, prompt_ids, batch, max_tokens, pad_id) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = bench_transformers.cache.get((folder, dtype))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        bench_transformers.cache = {(folder, dtype): model}
    rows = batch_prompts(prompt_ids, batch)
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def run(n):
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=pad_id)

    run(4)  # warm-up
    t0 = time.perf_counter()
    out = run(max_tokens)
    elapsed = time.perf_counter() - t0
    return batch * max_tokens / elapsed, out[:, width:].tolist()


bench_transformers.cache = {}


def bench_engine(model, make_proposer, config, prompt_ids, batch, max_tokens):
    """make_proposer: None (no speculation) or a factory, so each engine gets fresh proposer state."""

    def new_engine():
        engine = LLMEngine(model, config, make_proposer() if make_proposer else None)
        engine.eos_token_ids = ()  # decode exactly max_tokens per row, like transformers' min_new_tokens
        return engine

    new_engine().generate([prompt_ids[0]], SamplingParams(max_tokens=4))  # warm-up
    engine = new_engine()
    rows = batch_prompts(prompt_ids, batch)
    t0 = time.perf_counter()
    reqs = engine.generate(rows, SamplingParams(max_tokens=max_tokens, seed=SEED))
    elapsed = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in reqs) / elapsed, engine.stats, [r.output_ids for r in reqs]


def same_until_stop(ids: list[int], base: list[int], stops: tuple[int, ...]) -> bool:
    """Equal up to and including the base row's first stop token. Past it (EOS is ignored here to get
    fixed-length rows) the model decodes noise whose near-tied logits can flip in bf16."""
    end = next((i + 1 for i, t in enumerate(base) if t in stops), len(base))
    return ids[:end] == base[:end]


def eagle3_acceptance(args, target, tokenizer, dtype_name) -> dict:
    """Acceptance per position and mean acceptance length at each K, on the held-out built-in prompts."""
    from pipeline.draft.data import load_prompts, split_prompts
    from pipeline.draft.report import measure_acceptance

    held = split_prompts(load_prompts("builtin"))[1]
    ids = [encode_prompt(tokenizer, p, raw=False) for p in held]
    return measure_acceptance(target.path, args.eagle3, ids, ks=tuple(args.acceptance_ks),
                              max_new_tokens=args.max_tokens, eos_token_ids=args.stop_ids, dtype=dtype_name,
                              batch_size=len(ids))


def run_dtype(dtype_name, args, target, draft_path, tokenizer, prompt_ids, pad_id) -> tuple[list[Row], dict]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    max_seq_len = max(map(len, prompt_ids)) + args.max_tokens + 8
    config = EngineConfig(max_batch_size=max(args.batch_sizes), max_seq_len=max_seq_len, dtype=dtype_name,
                          num_draft_tokens=args.num_draft_tokens,
                          gate=GatePolicy(min_tokens=0))  # speculation rows always speculate, even in short runs
    model = load_transformer(target.path, max_seq_len, dtype)
    draft_model = load_transformer(draft_path, max_seq_len, dtype) if draft_path else None
    head = load_eagle3_head(args.eagle3, model.cfg, max_seq_len, dtype) if args.eagle3 else None
    floor = {"weight_bytes": weight_bytes(model)}
    floor["max_tokens_per_s_bs1"] = round(args.bandwidth_gbs * 1e9 / floor["weight_bytes"], 1)

    rows: list[Row] = []
    for batch in args.batch_sizes:
        torch.manual_seed(SEED)
        hf_tps, _ = bench_transformers(target.path, dtype, prompt_ids, batch, args.max_tokens, pad_id)
        rows.append(Row(dtype_name, "transformers generate", batch, hf_tps))
        base_tps, _, base_ids = bench_engine(model, None, config, prompt_ids, batch, args.max_tokens)
        rows.append(Row(dtype_name, "engine, no speculation", batch, base_tps))
        proposers = [("engine + n-gram", NgramProposer)]
        if head is not None:
            proposers.append(("engine + eagle3", lambda: Eagle3Proposer(head, model, config.max_batch_size,
                                                                         config.max_seq_len)))
        if draft_model is not None:
            proposers.append((f"engine + draft {args.draft}",
                              lambda: DraftModelProposer(draft_model, config.max_batch_size, config.max_seq_len)))
        for name, make in proposers:
            tps, stats, ids = bench_engine(model, make, config, prompt_ids, batch, args.max_tokens)
            same = sum(same_until_stop(a, b, args.stop_ids) for a, b in zip(ids, base_ids))
            rows.append(Row(dtype_name, name, batch, tps, acceptance_rate=stats.acceptance_rate,
                            mean_acceptance_length=stats.mean_acceptance_length, same_as_engine=f"{same}/{batch}"))
        if draft_model is None:
            rows.append(Row(dtype_name, "engine + draft model", batch, None))
        for row in rows:
            if row.batch == batch and row.tokens_per_s is not None:
                row.vs_transformers = row.tokens_per_s / hf_tps
                row.vs_engine = row.tokens_per_s / base_tps
        print(f"  {dtype_name} batch {batch} done", flush=True)
    return rows, floor


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def print_markdown(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> None:
    """One markdown table, columns padded to their widest cell."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")


def print_table(rows: list[Row], floors: dict, args) -> None:
    head = ("dtype", "method", "batch", "tok/s", "vs HF", "vs engine", "accept", "mean acc len", "same tokens")
    lines = [(r.dtype, r.method, str(r.batch), fmt(r.tokens_per_s, ".1f"), fmt(r.vs_transformers, ".2f") + "x",
              fmt(r.vs_engine, ".2f") + "x", fmt(r.acceptance_rate, ".2f"), fmt(r.mean_acceptance_length, ".2f"),
              r.same_as_engine or "") for r in rows]
    lines = [tuple(c.replace("n/ax", "n/a") for c in line) for line in lines]
    print_markdown(head, lines)
    print(f"\n{args.model}, {args.max_tokens} new tokens per prompt, k={args.num_draft_tokens}, "
          f"{torch.get_num_threads()} threads, load average {args.load_avg[0]} before, {args.load_avg[1]} after.\n"
          f"Copy bandwidth {args.bandwidth_gbs:.1f} GB/s (read + write). Same tokens: rows whose output equals the "
          "no-speculation engine's up to its first EOS.")
    for dtype, f in floors.items():
        print(f"Bandwidth floor {dtype}: {f['weight_bytes'] / 1e6:.0f} MB of weights -> at most "
              f"{f['max_tokens_per_s_bs1']} tok/s at batch 1 without speculation.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="target: preset, folder, .gguf or hub id")
    ap.add_argument("--draft", default=None, help="draft model (preset, folder, .gguf, hub id); default: none")
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 head folder (e.g. from `pipeline draft train`)")
    ap.add_argument("--acceptance-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                    help="K values for the EAGLE-3 held-out acceptance table (empty: skip it)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="bf16")
    ap.add_argument("--copy-mb", type=int, default=512, help="size of the bandwidth-measuring copy")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    target = resolve_model(args.model)
    draft_path = None
    if args.draft:
        draft_path = resolve_model(args.draft).path
        check_draft_compatible(target.path, draft_path)
    tokenizer = load_tokenizer(target.path)
    prompt_ids = [encode_prompt(tokenizer, p, raw=False) for p in PROMPTS]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    args.stop_ids = stop_token_ids(tokenizer, ModelConfig.from_folder(target.path).eos_token_ids)
    args.bandwidth_gbs = copy_bandwidth_gbs(args.copy_mb)
    load_before = os.getloadavg()[0]

    rows, floors = [], {}
    for dtype_name in (["bf16", "fp32"] if args.dtype == "both" else [args.dtype]):
        r, floors[dtype_name] = run_dtype(dtype_name, args, target, draft_path, tokenizer, prompt_ids, pad_id)
        rows += r
    acceptance = None
    if args.eagle3 and args.acceptance_ks:
        acceptance = eagle3_acceptance(args, target, tokenizer, "bf16" if args.dtype == "both" else args.dtype)
    # Other processes on the box skew every row; say how busy it was.
    args.load_avg = (round(load_before, 2), round(os.getloadavg()[0], 2))
    print_table(rows, floors, args)
    if acceptance is not None:
        from pipeline.draft.report import acceptance_table

        print(f"\nEAGLE-3 head {args.eagle3} on {acceptance['prompts']} held-out prompts, greedy, "
              f"{acceptance['max_new_tokens']} new tokens, one run per K:")
        print(acceptance_table(acceptance))
    if args.json:
        print(json.dumps({"eagle3_acceptance": acceptance, "model": args.model, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
                          "num_draft_tokens": args.num_draft_tokens, "load_avg": args.load_avg,
                          "copy_bandwidth_gbs": round(args.bandwidth_gbs, 2),
                          "bandwidth_floor": floors, "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
