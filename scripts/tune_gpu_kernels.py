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
import os
import sys
import time
from pathlib import Path

import torch

from pipeline.engine import gpu_kernels
from pipeline.engine.cuda_graphs import graph_time_ms
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
    """Microseconds a call, from a CUDA graph of `repeats` calls (cuda_graphs.graph_time_ms). On a CPU (--smoke,
    under Triton's interpreter: a check of this script, not a measurement) the calls' wall time."""
    if not torch.cuda.is_available():
        fn()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) * 1e6 / repeats
    return 1e3 * graph_time_ms(fn, repeats)


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


def write_table(report: dict, folder: Path | None = None) -> Path:
    """The picks (those that kept a row's bits) as gpu_kernels.tiles_for reads them, written whole or not at all."""
    name = report["gpu"]
    tiles = {}
    for r in report["linears"].values():
        if r.get("pick") and r.get("pick_invariant"):
            tiles[f"{r['n']}x{r['k']}"] = {**r["pick"]["tiles"], "us_m1": r["pick"]["us_m1"],
                                          "us_m64": r["pick"]["us_m64"], "vendor_us_m1": r["vendor_us_m1"],
                                          "vendor_us_m64": r["vendor_us_m64"]}
    path = (folder or gpu_kernels.TILES_DIR) / gpu_kernels.tiles_file_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpu": name, "sms": report["sms"], "torch": torch.__version__,
                               "measured": "--smoke: the CPU under Triton's interpreter, no measurement"
                               if report.get("smoke") else f"scripts/tune_gpu_kernels.py, {time.strftime('%Y-%m-%d')}, "
                               f"a CUDA graph of {report['repeats']} calls, best of 3 replays", "tiles": tiles},
                              indent=1) + "\n")
    tmp.replace(path)
    gpu_kernels.tuned_tiles.cache_clear()
    return path


SMOKE_SHAPES = {"smoke.narrow": (32, 512), "smoke.wide": (64, 256)}


def tune_shape(n: int, k: int, dev: str, sms: int, repeats: int, tries: list[LinearTiles], deadline: float,
               g: torch.Generator) -> dict:
    """Every tiling in `tries` of an [n, k] bf16 weight, timed at 1 and 64 rows, and the pick (see the module)."""
    w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, k, generator=g, device=dev).to(torch.bfloat16)
    mb = n * k * 2 / 1e6
    rows = []
    for t in tries:
        if time.perf_counter() > deadline:
            break
        try:
            us1 = graph_us(lambda: gpu_kernels.linear(x[:1], w, tiles=t), repeats)
            us64 = graph_us(lambda: gpu_kernels.linear(x, w, tiles=t), repeats)
        except Exception as e:  # noqa: BLE001  too much shared memory, say: recorded, the next one runs
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rows.append({"tiles": t.__dict__, "error": str(e).splitlines()[0][:120] if str(e) else type(e).__name__})
            continue
        rows.append({"tiles": t.__dict__, "us_m1": round(us1, 2), "us_m64": round(us64, 2),
                     "gb_s_m1": round(mb / us1 * 1e3, 1)})
    ok = [r for r in rows if "us_m1" in r]
    out = {"n": n, "k": k, "mb": round(mb, 1), "tried": len(rows), "of": len(tries), "failed": len(rows) - len(ok)}
    if not ok:
        return out
    current = gpu_kernels.linear_tiles(n, k, sms)
    best1 = min(ok, key=lambda r: r["us_m1"])
    pick = min((r for r in ok if r["us_m1"] <= 1.03 * best1["us_m1"]), key=lambda r: r["us_m64"])
    vendor1 = graph_us(lambda: torch.nn.functional.linear(x[:1], w), repeats)
    vendor64 = graph_us(lambda: torch.nn.functional.linear(x, w), repeats)
    out.update(current=next((r for r in ok if r["tiles"] == current.__dict__), None), best_m1=best1, pick=pick,
               pick_invariant=invariant(w, LinearTiles(**pick["tiles"])), vendor_us_m1=round(vendor1, 2),
               vendor_us_m64=round(vendor64, 2), vendor_gb_s_m1=round(mb / vendor1 * 1e3, 1),
               top_m1=sorted(ok, key=lambda r: r["us_m1"])[:8])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--workers", type=int, default=14, help="processes compiling the tilings first")
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--out", help="the whole report (every tiling's times) as JSON")
    ap.add_argument("--write", action="store_true", help="write the picks to --tiles-dir")
    ap.add_argument("--tiles-dir", default=str(gpu_kernels.TILES_DIR))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under Triton's interpreter: a check of this script, no measurement")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.smoke:  # before anything imports Triton
        os.environ.update({"TRITON_INTERPRET": "1", gpu_kernels.FORCE_ENV: "1"})
    elif not torch.cuda.is_available():
        sys.exit("tune_gpu_kernels: no GPU here; run it on one (it times CUDA graphs), or --smoke to check it")
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        shapes = dict(SMOKE_SHAPES)
        args.repeats, args.workers = min(args.repeats, 2), 0
    else:
        shapes = {}
        keys = [k.strip() for k in args.models.split(",")]
        for key in keys:  # most telling first: the budget may end the list
            shapes.update(linear_shapes(key))
        for key in keys:
            shapes.update(eagle3_shapes(key))
    tries = {name: candidates(*s) for name, s in shapes.items()}
    if args.smoke:  # the interpreter ignores warps and stages; a few tilings check the loop
        tries = {name: [t for t in ts if (t.num_warps, t.num_stages) == (4, 3)][::3] for name, ts in tries.items()}
    sms = gpu_kernels.sm_count(torch.device(dev))
    if args.workers:
        every = sorted({(t.block_n, t.block_k, 1 if t.split == 1 else 2, t.num_warps, t.num_stages)
                        for ts in tries.values() for t in ts})
        with mp.get_context("spawn").Pool(args.workers) as pool:
            compiled = sum(pool.map(_compile_some, [every[i::args.workers] for i in range(args.workers)]))
        log(t0, f"compiled {compiled} of {len(every)} kernels in {args.workers} processes")
    report = {"gpu": gpu_kernels.gpu_name(torch.device(dev)), "sms": sms, "repeats": args.repeats,
              "smoke": args.smoke, "linears": {}}
    if not args.smoke:
        try:
            report["other_kernels_us"] = other_kernels(args.repeats)
        except Exception as e:  # noqa: BLE001  the linears are what this run is for
            report["other_kernels_us"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        log(t0, f"other kernels {report['other_kernels_us']}")
    g = torch.Generator(device=dev).manual_seed(0)
    deadline = t0 + args.budget_s
    for name, (n, k) in shapes.items():
        if time.perf_counter() > deadline:
            report["linears"][name] = {"n": n, "k": k, "skipped": "out of time"}
            continue
        r = report["linears"][name] = tune_shape(n, k, dev, sms, args.repeats, tries[name], deadline, g)
        if "pick" in r:
            cur, pick = r["current"] or {}, r["pick"]
            log(t0, f"{name} {n}x{k} ({r['mb']:.0f} MB), {r['tried']} of {r['of']} tilings: the rule's "
                    f"{cur.get('us_m1')}/{cur.get('us_m64')} us, pick {pick['us_m1']}/{pick['us_m64']} us "
                    f"{pick['tiles']} ({pick['gb_s_m1']} GB/s); cuBLAS {r['vendor_us_m1']}/{r['vendor_us_m64']} us; "
                    f"a row's bits kept: {r['pick_invariant']}")
        else:
            log(t0, f"{name} {n}x{k}: no tiling ran ({r['failed']} failed)")
        save(report, args.out)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if args.write:
        report["wrote"] = str(write_table(report, Path(args.tiles_dir)))
        log(t0, f"wrote {report['wrote']}")
    save(report, args.out)
    if not args.out:
        print(json.dumps(report, indent=1))


def log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def save(report: dict, out: str | None) -> None:
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(out)


if __name__ == "__main__":
    main()
