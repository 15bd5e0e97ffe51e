"""Linear layers whose weights are re-laid-out for the device that runs them, so that a row's result never
depends on the rows beside it.

That property is what keeps greedy output the same alone, in a batch and under speculation (whose verify
feeds k+1 rows per request where a decode feeds 1). On a CPU each linear's weight is re-laid once at load
(`pack_linears`) for the engine's own C kernels (cpu_kernels.c), which compute every output in a fixed order:
- bf16 on a CPU with AMX: cpu_kernels.bf16_linear, the tile unit computing each row on its own;
- bf16 and fp32 elsewhere: cpu_kernels.dense_linear (AVX-512, AVX2 or portable C; the same bits on each).
A decode step at small batch streams the weights, and both stream them at about the memory's pace.

Without the kernels (no C compiler, PIPELINE_KERNELS=off), a vendor kernel runs: oneDNN on a weight it
reordered once (for weights of PACK_MIN_BYTES and up), or F.linear. Those change their code path with the row
count, so their calls are padded and split to a range of row counts (ONEDNN_ROWS, TORCH_ROWS), and
row_invariance checks at load that the range gives each row its bits on this CPU; where it doesn't, the layer
calls the kernel one row at a time (layout "rowwise").

On a GPU the plain weight runs on the engine's Triton kernel (gpu_kernels.linear: tiles and K-slices fixed by
the weight's shape), or on `F.linear` (cuBLAS) where gpu_kernels="vendor" opts out of invariance. The plain `weight` parameter is kept (the
checkpoint layout, state_dict, `.to()`); packing is a derived copy, rebuilt by calling `pack_linears` again
after moving or casting the model.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine import cpu_kernels, gpu_kernels, row_invariance
from pipeline.engine.kernels import AUTO, KernelSet

# PIPELINE_LINEAR: "auto" (the default): the engine's C kernels on a CPU where they are built, else a checked
# vendor kernel; "onednn": oneDNN for every weight (tests), checked; "torch": F.linear, checked.
_BACKEND_ENV = "PIPELINE_LINEAR"
# A oneDNN call costs ~10-30 us more than F.linear. That only pays back when the weight streams
# from DRAM; a weight that stays in L2 (tiny drafts, test models) is faster through F.linear.
PACK_MIN_BYTES = 256 << 10
# Rows per vendor call, (fewest, most), per kernel: a call is padded up to the fewest with other rows and split
# at the most, because both kernels pick their code path by the row count. oneDNN gave every row its solo bits
# for 4..32 rows on AMX and AVX-512-BF16 CPUs, and MKL's fp32 for 4..8 on some (measured for every SmolLM2 shape);
# row_invariance checks the range on the running CPU. Padding 1-2 rows to 4 also streams oneDNN's weight faster.
ONEDNN_ROWS = (4, 32)
TORCH_ROWS = (4, 8)
OWN_LAYOUTS = ("amx", "dense")  # the engine's C kernels: row-invariant by construction
VENDOR_LAYOUTS = ("onednn", "torch", "rowwise")


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _onednn_reorder(w: torch.Tensor) -> torch.Tensor | None:
    """w in oneDNN's own blocked layout, or None where oneDNN can't run this dtype here: its bf16 path needs
    AVX-512BW/VL/DQ or AVX-NE-CONVERT, and refuses on an AVX2 CPU (or under ONEDNN_MAX_CPU_ISA=AVX2)."""
    try:
        # No batch-size hint: oneDNN then picks a blocked layout that is good for M = 1..16
        # rows alike (a hint of 1 is ~1.5x slower at M = 4-16 in fp32 and no faster at M = 1).
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError:
        return None


class Linear(nn.Module):
    """nn.Linear's parameters and semantics, plus an optional device-specific packed weight."""

    kernels: KernelSet = AUTO  # the model's (model.choose_kernels)

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in `layout`, or None
        self.layout: str | None = None  # OWN_LAYOUTS, VENDOR_LAYOUTS, or None: F.linear (CUDA, meta)
        self.why: str | None = None  # why this layout: for describe()
        self._vendor: row_invariance.CheckedKernel | None = None  # a VENDOR_LAYOUTS kernel, checked at pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.triton(x) and not self.weight.is_meta:
            return gpu_kernels.linear(x, self.weight, self.bias)
        if self.layout is None:  # packed for no kernel of ours: a GPU's vendor kernel, or a weight too small to pack
            return F.linear(x, self.weight, self.bias)
        p = self.packed
        if self.layout in OWN_LAYOUTS:  # any number of rows in one call: each row's bits are its own
            c = self.kernels.c(x)
            if c is None or x.dtype != self.dtype:  # switched off (tests compare) or autograd: through torch
                return F.linear(x, self.plain_weight().to(x.dtype), self.bias)
            if self.layout == "amx":
                y = c.bf16_linear(x, p)
            else:
                y = c.dense_linear(x, p, self.out_features)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self._vendor is None or x.dtype != self.dtype:
            return F.linear(x, self.weight, self.bias)
        y = self._vendor(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def plain_weight(self) -> torch.Tensor:
        """The [out, in] weight, from the packed copy where the plain one was released."""
        if not self.weight.is_meta:
            return self.weight
        if self.layout == "amx":
            return cpu_kernels.unpair_blocks(self.packed)
        if self.layout == "dense":
            return cpu_kernels.undense_blocks(self.packed, self.out_features, self.in_features)
        raise ValueError("this linear's plain weight was released")

    def release_plain(self) -> None:
        """Hold the weight once: keep the packed copy and make the plain one shape-only (meta). Needs a
        packed copy; after this the module can't be re-packed, cast or moved."""
        if self.packed is None:
            raise ValueError("release_plain needs a packed weight")
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def pack(self, backend: str | None = None) -> None:
        backend = backend or os.environ.get(_BACKEND_ENV, "auto")
        if backend not in ("auto", "onednn", "torch"):
            raise ValueError(f"unknown linear backend {backend!r}; use auto, onednn or torch")
        w = self.weight
        if w.is_meta and self.packed is not None:
            raise ValueError("this linear's plain weight was released (load_transformer(keep_plain=False)); "
                             "load the model again to pack it another way")
        self.packed, self.layout, self.why, self._vendor = None, None, None, None
        if w.device.type != "cpu" or w.is_meta or gpu_kernels.runs_here(w):
            return
        with torch.no_grad():
            if backend == "auto" and cpu_kernels.usable() and w.dtype in cpu_kernels.DTYPES:
                if w.dtype == torch.bfloat16 and self._amx_available():
                    # Whatever the size: a ctypes call costs less than F.linear's, so tiny models take it too.
                    self.packed, self.layout = cpu_kernels.pair_blocks(w.detach()), "amx"
                    self.why = "AMX tiles compute each row on their own"
                else:
                    self.packed, self.layout = cpu_kernels.dense_blocks(w.detach()), "dense"
                    self.why = "fixed-order fp32 sums per output: row-invariant by construction"
                return
            why_vendor = (f"PIPELINE_LINEAR={backend}" if backend != "auto" else
                          f"no C kernels for {str(w.dtype).removeprefix('torch.')}" if cpu_kernels.usable() else
                          f"no C kernels ({cpu_kernels.status()})")
            if (_onednn_available() and w.dtype in (torch.float32, torch.bfloat16)
                    and (backend == "onednn" or backend == "auto" and w.numel() * w.element_size() >= PACK_MIN_BYTES)):
                self.packed = _onednn_reorder(w.detach())
            # The check calls the kernel without the bias (not loaded yet, and an add after it can't mix rows).
            if self.packed is not None:
                packed, name, rows = self.packed, "oneDNN", ONEDNN_ROWS
                fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            else:
                weight, name, rows = w.detach(), "F.linear", TORCH_ROWS
                fn = lambda x: F.linear(x, weight)  # noqa: E731
            key = ("onednn" if self.packed is not None else "torch", self.out_features)
            self._vendor = row_invariance.CheckedKernel(fn, key, self.in_features, w.dtype, rows)
            if self._vendor.invariant:
                self.layout = key[0]
                self.why = (f"{why_vendor}; {name} gave each row the same bits in {rows[0]}-{rows[1]}-row calls on "
                            "this CPU (checked at load)")
            else:
                self.layout = "rowwise"
                self.why = (f"{why_vendor}; {name}'s results changed with the row count on this CPU (checked "
                            "at load), so it runs one row a call")

    def _amx_available(self) -> bool:
        return (cpu_kernels.load().amx
                and cpu_kernels.amx_layout_reason(self.out_features, self.in_features) is None)

    def kernel_name(self) -> str:
        """What runs this layer's CPU forward, for describe()."""
        kernels = cpu_kernels.load() if self.layout in OWN_LAYOUTS else None
        names = {"amx": "cpu_kernels.bf16_linear on AMX tiles",
                 "dense": f"cpu_kernels.dense_linear ({kernels.isa if kernels else '?'} build)",
                 "onednn": "mkldnn._linear_pointwise on oneDNN-packed weights", "torch": "F.linear",
                 "rowwise": "oneDNN one row a call" if self.packed is not None else "F.linear one row a call",
                 None: "F.linear"}
        if self.layout is None and gpu_kernels.runs_here(self.weight):
            return "F.linear (cuBLAS)" if self.kernels.name == "vendor" else "gpu_kernels.linear (Triton)"
        return names[self.layout]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.layout}")


def pack_linears(model: nn.Module, backend: str | None = None) -> nn.Module:
    """(Re)build the packed weights of every engine Linear in `model` for its current device/dtype."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.pack(backend)
    return model
