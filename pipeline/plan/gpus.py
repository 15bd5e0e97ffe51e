"""The GPUs `pipeline plan` knows: memory, bandwidth, FP8 support and architecture."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PlanError

MIB = 1024 ** 2


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_mib: int  # total device memory as nvidia-smi reports it
    bandwidth_tb_s: float  # HBM/GDDR bandwidth from the datasheet (SXM parts where there are two)
    fp8: bool  # FP8 tensor cores: Ada (sm89) and newer
    arch: str
    sm: int
    aliases: tuple[str, ...] = ()
    # Dense tensor-core peaks from the datasheets (SXM parts; without sparsity), for the roofline cost model that
    # sizes TensorRT-LLM's draft_len_schedule (pipeline.compiler.draft_schedule); 0 where the part has no FP8.
    bf16_tflops: float = 0.0
    fp8_tflops: float = 0.0

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("a100-40gb", "A100 40GB", 40960, 1.555, False, "Ampere", 80, ("a100-40",), 312.0, 0.0),
    GPU("a100-80gb", "A100 80GB", 81920, 2.039, False, "Ampere", 80, ("a100", "a100-80"), 312.0, 0.0),
    GPU("l40s", "L40S", 46068, 0.864, True, "Ada Lovelace", 89, ("l40s-48gb",), 362.0, 733.0),
    GPU("h100-80gb", "H100 80GB", 81559, 3.35, True, "Hopper", 90, ("h100", "h100-sxm"), 989.0, 1979.0),
    GPU("h200-141gb", "H200 141GB", 143771, 4.8, True, "Hopper", 90, ("h200",), 989.0, 1979.0),
    GPU("b200-180gb", "B200 180GB", 183359, 8.0, True, "Blackwell", 100, ("b200",), 2250.0, 4500.0),
)}
_BY_ALIAS: dict[str, GPU] = {alias: g for g in GPUS.values() for alias in (g.key, *g.aliases)}


def get_gpu(name: str) -> GPU:
    gpu = _BY_ALIAS.get(name.strip().lower().replace("_", "-"))
    if gpu is None:
        raise PlanError(f"unknown --gpu {name!r}; pick one of {', '.join(GPUS)}")
    return gpu


def detect_gpu() -> GPU | None:
    """The catalog entry for GPU 0 of this machine, from nvidia-smi; None without one or for an unknown part.

    Matched by name first (H100, H200, ...), then by nearest memory size within the name's family.
    """
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        name, mem = out.splitlines()[0].rsplit(",", 1)
        mem_mib = int(float(mem))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return match_gpu(name, mem_mib)


def match_gpu(name: str, memory_mib: int) -> GPU | None:
    """Pure part of detect_gpu: 'NVIDIA H100 80GB HBM3', 81559 -> h100-80gb."""
    family = [g for g in GPUS.values() if g.name.split()[0].lower() in name.lower()]
    if not family:
        return None
    return min(family, key=lambda g: abs(g.memory_mib - memory_mib))
