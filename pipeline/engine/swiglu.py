"""The SwiGLU MLP, down(silu(gate(x)) * up(x)), with gate and up fused into one projection: a dense layer's MLP
(model.MLP) and each expert of a mixture (moe.SparseMoE) alike. SiLU-and-multiply runs as one C kernel on a CPU
(cpu_kernels.silu_mul), whose rounding is torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine import cpu_kernels
from pipeline.engine.linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up = Linear(hidden, 2 * inter, bias=False)
        self.down = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        kernels = cpu_kernels.for_tensor(gate_up)
        if kernels is not None:
            return self.down(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)
