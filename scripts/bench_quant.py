"""Benchmark quantized checkpoints in the portable engine, in one run, on one model.

For each format (none, fp8, int4_awq by default) it quantizes the model with `pipeline quantize`'s
library (or reuses an earlier export in --cache-dir: AWQ calibration takes minutes on a CPU), then
measures engine decode tokens/s at batch 1 in bf16 on fixed prompts, with the unquantized bf16 engine
as the baseline. It also runs self-speculation: the target drafts with its own INT4-AWQ copy, which
needs no second model; greedy output must stay the target's own. Quality comes from each export's
report (perplexity and top-1 agreement on held-out text, measured by the quantize stage).

Targets (issue 3): INT4-AWQ decode >= 1.5x bf16; perplexity +<=5% for fp8 and +<=15% for int4_awq.

    python scripts/bench_quant.py                 # smollm2-135m; quantizes into ~/.cache/pipeline/bench_quant once
    python scripts/bench_quant.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.home import pipeline_home
from pipeline.models.resolve import resolve_model
from pipeline.models.tokenizer import encode_prompt, load_tokenizer

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Explain the difference between a list and a tuple in Python, with examples.",
)
PPL_TARGETS = {"fp8": 0.05, "int4_awq": 0.15}  # max relative perplexity increase
SPEED_TARGET = {"int4_awq": 1.5}  # min decode speedup over bf16


def quantized_folder(model: str, qformat: str, cache_dir: Path, calib_size: int) -> tuple[Path, dict | None]:
    """The model's export in `qformat`, made once and reused. Returns (folder, quantize report or None)."""
    if qformat == "none":
        return resolve_model(model).path, None
    from pipeline.quantize import QuantizeOptions, quantize

    out = cache_dir / f"{Path(model).name}-{qformat}-c{calib_size}"
    if not (out / "report.json").is_file():
        print(f"  quantizing {model} to {qformat} (calibration {calib_size} samples) -> {out}", flush=True)
        quantize(QuantizeOptions(model=model, output=out, qformat=qformat, calib_size=calib_size))
    return out, json.loads((out / "report.json").read_text())


def decode_speed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Batch-1 greedy decode of each prompt in turn; tokens/s over all of them (prefill included)."""
    engine.eos_token_ids = ()  # fixed-length rows: every run decodes exactly max_tokens
    engine.generate([prompts[0]], SamplingParams(max_tokens=8))  # warm-up: oneDNN/int4 kernels for these shapes
    outputs, tokens, elapsed = [], 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        req = engine.generate([p], SamplingParams(max_tokens=max_tokens))[0]
        elapsed += time.perf_counter() - t0
        tokens += len(req.output_ids)
        outputs.append(req.output_ids)
    return tokens / elapsed, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", nargs="+", default=["none", "fp8", "int4_awq"])
    ap.add_argument("--cache-dir", type=Path, default=None, help="where exports are kept (default: PIPELINE_HOME/bench_quant)")
    ap.add_argument("--calib-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", dest="json_", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cache_dir = args.cache_dir or pipeline_home() / "bench_quant"

    tok = load_tokenizer(resolve_model(args.model).path)
    prompts = [encode_prompt(tok, p, raw=False) for p in PROMPTS]
    config = EngineConfig(max_batch_size=1, max_seq_len=1024, dtype="bf16", num_draft_tokens=args.num_draft_tokens,
                          gate=GatePolicy(min_tokens=0))

    rows, folders, baseline, base_out = [], {}, None, None
    for qformat in args.formats:
        folder, report = quantized_folder(args.model, qformat, cache_dir, args.calib_size)
        folders[qformat] = folder
        engine = LLMEngine.load(folder, config)
        tps, outputs = decode_speed(engine, prompts, args.max_tokens)
        if qformat == "none":
            baseline, base_out = tps, outputs
        row = {"format": qformat, "tokens_per_s": round(tps, 2),
               "weights": engine.model.describe().get("weights", qformat) if hasattr(engine.model, "describe") else qformat}
        if report:
            ppl_rise = report["perplexity_after"] / report["perplexity_before"] - 1
            row |= {"weight_mb": round(report["bytes_after"] / 1e6, 1),
                    "perplexity": report["perplexity_after"], "perplexity_before": report["perplexity_before"],
                    "perplexity_rise": round(ppl_rise, 4), "top1_agreement": report["top1_agreement"],
                    "ppl_target_met": ppl_rise <= PPL_TARGETS[qformat] if qformat in PPL_TARGETS else None}
        rows.append(row)
        del engine
    for row in rows:
        row["speedup_vs_bf16"] = round(row["tokens_per_s"] / baseline, 3) if baseline else None
        if row["format"] in SPEED_TARGET and baseline:
            row["speed_target_met"] = row["speedup_vs_bf16"] >= SPEED_TARGET[row["format"]]

    spec = None
    if "int4_awq" in folders and "none" in folders:
        engine = LLMEngine.load(folders["none"], config, draft=folders["int4_awq"])
        tps, outputs = decode_speed(engine, prompts, args.max_tokens)
        s = engine.stats
        spec = {"target": "bf16", "draft": "its own int4_awq copy", "k": args.num_draft_tokens,
                "tokens_per_s": round(tps, 2), "speedup_vs_target_alone": round(tps / baseline, 3),
                "acceptance_rate": round(s.acceptance_rate, 4), "mean_acceptance_length": round(s.mean_acceptance_length, 3),
                "acceptance_per_position": [round(x, 3) for x in s.acceptance_per_position],
                "greedy_identical_to_target": outputs == base_out}

    result = {"model": args.model, "dtype": "bf16", "batch": 1, "max_tokens": args.max_tokens, "threads": args.threads,
              "formats": rows, "self_speculation": spec}
    print_table(result)
    if args.json_:
        print(json.dumps(result, indent=2))


def print_table(r: dict) -> None:
    print(f"\n{r['model']}, bf16 activations, batch 1, {r['max_tokens']} new tokens, {r['threads']} threads\n")
    print("| format | tok/s | vs bf16 | weights MB | perplexity (before -> after) | rise | top-1 agree | targets |")
    print("|---|---|---|---|---|---|---|---|")
    for row in r["formats"]:
        targets = []
        if row.get("speed_target_met") is not None:
            targets.append(f"speed>={SPEED_TARGET[row['format']]}x {'met' if row['speed_target_met'] else 'MISSED'}")
        if row.get("ppl_target_met") is not None:
            targets.append(f"ppl<=+{PPL_TARGETS[row['format']]:.0%} {'met' if row['ppl_target_met'] else 'MISSED'}")
        ppl = (f"{row['perplexity_before']:.2f} -> {row['perplexity']:.2f}" if "perplexity" in row else "baseline")
        print(f"| {row['format']} | {row['tokens_per_s']:.1f} | {row['speedup_vs_bf16']:.2f}x | {row.get('weight_mb', '')} | "
              f"{ppl} | {row.get('perplexity_rise', 0):+.1%} | {row.get('top1_agreement', '')} | {'; '.join(targets)} |")
    s = r["self_speculation"]
    if s:
        print(f"\nSelf-speculation (bf16 target, its own INT4-AWQ copy as draft, k={s['k']}): {s['tokens_per_s']:.1f} tok/s, "
              f"{s['speedup_vs_target_alone']:.2f}x the target alone; acceptance {s['acceptance_rate']:.2f}, "
              f"mean acceptance length {s['mean_acceptance_length']:.2f}, per position {s['acceptance_per_position']}; "
              f"greedy output identical to the target's: {s['greedy_identical_to_target']}")


if __name__ == "__main__":
    main()
