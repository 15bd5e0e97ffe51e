"""The load-time check that a vendor GEMM gives a row the same bits whatever rows share its call.

Greedy speculation is lossless only if a token's logits come out bit for bit the same in a decode (1 row),
beside other requests and inside a verify (k+1 rows per request). The engine's own C linears have that by
construction. oneDNN, MKL and F.linear don't promise it: they pick a kernel, and with it a summation order,
by the row count and the CPU. On an AMD EPYC, F.linear's fp32 path changed a row's bits between 4 and 8
rows; on an Ice Lake Xeon without avx512_bf16, oneDNN's bf16 path did. So a vendor kernel stays
in the engine only where this check passes on the running CPU, for the layer's own shape, dtype and thread
count; elsewhere the layer calls it one row at a time, which is row-invariant because every call is alike.

A passing check is evidence, not a proof: it tries every row count the layer's calls can have, with random
rows, but a kernel could in principle depend on the values. The engine's own kernels are what makes the
contract hold; this keeps the fallback honest.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

_checked: dict[tuple, bool] = {}


def rows_invariant(call: Callable[[torch.Tensor], torch.Tensor], key: tuple, in_features: int, dtype: torch.dtype,
                   fewest: int, most: int, trials: int = 2) -> bool:
    """Whether call(x [n, in_features]) gives every row the same bits for each n in fewest..most, whatever the
    other rows hold. Cached per key (with the thread count: a kernel may split its work by it)."""
    key = (*key, dtype, in_features, fewest, most, torch.get_num_threads())
    if key not in _checked:
        _checked[key] = _check(call, in_features, dtype, fewest, most, trials)
    return _checked[key]


@torch.inference_mode()
def _check(call, in_features: int, dtype: torch.dtype, fewest: int, most: int, trials: int) -> bool:
    g = torch.Generator().manual_seed(0)
    for _ in range(trials):
        x = torch.randn(most + fewest, in_features, generator=g).to(dtype)
        others = x[most:most + fewest - 1]  # the rows a short call is padded with
        alone = torch.cat([call(torch.cat([x[i:i + 1], others]))[:1] for i in range(most)])
        for n in range(fewest, most + 1):
            if not torch.equal(call(x[:n]), alone[:n]):
                return False
    return True


class CheckedKernel:
    """A vendor kernel (fn: x [rows, in] -> [rows, out]) called so that a row's bits never depend on the rows
    beside it: in calls of `rows` = (fewest, most) rows, padded and split, where rows_invariant passed on this
    CPU; else one row a call, where every call is alike."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], key: tuple, in_features: int,
                 dtype: torch.dtype, rows: tuple[int, int]):
        self.fn, self.in_features = fn, in_features
        self.fewest, self.most = rows
        self.invariant = rows_invariant(fn, key, in_features, dtype, *rows)
        self._pad: tuple[int, torch.Tensor | None] = (0, None)  # (thread, buffer): see _pad_buffer

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        rows, fn = flat.shape[0], self.fn
        if not self.invariant:
            return torch.cat([fn(flat[i:i + 1]) for i in range(rows)]) if rows > 1 else fn(flat)
        if self.fewest <= rows <= self.most:  # one call as it stands: most decode steps
            return fn(flat)
        if rows < self.fewest:  # a batch-1 decode step: into a padded buffer, one copy instead of zeros + cat
            pad = self._pad_buffer(flat)
            pad[:rows].copy_(flat)
            return fn(pad)[:rows]
        out = []
        for i in range(0, rows, self.most):
            chunk = flat[i:i + self.most]
            n = chunk.shape[0]
            if n < self.fewest:
                chunk = torch.cat([chunk, chunk.new_zeros(self.fewest - n, self.in_features)])
            out.append(fn(chunk)[:n])
        return out[0] if len(out) == 1 else torch.cat(out)

    def _pad_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A [fewest, in_features] input buffer for short calls, owned by the calling thread: another thread
        finds the owner differs and makes its own, so two threads' forwards never share one. Its rows past a
        call's own hold an earlier call's values: harmless, as the check found a row's result independent of
        the other rows."""
        owner, buf = self._pad
        if owner != threading.get_ident() or buf is None or buf.dtype != like.dtype:
            buf = like.new_zeros(self.fewest, self.in_features)
            self._pad = (threading.get_ident(), buf)
        return buf
