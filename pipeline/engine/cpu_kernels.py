"""The engine's own C kernels for the CPU forward (bf16 and fp32), built on first use with the machine's C compiler.

A batch-1 bf16 decode step of SmolLM2 spent 24 of 38 ms of op time in its 121 linears (oneDNN, at
about the memory's read bandwidth) and most of the rest in ~1300 small ops: casts, norms, rope,
cache writes, softmax, each costing 10-50 us of dispatch for a few KB of work. Three kernels replace
them per layer: RMSNorm with the residual add before it, rope + KV write + attention, and
SiLU-and-multiply (cpu_kernels_layer.h, one source for bf16 and fp32 storage).

They are plain C on raw pointers, called through ctypes: no torch headers, so building them takes
a few seconds with `cc`, and a machine without a compiler runs the torch ops instead (describe()
says which). The shared object is cached under the pipeline home, keyed by the sources, the flags and
the CPU's feature flags. OpenMP comes from the libgomp torch already loaded (same soname), so the
kernels and torch share one thread pool.

The same library holds the linears: quant_linear for int4 checkpoint weights and the engine's int8
lm_head (blocks of 16 output features, one vector lane per output, a block decoded once for up to 4
rows), bf16_linear for bf16 weights on AMX tiles, and dense_linear for bf16 and fp32 weights on any CPU.
Each gives a row the same bits whatever rows share the call, by construction: that is what keeps greedy
speculation lossless (a verify feeds k+1 rows where a decode feeds 1), and vendor GEMMs don't promise it.
When every projection of a model runs on them, layers_bf16 (or layers_f32) runs the whole decoder stack in one
call (see Transformer.layer_stack), and head_layer_bf16 an EAGLE-3 head's layer (Eagle3Head.layer_row).

PIPELINE_KERNELS picks the build: auto (the default: -march=native, AMX where the CPU has it), or a cap
that builds them as a CPU with less would run them: amx, avx512 (x86-64-v4: AVX-512F/BW/DQ/VL, no AMX,
no bf16 instructions), avx2 (x86-64-v3: AVX2 + FMA), portable (plain C for the architecture's baseline);
off runs the torch ops. Every path gives the same bits as the portable one, but AMX's bf16 linear, whose
tile unit sums its own way. CUDA and autograd always run the torch ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.engine import gpu_kernels
from pipeline.errors import ConfigError
from pipeline.home import kernel_cache

SOURCE = Path(__file__).with_name("cpu_kernels.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_kernels_layer.h"))  # the .c includes the header: both key the build
# -ffp-contract=off: gcc fuses a * b + c into one FMA where the target has it (its default), which rounds once
# where the portable build rounds twice; the C source says fmaf where it wants a fused one.
# -fno-trapping-math: without it gcc 12 left exp_poly's loops (softmax, SiLU) scalar, as floorf and the clamp might
# raise FP exceptions; nothing here traps, and no result changes.
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC", "-shared"]
# gcc vectorizes with 256-bit registers on AVX-512 CPUs unless told otherwise; the attention's loops ran 20-25% faster
# with 512 (a verify's five queries over 400 keys: 148 against 201 us). Lanes never change a result's bits here.
X86_FLAGS = ["-mprefer-vector-width=512"]
_ENV = "PIPELINE_KERNELS"
# The build per setting, and the CPU flags (/proc/cpuinfo) a capped build needs: the x86-64-v3 and v4 levels.
ISA_MARCH = {"auto": "-march=native", "amx": "-march=native", "avx512": "-march=x86-64-v4",
             "avx2": "-march=x86-64-v3", "portable": None}
ISA_NEEDS = {"amx": ("amx_tile", "amx_bf16"), "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
             "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")}
SETTINGS = ("auto", "off", *(isa for isa in ISA_MARCH if isa != "auto"))

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_LAYER_OPS = {  # the per-layer ops (cpu_kernels_layer.h), one copy per storage type: name_bf16 and name_f32
    "rms_norm": (None, [_P, _P, _P, _F, _I, _I, _P, _P, ctypes.c_int]),
    "rms_norm_w32": (None, [_P, _P, _P, _F, _I, _I, _P, _P, ctypes.c_int]),
    "silu_mul": (None, [_P, _I, _I, _P, ctypes.c_int]),
    "gelu_mul": (None, [_P, _I, _I, _P, ctypes.c_int]),
    "rope_attend": (ctypes.c_int, [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _P, _F, _I,
                                   ctypes.c_int, _P]),
    "layers": (ctypes.c_int, [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _F, _P, _P, _P, _P, _I, _I, _P, _I, _P,
                              _F, ctypes.c_int, _I, _P, _P]),
    "moe": (ctypes.c_int, [_P, _I, _I, _P, _I, _P, ctypes.c_int]),
    "head_layer": (ctypes.c_int, [_P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P, _I, _F, _P, _P, _P, _P, _I, _I,
                                  _P, _I, _P, _F, ctypes.c_int]),
}
_SIGNATURES = {  # name -> (return type, argument types)
    **{f"{name}_{suffix}": sig for name, sig in _LAYER_OPS.items() for suffix in ("bf16", "f32")},
    "bf16_linear": (ctypes.c_int, [_P, _I, _I, _P, _I, _P, ctypes.c_int, ctypes.c_int]),
    "dense_linear": (ctypes.c_int, [_P, ctypes.c_int, _I, _I, _P, _I, _P, ctypes.c_int, ctypes.c_int]),
    "kernel_isa": (ctypes.c_char_p, []),
    "amx_usable": (ctypes.c_int, []),
    "quant_linear": (ctypes.c_int, [_P, ctypes.c_int, _I, _I, _P, _P, ctypes.c_int, _P, _I, _I, _P, ctypes.c_int,
                                    ctypes.c_int]),
}
QUANT_BLOCK = 16  # output features per weight block (QN in cpu_kernels.c)
DTYPES = (torch.bfloat16, torch.float32)  # what every kernel reads and writes (a dense weight too)
QUANT_GROUP_MULTIPLE = 4  # a scale group covers a multiple of 4 inputs (the kernel's four accumulator chains)
# A projection's kind in the layer stack (STACK_* in the C); "moe": a layer's experts, in its gate_up entry.
STACK_KINDS = {"dense": 2, "int4": 4, "amx": 16, "moe": 32}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def isa_flags(setting: str) -> list[str]:
    """The compiler flags for a PIPELINE_KERNELS setting: FLAGS (and X86_FLAGS on x86) plus its -march (none for
    portable)."""
    march = ISA_MARCH[setting]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return FLAGS + (X86_FLAGS if x86 else []) + ([march] if march else [])


def isa_refusal(setting: str, cpu_flags: str | None = None) -> str | None:
    """Why this CPU can't run kernels built for `setting`, or None: a capped build runs instructions the CPU
    must have, or the process dies of an illegal instruction."""
    if setting in ("auto", "portable", "off"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{_ENV}={setting} is an x86-64 build and this CPU is {platform.machine()}: use auto or portable"
    have = set((cpu_flags if cpu_flags is not None else _cpu_flags()).split())
    missing = [f for f in ISA_NEEDS[setting] if f not in have]
    if missing:
        return f"{_ENV}={setting} needs {', '.join(missing)}, which this CPU lacks: use a lower cap or auto"
    return None


def _build(compiler: str, flags: list[str] | None = None) -> Path:
    flags = isa_flags("auto") if flags is None else flags
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES) + " ".join(flags).encode() + _cpu_flags().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    lib = kernel_cache() / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        done = subprocess.run([compiler, *flags, "-o", str(out), str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}")
        os.replace(out, lib)  # whole or absent: a concurrent builder renames the same bytes
    return lib


class CpuKernels:
    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._ops = {dtype: {name: getattr(self.lib, f"{name}_{suffix}") for name in _LAYER_OPS}
                     for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))}
        self._quant, self._bf16_linear, self._dense = self.lib.quant_linear, self.lib.bf16_linear, self.lib.dense_linear
        self.amx = bool(self.lib.amx_usable())  # AMX tiles built in, and Linux granted them
        self.isa = self.lib.kernel_isa().decode()  # the vector code built in: avx512, avx2 or portable

    def _op(self, name: str, *tensors: torch.Tensor):
        """The per-layer op `name` for the tensors' storage type (bf16 or fp32; all alike)."""
        dtype = tensors[0].dtype
        ops = self._ops.get(dtype)
        if ops is None or any(t.dtype != dtype for t in tensors):
            raise ValueError(f"{name} takes bf16 or fp32 tensors of one dtype, not {[t.dtype for t in tensors]}")
        return ops[name]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x) (bf16 or fp32); with delta, (x + delta, RMSNorm(x + delta)), the residual add fused. An fp32
        weight on bf16 rows (Gemma's 1 + w) scales in fp32 and rounds once."""
        x = x.contiguous()
        dim = x.shape[-1]
        out = torch.empty_like(x)
        w32 = weight.dtype == torch.float32 and x.dtype != torch.float32
        norm = self._op("rms_norm_w32" if w32 else "rms_norm", x, *(() if w32 else (weight,)),
                        *(() if delta is None else (delta,)))
        if delta is None:
            norm(x.data_ptr(), None, weight.data_ptr(), eps, x.numel() // dim, dim, None, out.data_ptr(),
                 torch.get_num_threads())
            return out
        delta = delta.contiguous()
        total = torch.empty_like(x)
        norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, x.numel() // dim, dim, total.data_ptr(),
             out.data_ptr(), torch.get_num_threads())
        return total, out

    def silu_mul(self, gate_up: torch.Tensor, op: str = "silu_mul") -> torch.Tensor:
        """gate_up [..., 2I] -> silu(gate) * up [..., I]; op "gelu_mul": gelu(gate) * up (tanh approximation)."""
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        self._op(op, gate_up)(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, out.data_ptr(),
                              torch.get_num_threads())
        return out

    def moe(self, x: torch.Tensor, desc: torch.Tensor, group: int) -> torch.Tensor:
        """A mixture-of-experts MLP in one call (moe in the C source): x [..., hidden] -> [..., hidden]. desc: the
        block's description (moe.SparseMoE.c_desc); group: its int4 projections' group size (0 for none)."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(flat)
        rc = self._op("moe", flat)(flat.data_ptr(), flat.shape[0], flat.shape[1], desc.data_ptr(), group,
                                   out.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError("the experts were planned with a projection their kernels can't hold")
        return out.view(x.shape)

    def rope_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                    cache_v: torch.Tensor, block_table: torch.Tensor, write_pos: torch.Tensor, n_heads: int,
                    n_kv: int, scale: float | None = None, window: int = 0) -> torch.Tensor:
        """qkv [B, T, H + 2KV, D]; cos/sin [B, T, 1, D]; cache_k/v one layer's block pool [NB, KV, BS, D];
        block_table [B, MB] and write_pos [B, T] (-1 for pads) int64 -> attention output [B, T, H, D]. Writes the
        rotated K and V to the cache. scale: the scores' (default D ** -0.5); window: a token attends to its last
        `window` keys (0: all before it)."""
        B, T, _, D = qkv.shape
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
            raise ValueError("rope_attend needs a contiguous KV cache")
        if block_table.dtype != torch.int64 or write_pos.dtype != torch.int64:
            raise ValueError("rope_attend reads block_table and write_pos as int64")
        out = qkv.new_empty(B, T, n_heads, D)
        table, write_pos = block_table.contiguous(), write_pos.contiguous()
        attend = self._op("rope_attend", qkv, cos, sin, cache_k, cache_v)
        if attend(qkv.data_ptr(), B, T, n_heads, n_kv, D, cos.data_ptr(), sin.data_ptr(), cache_k.data_ptr(),
                  cache_v.data_ptr(), cache_k.shape[0], cache_k.shape[2], table.data_ptr(), table.shape[1],
                  write_pos.data_ptr(), D**-0.5 if scale is None else scale, window, torch.get_num_threads(),
                  out.data_ptr()):
            raise IndexError(f"a position or block is outside the KV cache ({cache_k.shape[0]} blocks of "
                             f"{cache_k.shape[2]}): table {table.tolist()}")
        return out

    def quant_linear(self, x: torch.Tensor, blocks: torch.Tensor, bits: int, scales: torch.Tensor,
                     pre_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] (bf16 or fp32) times a weight-quantized [N, K] matrix held as `blocks` and `scales`
        (see block_weights) -> [..., N] in out_dtype (x's by default). pre_scale [K] fp32 multiplies x first."""
        K = x.shape[-1]
        x = x.reshape(-1, K).contiguous()
        nblocks, ngroups, lanes = scales.shape
        out = x.new_empty(x.shape[0], nblocks * lanes, dtype=out_dtype or x.dtype)
        if out.dtype not in DTYPES or x.dtype not in DTYPES:
            raise ValueError("quant_linear reads and writes bf16 or fp32")
        if self._quant(x.data_ptr(), x.dtype == torch.float32, x.shape[0], K,
                       None if pre_scale is None else pre_scale.data_ptr(), blocks.data_ptr(), bits,
                       scales.data_ptr(), K // ngroups, out.shape[1], out.data_ptr(), out.dtype == torch.float32,
                       torch.get_num_threads()):
            raise ValueError(f"quant_linear: K={K}, {ngroups} groups, N={out.shape[1]} is not a layout it takes")
        return out

    def bf16_linear(self, x: torch.Tensor, pairs: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] bf16 times a bf16 [N, K] weight held as `pairs` (see pair_blocks), on AMX -> [..., N]."""
        K = x.shape[-1]
        x = x.reshape(-1, K).contiguous()
        out = x.new_empty(x.shape[0], pairs.shape[0] * QUANT_BLOCK, dtype=out_dtype or x.dtype)
        if x.dtype != torch.bfloat16 or out.dtype not in (torch.bfloat16, torch.float32) or self._bf16_linear(
                x.data_ptr(), x.shape[0], K, pairs.data_ptr(), out.shape[1], out.data_ptr(),
                out.dtype == torch.float32, torch.get_num_threads()):
            raise ValueError(f"bf16_linear: {x.dtype} x of K={K}, N={out.shape[1]} is not what it takes (AMX: "
                             f"{self.amx})")
        return out

    def dense_linear(self, x: torch.Tensor, blocks: torch.Tensor, out_features: int,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] times a [N, K] weight of x's dtype (bf16 or fp32) held as `blocks` (see dense_blocks), in
        fp32 sums of fixed order -> [..., N] in out_dtype (x's by default)."""
        K = x.shape[-1]
        x = x.reshape(-1, K).contiguous()
        out = x.new_empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
        f32 = x.dtype == torch.float32
        if (x.dtype not in DTYPES or blocks.dtype != (torch.float32 if f32 else torch.int32)
                or out.dtype not in DTYPES or blocks.numel() != dense_blocks_numel(out_features, K, f32)
                or self._dense(x.data_ptr(), f32, x.shape[0], K, blocks.data_ptr(), out_features, out.data_ptr(),
                               out.dtype == torch.float32, torch.get_num_threads())):
            raise ValueError(f"dense_linear: {x.dtype} x of K={K} and {blocks.dtype} blocks {tuple(blocks.shape)} "
                             f"for N={out_features} is not what it takes")
        return out

    def layers(self, x: torch.Tensor, table: torch.Tensor, group: int, cfg, cos: torch.Tensor, sin: torch.Tensor,
               cache, fb, first: int = 0, end: int | None = None, flags: int = 0, scale: float | None = None,
               local: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layers first..end-1 (default all) in one call (see Transformer.layer_stack and layers_bf16 in the
        C source): x [B, T, hidden], the first layer's input (the embeddings, or a captured layer's input with its
        residual added) -> (the residual after the last attention, the last MLP output), which the caller adds.
        Writes those layers' K and V to the cache, and overwrites x. flags: model.STACK_FLAGS; scale: attention's
        (default head_dim ** -0.5); local: the sliding-window layers' rope tables (cos, sin) where they differ."""
        end = cfg.num_layers if end is None else end
        if not 0 <= first < end <= cfg.num_layers:
            raise ValueError(f"layers {first}..{end - 1} of {cfg.num_layers}")
        B, T, hidden = x.shape
        x = x.contiguous()
        delta = torch.empty_like(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        local = tuple(t.contiguous() for t in local) if local is not None else None
        k, v, blocks, write_pos = _stack_cache(cache, fb, "the layer stack")  # k, v: [layers, NB, KV, BS, D]
        layers = self._op("layers", x, cos, sin, k, v, *(local or ()))
        rows = table[first:end].contiguous()
        rc = layers(x.data_ptr(), delta.data_ptr(), B, T, end - first, hidden, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim, cfg.intermediate_size, group, rows.data_ptr(), cfg.rms_norm_eps, cos.data_ptr(),
                    sin.data_ptr(), k[first].data_ptr(), v[first].data_ptr(), k.shape[1], k.shape[3],
                    blocks.data_ptr(), blocks.shape[1], write_pos.data_ptr(),
                    cfg.head_dim**-0.5 if scale is None else scale, torch.get_num_threads(), flags,
                    *((local[0].data_ptr(), local[1].data_ptr()) if local else (None, None)))
        _stack_check(rc, "the layer stack", "the KV cache", k, blocks)
        return x, delta

    def head_layer(self, emb: torch.Tensor, state: torch.Tensor, row: torch.Tensor, hidden_norm: torch.Tensor,
                   flags: int, group: int, cfg, cos: torch.Tensor, sin: torch.Tensor, cache, fb) -> torch.Tensor:
        """An EAGLE-3 head's decoder layer in one call (head_layer in the C source): emb and state [B, T, hidden]
        (the next tokens' embeddings, the fused or the head's own states) -> the layer's output [B, T, hidden],
        before the final norm. row: the layer's entries in the layer stack's table layout; flags: HEAD_FLAGS. Writes
        the layer's K and V to the cache (a one-layer KVCache)."""
        B, T, hidden = state.shape
        emb, state, cos, sin = emb.contiguous(), state.contiguous(), cos.contiguous(), sin.contiguous()
        k, v, blocks, write_pos = _stack_cache(cache, fb, "the head layer")  # k, v: [1, NB, KV, BS, D]
        out = torch.empty_like(state)
        rc = self._op("head_layer", emb, state, cos, sin, k, v, hidden_norm)(
            emb.data_ptr(), state.data_ptr(), out.data_ptr(), B, T, hidden, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, group, row.data_ptr(), hidden_norm.data_ptr(), flags,
            cfg.rms_norm_eps, cos.data_ptr(), sin.data_ptr(), k[0].data_ptr(), v[0].data_ptr(), k.shape[1],
            k.shape[3], blocks.data_ptr(), blocks.shape[1], write_pos.data_ptr(), cfg.head_dim**-0.5,
            torch.get_num_threads())
        _stack_check(rc, "the head layer", "the head's KV cache", k, blocks)
        return out


def _stack_cache(cache, fb, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, block_table, write_pos) for a C call that runs whole layers (`what`, named in errors): the cache as
    it is, which must be contiguous, and the batch's tables contiguous, which must be int64."""
    k, v = cache.k, cache.v
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"{what} needs a contiguous KV cache")
    blocks, write_pos = fb.block_table.contiguous(), fb.write_pos.contiguous()
    if blocks.dtype != torch.int64 or write_pos.dtype != torch.int64:
        raise ValueError(f"{what} reads block_table and write_pos as int64")
    return k, v, blocks, write_pos


def _stack_check(rc: int, what: str, cache_name: str, k: torch.Tensor, blocks: torch.Tensor) -> None:
    """Raise for a layer call's nonzero return: -2 a projection its kernels refuse (a plan bug), else a position or
    block outside the cache (nothing was written then)."""
    if rc == -2:
        raise ValueError(f"{what} was planned with a projection its kernels can't hold")
    if rc:
        raise IndexError(f"a position or block is outside {cache_name} ({k.shape[1]} blocks of {k.shape[3]}): "
                         f"table {blocks.tolist()}")


def pair_blocks(w: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight -> [N/16, K/2, 16, 2], bf16_linear's layout: pair p of lane j is (w[n, 2p], w[n, 2p+1])."""
    N, K = w.shape
    return w.reshape(N // QUANT_BLOCK, QUANT_BLOCK, K // 2, 2).transpose(1, 2).contiguous()


def unpair_blocks(pairs: torch.Tensor) -> torch.Tensor:
    """pair_blocks' inverse: [N, K]."""
    return pairs.transpose(1, 2).reshape(pairs.shape[0] * QUANT_BLOCK, -1)


def dense_blocks(w: torch.Tensor) -> torch.Tensor:
    """A bf16 or fp32 [N, K] weight -> dense_linear's layout, N padded with zero rows to whole blocks of 16:
    fp32 [N/16, K, 16]; bf16 the pairs of pair_blocks (K padded to even) as int32 [N/16, K/2, 16], each int32
    holding w[n, 2p] in its low half and w[n, 2p + 1] in its high one."""
    N, K = w.shape
    f32 = w.dtype == torch.float32
    w = torch.nn.functional.pad(w, (0, 0 if f32 else K % 2, 0, -N % QUANT_BLOCK))
    if f32:
        return w.reshape(-1, QUANT_BLOCK, K).transpose(1, 2).contiguous()
    return pair_blocks(w).view(torch.int32).reshape(w.shape[0] // QUANT_BLOCK, -1, QUANT_BLOCK)


def undense_blocks(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """dense_blocks' inverse: [N, K] in bf16 (int32 blocks) or fp32."""
    if blocks.dtype == torch.float32:
        return blocks.transpose(1, 2).reshape(-1, in_features)[:out_features]
    pairs = blocks.view(torch.bfloat16).reshape(blocks.shape[0], blocks.shape[1], QUANT_BLOCK, 2)
    return unpair_blocks(pairs)[:out_features, :in_features]


def dense_blocks_numel(out_features: int, in_features: int, f32: bool) -> int:
    """How many elements dense_blocks holds for an [N, K] weight (int32 pairs for bf16)."""
    blocks = -(-out_features // QUANT_BLOCK) * QUANT_BLOCK
    return blocks * (in_features if f32 else -(-in_features // 2))


def amx_layout_reason(out_features: int, in_features: int) -> str | None:
    """Why bf16_linear can't hold this weight, or None."""
    if out_features % QUANT_BLOCK or in_features % 32:
        return f"[{out_features}, {in_features}]: AMX takes whole blocks of 16 outputs and of 32 inputs"
    return None


def block_weights(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q int8 [N, K] (int4 values in [-8, 7] or int8) -> the blocked layout quant_linear reads:
    int4 uint8 [N/16, K/2, 16] (two inputs per byte, the even one in the low nibble), int8 [N/16, K, 16]."""
    N, K = q.shape
    b = q.reshape(N // QUANT_BLOCK, QUANT_BLOCK, K).transpose(1, 2)  # [N/16, K, 16]
    if bits == 8:
        return b.contiguous()
    u = (b.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unblock_weights(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """block_weights' inverse: int8 [N, K]."""
    if bits == 4:
        lo, hi = (blocks & 15).to(torch.int8) - 8, (blocks >> 4).to(torch.int8) - 8
        blocks = torch.stack((lo, hi), dim=2).reshape(blocks.shape[0], -1, blocks.shape[2])
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """[N, K/G] -> fp32 [N/16, K/G, 16]."""
    N, groups = scale.shape
    return scale.float().reshape(N // QUANT_BLOCK, QUANT_BLOCK, groups).transpose(1, 2).contiguous()


def unblock_scales(scales: torch.Tensor) -> torch.Tensor:
    """block_scales' inverse: fp32 [N, K/G]."""
    return scales.transpose(1, 2).reshape(scales.shape[0] * QUANT_BLOCK, -1)


def quant_layout_reason(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why quant_linear can't hold this weight, or None."""
    if out_features % QUANT_BLOCK:
        return f"out_features {out_features} is not a multiple of {QUANT_BLOCK}"
    if group_size % QUANT_GROUP_MULTIPLE or in_features % group_size:
        return f"group size {group_size} (the C kernel takes multiples of {QUANT_GROUP_MULTIPLE} that divide in_features)"
    return None


_loaded: CpuKernels | None = None
_why_not: str | None = None  # why the kernels aren't in use, once tried
_setting = os.environ.get(_ENV, "auto")
_enabled = _setting != "off"


def setting() -> str:
    """PIPELINE_KERNELS as this process read it (validated)."""
    if _setting not in SETTINGS:
        raise ConfigError(f"{_ENV}={_setting!r} is not a setting: use one of {', '.join(SETTINGS)} (auto is the "
                          "default)")
    return _setting


def load() -> CpuKernels | None:
    """The compiled kernels, built on first call; None where they can't be (see status())."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    refusal = isa_refusal(setting())
    if refusal:
        raise ConfigError(refusal)
    compiler = _compiler()
    if compiler is None:
        _why_not = "no C compiler (cc or gcc) on PATH"
        return None
    try:
        _loaded = CpuKernels(_build(compiler, isa_flags("auto" if _setting == "off" else _setting)))
    except (OSError, AttributeError) as e:
        _why_not = f"building them failed: {e}"
        return None
    if _setting == "amx" and not _loaded.amx:
        raise ConfigError(f"{_ENV}=amx: the kernels were built with AMX but Linux refused the tile state; use auto")
    return _loaded


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def usable() -> bool:
    """Whether the kernels are switched on and built (a module deciding its weight layout at load asks)."""
    return _enabled and load() is not None


def for_dtype(x: torch.Tensor) -> CpuKernels | None:
    """The kernels for a forward on x on a model whose kernel set is the C one (pipeline.engine.kernels): where
    they take x's dtype (DTYPES), no autograd is on, and they are not switched off."""
    if not _enabled or x.dtype not in DTYPES or torch.is_grad_enabled():
        return None
    return load()


def for_tensor(x: torch.Tensor) -> CpuKernels | None:
    """for_dtype, where x is on a CPU and the GPU kernels don't run there: a layer with no kernel set of its own
    (kernels.AUTO) asks this each call."""
    if x.device.type != "cpu" or gpu_kernels.runs_here(x):  # runs_here: a test under Triton's interpreter
        return None
    return for_dtype(x)


def status() -> str:
    """One line for describe(): whether the fused kernels run, and why not."""
    if not _enabled:
        return f"off ({_ENV}=off)"
    kernels = load()
    return f"fused C, {path_name(kernels)} build ({kernels.path.name})" if kernels else f"torch ops: {_why_not}"


def path_name(kernels: CpuKernels) -> str:
    """The code path a build runs: amx (its bf16 linears; the rest avx512), avx512, avx2 or portable."""
    return "amx" if kernels.amx else kernels.isa


# CPU flags that give bf16 dot products in hardware (x86 AVX512_BF16 and AMX; Arm's BF16 extension): where
# oneDNN can run bf16 at speed without the engine's kernels.
_BF16_HARDWARE = ("avx512_bf16", "amx_bf16", "bf16")


def fast_lossless_dtype(build: bool = True) -> tuple[str, str]:
    """(dtype, why): the CPU compute dtype the engine runs fastest here, every choice lossless (each linear is
    row-invariant, by construction or by the load-time check). bf16 streams half fp32's bytes, so it is faster
    wherever its matmuls run at the memory's pace: on the engine's kernels (every path), or on oneDNN where the
    CPU has bf16 instructions. Without either, oneDNN emulates bf16 slower than it runs fp32 (an Ice Lake Xeon:
    17 against 26 tok/s on SmolLM2), so fp32 is the faster. build=False answers without building the kernels
    (a probe that must create nothing): a compiler on PATH stands for them."""
    if build and usable():
        return "bf16", f"the engine's C kernels ({path_name(load())} build) run bf16 at the memory's pace"
    if not build and _enabled and _compiler():
        return "bf16", (f"the engine's C kernels (built with {Path(_compiler()).name} on first use) run bf16 at "
                        "the memory's pace")
    why = status().removeprefix("torch ops: ") if build else "off" if not _enabled else "no C compiler on PATH"
    if set(_cpu_flags().split()) & set(_BF16_HARDWARE):
        return "bf16", f"no C kernels ({why}); this CPU's bf16 instructions run oneDNN's bf16"
    return "fp32", (f"no C kernels ({why}) and no bf16 instructions on this CPU: oneDNN would emulate bf16, slower "
                    "than fp32")


@contextlib.contextmanager
def disabled():
    """Run the torch ops inside the block (tests compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
