"""The gated MLP, down(act(gate(x)) * up(x)), with gate and up fused into one projection: a dense layer's MLP
(model.MLP) and each expert of a mixture (moe.SparseMoE) alike. act is SiLU (SwiGLU: Llama, Qwen) or GELU with
the tanh approximation (GeGLU: Gemma's gelu_pytorch_tanh). SiLU-and-multiply runs as one C kernel on a CPU
(cpu_kernels.silu_mul), whose rounding is torch's; GELU runs as torch's elementwise ops (an element's result is
its own inputs', whatever the batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.kernels import AUTO, KernelSet
from pipeline.engine.linear import Linear

ACTIVATIONS = ("silu", "gelu_tanh")


class SwiGLU(nn.Module):
    kernels: KernelSet = AUTO  # the model's (model.choose_kernels)

    def __init__(self, hidden: int, inter: int, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: one of {ACTIVATIONS}")
        self.inter, self.activation = inter, activation
        self.gate_up = Linear(hidden, 2 * inter, bias=False)
        self.down = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gelu = self.activation == "gelu_tanh"
        c = self.kernels.c(gate_up)
        if c is not None:
            return self.down(c.silu_mul(gate_up, "gelu_mul" if gelu else "silu_mul"))
        gate, up = gate_up.split(self.inter, dim=-1)
        if not gelu:
            return self.down(F.silu(gate) * up)
        if self.kernels.per_row(gate):  # row by row, see gelu_rows
            return self.down(gelu_rows(gate) * up)
        return self.down(F.gelu(gate, approximate="tanh") * up)


def gelu_rows(gate: torch.Tensor) -> torch.Tensor:
    """torch's tanh GELU on a CPU, one contiguous row per call. Its vectorized tanh (Sleef's) and the scalar one
    it runs on a vector's leftover elements can round differently, and which elements are leftovers follows the
    tensor's shape and how threads split it: whole rows alone put the same elements in the same lanes whatever
    the batch."""
    rows = gate.reshape(-1, gate.shape[-1])
    return torch.stack([F.gelu(r.contiguous(), approximate="tanh") for r in rows]).view(gate.shape)
