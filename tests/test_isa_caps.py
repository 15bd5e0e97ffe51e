"""The identity and batch-invariance tests (`-m identity`) under every instruction-set cap this CPU can run, so
what passes here passes on a user's CPU with less: issue 27 found greedy speculation lossless on an AMX machine
and not on an Ice Lake Xeon (AVX-512 without bf16 instructions).

Each cap is a pytest run in a fresh process, as a user's machine would start one:
- the engine's own kernels built as each code path (PIPELINE_KERNELS: portable, avx2, avx512; the native
  build, AMX on a CPU with it, is the rest of the suite's run);
- oneDNN and ATen capped alongside (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), for what still reaches them;
- the kernels off, so the vendor GEMMs and their load-time row check run, under the same caps.

The CPU's own flags decide which caps run: a build for instructions the CPU lacks would die of an illegal
instruction, so it is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engine import cpu_kernels

ROOT = Path(__file__).parent.parent
# name -> (PIPELINE_KERNELS, the vendor caps): a CPU of each kind the engine meets.
# The native build (AMX where the CPU has it) is the rest of the suite's own run.
CAPS = {
    "portable": ("portable", {}),
    "avx2 machine": ("avx2", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}),
    "ice lake": ("avx512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
    "no kernels, ice lake": ("off", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ATEN_CPU_CAPABILITY": "avx2"}),
}
# Run once in this session already (it builds every cap itself): not again per cap.
ONCE = "tests/test_cpu_kernels.py::test_every_build_this_cpu_runs_computes_the_same_bits"


def identity_files() -> list[str]:
    """The test files that mark tests `identity`: a cap's run collects only these (under a second) instead of the
    whole tree (about 9 s of imports, four times over)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.identity" in p.read_text())


def _refusal(kernels: str, vendor: dict) -> str | None:
    if kernels not in ("off", "auto") and (why := cpu_kernels.isa_refusal(kernels)):
        return why
    if vendor.get("ATEN_CPU_CAPABILITY") == "avx2" and "avx2" not in cpu_kernels._cpu_flags().split():
        return "ATEN_CPU_CAPABILITY=avx2 needs AVX2"
    return None


@pytest.mark.slow  # four pytest runs of the identity tests, about 30 s each
@pytest.mark.parametrize("cap", list(CAPS))
def test_the_identity_tests_pass_under_the_cap(cap, tmp_path, tmp_path_factory):
    kernels, vendor = CAPS[cap]
    if why := _refusal(kernels, vendor):
        pytest.skip(why)
    # Under xdist the run inherits its worker's one thread (conftest.py): two would contend with the other worker
    # (84 s instead of 28). The kernels' threaded path is still compared with the one-thread path, end to end: the
    # served tests' engines compute on the machine's threads and must answer as the in-process engine does.
    env = {**os.environ, "PIPELINE_KERNELS": kernels, **vendor, "PIPELINE_HOME": str(tmp_path / "home"),
           # one ModelOpt export a format for the four runs (test_quantized_engine.py's export())
           "PIPELINE_TEST_EXPORTS": str(tmp_path_factory.getbasetemp() / "caps-exports")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "identity and not slow",
           "--deselect", ONCE, *identity_files()]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else done.stderr.strip().splitlines()[-3:]
    assert done.returncode == 0, f"under {cap} ({kernels}, {vendor}): {summary}\n{done.stdout[-3000:]}"
    assert " passed" in summary[0], summary
