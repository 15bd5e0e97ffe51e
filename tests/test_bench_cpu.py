"""scripts/bench_cpu.py's arithmetic: medians over rounds, the bandwidth floor, and each target met or missed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_cpu.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(tokens, seconds, rss, **extra):
    return {"tokens": tokens, "seconds": seconds, "peak_rss_mb": rss, **extra}


def test_medians_floor_and_targets():
    bench = load()
    engine = dict(weight_mb=256.0, kv_mb=4.0, acceptance=0.3, kernel="avx512")
    samples = {
        ("baseline", 1): [run(0, 1, 230)] * 3,
        ("llamacpp", 1): [run(640, 10, 220), run(600, 10, 221), run(700, 10, 219)],  # median 64 tok/s
        ("engine", 1): [run(300, 10, 500, **engine), run(400, 10, 510, **engine), run(350, 10, 505, **engine)],
        ("engine@avx2", 1): [run(600, 10, 500, **{**engine, "kernel": "avx2"})] * 3,  # 60 of 96.9: met
        ("engine-fp32", 1): [run(380, 10, 700, **{**engine, "weight_mb": 512.0})] * 3,  # faster than bf16's 35
        ("engine+lookup", 1): [run(700, 10, 520, **engine)] * 3,
        ("engine-int4+lookup", 1): [run(900, 10, 300, **{**engine, "weight_mb": 100.0})] * 3,  # 90: 1.41x of 64
        ("engine", 16): [run(2000, 10, 600, **engine)] * 3,
        ("llamacpp", 16): [run(640, 10, 220)] * 3,
    }
    bandwidth = 26.0  # GB/s: a 256 MiB model's floor is about 96.9 tok/s
    rows = bench.summarize(samples, bandwidth)
    plain = next(r for r in rows if r["row"] == "engine" and r["batch"] == 1)
    assert plain["tokens_per_s"] == 35.0 and plain["peak_rss_mb"] == 510 and plain["kernel"] == "avx512"
    assert plain["floor_tokens_per_s"] == round(26e9 / (256 * 2**20), 1)
    assert next(r for r in rows if r["row"] == "baseline")["tokens_per_s"] is None
    checks = {c["target"].split(" ->")[0]: c for c in bench.targets(rows, bandwidth)}

    def check(start: str) -> dict:
        [found] = [c for name, c in checks.items() if name.startswith(start)]
        return found

    assert not check("engine (avx512): plain bf16 >= 50% of the bandwidth floor")["met"]  # 35 of 96.9
    assert check("engine@avx2 (avx2): plain bf16 >= 50%")["met"]  # 60 of 96.9
    assert not check("fp32 no faster than bf16")["met"] and check("fp32 no faster")["value"] == round(38 / 35, 2)
    assert check("best speculative >= 1.0x llama.cpp plain")["met"]  # 90 against 64
    assert check("best speculative >= 1.0x llama.cpp plain")["value"] == round(90 / 64, 2)
    assert not check("INT4 + n-gram >= 1.5x llama.cpp plain")["met"]  # 90 against 64: 1.41x
    # 1.5 x (256 + 4) + the baseline's 230 = 620 MB: 510 is within; fp32's 700 against 1.5 x 516 + 230 = 1004 too
    assert check("engine peak RSS <= 1.5 x (weights + KV) + baseline 230 MB (620 MB)")["met"]
    assert check("batch 16 >= 2x llama.cpp's best at 16 in flight")["met"]  # 200 against 64
