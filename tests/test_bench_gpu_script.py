"""scripts/bench_gpu.py (issue 40's GPU benchmark) runs end to end on a CPU in --smoke mode: every section, the
identity matrix all identical (the CPU engine is row-invariant by construction), self-draft acceptance exactly 1.0;
and its verdicts miss when a run differs or a bar isn't reached."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "bench_gpu.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the whole script in a subprocess, ~25 s: CI runs it, the fast loop keeps the checks below
def test_smoke_run_on_cpu_has_every_section_and_identical_greedy_output(tmp_path):
    bench = load()
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(out), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report  # --json prints what --out wrote
    assert "| shape" in done.stderr and "identity, all runs" in done.stderr  # the table, on stderr with --json
    assert report["smoke"] and report["copy_bandwidth_gb_s"] > 0
    assert set(report["shapes"]) == {"1b", "8b"}
    for key, shape in report["shapes"].items():
        sections = shape["sections"]
        assert set(sections) == set(bench.SECTIONS), key
        assert sections["kernels"]["status"] == "skipped"  # the engine's GPU kernels run on a GPU only
        bad = {name: s.get("error") for name, s in sections.items() if s["status"] != "ok" and name != "kernels"}
        assert not bad, (key, bad)
        assert shape["floor_tok_s"] > 0 and shape["weight_bytes"] > 0
        assert [r["batch"] for r in sections["plain"]["rows"]] == list(bench.SMOKE_SIZES.batches)
        assert sections["plain"]["rows"][0]["floor_fraction"] > 0
        assert sections["verify"]["ratio"] > 0 and sections["transformers_eager"]["tok_s"] > 0
        assert [r["batch"] for r in sections["vendor"]["rows"]] == [64, 1]

        identity = sections["identity"]
        assert identity["prompts"] == 8 and not identity["skipped"]
        assert set(identity["runs"]) == set(bench.IDENTITY_RUNS)
        for name, run in identity["runs"].items():
            assert run.get("identical") == 8, (key, name, run)
            assert run["first_diff"] == [None] * 8
        # The reference varies token to token: identity over a repeated token would check little.
        assert min(identity["baseline"]["distinct_tokens"]) > 10, identity["baseline"]
        assert all(n > 0 for n in identity["runs"]["prefix_cache"]["cached_prompt_tokens"])  # the hits happened
        assert identity["runs"]["chunked_prefill"]["prefill_steps"] > 8  # prompts took several steps

        assert identity["runs"]["self_draft"]["acceptance"] == 1.0
        spec = {r["proposer"]: r for r in sections["speculation"]["rows"]}
        assert set(spec) == set(bench.SPEC_KINDS) and not any("error" in r for r in spec.values()), spec
        assert spec["self_draft"]["acceptance"] == 1.0 and spec["self_draft"]["drafted_tokens"] > 0
        assert spec["eagle3"]["drafted_tokens"] > 0  # the random head proposed; rarely right, which is fine

    verdicts = {(t["shape"], t["target"].split(" ")[0]): t["met"] for t in report["targets"]}
    for key in ("1b", "8b"):
        assert verdicts[(key, "identity:")] is True and verdicts[(key, "self-draft")] is True


def test_verdicts_miss_on_a_differing_run_and_stay_open_on_a_skipped_one():
    bench = load()
    runs = {name: {"identical": 8, "first_diff": [None] * 8} for name in bench.IDENTITY_RUNS}
    runs["self_draft"].update(acceptance=1.0)

    def report(runs, skipped=None, acceptance=1.0, floor_fraction=0.7):
        sections = {
            "identity": {"prompts": 8, "runs": runs, "skipped": skipped or {}},
            "speculation": {"rows": [{"proposer": "self_draft", "acceptance": acceptance}]},
            "plain": {"rows": [{"batch": 1, "tok_s": 150.0, "floor_fraction": floor_fraction}]},
            "verify": {"ratio": 1.1},
            "transformers_eager": {"tok_s": 20.0},
            "vendor": {"rows": [{"batch": 64, "invariant_over_vendor": 0.69}]},
        }
        return {t["target"].split(" ")[0]: t for t in bench.targets(
            {"sizes": {"batches": [1, 8, 32, 64]}, "shapes": {"8b": {"sections": sections}}})}

    good = report(runs)
    assert good["identity:"]["met"] is True and good["self-draft"]["met"] is True
    assert good["plain"]["met"] is True and good["verify"]["met"] is True and good["engine"]["value"] == 7.5
    assert good["invariant"]["met"] is False  # 0.69 against 0.7
    differing = {**runs, "batch_64": {"identical": 7, "first_diff": [None] * 7 + [147]}}
    assert report(differing)["identity:"]["met"] is False
    failed = {**runs, "eagle3": {"error": "RuntimeError: boom"}}
    assert report(failed)["identity:"]["met"] is False
    partial = {k: v for k, v in runs.items() if k != "batch_4"}
    assert report(partial, skipped={"batch_4": "time"})["identity:"]["met"] is None
    assert report(runs, acceptance=0.89)["self-draft"]["met"] is False
    assert report(runs, floor_fraction=0.07)["plain"]["met"] is False
    assert bench.first_diff([1, 2, 3], [1, 2, 3]) is None and bench.first_diff([1, 5, 3], [1, 2, 3]) == 1
    assert bench.first_diff([1, 2], [1, 2, 3]) == 2


def test_the_script_needs_nothing_the_gpu_machine_lacks():
    """The GPU machine has torch, transformers, safetensors, triton and numpy, and no network to install more: the
    script and the engine modules it loads on first use must not pull in the pipeline's other dependencies."""
    others = ("click", "gguf", "modelopt", "pytriton", "tritonclient", "matplotlib", "fastapi", "pydantic",
              "uvicorn", "openai", "grpc")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('bench_gpu', {str(SCRIPT)!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['bench_gpu'] = module\n"
        "spec.loader.exec_module(module)\n"
        "import pipeline.engine.eagle3, pipeline.engine.weights\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from safetensors.torch import save_file\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({others!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
