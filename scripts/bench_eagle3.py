"""Does an EAGLE-3 head pay on this machine: batch 1, greedy, the head against plain decoding in the same run.

Each of the held-out code-completion prompts (bench_cpu.py's, which no head trains on) decodes --max-tokens new
tokens alone (end-of-sequence ignored) through four engines in turn, --rounds times: plain, n-gram, the head alone,
and the head behind n-gram lookup (the engine's default for a head: EngineConfig.ngram_first). Each speculating
engine first measures its costs (engine/calibrate.py, as `pipeline compile` does), so the planner picks k per step
from them. A run's tok/s is its median round. It reports each run's speedup over plain, whether every answer is the
plain one token for token (it must be), the mean acceptance length, and what the head's proposals cost against the
target's steps (EngineStats.draft_cost). With --train-minutes it first trains the head (`pipeline draft train`, that
budget) into --head.

Targets (issue 42, the embedded default, 2 cores): a 10-minute head >= 1.3x plain with mean acceptance length
>= 2.0; a 60-minute one >= 1.6x and >= 2.5; the head and n-gram together at least as fast as the better alone.

    python scripts/bench_eagle3.py --head heads/smol-eagle3
    python scripts/bench_eagle3.py --head /tmp/h10 --train-minutes 10 --json
    python scripts/bench_eagle3.py --head /tmp/h60 --also /tmp/h60-old --prompts 8   # two heads, one run

Four prompts are a small sample (two heads trained alike differ by more than a few minutes of training do): --also
runs more heads, alone and behind n-gram, in the same run, and --prompts 8 takes all of bench_cpu.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import PROMPTS  # noqa: E402
from bench_serving import fmt, print_markdown  # noqa: E402


def load(model: str, draft: str | None, args, ngram_first: bool = True):
    """(engine, prompt ids), warmed up; a speculating engine with its costs measured first (--no-calibrate: not)."""
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.resolve import resolve_model
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer

    target = resolve_model(model).path
    tokenizer = load_tokenizer(target)
    prompts = [encode_prompt(tokenizer, p, raw=False) for p in PROMPTS[:args.prompts]]
    config = EngineConfig(max_batch_size=1, max_seq_len=max(len(p) for p in prompts) + args.max_tokens + 8,
                          dtype="bf16", num_draft_tokens=args.k, ngram_first=ngram_first,
                          gate=GatePolicy(max_batch_size=1, hysteresis=0, min_tokens=0))
    engine = LLMEngine.load(target, config, draft=draft)
    if draft and args.calibrate:  # k per step from this machine's measured costs, as a compiled engine folder has
        from pipeline.engine.calibrate import calibrate

        engine.cost_model = calibrate(engine).cost
    engine.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up: first-call costs out of the timing
    engine.stats = type(engine.stats)()  # the counters from here: not the warm-up's or the calibration's steps
    return engine, prompts


def run_all(engines: dict, args) -> dict:
    """Every prompt alone through each engine in turn, round after round (so a slow spell of a shared machine lands
    on every run alike, not on one): per run the median round's tok/s, the answers and the proposer's counters."""
    from pipeline.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    answers: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, (engine, prompts) in engines.items():
            t0 = time.perf_counter()
            answers[name] = [engine.generate([p], params)[0].output_ids for p in prompts]
            rounds[name].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
    out = {}
    for name, (engine, _) in engines.items():
        s = engine.stats
        out[name] = {"tok_s": statistics.median(rounds[name]), "answers": answers[name],
                     "mean_acceptance_length": round(s.mean_acceptance_length, 3) if s.verified_rows else None,
                     "acceptance_per_position": [round(x, 3) for x in s.acceptance_per_position],
                     "drafts_per_proposal": round(s.proposed_tokens / s.proposals, 2) if s.proposals else None,
                     "draft_cost": s.draft_cost(), "skip_reasons": dict(s.skip_reasons),
                     "sources": engine.describe().get("draft", {}).get("ngram_first")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, required=True, help="an EAGLE-3 head folder (written first with "
                    "--train-minutes)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--train-minutes", type=float, default=None, help="train the head first, this budget")
    ap.add_argument("--also", type=Path, action="append", default=[], metavar="HEAD",
                    help="another head to run, alone and behind n-gram, in the same run (repeatable)")
    ap.add_argument("--prompts", type=int, default=4, choices=range(1, len(PROMPTS) + 1), metavar="N")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="drafts a step at most (the planner picks per step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="plan k with the rule-of-thumb cost model instead of one measured first (about 5 s a run)")
    ap.add_argument("--json", dest="json_", action="store_true")
    args = ap.parse_args()
    if args.train_minutes:
        subprocess.run(["pipeline", "draft", "train", "--target", args.model,
                        "--budget-minutes", str(args.train_minutes), "-o", str(args.head), "--force", "--quiet"],
                       check=True)
    engines = {"plain": load(args.model, None, args), "ngram": load(args.model, "ngram", args)}
    for label, head in [("", args.head), *((f" {other}", other) for other in args.also)]:
        engines[f"eagle3{label}"] = load(args.model, f"eagle3:{head}", args, ngram_first=False)
        engines[f"eagle3+ngram{label}"] = load(args.model, f"eagle3:{head}", args)
    runs = run_all(engines, args)
    plain = runs["plain"]
    result = {"model": args.model, "head": str(args.head), "prompts": args.prompts, "max_tokens": args.max_tokens,
              "k": args.k, "train_minutes": args.train_minutes, "also": [str(h) for h in args.also], "runs": {}}
    for name, r in runs.items():
        result["runs"][name] = {"tok_s": round(r["tok_s"], 1), "speedup": round(r["tok_s"] / plain["tok_s"], 3),
                                "identical": r["answers"] == plain["answers"],
                                **{k: r[k] for k in ("mean_acceptance_length", "acceptance_per_position",
                                                     "drafts_per_proposal", "skip_reasons", "draft_cost",
                                                     "sources")}}
    report = Path(args.head) / "train_report.json"
    if report.is_file():
        result["train"] = {k: json.loads(report.read_text()).get(k)
                           for k in ("steps", "train_seconds", "epochs", "train_precision")}
    eagle, both = result["runs"]["eagle3"], result["runs"]["eagle3+ngram"]
    cost = eagle["draft_cost"] or {}
    rows = [(f"{name} tok/s", f"{fmt(r['tok_s'])} ({r['speedup']:.2f}x)", f"identical {r['identical']}, mean "
             f"acceptance length {fmt(r['mean_acceptance_length'], '.2f')}") for name, r in result["runs"].items()]
    rows += [("EAGLE-3 accepted per position", " ".join(f"{x:.2f}" for x in eagle["acceptance_per_position"]),
              "the head alone"),
             ("EAGLE-3 drafts per proposal", fmt(eagle["drafts_per_proposal"], ".2f"),
              f"the planner's k, at most {args.k}"),
             ("a proposal / verify / plain step ms", "/".join(fmt(cost.get(k)) for k in
                                                             ("proposal_ms", "verify_step_ms", "plain_step_ms")),
              "the head alone, beside the target"),
             ("eagle3+ngram rows by source", json.dumps(both["sources"]), "n-gram where it matches 2+ tokens"),
             ("targets", "eagle3 >= 1.3x, MAL >= 2.0 (10-min head); 1.6x, 2.5 (60-min)",
              "eagle3+ngram >= the better of the two alone")]
    if args.json_:
        print(json.dumps(result, indent=2))
        return
    print_markdown(("measure", "value", "note"), rows)
    print(f"\n{args.model}, head {args.head}, {args.prompts} held-out code prompts x {args.max_tokens} tokens, "
          f"{os.cpu_count()} threads, median of {args.rounds} round(s).")


if __name__ == "__main__":
    main()
