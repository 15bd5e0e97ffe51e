"""Batch-1 decode speed of each model family on the portable engine, against the Llama-shaped model, in one run.

Issue 54's speed target: on a random model of SmolLM2-135M's size in each family, bf16 batch-1 decoding reaches at
least 0.9x the fraction of the memory floor the Llama-shaped model reaches on the same machine in the same run. The
floor is the bytes a token reads (its layers' weights, for a mixture of experts only its top_k experts and the
router, plus the final norm, the lm_head and its embedding row) over the memory's bandwidth, which this script
measures with a copy; the ratio between families doesn't depend on that measurement (the bandwidth cancels).

Each family's model is random (tiny.py's writer, transformers' own class for the family) at SmolLM2-135M's shape:
30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, a tied 49152 vocabulary. The Qwen3-MoE model keeps the
same bytes a token reads in its MLPs: 32 experts of 384, 4 a token (4 x 384 = SmolLM2's 1536). Models alternate,
round after round, and each keeps its fastest round: a shared machine's slow spells only ever add time.

The MoE gate table (--gate): on a random Qwen3-MoE of SmolLM2's width (8 layers, 64 experts of 128, 4 a token),
throughput of a batch of greedy requests with n-gram drafts (K=4) at 1, 4, 16 and 64 requests, speculation off,
always on, and gated ("auto": the engine's gate and per-row planner over its calibrated cost model, with the
engine's defaults), the modes taking turns for GATE_ROUNDS rounds, each keeping its best, with the
router as initialized (random routing: a verify's tokens pick the most experts, the worst case) and skewed (four
experts' router rows scaled up, so most tokens pick them). Random models fall into loops that n-gram lookup then
drafts well, so drafts are accepted. Target: gated >= 0.97 x max(off, on) everywhere.

    python scripts/bench_families.py              # every family, 3 rounds of 64 tokens
    python scripts/bench_families.py --gate       # the MoE gate table too
    python scripts/bench_families.py --json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.models.shape import ModelShape
from pipeline.models.tiny import make_tiny_llama

SHAPE = dict(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab_size=49152, tie=True,
             init_std=0.02, max_positions=2048)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3"),
    "qwen3_moe": dict(model_type="qwen3_moe", moe=dict(num_experts=32, num_experts_per_tok=4,
                                                       moe_intermediate_size=384, norm_topk_prob=True)),
    # Gemma 3 1B's layout: 5 local layers (a window of 512) to a global one
    "gemma3": dict(model_type="gemma3_text", config=dict(sliding_window=512, query_pre_attn_scalar=64)),
}
TARGET = 0.9
GATE_MOE = dict(layers=8, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab_size=49152,
                tie=True, init_std=0.02, max_positions=2048, model_type="qwen3_moe",
                moe=dict(num_experts=64, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True))
GATE_BATCHES = (1, 4, 16, 64)
GATE_TARGET = 0.97
GATE_ROUNDS = 2
SKEW = 4.0  # the skewed router: experts 0-3's rows times this


def bytes_per_token(shape: ModelShape, elt: int = 2) -> int:
    """What one decoded token reads of the weights, in `elt`-byte elements."""
    h, vocab = shape.hidden_size, shape.vocab_size
    tables = vocab * h * (1 if shape.tie_word_embeddings else 2)  # the embedding and an untied lm_head
    return elt * (shape.active_param_count - tables + vocab * h + h)  # the lm_head whole, one embedding row


def copy_bandwidth() -> float:
    """Bytes a second a 256 MB copy moves (read and write), the fastest of 5."""
    a = torch.empty(128 << 20, dtype=torch.int16)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / best


def decode_s(engine: LLMEngine, tokens: int) -> float:
    """Seconds a token of batch-1 greedy decoding (the prompt's step left out)."""
    prompt = list(range(100, 116))
    engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    return (time.perf_counter() - t0 - first) / tokens


def skew_router(folder: Path) -> None:
    """Scale experts 0-3's router rows in every layer by SKEW, in place: most tokens then pick them."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            t[:4] *= SKEW
    save_file(tensors, path, metadata={"format": "pt"})


def gate_row(path: Path, batch: int, tokens: int, ceiling: int) -> dict:
    """Tokens/s of `batch` greedy requests of `tokens` tokens each, n-gram drafts, per speculation mode."""
    from pipeline.engine.calibrate import calibrate

    engine = LLMEngine.load(path, EngineConfig(max_batch_size=64, max_seq_len=256, dtype="bf16", num_draft_tokens=4,
                                               gate=GatePolicy.with_ceiling(ceiling)), draft="ngram")
    engine.cost_model = calibrate(engine, budget_s=20).cost
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 4000, (12,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up (short: nothing drafted, nothing learned)
    out = {"off": 0.0, "on": 0.0, "auto": 0.0}
    for round_ in range(GATE_ROUNDS):  # the modes take turns; each keeps its best round
        for mode in ("off", "on", "auto"):
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, params, speculation=mode)
            rate = sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)
            out[mode] = max(out[mode], rate)
            if mode == "auto" and round_ == 0:  # the engine's first gated batch: it has seen no draft yet
                out["auto_first"] = rate
            if mode == "on":
                out["acceptance"] = round(sum(r.num_accepted for r in reqs) / max(1, sum(r.num_drafted for r in reqs)),
                                          2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--gate", action="store_true", help="also the MoE gate table")
    ap.add_argument("--gate-tokens", type=int, default=48)
    ap.add_argument("--gate-ceiling", type=int, default=GatePolicy().max_batch_size,
                    help="the gate's ceiling (its operator bound); at the batch's size or above, the planner alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    families = ["llama", *(f for f in args.families if f != "llama")]
    with tempfile.TemporaryDirectory() as tmp:
        engines, shapes = {}, {}
        for name in families:
            path = make_tiny_llama(Path(tmp) / name, seed=0, **SHAPE, **FAMILIES[name])
            shapes[name] = ModelShape.from_folder(path)
            engines[name] = LLMEngine.load(path, EngineConfig(max_batch_size=1, max_seq_len=256, dtype="bf16"))
        best = {name: float("inf") for name in families}
        for _ in range(args.rounds):
            for name in families:
                best[name] = min(best[name], decode_s(engines[name], args.tokens))
        bandwidth = copy_bandwidth()
        gate = []
        if args.gate:
            for router in ("random", "skewed"):
                path = make_tiny_llama(Path(tmp) / f"gate-{router}", seed=1, **GATE_MOE)
                if router == "skewed":
                    skew_router(path)
                for batch in GATE_BATCHES:
                    r = gate_row(path, batch, args.gate_tokens, args.gate_ceiling)
                    gate.append({"router": router, "batch": batch, **{k: round(v, 1) if k != "acceptance" else v
                                                                      for k, v in r.items()},
                                 "gated_vs_best": round(r["auto"] / max(r["off"], r["on"]), 3)})
    rows = []
    base = bytes_per_token(shapes["llama"]) / best["llama"]
    for name in families:
        read = bytes_per_token(shapes[name])
        rows.append({"family": name, "tok_s": round(1 / best[name], 1), "mb_per_token": round(read / 1e6, 1),
                     "floor_fraction": round(read / best[name] / bandwidth, 3),
                     "ratio_to_llama": round(read / best[name] / base, 3),
                     "stack": engines[name].model.layer_stack() is not None})
    result = {"threads": args.threads, "copy_gb_s": round(bandwidth / 1e9, 1), "target": TARGET, "rows": rows,
              "gate": gate, "gate_target": GATE_TARGET}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"bf16, batch 1, {args.tokens} tokens, best of {args.rounds} rounds, {args.threads} threads; "
          f"copy {result['copy_gb_s']} GB/s")
    print(f"{'family':<11} {'tok/s':>7} {'MB/token':>9} {'of floor':>9} {'vs llama':>9}  C stack")
    for r in rows:
        ok = "" if r["family"] == "llama" else ("  met" if r["ratio_to_llama"] >= TARGET else "  NOT met")
        print(f"{r['family']:<11} {r['tok_s']:>7} {r['mb_per_token']:>9} {r['floor_fraction']:>9} "
              f"{r['ratio_to_llama']:>9}  {'yes' if r['stack'] else 'no'}{ok}")
    if gate:
        print(f"\nMoE gate: tok/s of a batch, n-gram drafts K=4, {args.gate_tokens} tokens a request")
        print(f"(best of {GATE_ROUNDS} rounds each; 'gated, first': the engine's first gated batch, before it had "
              "seen a draft checked)")
        print(f"{'router':<7} {'batch':>5} {'off':>8} {'on':>8} {'gated':>8} {'accept':>7} {'gated/best':>11} "
              f"{'gated, first':>13}")
        for g in gate:
            ok = "  met" if g["gated_vs_best"] >= GATE_TARGET else "  NOT met"
            print(f"{g['router']:<7} {g['batch']:>5} {g['off']:>8} {g['on']:>8} {g['auto']:>8} {g['acceptance']:>7} "
                  f"{g['gated_vs_best']:>11} {g['auto_first']:>13}{ok}")


if __name__ == "__main__":
    main()
