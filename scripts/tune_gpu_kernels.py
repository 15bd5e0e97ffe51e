"""Time the engine's GPU kernels at the shapes of a decode step, on one GPU: every tiling of each linear of
Llama-3.2-1B's and Llama-3.1-8B's shapes (and an EAGLE-3 head's), and the other kernels at batch 1 and 64.

A kernel's time is a CUDA graph of --repeats back-to-back calls replayed, over the repeats: no launch cost, as the
engine's graphed steps run them. A tiling is any (block_n, block_k, split, num_warps, num_stages): each is as
lossless as the next (a function of the weight's shape, never of the row count), so this only picks the fastest,
and checks that the pick gives a row the same bits alone as in calls of 3, 64 and 65 rows. The pick per shape is
the fastest at 1 row (a decode step), or among those within 3% of it the fastest at 64; --write puts the picks in
pipeline/engine/gpu_tiles/<GPU name>.json, which gpu_kernels.tiles_for reads (other shapes keep linear_tiles' rule).
Compiles run first, in parallel processes that fill Triton's disk cache.

    PYTHONPATH=. python scripts/tune_gpu_kernels.py --budget-s 100 --out tune.json --write
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

from pipeline.engine import gpu_kernels
from pipeline.engine.gpu_kernels import LinearTiles

VOCAB = 128256
MODELS = {  # hidden, intermediate, heads, kv heads, head dim
    "1b": (2048, 8192, 32, 8, 64),
    "8b": (4096, 14336, 32, 8, 128),
}


def linear_shapes(key: str) -> dict[str, tuple[int, int]]:
    H, I, nh, kv, hd = MODELS[key]
    shapes = {"qkv": ((nh + 2 * kv) * hd, H), "o": (H, nh * hd), "gate_up": (2 * I, H), "down": (H, I),
              "lm_head": (VOCAB, H)}
    return {f"{key}.{name}": s for name, s in shapes.items()}


def eagle3_shapes(key: str) -> dict[str, tuple[int, int]]:
    """An EAGLE-3 head's own linears (its fc over 3 captured layers, attention over [embedding, hidden], a
    32000-token head); its MLP and o are the target's shapes."""
    H, I, nh, kv, hd = MODELS[key]
    return {f"{key}.eagle3_fc": (H, 3 * H), f"{key}.eagle3_qkv": ((nh + 2 * kv) * hd, 2 * H),
            f"{key}.eagle3_head": (32000, H)}


def candidates(n: int, k: int) -> list[LinearTiles]:
    out = []
    for bn, bk, warps, stages, split in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4),
                                                           (1, 2, 4, 8)):
        if bn > n or k // split < 2 * bk or bk * bn > 128 * 128 or (bn == 16 and warps == 8):
            continue  # too few K-blocks a slice; more shared memory than an SM has; warps with nothing to do
        out.append(LinearTiles(bn, bk, split, warps, stages))
    return out


def _compile_some(tiles: list[tuple]) -> int:
    """A worker: compile each tiling (for bf16, 1 row) into Triton's disk cache; returns how many compiled."""
    done = 0
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(256, 1024, dtype=torch.bfloat16, device="cuda")
    for t in tiles:
        try:
            gpu_kernels.linear(x, w, tiles=LinearTiles(*t))
            done += 1
        except Exception:  # noqa: BLE001  too much shared memory, say: timed as failed later
            pass
    torch.cuda.synchronize()
    return done


def graph_us(fn, repeats: int) -> float:
    """Microseconds a call, from a CUDA graph of `repeats` calls (best of 3 replays)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeats):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / repeats)
    return best


def invariant(w: torch.Tensor, tiles: LinearTiles) -> bool:
    x = torch.randn(65, w.shape[1], device=w.device).to(w.dtype)
    alone = torch.cat([gpu_kernels.linear(x[i:i + 1], w, tiles=tiles) for i in range(65)])
    return all(torch.equal(gpu_kernels.linear(x[:n], w, tiles=tiles), alone[:n]) for n in (3, 64, 65))


def other_kernels(repeats: int) -> dict:
    """The 8B shape's other kernels per layer, at batch 1 and 64 (attention at position 383, a 384-token context)."""
    H, I, nh, kv, hd = MODELS["8b"]
    dev, dt = "cuda", torch.bfloat16
    out = {}
    bs, blocks = 16, 64 * 24 + 1
    ck = torch.randn(blocks, kv, bs, hd, device=dev).to(dt)
    cv = torch.randn(blocks, kv, bs, hd, device=dev).to(dt)
    for B in (1, 64):
        x = torch.randn(B, 1, H, device=dev).to(dt)
        r = torch.randn(B, 1, H, device=dev).to(dt)
        wn = torch.ones(H, device=dev, dtype=dt)
        out[f"rms_norm_residual_b{B}"] = graph_us(lambda: gpu_kernels.rms_norm(x, wn, 1e-5, residual=r), repeats)
        gu = torch.randn(B, 1, 2 * I, device=dev).to(dt)
        out[f"silu_mul_torch_b{B}"] = graph_us(
            lambda: torch.nn.functional.silu(gu[..., :I]) * gu[..., I:], repeats)
        table = torch.arange(1, B * 24 + 1, device=dev).view(B, 24)
        pos = torch.full((B, 1), 383, device=dev)
        q = torch.randn(B, 1, nh, hd, device=dev).to(dt)
        out[f"paged_attention_b{B}"] = graph_us(lambda: gpu_kernels.paged_attention(q, ck, cv, table, pos), repeats)
        qkv = torch.randn(B, 1, nh + 2 * kv, hd, device=dev).to(dt)
        cos = torch.randn(B, 1, 1, hd, device=dev).to(dt)
        sin = torch.randn(B, 1, 1, hd, device=dev).to(dt)
        out[f"rope_and_write_b{B}"] = graph_us(
            lambda: gpu_kernels.rope_and_write(qkv, cos, sin, ck, cv, table, pos, nh, kv), repeats)
    return {k: round(v, 2) for k, v in out.items()}


def write_table(report: dict) -> Path:
    """The picks (those that kept a row's bits) as gpu_kernels.tiles_for reads them, written whole or not at all."""
    name = report["gpu"]
    tiles = {}
    for r in report["linears"].values():
        if r.get("pick") and r.get("pick_invariant"):
            tiles[f"{r['n']}x{r['k']}"] = {**r["pick"]["tiles"], "us_m1": r["pick"]["us_m1"],
                                          "us_m64": r["pick"]["us_m64"], "vendor_us_m1": r["vendor_us_m1"],
                                          "vendor_us_m64": r["vendor_us_m64"]}
    path = gpu_kernels.TILES_DIR / gpu_kernels.tiles_file_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpu": name, "sms": report["sms"], "torch": torch.__version__,
                               "measured": f"scripts/tune_gpu_kernels.py, {time.strftime('%Y-%m-%d')}, a CUDA graph "
                                           f"of {report['repeats']} calls, best of 3 replays", "tiles": tiles},
                              indent=1) + "\n")
    tmp.replace(path)
    gpu_kernels.tuned_tiles.cache_clear()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--workers", type=int, default=14, help="processes compiling the tilings first")
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--out", help="the whole report (every tiling's times) as JSON")
    ap.add_argument("--write", action="store_true", help="write the picks to pipeline/engine/gpu_tiles/")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        sys.exit("tune_gpu_kernels: no GPU here; run it on one (it times CUDA graphs)")
    shapes = {}
    keys = [k.strip() for k in args.models.split(",")]
    for key in keys:  # most telling first: the budget may end the list
        shapes.update(linear_shapes(key))
    for key in keys:
        shapes.update(eagle3_shapes(key))
    sms = gpu_kernels.sm_count(torch.device("cuda"))
    every = sorted({(t.block_n, t.block_k, 1 if t.split == 1 else 2, t.num_warps, t.num_stages)
                    for s in shapes.values() for t in candidates(*s)})
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        compiled = sum(pool.map(_compile_some, [every[i::args.workers] for i in range(args.workers)]))
    print(f"[{time.perf_counter() - t0:5.1f}s] compiled {compiled} of {len(every)} kernels in {args.workers} "
          "processes", file=sys.stderr, flush=True)
    report = {"gpu": torch.cuda.get_device_name(), "sms": sms, "repeats": args.repeats, "linears": {}}
    report["other_kernels_us"] = other_kernels(args.repeats)
    print(f"[{time.perf_counter() - t0:5.1f}s] other kernels {report['other_kernels_us']}", file=sys.stderr,
          flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in shapes.items():
        if time.perf_counter() - t0 > args.budget_s:
            report["linears"][name] = {"skipped": "out of time"}
            continue
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
        mb = n * k * 2 / 1e6
        rows = []
        for t in candidates(n, k):
            try:
                us1 = graph_us(lambda: gpu_kernels.linear(x[:1], w, tiles=t), args.repeats)
                us64 = graph_us(lambda: gpu_kernels.linear(x, w, tiles=t), args.repeats)
            except Exception as e:  # noqa: BLE001
                torch.cuda.synchronize()
                rows.append({"tiles": t.__dict__, "error": str(e).splitlines()[0][:120]})
                continue
            rows.append({"tiles": t.__dict__, "us_m1": round(us1, 2), "us_m64": round(us64, 2),
                         "gb_s_m1": round(mb / us1 * 1e3, 1)})
        ok = [r for r in rows if "us_m1" in r]
        current = gpu_kernels.linear_tiles(n, k, sms)
        cur = next((r for r in ok if r["tiles"] == current.__dict__), None)
        best1 = min(ok, key=lambda r: r["us_m1"])
        best_sum = min(ok, key=lambda r: r["us_m1"] + r["us_m64"])
        pick = min((r for r in ok if r["us_m1"] <= 1.03 * best1["us_m1"]), key=lambda r: r["us_m64"])
        vendor1 = graph_us(lambda: torch.nn.functional.linear(x[:1], w), args.repeats)
        vendor64 = graph_us(lambda: torch.nn.functional.linear(x, w), args.repeats)
        top = sorted(ok, key=lambda r: r["us_m1"])[:8]
        report["linears"][name] = {
            "n": n, "k": k, "mb": round(mb, 1), "current": cur, "best_m1": best1, "best_m1_plus_m64": best_sum,
            "pick": pick, "pick_invariant": invariant(w, LinearTiles(**pick["tiles"])),
            "vendor_us_m1": round(vendor1, 2),
            "vendor_us_m64": round(vendor64, 2), "vendor_gb_s_m1": round(mb / vendor1 * 1e3, 1), "top_m1": top,
            "tried": len(rows), "failed": len(rows) - len(ok)}
        r = report["linears"][name]
        print(f"[{time.perf_counter() - t0:5.1f}s] {name} {n}x{k} ({mb:.0f} MB): current "
              f"{cur and cur['us_m1']}/{cur and cur['us_m64']} us, pick {pick['us_m1']}/{pick['us_m64']} us "
              f"{pick['tiles']} ({pick['gb_s_m1']} GB/s); cuBLAS {r['vendor_us_m1']}/{r['vendor_us_m64']} us; "
              f"invariant {r['pick_invariant']}", file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if args.write:
        report["wrote"] = str(write_table(report))
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text if not args.out else f"wrote {args.out}")


if __name__ == "__main__":
    main()
