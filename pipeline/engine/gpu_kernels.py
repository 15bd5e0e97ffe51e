"""The engine's own GPU kernels, in Triton, whose result for a row depends on nothing but that row.

Greedy speculation is lossless only if a token's logits come out bit for bit the same in a decode (1 row), beside
other requests, inside a verify (k+1 rows), after a prefix-cache hit (the last prompt token computed alone) and in
a chunked prefill. cuBLAS and SDPA don't promise that: they pick a kernel, a tile and a split of the reduction by
the shape, and on an H200 the target as its own draft accepted 0.83-0.89 of its drafts in bf16, not 1.0
(docs/design.md, "Row-invariant by construction, on a GPU"). So on a GPU every reduction of a forward runs here,
in an order fixed by the weights' shapes alone:

- `linear`: one tile shape and one split of K per weight, chosen from (N, K) and the GPU's SM count, never from the
  row count M. A row's output is sum over K of its own products, in K-blocks added in order, each block by the
  same tensor-core instruction; the split-K partials are added in split order by a second kernel, never by atomics.
  The rows that share a tile only share the weight loads: a dot's output row reads its own input row only.
- `rms_norm`: one program per row, the row's sum of squares by one tl.sum over a block fixed by the hidden size.
- `paged_attention`: one program per (token, KV head): the token's keys in blocks of KEY_BLOCK, 0 up to its own
  position, with an online softmax. What it reads and in what order follows from the token's position and the
  cache's bits only, so a token costs the same arithmetic in a decode, a verify, a prefill chunk or after a
  prefix-cache hit. Key blocks past a token's position are never read.
- `rope_and_write`: rope on a token's q and k heads, and its k and v into the cache: elementwise, one launch where
  torch's ops took eight a layer.
Other elementwise ops (SiLU-and-multiply, the final residual add, casts) and gathers (the embedding, the rope
tables) stay torch's: an element's result is one rounding of its own inputs whatever the launch shape.
Greedy's argmax over the logits stays torch's: `argmax_invariant` checks it at load, on the running GPU, and the
engine refuses to start where it fails. Sampled rows' softmax already runs on the CPU, beside their generators.

The same kernels run on a CPU under TRITON_INTERPRET=1, which is how CI (no GPU) checks the invariance: which
blocks each sum covers and in what order, what depends on the row count, what a pad or a short row reads. Two
things differ there (INTERPRET): the interpreter can't do bf16 arithmetic or round like a GPU, and numpy's matmul
gives a row other bits at another place in the tile, so a tile's products are summed by hand in fp32. On a GPU a
tile's dot is one tensor-core instruction computing every output element alike wherever its row sits: the one
assumption the interpreter can't check, which the CUDA run of the same tests and scripts/bench_gpu.py's identity
matrix do.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# Imported on first use (_compile): a CPU install may have no Triton, and a process that never runs these kernels
# shouldn't pay for importing it. Module globals, because the interpreter patches the `tl` it finds in them.
triton = tl = None

KEY_BLOCK = 32  # keys per step of the attention's loop: two of the cache's 16-token blocks
TILE_M = 64  # rows per linear tile, for every M: a 1-row decode pads its tile, which costs no weight traffic
H200_SMS = 132  # the config under the interpreter (no GPU to ask): an H200's, so CI runs the configs it ships
H200_NAME = "NVIDIA H200"
INTERPRET_BLOCK_N = 128  # the linear's output tile under the interpreter (see linear)
NO_WINDOW = 1 << 30  # attention's window where a layer has none: past every position a cache holds

# The engine's own GPU kernels on a CPU, through Triton's interpreter: tests only (CI has no GPU).
FORCE_ENV = "PIPELINE_GPU_KERNELS_ON_CPU"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_here(x: torch.Tensor) -> bool:
    """Whether the engine's GPU kernels run a forward on x's device: a GPU, or a CPU under the interpreter when
    a test asks for it."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get(FORCE_ENV) == "1" and interpreting())


def available() -> str | None:
    """None where Triton imports, else why not (one line)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install triton, or run with gpu_kernels='vendor'"
    return None


def _kernels():
    return _compile(interpreting())


@functools.cache
def _compile(interpret: bool):
    """The Triton kernels, made on first use, for the GPU or for the interpreter. Triton reads TRITON_INTERPRET
    when it is imported (its own library functions) and when it wraps a function, so a process picks one at start:
    tests/conftest.py sets it before anything imports Triton."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                      stride_os, HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
        """out[s, m, n] (PARTIALS: fp32 partials over K slice s) or out[m, n] = x[m, :] . w[n, :] (+ b[n])."""
        pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k0 = pid_s * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k0 + k_per_split, BLOCK_K):
            kk = k + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
            if INTERPRET:  # numpy's matmul gives a row other bits at another place in the tile: sum by hand
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        keep = (rm[:, None] < M) & (rn[None, :] < N)
        if PARTIALS:
            tl.store(out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=keep)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit(do_not_specialize=["M"])
    def split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_ps, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK: tl.constexpr):
        """out[m, n] = sum over s in order of part[s, m, n] (+ b[n]): split-K's partials, added in one fixed order."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = i < M * N
        acc = tl.load(part_ptr + i, mask=keep, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * stride_ps + i, mask=keep, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, H, eps, stride, HAS_RESIDUAL: tl.constexpr,
                        FP32: tl.constexpr, BLOCK: tl.constexpr):
        """One row: total = x (+ r, rounded to the model's dtype); out = norm(total) * w, as transformers rounds."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < H
        x = tl.load(x_ptr + row * stride + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(r_ptr + row * stride + cols, mask=keep, other=0.0).to(tl.float32)
            x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)  # the residual stream is stored in the model's dtype
            tl.store(sum_ptr + row * stride + cols, x.to(sum_ptr.dtype.element_ty), mask=keep)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        if FP32:
            y = x * rstd * w
        else:  # round the normalised row to the model's dtype before the weight, as transformers does
            y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, T, scale, window, stride_qt, stride_qh,
                         stride_cb, stride_ch, stride_cs, stride_tb, G: tl.constexpr, BLOCK_G: tl.constexpr,
                         D: tl.constexpr, BS: tl.constexpr, BLOCK_KEYS: tl.constexpr, INTERPRET: tl.constexpr,
                         IEEE: tl.constexpr):
        """One token's G query heads of one KV head, against keys 0..its position in its row's blocks (window > 0:
        its last `window` keys only; the blocks before them aren't read)."""
        tok, kvh = tl.program_id(0), tl.program_id(1)
        b = tok // T
        wp = tl.load(pos_ptr + tok)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        heads = kvh * G + g
        q_off = tok * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=g[:, None] < G, other=0.0)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
        keys = tl.arange(0, BLOCK_KEYS)
        lo = tl.maximum(wp + 1 - window, 0)  # the first key it sees (no window: window is past every position)
        for start in range(lo // BLOCK_KEYS * BLOCK_KEYS, wp + 1, BLOCK_KEYS):
            kpos = start + keys
            seen = (kpos <= wp) & (kpos >= lo)
            block = tl.load(table_ptr + b * stride_tb + kpos // BS, mask=seen, other=0)
            c_off = block[:, None] * stride_cb + kvh * stride_ch + (kpos % BS)[:, None] * stride_cs + d[None, :]
            k = tl.load(k_ptr + c_off, mask=seen[:, None], other=0.0)
            v = tl.load(v_ptr + c_off, mask=seen[:, None], other=0.0)
            if INTERPRET:  # see linear_kernel
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            elif IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(seen[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if INTERPRET:
                pv = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # A pad (wp = -1) reads no key: its l is 0 and its output, which nothing reads, is written as zeros.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)

    @triton.jit
    def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, wp_ptr, table_ptr, q_ptr, k_ptr, v_ptr, T, stride_tb,
                          stride_cb, stride_ch, stride_cs, NQ: tl.constexpr, NKV: tl.constexpr, NH: tl.constexpr,
                          D: tl.constexpr, BS: tl.constexpr, FP32: tl.constexpr):
        """One token: rope on its q and k heads (rotate-half: sin's first half carries the sign), q out, k and v
        into the cache at the token's write position (a pad, -1, writes nothing). Elementwise, as torch's ops."""
        tok = tl.program_id(0)
        b = tok // T
        h = tl.arange(0, NH)
        d = tl.arange(0, D)
        partner = (d + D // 2) % D  # roll by half: rotate_half with the sign in sin
        base = qkv_ptr + tok * (NQ + 2 * NKV) * D
        roped = h[:, None] < NQ + NKV
        x = tl.load(base + h[:, None] * D + d[None, :], mask=h[:, None] < NQ + 2 * NKV, other=0.0).to(tl.float32)
        xr = tl.load(base + h[:, None] * D + partner[None, :], mask=roped, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + tok * D + d).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + tok * D + d).to(tl.float32)[None, :]
        if FP32:
            y = x * c + xr * s
        else:  # each product rounded to the model's dtype, then the sum: as transformers' bf16 ops round
            dt = q_ptr.dtype.element_ty
            y = (x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)
        y = tl.where(roped, y, x)  # v heads pass through
        tl.store(q_ptr + tok * NQ * D + h[:, None] * D + d[None, :], y.to(q_ptr.dtype.element_ty),
                 mask=h[:, None] < NQ)
        wp = tl.load(wp_ptr + tok)
        block = tl.load(table_ptr + b * stride_tb + tl.maximum(wp, 0) // BS)
        kvh = tl.where(h < NQ + NKV, h - NQ, h - NQ - NKV)
        at = block * stride_cb + kvh[:, None] * stride_ch + (tl.maximum(wp, 0) % BS) * stride_cs + d[None, :]
        is_k = (h[:, None] >= NQ) & roped
        is_v = (h[:, None] >= NQ + NKV) & (h[:, None] < NQ + 2 * NKV)
        tl.store(k_ptr + at, y.to(k_ptr.dtype.element_ty), mask=is_k & (wp >= 0))
        tl.store(v_ptr + at, y.to(v_ptr.dtype.element_ty), mask=is_v & (wp >= 0))

    return linear_kernel, split_sum_kernel, rms_norm_kernel, attention_kernel, rope_write_kernel


# ---- linear -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearTiles:
    """How one weight's products are tiled and summed: a function of (N, K, SMs) alone, so of no row count.
    num_warps and num_stages change how fast a tile is computed, not the order of its sums."""

    block_n: int
    block_k: int
    split: int  # K is cut in this many slices, summed in order by split_sum_kernel
    num_warps: int = 4
    num_stages: int = 3

    @property
    def describe(self) -> str:
        return f"{TILE_M}x{self.block_n} tiles, K in {self.block_k}-blocks" + (
            f", {self.split} K-slices summed in order" if self.split > 1 else "")


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


@functools.cache
def linear_tiles(n: int, k: int, sms: int) -> LinearTiles:
    """The widest tile that still gives every SM a tile of its own at batch 1 (a decode step streams the weight,
    and needs all of them reading); where even 16-wide tiles leave SMs idle, K is split too, up to 4 ways."""
    block_k = 64 if k % 64 == 0 or k > 256 else 32
    for block_n in (128, 64, 32, 16):
        if -(-n // block_n) >= sms:
            return LinearTiles(block_n, block_k, 1)
    tiles = -(-n // 16)
    split = 1
    while split < 4 and tiles * split < sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return LinearTiles(16, block_k, split)


# Tilings timed on a GPU by scripts/tune_gpu_kernels.py, one file per GPU name (as vLLM ships its MoE configs).
TILES_DIR = Path(__file__).parent / "gpu_tiles"


def tiles_file_name(gpu_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", gpu_name).strip("_") + ".json"


@functools.cache
def tuned_tiles(gpu_name: str) -> dict[tuple[int, int], LinearTiles]:
    """{(N, K): tiling} measured on this GPU kind, {} where none was. Any tiling is as lossless as the next (it is
    the weight's and the GPU's), so a table only makes a shape faster; a malformed one is refused, naming the file."""
    path = TILES_DIR / tiles_file_name(gpu_name)
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())["tiles"]
        table = {}
        for shape, t in entries.items():
            n, k = (int(v) for v in shape.split("x"))
            tiles = LinearTiles(**{f: int(t[f]) for f in ("block_n", "block_k", "split", "num_warps", "num_stages")})
            if not all(v > 0 and v & (v - 1) == 0 for v in (tiles.block_n, tiles.block_k, tiles.split)) \
                    or tiles.block_n < 16 or tiles.block_k < 16:
                raise ValueError(f"{shape}: block sizes and split must be powers of two, blocks at least 16")
            table[(n, k)] = tiles
        return table
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a tiling table ({e}); regenerate it with scripts/tune_gpu_kernels.py "
                         "--write") from None


def tiles_for(x: torch.Tensor, weight: torch.Tensor) -> LinearTiles:
    """The tiling of x @ weight.T: the weight's and the GPU's, never x's row count (a test breaks that on purpose).
    A shape timed on this GPU kind takes its measured tiling; any other, linear_tiles' rule. Under the interpreter
    the H200's table applies, so CI runs what an H200 runs."""
    n, k = weight.shape
    tuned = tuned_tiles(gpu_name(x.device)).get((n, k))
    return tuned or linear_tiles(n, k, sm_count(x.device))


@functools.cache
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else H200_NAME


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: LinearTiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in x's dtype, each row's bits its own (see the module's docstring).
    tiles: the weight's tiling (default tiles_for's); scripts/tune_gpu_kernels.py times others."""
    linear_kernel, split_sum_kernel, *_ = _kernels()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    tiles = tiles or tiles_for(x2, weight)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*shape[:-1], N)
    # Each K-slice a whole number of K-blocks, so the blocks a slice sums are the same for every M.
    per_split = -(-K // (tiles.split * tiles.block_k)) * tiles.block_k
    interpret, ieee = interpreting(), x.dtype == torch.float32
    block_n = tiles.block_n
    if interpret:
        # The interpreter pays milliseconds per op per program, and a tile's width only says which outputs one
        # program writes: an output's sum (its K-blocks in order, the K-slices in order) is the same in any tile.
        # So it runs the GPU's sums in wider tiles: a few programs a weight instead of dozens.
        block_n = max(block_n, min(INTERPRET_BLOCK_N, triton.next_power_of_2(N)))
    grid = (-(-N // block_n), -(-M // TILE_M), tiles.split)
    has_bias = bias is not None
    speed = {} if interpret else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if tiles.split == 1:
        linear_kernel[grid](x2, weight, bias if has_bias else x2, out, M, N, K, per_split, x2.stride(0),
                            weight.stride(0), out.stride(0), 0, HAS_BIAS=has_bias, PARTIALS=False, BLOCK_M=TILE_M,
                            BLOCK_N=block_n, BLOCK_K=tiles.block_k, INTERPRET=interpret, IEEE=ieee, **speed)
    else:
        part = torch.empty(tiles.split, M, N, dtype=torch.float32, device=x.device)
        linear_kernel[grid](x2, weight, x2, part, M, N, K, per_split, x2.stride(0), weight.stride(0), N, M * N,
                            HAS_BIAS=False, PARTIALS=True, BLOCK_M=TILE_M, BLOCK_N=block_n,
                            BLOCK_K=tiles.block_k, INTERPRET=interpret, IEEE=ieee, **speed)
        block = 1024
        split_sum_kernel[(-(-(M * N) // block),)](part, bias if has_bias else part, out, M, N, M * N,
                                                  HAS_BIAS=has_bias, SPLIT=tiles.split, BLOCK=block)
    return out.view(*shape[:-1], N)


# ---- RMSNorm ------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, norm(total) * weight) with total = x (+ residual, added in the model's dtype), row by row."""
    rms_norm_kernel = _kernels()[2]
    H = x.shape[-1]
    x2 = x.reshape(-1, H).contiguous()
    r2 = residual.reshape(-1, H).contiguous() if residual is not None else None
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if r2 is not None else x2
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](x2, r2 if r2 is not None else x2, weight, total, out, H, eps, H,
                                        HAS_RESIDUAL=r2 is not None,
                                        # an fp32 weight (Gemma's 1 + w) scales the fp32 row: one rounding
                                        FP32=torch.float32 in (x.dtype, weight.dtype),
                                        BLOCK=max(16, 1 << (H - 1).bit_length()))
    return total.view(x.shape), out.view(x.shape)


# ---- attention over the paged cache -------------------------------------------------------------------------

def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor,
                    write_pos: torch.Tensor, scale: float | None = None, window: int = 0) -> torch.Tensor:
    """q [B, T, H, D] (its K/V already written to the cache); cache_k/v: one layer's [NB + 1, KV, BS, D];
    block_table [B, MB]; write_pos [B, T] (-1: a pad) -> [B, T, H, D]: each token against its own keys (its last
    `window` where window > 0), scores scaled by `scale` (default D ** -0.5)."""
    attention_kernel = _kernels()[3]
    B, T, H, D = q.shape
    KV, BS = cache_k.shape[1], cache_k.shape[2]
    G = H // KV
    q = q.contiguous()
    out = torch.empty_like(q)
    table, pos = block_table.contiguous(), write_pos.contiguous()  # int64, read as they are: no cast per layer
    ieee = q.dtype == torch.float32
    attention_kernel[(B * T, KV)](q, cache_k, cache_v, table, pos, out, T, D**-0.5 if scale is None else scale,
                                  window or NO_WINDOW, q.stride(1), q.stride(2),
                                  cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), table.stride(0),
                                  G=G, BLOCK_G=max(16, 1 << (G - 1).bit_length()), D=D, BS=BS,
                                  BLOCK_KEYS=KEY_BLOCK, INTERPRET=interpreting(), IEEE=ieee)
    return out


# ---- rope and the cache write ---------------------------------------------------------------------------------

def rope_and_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, block_table: torch.Tensor, write_pos: torch.Tensor, n_q: int,
                   n_kv: int) -> torch.Tensor:
    """qkv [B, T, NQ + 2 NKV, D]; cos/sin [B, T, 1, D] in the model's dtype (sin's first half negated) -> q
    [B, T, NQ, D] with rope, after writing k (with rope) and v into one layer's cache at write_pos. One launch where
    torch's ops take eight; a kernel of its own because attention reads keys the same forward writes."""
    B, T, NH, D = qkv.shape
    q = torch.empty(B, T, n_q, D, dtype=qkv.dtype, device=qkv.device)
    table = block_table.contiguous()
    _kernels()[4][(B * T,)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), write_pos.contiguous(),
                            table, q, cache_k, cache_v, T, table.stride(0),
                            cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), NQ=n_q, NKV=n_kv,
                            NH=max(16, 1 << (NH - 1).bit_length()), D=D, BS=cache_k.shape[2],
                            FP32=qkv.dtype == torch.float32)
    return q


# ---- the logits' argmax ------------------------------------------------------------------------------------

_argmax_checked: dict[tuple, bool] = {}


@torch.inference_mode()
def argmax_invariant(device: torch.device, vocab: int, most: int = 64) -> bool:
    """Whether torch's argmax over [n, vocab] fp32 rows gives each row the same token alone as in calls of 2..most
    rows on this device: the one vendor reduction a GPU forward keeps (greedy's pick; sampled rows' softmax runs on
    the CPU, beside their generators). A max is exact in any order, so only a tie could move, and torch breaks
    ties by the lowest index; checked once per (device, vocab) at load, with ties planted, all the same."""
    key = (str(device), vocab, most)
    if key not in _argmax_checked:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(most, vocab, generator=g, device=device)
        x[::2, vocab // 3] = x[::2, vocab // 2] = 1e4  # a tie in every other row
        alone = torch.cat([x[i:i + 1].argmax(-1) for i in range(most)])
        _argmax_checked[key] = all(torch.equal(x[:n].argmax(-1), alone[:n]) for n in range(2, most + 1))
    return _argmax_checked[key]


def tilings_source(device: torch.device) -> str:
    """Where this device's linear tilings come from, for describe()."""
    name = gpu_name(device)
    if tuned_tiles(name):
        return f"timed on {name} for {len(tuned_tiles(name))} shapes (gpu_tiles/{tiles_file_name(name)}), the rule " \
               "for the rest"
    return f"the rule of gpu_kernels.linear_tiles ({name} has no timed table)"
