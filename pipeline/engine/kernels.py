"""Which kernels a model's forwards run, chosen once for the device its weights are on and handed to every layer.

Three families, each keeping a row's bits its own whatever the batch (the lossless contract):
- **c**: the engine's C kernels on a CPU where they build (cpu_kernels: norms, rope + attention, the activations,
  the linears, the whole layer stack in one call);
- **triton**: the engine's Triton kernels on a GPU (gpu_kernels), or on a CPU under Triton's interpreter when a test
  asks for it (gpu_kernels.FORCE_ENV);
- **torch**: torch's ops, made row-invariant on a CPU (attention token by token, GELU row by row: `per_row`), and on
  a GPU the vendor's (cuBLAS and SDPA, `gpu_kernels="vendor"`: an explicit opt-out whose bits move with the batch).

`for_device` chooses; `use_kernels` hands the set to every layer of a model (LLMEngine does, for the target, a draft
model and an EAGLE-3 head alike). The forwards ask the set and never look at a tensor's device, as vLLM's layers ask
`current_platform`. A layer built on its own and never handed a set (a test of one module) runs AUTO, which asks the
tensor each call, as the engine did before the set existed.

A chosen set still runs torch's ops for a call the C kernels don't take: a dtype they lack, or autograd on (EAGLE-3
training through the target), or the kernels switched off inside cpu_kernels.disabled() (tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine import cpu_kernels, gpu_kernels


class KernelSet:
    name = "auto"

    def c(self, x: torch.Tensor) -> cpu_kernels.CpuKernels | None:
        """The C kernels for a forward on x, or None: torch's ops (or the Triton kernels, where `triton`)."""
        return cpu_kernels.for_tensor(x)

    def triton(self, x: torch.Tensor) -> bool:
        """Whether the engine's Triton kernels run this forward."""
        return gpu_kernels.runs_here(x)

    def per_row(self, x: torch.Tensor) -> bool:
        """Whether torch's ops must run a row (attention: a token) at a time to keep its bits: torch's CPU kernels
        pick their code path by shape."""
        return x.device.type == "cpu"

    def __repr__(self) -> str:
        return f"KernelSet({self.name})"


AUTO = KernelSet()


@dataclass(frozen=True, repr=False)
class Chosen(KernelSet):
    name: str  # c | triton | torch | vendor
    use_c: bool = False
    use_triton: bool = False
    on_cpu: bool = True

    def c(self, x: torch.Tensor) -> cpu_kernels.CpuKernels | None:
        return cpu_kernels.for_dtype(x) if self.use_c else None

    def triton(self, x: torch.Tensor) -> bool:
        return self.use_triton

    def per_row(self, x: torch.Tensor) -> bool:
        return self.on_cpu


def for_device(device: torch.device | str, gpu_choice: str = "invariant") -> Chosen:
    """The set for weights on `device`. gpu_choice: "invariant" (the engine's Triton kernels on a GPU) or "vendor"
    (config.GPU_KERNEL_CHOICES); a CPU's set doesn't depend on it."""
    device = torch.device(device)
    if device.type == "cuda":
        return Chosen("triton", use_triton=True, on_cpu=False) if gpu_choice == "invariant" else \
            Chosen("vendor", on_cpu=False)
    if gpu_kernels.runs_here(torch.empty(0, device=device)):  # a test: the GPU kernels under the interpreter
        return Chosen("triton", use_triton=True)
    return Chosen("c", use_c=True) if cpu_kernels.usable() else Chosen("torch")


def use_kernels(model: torch.nn.Module, kernels: KernelSet) -> None:
    """Hand `kernels` to every layer of model that runs one (those with a `kernels` attribute)."""
    for m in model.modules():
        if isinstance(getattr(type(m), "kernels", None), KernelSet):
            m.kernels = kernels
