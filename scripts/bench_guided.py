"""Guided decoding on the portable engine, in one run on one model (default: the embedded SmolLM2-135M, bf16):
what the grammar's mask costs a decode step, whether speculation still pays under a guide, and whether every
answer matches its schema.

- cost: the same schema prompts, greedy, at batch 1 and 32: plain decode steps against guided ones (each prompt
  with its JSON schema), and the guide's own work per token (llguidance's masks, draft checks and the mask's
  application, timed where the engine calls them) as a share of a plain decode step.
- speculation: guided, with n-gram drafts forced on, against guided without drafts, on the same prompts: tok/s,
  acceptance, and whether the answers are token for token the same (they must be).
- validity: each of the SCHEMAS (shapes like NousResearch/json-mode-eval's, written anew) with its prompt, guided:
  how many answers parse and validate against their schema (jsonschema), and how many ran out of max_tokens.

    python scripts/bench_guided.py                 # smollm2-135m, bf16
    python scripts/bench_guided.py --json --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager

import torch

import pipeline.engine.llm_engine as llm_engine
from pipeline.engine.config import EngineConfig, GatePolicy, ModelConfig
from pipeline.engine.guide import Guide, GuideSpec
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.request import FinishReason
from pipeline.engine.sampling import SamplingParams
from pipeline.models.resolve import resolve_model
from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

TARGET_SHARE = 0.05  # the bar: a JSON schema's mask work per token, as a share of a decode step, batch 1


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


S, I, N, B = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def enum(*values):
    return {"enum": list(values)}


def array(items, most=4):
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


SCHEMAS: list[tuple[str, dict]] = [
    ("Give the name and age of a fictional person.", obj({"name": S, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120}})),
    ("Describe a postal address in Paris.", obj({"street": S, "city": S, "postcode": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}})),
    ("List a product for an online shop.", obj({"sku": S, "price": N, "in_stock": B})),
    ("Record a customer order of two items.", obj({"order_id": I, "items": array(obj({"sku": S, "qty": I})),
                                                  "paid": B})),
    ("Describe a conference event.", obj({"title": S, "date": {"type": "string", "format": "date"},
                                          "online": B})),
    ("Give today's weather in Oslo.", obj({"city": S, "temperature_c": N,
                                           "sky": enum("clear", "cloudy", "rain", "snow")})),
    ("Describe a classic novel.", obj({"title": S, "author": S, "year": I})),
    ("Review a science-fiction movie.", obj({"movie": S, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                             "summary": S})),
    ("Write a pancake recipe.", obj({"dish": S, "ingredients": array(S, 6), "minutes": I})),
    ("Book a flight from Paris to Rome.", obj({"from": S, "to": S, "seat": enum("window", "aisle", "middle"),
                                               "passengers": I})),
    ("Describe an employee of a bakery.", obj({"name": S, "role": S, "full_time": B}, {"manager": S})),
    ("Write an invoice for web design work.", obj({"invoice_no": I, "lines": array(obj({"item": S, "amount": N})),
                                                  "currency": enum("EUR", "USD", "GBP")})),
    ("Report a sensor reading from a greenhouse.", obj({"sensor": S, "humidity": N, "ok": B})),
    ("Create a user profile for a chess website.", obj({"username": S, "rating": I, "country": S})),
    ("Make a to-do list for moving house.", obj({"owner": S, "tasks": array(obj({"task": S, "done": B}), 5)})),
    ("Schedule a meeting about the budget.", obj({"subject": S, "attendees": array(S), "minutes": I})),
    ("Record a bank transfer of 250 euros.", obj({"amount": N, "from_account": S, "to_account": S,
                                                 "kind": enum("debit", "credit")})),
    ("Log one HTTP request to an API.", obj({"method": enum("GET", "POST", "PUT", "DELETE"), "path": S,
                                             "status": I, "ms": N})),
    ("Answer a survey about coffee.", obj({"likes_coffee": B, "cups_per_day": I, "favourite": S})),
    ("Describe a dish on a restaurant menu.", obj({"name": S, "price": N, "vegetarian": B,
                                                   "allergens": array(S)})),
    ("Describe a used car for sale.", obj({"make": S, "model": S, "year": I, "km": I})),
    ("Report the score of a football match.", obj({"home": S, "away": S, "home_goals": I, "away_goals": I})),
]


class GuideClock:
    """Time spent in the guide where the engine and the drafters call it (outermost calls only)."""

    METHODS = ("refused", "row_refusals", "valid_prefix", "advance", "draft_refusals", "push", "pop")

    def __init__(self):
        self.seconds, self.local = 0.0, threading.local()

    def wrap(self, fn):
        def timed(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            self.local.depth = depth + 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = depth
                if depth == 0:
                    self.seconds += time.perf_counter() - t
        return timed

    @contextmanager
    def installed(self):
        saved = {m: getattr(Guide, m) for m in self.METHODS}
        saved_apply = llm_engine.apply_refusals
        for m, fn in saved.items():
            setattr(Guide, m, self.wrap(fn))
        llm_engine.apply_refusals = self.wrap(saved_apply)
        try:
            yield self
        finally:
            for m, fn in saved.items():
                setattr(Guide, m, fn)
            llm_engine.apply_refusals = saved_apply


def run(engine: LLMEngine, prompts, params_list, speculation: str) -> dict:
    """Step the engine until every request ends; decode steps timed apart from steps that prefill."""
    reqs = [engine.add_request(p, sp, speculation=speculation) for p, sp in zip(prompts, params_list)]
    decode, t0 = [], time.perf_counter()
    while not all(r.finished for r in reqs):
        prefills, tokens = engine.stats.prefill_steps, engine.stats.generated_tokens
        t = time.perf_counter()
        engine.step()
        if engine.stats.prefill_steps == prefills:
            decode.append((time.perf_counter() - t, engine.stats.generated_tokens - tokens))
    wall = time.perf_counter() - t0
    failed = [r.error for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    emitted = sum(len(r.output_ids) for r in reqs)
    return {"reqs": reqs, "wall_s": wall, "tok_s": emitted / wall, "tokens": emitted,
            "step_ms": 1e3 * statistics.median(s for s, _ in decode) if decode else None,
            "decode_s": sum(s for s, _ in decode), "decode_tokens": sum(n for _, n in decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--batch1-prompts", type=int, default=4, help="schema prompts run one at a time for batch 1")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jsonschema

    target = resolve_model(args.model)
    tokenizer = load_tokenizer(target.path)
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(target.path).eos_token_ids)
    prompts = [encode_prompt(tokenizer, f"{text} Answer in JSON.", raw=False) for text, _ in SCHEMAS]
    guided = [SamplingParams(max_tokens=args.max_tokens, stop_token_ids=tuple(stops),
                             guide=GuideSpec("json_schema", json.dumps(schema))) for _, schema in SCHEMAS]
    plain = [SamplingParams(max_tokens=args.max_tokens, stop_token_ids=tuple(stops)) for _ in SCHEMAS]
    config = EngineConfig(max_batch_size=max(max(args.batch_sizes), len(SCHEMAS)), max_seq_len=1024,
                          dtype=args.dtype, num_draft_tokens=args.num_draft_tokens, prefix_caching=False,
                          gate=GatePolicy(min_tokens=0))

    def engine(draft=None) -> LLMEngine:
        e = LLMEngine.load(target.path, config, draft=draft)
        e.tokenizer = tokenizer
        e.generate(prompts[:1], guided[:1])  # warm-up: the guide tokenizer, oneDNN's kernels
        return e

    report = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "threads": args.threads,
              "schemas": len(SCHEMAS), "cost": [], "speculation": None, "validity": None}
    eng = engine()
    for b in args.batch_sizes:
        n = args.batch1_prompts if b == 1 else b
        idx = [i % len(SCHEMAS) for i in range(n)]
        groups = [idx[i:i + b] for i in range(0, n, b)]
        rows = {}
        for name, params in (("plain", plain), ("guided", guided)):
            clock = GuideClock()
            with clock.installed():
                runs = [run(eng, [prompts[i] for i in g], [params[i] for i in g], "off") for g in groups]
            decode_tokens = sum(r["decode_tokens"] for r in runs)
            rows[name] = {"step_ms": statistics.median(r["step_ms"] for r in runs),
                          "decode_ms_per_token": 1e3 * sum(r["decode_s"] for r in runs) / decode_tokens,
                          "guide_ms_per_token": 1e3 * clock.seconds / max(1, sum(r["tokens"] for r in runs)),
                          "tokens": sum(r["tokens"] for r in runs)}
        share = rows["guided"]["guide_ms_per_token"] * b / rows["plain"]["step_ms"]  # b tokens a step
        report["cost"].append({"batch": b, **{f"{k}_{m}": round(v, 4) for k, r in rows.items() for m, v in r.items()},
                               "guide_share_of_plain_step": round(share, 4)})
        print(f"[cost] batch {b}: plain step {rows['plain']['step_ms']:.2f} ms, guided {rows['guided']['step_ms']:.2f}"
              f" ms; the guide's work {rows['guided']['guide_ms_per_token']:.3f} ms a token = {share:.1%} of a plain "
              "step", file=sys.stderr, flush=True)

    # Validity: every schema once, guided, as one batch.
    done = run(eng, prompts, guided, "off")
    valid, cut = 0, 0
    failures = []
    for (text, schema), r in zip(SCHEMAS, done["reqs"]):
        answer = tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if r.finish_reason is FinishReason.LENGTH:
            cut += 1
            failures.append({"prompt": text, "why": "max_tokens", "answer": answer[:200]})
            continue
        try:
            jsonschema.validate(json.loads(answer), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"prompt": text, "why": str(e).splitlines()[0][:200], "answer": answer[:200]})
    report["validity"] = {"valid": valid, "of": len(SCHEMAS), "cut_by_max_tokens": cut, "failures": failures,
                          "example": tokenizer.decode(done["reqs"][0].output_ids, skip_special_tokens=True)}
    print(f"[validity] {valid}/{len(SCHEMAS)} valid ({cut} cut by max_tokens)", file=sys.stderr, flush=True)

    # Speculation under the guide: n-gram forced on against none, the same prompts one at a time (batch 1).
    ngram = engine("ngram")
    n = args.batch1_prompts * 2
    base = [run(eng, [prompts[i]], [guided[i]], "off") for i in range(n)]
    spec = [run(ngram, [prompts[i]], [guided[i]], "on") for i in range(n)]
    same = all(a["reqs"][0].output_ids == b["reqs"][0].output_ids for a, b in zip(base, spec))
    st = ngram.stats

    def tok_s(runs):
        return sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)

    report["speculation"] = {"prompts": n, "guided_tok_s": round(tok_s(base), 2),
                             "guided_ngram_tok_s": round(tok_s(spec), 2),
                             "speedup": round(tok_s(spec) / tok_s(base), 3),
                             "acceptance": round(st.acceptance_rate, 4), "drafted": st.drafted_tokens,
                             "identical": same}
    base, spec = {"tok_s": tok_s(base)}, {"tok_s": tok_s(spec)}
    print(f"[speculation] guided {base['tok_s']:.1f} tok/s, guided + n-gram {spec['tok_s']:.1f} "
          f"({spec['tok_s'] / base['tok_s']:.2f}x), acceptance {st.acceptance_rate:.3f}, identical {same}",
          file=sys.stderr, flush=True)

    print_table(report)
    if args.json:
        print(json.dumps(report, indent=2))


def print_table(report: dict) -> None:
    lines = []
    for c in report["cost"]:
        lines.append((f"batch {c['batch']}: decode time a token, plain / guided",
                      f"{c['plain_decode_ms_per_token']:.3f} / {c['guided_decode_ms_per_token']:.3f} ms", "", ""))
        verdict = "met" if c["guide_share_of_plain_step"] <= TARGET_SHARE else "MISSED"
        lines.append((f"batch {c['batch']}: the guide's work a step / a plain step",
                      f"{c['guide_share_of_plain_step']:.1%} ({c['guided_guide_ms_per_token']:.3f} ms a token)",
                      f"<= {TARGET_SHARE:.0%}" if c["batch"] == 1 else "", verdict if c["batch"] == 1 else ""))
    s = report["speculation"]
    lines.append((f"guided + n-gram / guided, batch 1 ({s['prompts']} prompts)",
                  f"{s['speedup']}x ({s['guided_ngram_tok_s']} / {s['guided_tok_s']} tok/s), acceptance "
                  f"{s['acceptance']}", "> 1", "met" if s["speedup"] > 1 else "MISSED"))
    lines.append(("guided + n-gram answers token for token the guided ones", str(s["identical"]), "True",
                  "met" if s["identical"] else "MISSED"))
    v = report["validity"]
    lines.append((f"schema-valid answers ({v['cut_by_max_tokens']} cut by max_tokens)", f"{v['valid']}/{v['of']}",
                  "all", "met" if v["valid"] == v["of"] else "MISSED"))
    head = ("measurement", "value", "target", "result")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
    print(f"\n{report['model']}, {report['dtype']}, {report['threads']} threads, greedy, up to {report['max_tokens']} "
          f"new tokens, {report['schemas']} schemas.")


if __name__ == "__main__":
    main()
