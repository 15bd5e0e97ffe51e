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
    engine = dict(weight_mb=256.0, kv_mb=4.0, acceptance=0.3)
    samples = {
        ("llamacpp", 1): [run(640, 10, 220), run(600, 10, 221), run(700, 10, 219)],  # median 64 tok/s
        ("engine", 1): [run(300, 10, 500, **engine), run(400, 10, 510, **engine), run(350, 10, 505, **engine)],
        ("engine+lookup", 1): [run(700, 10, 520, **engine)] * 3,
        ("engine", 16): [run(2000, 10, 600, **engine)] * 3,
        ("llamacpp", 16): [run(640, 10, 220)] * 3,
    }
    bandwidth = 26.0  # GB/s: a 256 MiB model's floor is about 96.9 tok/s
    rows = bench.summarize(samples, bandwidth)
    plain = next(r for r in rows if r["row"] == "engine" and r["batch"] == 1)
    assert plain["tokens_per_s"] == 35.0 and plain["peak_rss_mb"] == 510
    assert plain["floor_tokens_per_s"] == round(26e9 / (256 * 2**20), 1)
    checks = {c["target"].split(" (")[0]: c for c in bench.targets(rows, bandwidth)}
    assert not checks["plain bf16 >= 50% of the bandwidth floor"]["met"]  # 35 of 96.9
    assert checks["best speculative >= 1.0x llama.cpp plain"]["met"]  # 70 against 64
    assert checks["best speculative >= 1.0x llama.cpp plain"]["value"] == round(70 / 64, 2)
    assert not checks["engine peak RSS <= 1.5 x weights + KV"]["met"]  # 510 MB against 388
    assert checks["batch 16 >= 2x llama.cpp's best at 16 in flight"]["met"]  # 200 against 64
