"""Linear layers whose weights can be re-laid-out for the device that runs them.

At small batch a decode step is a string of matrix-vector products, bound by how fast the weights
stream from memory. On a CPU, PyTorch's default fp32 path (MKL sgemm on an [out, in] weight) streams
at well under half the memory bandwidth for M = 1..16 rows, while oneDNN on a weight reordered once
into its own blocked layout streams much closer to it, for fp32 and bf16 alike. So on a CPU each
linear's weight is packed once at load time (`pack_linears`), and the forward calls oneDNN directly.
A bf16 weight on a CPU with AMX goes to the engine's own AMX kernel instead (cpu_kernels.bf16_linear:
cheaper to call, faster at 1-32 rows, and batch-independent without padding or splitting).

Elsewhere (CUDA, or a torch built without oneDNN) nothing changes: `F.linear` on the plain weight.
The plain `weight` parameter is kept (the checkpoint layout, state_dict, `.to()`); packing is a
derived copy, rebuilt by calling `pack_linears` again after moving or casting the model.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine import cpu_kernels

# "auto": pack for oneDNN on CPU when available, for weights of at least PACK_MIN_BYTES;
# "onednn": pack every weight (tests); "torch": plain F.linear everywhere.
_BACKEND_ENV = "PIPELINE_LINEAR"
# A oneDNN call costs ~10-30 us more than F.linear. That only pays back when the weight streams
# from DRAM; a weight that stays in L2 (tiny drafts, test models) is faster through F.linear.
PACK_MIN_BYTES = 256 << 10
# Rows per CPU call, (fewest, most), per kernel. A row's result must not depend on how many other
# rows share the call: that keeps greedy output the same alone, in a batch, and under speculation
# (whose verify feeds k+1 rows per request). Both kernels pick their code path by the row count:
# oneDNN gives every row its solo bits for 4..32 rows and other bits past 32; torch's fp32 matmul
# (MKL) runs a matrix-vector kernel for 1 row and changes kernel again at 16 (measured for every
# SmolLM2 shape, bf16 and fp32, up to 300 rows). So a call is padded up to the fewest with zero rows and
# split at the most. Padding 1-2 rows to 4 also streams oneDNN's weight faster (measured on the real
# model, 2 threads: fp32 16 vs 20/24 ms for all linears, bf16 10 vs 12/13 ms). The split costs
# prefill about 2x in the linears for long prompts (a 1024-token prompt: 0.2 -> 0.4 s); decode steps
# of up to 32 rows are unchanged.
ONEDNN_ROWS = (4, 32)
TORCH_ROWS = (4, 8)


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """nn.Linear's parameters and semantics, plus an optional device-specific packed weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in `layout`, or None
        self.layout: str | None = None  # "amx" (cpu_kernels.bf16_linear) or "onednn"
        self._pad: tuple[int, torch.Tensor | None] = (0, None)  # (thread, buffer): see _pad_buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        p = self.packed
        if self.layout == "amx":  # any number of rows in one call: AMX gives each row its bits alone
            kernels = cpu_kernels.for_tensor(x)
            if kernels is None:  # the kernels switched off (tests compare): the same weights, through torch
                return F.linear(x, cpu_kernels.unpair_blocks(p), self.bias)
            y = kernels.bf16_linear(x, p).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if p is not None and x.dtype == p.dtype:
            kernel, (fewest, most) = self._onednn, ONEDNN_ROWS
        else:
            kernel, (fewest, most) = self._torch, TORCH_ROWS
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if fewest <= rows <= most:  # one call as it stands: most decode steps (the loop below costs ~10 us)
            return kernel(flat).view(*x.shape[:-1], self.out_features)
        if rows < fewest:  # a batch-1 decode step: into a padded buffer, one copy instead of zeros + cat
            pad = self._pad_buffer(fewest, flat)
            pad[:rows].copy_(flat)
            return kernel(pad)[:rows].view(*x.shape[:-1], self.out_features)
        out = []
        for i in range(0, rows, most):
            chunk = flat[i:i + most]
            n = chunk.shape[0]
            if n < fewest:
                chunk = torch.cat([chunk, chunk.new_zeros(fewest - n, self.in_features)])
            out.append(kernel(chunk)[:n])
        y = out[0] if len(out) == 1 else torch.cat(out)
        return y.view(*x.shape[:-1], self.out_features)

    def _pad_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, in_features] input buffer for short calls, owned by the calling thread: another thread
        finds the owner differs and makes its own, so two threads' forwards never share one. Its rows past a
        call's own hold an earlier call's values: harmless, as a row's result never depends on another row
        (see ONEDNN_ROWS)."""
        owner, buf = self._pad
        if owner != threading.get_ident() or buf is None or buf.shape[0] < rows or buf.dtype != like.dtype:
            buf = like.new_zeros(rows, self.in_features)
            self._pad = (threading.get_ident(), buf)
        return buf

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def release_plain(self) -> None:
        """Hold the weight once: keep the packed copy and make the plain one shape-only (meta). Needs a
        packed copy; after this the module can't be re-packed, cast or moved."""
        if self.packed is None:
            raise ValueError("release_plain needs a packed weight")
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def pack(self, backend: str | None = None) -> None:
        backend = backend or os.environ.get(_BACKEND_ENV, "auto")
        w = self.weight
        if w.is_meta and self.packed is not None:
            raise ValueError("this linear's plain weight was released (load_transformer(keep_plain=False)); "
                             "load the model again to pack it another way")
        self.packed, self.layout = None, None
        if backend == "torch" or w.device.type != "cpu" or w.is_meta:
            return
        if backend == "auto" and w.dtype == torch.bfloat16 and self._amx_available():
            self.packed, self.layout = cpu_kernels.pair_blocks(w.detach()), "amx"
            return
        if not _onednn_available():
            return
        if w.dtype not in (torch.float32, torch.bfloat16):
            return
        if backend == "auto" and w.numel() * w.element_size() < PACK_MIN_BYTES:
            return
        if backend not in ("auto", "onednn"):
            raise ValueError(f"unknown linear backend {backend!r}; use auto, onednn or torch")
        with torch.no_grad():
            # No batch-size hint: oneDNN then picks a blocked layout that is good for M = 1..16
            # rows alike (a hint of 1 is ~1.5x slower at M = 4-16 in fp32 and no faster at M = 1).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self.layout = "onednn"

    def _amx_available(self) -> bool:
        # Whatever the size: a ctypes call costs less than F.linear's, so tiny models (tests) take it too.
        return (cpu_kernels.usable() and cpu_kernels.load().amx
                and cpu_kernels.amx_layout_reason(self.out_features, self.in_features) is None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.layout}")


def pack_linears(model: nn.Module, backend: str | None = None) -> nn.Module:
    """(Re)build the packed weights of every engine Linear in `model` for its current device/dtype."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.pack(backend)
    return model
