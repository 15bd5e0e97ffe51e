"""The portable engine against llama.cpp and transformers on this CPU: tokens/s and peak RSS, side by side.

Each row runs in a fresh child process (so its peak RSS is its own), rows alternate within a round, and a
row's figure is its median over --rounds rounds. Batch 1 rows decode 8 code-completion prompts one after
another, greedy, exactly --max-tokens new tokens each (end-of-sequence ignored), and report new tokens per
second including prefill. Batch 16 rows decode the 8 prompts twice over as one in-flight batch.

Rows (those whose package is missing, or whose instructions this CPU lacks, print n/a):
- llama.cpp (llama-cpp-python, the optional extra `pip install '.[llamacpp]'`) on the embedded Q4_1 GGUF,
  plain and with prompt-lookup decoding (LlamaPromptLookupDecoding, 4 tokens);
- this engine in bf16: plain, and n-gram speculation as the gate runs it (`speculation auto`); with
  --int4 DIR (a `pipeline quantize --qformat int4_awq --export hf` folder) the same two on INT4 weights;
- this engine in bf16, plain, once per kernel path (engine@amx, @avx512, @avx2, @portable: PIPELINE_KERNELS
  caps the build as a CPU with less would run it), and in fp32;
- transformers `generate` in bf16, plain and with prompt_lookup_num_tokens=4;
- the baseline: a process with torch, the engine and the tokenizer loaded and no weights, for its peak RSS.

The targets (issues 16 and 27) are printed with the table: plain bf16 decode at >= 50% of the bandwidth floor
(the weight bytes over the measured copy bandwidth), on every kernel path; fp32 no faster than bf16; the best
speculative row at >= 1.0x llama.cpp's plain decode and INT4 + n-gram at >= 1.5x; the engine's peak RSS at
<= 1.5x its weight bytes plus the KV cache it reserves, plus the baseline's; and batch 16 at >= 2x llama.cpp's
best at the same concurrency. llama-cpp-python's Llama object decodes one sequence at a time, so llama.cpp at 16
requests in flight is its batch-1 rate (its server's n_parallel isn't reachable from the binding).

    python scripts/bench_cpu.py                      # batch 1 and 16, 3 rounds
    python scripts/bench_cpu.py --batch-sizes 1 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = (  # code completions in the style of HumanEval: a signature and a docstring, complete the body
    'def running_max(numbers: list[int]) -> list[int]:\n    """Return the running maximum of numbers.\n'
    '    >>> running_max([1, 3, 2, 5, 4])\n    [1, 3, 3, 5, 5]\n    """\n',
    'def is_balanced(text: str) -> bool:\n    """True when every bracket in text ((), [], {}) is closed in order.\n'
    '    >>> is_balanced("([]{})")\n    True\n    """\n',
    'def word_counts(text: str) -> dict[str, int]:\n    """Count each lower-cased word of text, ignoring punctuation.\n'
    '    >>> word_counts("A b, a.")\n    {\'a\': 2, \'b\': 1}\n    """\n',
    'def rotate(matrix: list[list[int]]) -> list[list[int]]:\n    """Rotate a square matrix 90 degrees clockwise.\n'
    '    >>> rotate([[1, 2], [3, 4]])\n    [[3, 1], [4, 2]]\n    """\n',
    'def flatten(items: list) -> list:\n    """Flatten arbitrarily nested lists.\n'
    '    >>> flatten([1, [2, [3, 4]], 5])\n    [1, 2, 3, 4, 5]\n    """\n',
    'def to_roman(n: int) -> str:\n    """Write 1 <= n <= 3999 in Roman numerals.\n'
    '    >>> to_roman(1994)\n    \'MCMXCIV\'\n    """\n',
    'def chunks(items: list, size: int) -> list[list]:\n    """Split items into lists of at most size items.\n'
    '    >>> chunks([1, 2, 3, 4, 5], 2)\n    [[1, 2], [3, 4], [5]]\n    """\n',
    'def longest_common_prefix(words: list[str]) -> str:\n    """The longest prefix every word shares.\n'
    '    >>> longest_common_prefix(["flower", "flow", "flight"])\n    \'fl\'\n    """\n',
)
N_LOOKUP = 4  # draft tokens per step for every speculative row


# ---- one row, in a child process ----------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, which starts afresh with the process's image (getrusage's ru_maxrss
    carries the parent's peak across fork and exec, so every child reported the parent's)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def run_engine(args, batch: int, speculate: bool, folder: str, dtype: str = "bf16") -> dict:
    import torch

    from pipeline.engine.config import EngineConfig
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.proposers import NgramProposer
    from pipeline.engine.sampling import SamplingParams
    from pipeline.engine.weights import load_transformer
    from pipeline.models.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    ids = prompt_ids(load_tokenizer(folder))
    max_seq_len = max(map(len, ids)) + args.max_tokens + N_LOOKUP + 8
    config = EngineConfig(max_batch_size=batch, max_seq_len=max_seq_len, dtype=dtype, num_draft_tokens=N_LOOKUP)
    model = load_transformer(folder, max_seq_len, config.torch_dtype, keep_plain=False, lm_head=config.lm_head)
    engine = LLMEngine(model, config, NgramProposer() if speculate else None, eos_token_ids=())
    params = SamplingParams(max_tokens=args.max_tokens)
    engine.generate([ids[0]], SamplingParams(max_tokens=8))  # warm-up
    rows = [ids[i % len(ids)] for i in range(max(batch, len(ids)))]
    t0 = time.perf_counter()
    if batch == 1:
        reqs = [r for p in rows for r in engine.generate([p], params, speculation="auto")]
    else:
        reqs = engine.generate(rows, params, speculation="auto")
    elapsed = time.perf_counter() - t0
    weights = _weight_bytes(model)
    return {"tokens": sum(len(r.output_ids) for r in reqs), "seconds": elapsed, "weight_mb": weights / 2**20,
            "kv_mb": engine.cache.nbytes() / 2**20, "acceptance": engine.stats.acceptance_rate,
            "kernel": kernel_path(model)}


def kernel_path(model) -> str:
    """Which code ran the dense linears (or, for INT4, the int4 ones): amx, avx512, avx2, portable, or a torch
    kernel's name."""
    from pipeline.engine import cpu_kernels
    from pipeline.engine.linear import Linear

    dense = [m for m in model.modules() if type(m) is Linear]
    if any(m.layout == "amx" for m in dense):
        return "amx"
    kernels = cpu_kernels.load() if cpu_kernels.usable() else None
    if kernels is not None:
        return kernels.isa
    return sorted({m.layout for m in dense if m.layout})[0] if dense else "torch"


def run_baseline(folder: str) -> dict:
    """What an engine row's process holds before its weights: torch and the engine imported, one op run, and the
    model's tokenizer loaded (transformers' tokenizer modules are about 120 MB of it)."""
    import torch

    from pipeline.engine.llm_engine import LLMEngine  # noqa: F401  (its imports are the baseline)
    from pipeline.models.tokenizer import load_tokenizer

    torch.ones(8, 8) @ torch.ones(8, 8)
    load_tokenizer(folder)
    return {}


def _weight_bytes(model) -> int:
    """The weights as the engine holds them: a packed copy where a linear has one, else the plain tensor, and the
    quantized modules' buffers."""
    from pipeline.engine.linear import Linear

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            total += module.packed.nbytes  # what the layout holds, padding included
            if module.bias is not None:
                total += module.bias.nbytes
            continue
        # Buffers too: int4 blocks and scales, the int8 head. Not the rope tables (non-persistent: not weights).
        buffers = [b for name, b in module.named_buffers(recurse=False) if name not in module._non_persistent_buffers_set]
        for p in [*module.parameters(recurse=False), *buffers]:
            if p is not None and not p.is_meta and id(p) not in seen:
                seen.add(id(p))
                total += p.nbytes
    return total


def run_llamacpp(args, batch: int, speculate: bool) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from pipeline.models.resolve import embedded_gguf

    draft = LlamaPromptLookupDecoding(num_pred_tokens=N_LOOKUP) if speculate else None
    llm = Llama(str(embedded_gguf()), n_ctx=1024, n_threads=args.threads, n_batch=512, verbose=False,
                draft_model=draft, seed=0)
    ids = [llm.tokenize(p.encode(), add_bos=True) for p in PROMPTS]
    rows = [ids[i % len(ids)] for i in range(max(batch, len(ids)))]  # one sequence at a time: see the docstring

    def decode(tokens, n):
        llm.reset()
        out = []
        for tok in llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)  # end-of-sequence ignored: exactly n tokens, as every row here
            if len(out) == n:
                break
        return out

    decode(ids[0], 8)  # warm-up
    t0 = time.perf_counter()
    total = sum(len(decode(r, args.max_tokens)) for r in rows)
    return {"tokens": total, "seconds": time.perf_counter() - t0}


def run_transformers(args, batch: int, speculate: bool, folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = prompt_ids(tokenizer)
    extra = {"prompt_lookup_num_tokens": N_LOOKUP} if speculate else {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def decode(tokens, n):
        with torch.inference_mode():
            out = model.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad, **extra)
        return out.shape[1] - len(tokens)

    if batch != 1:
        raise SystemExit("transformers rows run at batch 1 only")
    decode(ids[0], 8)
    t0 = time.perf_counter()
    total = sum(decode(r, args.max_tokens) for r in ids)
    return {"tokens": total, "seconds": time.perf_counter() - t0}


def child(args) -> None:
    kind, batch = args.row, args.batch
    speculate = kind.endswith("+lookup")
    system = kind.split("+")[0]
    if system == "llamacpp":
        out = run_llamacpp(args, batch, speculate)
    elif system == "transformers":
        out = run_transformers(args, batch, speculate, args.folder)
    elif system == "baseline":
        out = run_baseline(args.folder)
    else:  # the parent set PIPELINE_KERNELS for the row (see kernels_setting)
        folder = args.int4 if system == "engine-int4" else args.folder
        out = run_engine(args, batch, speculate, folder, dtype="fp32" if system == "engine-fp32" else "bf16")
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out))


# ---- the parent: rounds of rows, medians, targets ----------------------------------------------------------


ROWS = {  # name -> (child row kind, label); a name's "@isa" or "-torchops" sets PIPELINE_KERNELS (kernels_setting)
    "baseline": ("baseline", "baseline: torch, the engine and the tokenizer loaded, no weights"),
    "llamacpp": ("llamacpp", "llama.cpp Q4_1, plain"),
    "llamacpp+lookup": ("llamacpp+lookup", "llama.cpp Q4_1, prompt lookup"),
    "engine": ("engine", "engine bf16, plain"),
    "engine@amx": ("engine", "engine bf16, plain, AMX kernels"),
    "engine@avx512": ("engine", "engine bf16, plain, AVX-512 kernels"),
    "engine@avx2": ("engine", "engine bf16, plain, AVX2 kernels"),
    "engine@portable": ("engine", "engine bf16, plain, portable C kernels"),
    "engine-fp32": ("engine-fp32", "engine fp32, plain"),
    "engine+lookup": ("engine+lookup", "engine bf16, n-gram (gated)"),
    "engine-torchops": ("engine", "engine bf16, plain, no C kernels (PIPELINE_KERNELS=off)"),
    "engine-int4": ("engine-int4", "engine INT4-AWQ, plain"),
    "engine-int4+lookup": ("engine-int4+lookup", "engine INT4-AWQ, n-gram (gated)"),
    "transformers": ("transformers", "transformers bf16, plain"),
    "transformers+lookup": ("transformers+lookup", "transformers bf16, prompt lookup"),
}


# Rows run at batch 1 only: transformers' generate runs one sequence; the rest are about one step's cost.
BATCH_1_ONLY = ("transformers", "baseline", "engine@", "engine-fp32")


def kernels_setting(name: str) -> str | None:
    """The PIPELINE_KERNELS a row runs under (None: the caller's)."""
    if name == "engine-torchops":  # C kernels off (torch ops, checked vendor GEMMs): their gain
        return "off"
    return name.split("@")[1] if "@" in name else None


def available(name: str, args) -> str | None:
    """None when the row can run, else why not."""
    import importlib.util

    from pipeline.engine import cpu_kernels

    if name.startswith("llamacpp") and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python not installed (pip install '.[llamacpp]')"
    if name.startswith("engine-int4") and not args.int4:
        return "no --int4 folder"
    setting = kernels_setting(name)
    if setting and setting != "off":
        return cpu_kernels.isa_refusal(setting)
    return None


def run_row(name: str, batch: int, args) -> dict:
    cmd = [sys.executable, __file__, "--row", ROWS[name][0], "--batch", str(batch), "--folder", args.folder,
           "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    if args.int4:
        cmd += ["--int4", args.int4]
    setting = kernels_setting(name)
    env = {**os.environ, "PIPELINE_KERNELS": setting} if setting else None
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode:
        raise SystemExit(f"row {name} at batch {batch} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def copy_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` large copies, counting read + write bytes."""
    import torch

    src = torch.ones(mbytes * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--int4", help="an INT4-AWQ Hugging Face folder of the same model (pipeline quantize)")
    ap.add_argument("--folder", help="the bf16/fp32 Hugging Face folder [default: the embedded SmolLM2's]")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.folder is None:
        from pipeline.models.resolve import resolve_model

        args.folder = str(resolve_model("smollm2-135m").path)
    if args.row:
        child(args)
        return

    names = [n for n in args.rows.split(",") if n]
    skipped = {n: why for n in names if (why := available(n, args))}
    load = os.getloadavg()[0]
    samples: dict[tuple[str, int], list[dict]] = {}
    bandwidths = []
    for r in range(args.rounds):
        # Measured every round, and the floor taken from the best: on a shared machine the bandwidth swings
        # as much as the rows do (14.9 and 22.2 GB/s on two afternoons), and the best is the strictest floor.
        bandwidths.append(copy_bandwidth_gbs())
        for batch in args.batch_sizes:
            for name in names:
                if name in skipped or (batch != 1 and name.startswith(BATCH_1_ONLY)):
                    continue
                samples.setdefault((name, batch), []).append(run_row(name, batch, args))
                print(f"  round {r + 1}/{args.rounds}: {name} at batch {batch} done", file=sys.stderr, flush=True)
    bandwidth = max(bandwidths)
    results = summarize(samples, bandwidth)
    report = {"bandwidth_gbs": round(bandwidth, 1), "bandwidth_gbs_rounds": [round(b, 1) for b in bandwidths],
              "threads": args.threads, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)],
              "rows": results, "skipped": skipped, "targets": targets(results, bandwidth)}
    print_table(report)
    if args.json:
        print(json.dumps(report, indent=2))


def summarize(samples: dict, bandwidth: float) -> list[dict]:
    out = []
    for (name, batch), runs in samples.items():
        if name == "baseline":
            out.append({"row": name, "label": ROWS[name][1], "batch": batch, "tokens_per_s": None,
                        "tokens_per_s_runs": [], "peak_rss_mb": round(max(s["peak_rss_mb"] for s in runs))})
            continue
        tps = [s["tokens"] / s["seconds"] for s in runs]
        row = {"row": name, "label": ROWS[name][1], "batch": batch, "tokens_per_s": round(statistics.median(tps), 1),
               "tokens_per_s_runs": [round(t, 1) for t in tps],
               "peak_rss_mb": round(max(s["peak_rss_mb"] for s in runs))}
        if "weight_mb" in runs[0]:
            row.update(weight_mb=round(runs[0]["weight_mb"]), kv_mb=round(runs[0]["kv_mb"]),
                       acceptance=runs[0]["acceptance"], kernel=runs[0]["kernel"])
            row["floor_tokens_per_s"] = round(bandwidth * 1e9 / (runs[0]["weight_mb"] * 2**20), 1)
        out.append(row)
    return out


def targets(rows: list[dict], bandwidth: float) -> list[dict]:
    def get(name, batch=1):
        return next((r for r in rows if r["row"] == name and r["batch"] == batch), None)

    checks = []
    plain, llama, base = get("engine"), get("llamacpp"), get("baseline")
    for r in rows:  # the default row and every kernel path's
        if r["batch"] == 1 and (r["row"] == "engine" or r["row"].startswith("engine@")):
            share = r["tokens_per_s"] / r["floor_tokens_per_s"]
            checks.append({"target": f"{r['row']} ({r['kernel']}): plain bf16 >= 50% of the bandwidth floor",
                           "value": round(share, 2), "met": share >= 0.5})
    fp32 = get("engine-fp32")
    if fp32 and plain:
        checks.append({"target": "fp32 no faster than bf16 (ratio fp32 / bf16)",
                       "value": round(fp32["tokens_per_s"] / plain["tokens_per_s"], 2),
                       "met": fp32["tokens_per_s"] <= plain["tokens_per_s"]})
    spec = [r for r in rows if r["batch"] == 1 and r["row"].startswith("engine") and r["row"].endswith("+lookup")]
    if spec and llama:
        best = max(spec, key=lambda r: r["tokens_per_s"])
        ratio = best["tokens_per_s"] / llama["tokens_per_s"]
        checks.append({"target": "best speculative >= 1.0x llama.cpp plain", "value": round(ratio, 2),
                       "row": best["row"], "met": ratio >= 1.0})
    int4_spec = get("engine-int4+lookup")
    if int4_spec and llama:
        ratio = int4_spec["tokens_per_s"] / llama["tokens_per_s"]
        checks.append({"target": "INT4 + n-gram >= 1.5x llama.cpp plain", "value": round(ratio, 2),
                       "met": ratio >= 1.5})
    baseline_mb = base["peak_rss_mb"] if base else 0
    for r in rows:
        if r["row"].startswith("engine") and "weight_mb" in r and r["batch"] == 1:
            limit = 1.5 * (r["weight_mb"] + r["kv_mb"]) + baseline_mb
            checks.append({"target": f"{r['row']} peak RSS <= 1.5 x (weights + KV) + baseline {baseline_mb} MB "
                                     f"({limit:.0f} MB)", "value": r["peak_rss_mb"], "met": r["peak_rss_mb"] <= limit})
    engine16 = [r for r in rows if r["batch"] == 16 and r["row"].startswith("engine")]
    llama16 = [r for r in rows if r["batch"] == 16 and r["row"].startswith("llamacpp")]
    if engine16 and llama16:
        best, theirs = max(r["tokens_per_s"] for r in engine16), max(r["tokens_per_s"] for r in llama16)
        checks.append({"target": "batch 16 >= 2x llama.cpp's best at 16 in flight", "value": round(best / theirs, 2),
                       "met": best >= 2 * theirs})
    return checks


def print_table(report: dict) -> None:
    print("\n| system | kernels | batch | tok/s (median) | of the floor | runs | peak RSS MB | weights MB | KV MB | "
          "acceptance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        floor = f"{r['tokens_per_s'] / r['floor_tokens_per_s']:.2f}" if r.get("floor_tokens_per_s") else ""
        print(f"| {r['label']} | {r.get('kernel', '')} | {r['batch']} | {r['tokens_per_s'] or ''} | {floor} | "
              f"{', '.join(map(str, r['tokens_per_s_runs']))} | {r['peak_rss_mb']} | {r.get('weight_mb', '')} | "
              f"{r.get('kv_mb', '')} | {'' if r.get('acceptance') is None else round(r['acceptance'], 2)} |")
    for name, why in report["skipped"].items():
        print(f"| {ROWS[name][1]} | | | n/a: {why} | | | | | | |")
    print(f"\nCopy bandwidth {report['bandwidth_gbs']} GB/s (read + write; the best of "
          f"{', '.join(map(str, report['bandwidth_gbs_rounds']))}, one per round), {report['threads']} threads, "
          f"{report['max_tokens']} new tokens per prompt, medians of {report['rounds']} alternating rounds, load "
          f"average {report['load_avg'][0]} before and {report['load_avg'][1]} after.")
    for c in report["targets"]:
        print(f"- {c['target']}: {c['value']} -> {'met' if c['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
