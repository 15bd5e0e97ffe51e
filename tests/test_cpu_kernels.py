"""The fused C kernels (pipeline/engine/cpu_kernels.c) against the torch ops they replace, and the
property the engine's losslessness leans on: a row's bits don't depend on the batch around it."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch

from pipeline.engine import cpu_kernels
from pipeline.engine.config import ModelConfig
from pipeline.engine.kv_cache import ForwardBatch, KVCache
from pipeline.engine.model import MLP, Attention, RMSNorm, Transformer

KERNELS = cpu_kernels.load()
pytestmark = [pytest.mark.skipif(not cpu_kernels.usable(), reason=f"no fused kernels: {cpu_kernels.status()}"),
              pytest.mark.identity]
BF = torch.bfloat16


def cfg(heads=6, kv=2, head_dim=16, hidden=96) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=hidden, intermediate_size=160, num_layers=1,
                       num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two same-sign-ish bf16 tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def test_norm_and_residual_add_match_the_torch_ops():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(BF)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x, delta = (torch.randn(5, 3, 96, generator=g) * 4).to(BF), torch.randn(5, 3, 96, generator=g).to(BF)
    with torch.inference_mode():
        total, fused = norm.add_forward(x, delta)
        with cpu_kernels.disabled():
            ref_total, ref = norm.add_forward(x, delta)
    assert torch.equal(total, ref_total)  # the add rounds once, as torch's does
    # The sum of squares runs in another order than torch's: at most a one-ulp difference, rarely.
    assert ulps(fused, ref) <= 1 and (fused == ref).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_the_fused_residual_add_gives_the_norm_a_separate_add_gives(dtype):
    """The engine adds a layer's residual inside the norm, except where it must see the sum first (EAGLE-3's
    captured layers): both must give the same bits. A vectorized reduction had summed the squares in another
    order in the two, and SmolLM2's greedy output moved under EAGLE-3."""
    g = torch.Generator().manual_seed(2)
    for dim in (576, 960, 100, 17):
        w = (torch.randn(dim, generator=g) * 0.5 + 1).to(dtype)
        x, delta = (torch.randn(64, dim, generator=g) * 3).to(dtype), torch.randn(64, dim, generator=g).to(dtype)
        with torch.inference_mode():
            total, fused = KERNELS.rms_norm(x, w, 1e-5, delta)
            separate = KERNELS.rms_norm(x + delta, w, 1e-5)
        assert torch.equal(total, x + delta) and torch.equal(fused, separate), dim


def test_silu_mul_matches_the_torch_ops():
    g = torch.Generator().manual_seed(1)
    mlp = MLP(cfg())
    gate_up = (torch.randn(7, 320, generator=g) * 3).to(BF)
    with torch.inference_mode():
        fused = KERNELS.silu_mul(gate_up)
    gate, up = gate_up.split(160, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert mlp.inter == 160 and ulps(fused, ref) <= 1 and (fused == ref).float().mean() > 0.97


def test_gelu_mul_and_an_fp32_weighted_norm_match_the_torch_ops():
    """Gemma's parts on the C kernels: GeGLU (gelu, tanh approximation, times up) within 2^-7 (relative) and 1e-5
    of torch's ops (the kernel's x / (1 + e^-2y) keeps the tiny values that torch's 0.5 x (1 + tanh y) cancels to 0 at
    x < -5, and its rounding of the gelu moves the product by an ulp now and then), and the RMSNorm whose fp32 weight
    (1 + w) scales the fp32 row before its one rounding within an ulp, the fused residual add's norm the separate
    one's bits."""
    from pipeline.engine.swiglu import SwiGLU

    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 320, generator=g) * 3).to(BF)
    with torch.inference_mode():
        fused = KERNELS.silu_mul(gate_up, "gelu_mul")
    gate, up = gate_up.split(160, dim=-1)
    ref = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert SwiGLU(8, 160, "gelu_tanh").activation == "gelu_tanh"
    torch.testing.assert_close(fused.float(), ref.float(), atol=1e-5, rtol=2 ** -7)
    assert (fused == ref).float().mean() > 0.9
    w = 1 + torch.randn(96, generator=g) * 0.5  # fp32
    x, delta = (torch.randn(64, 96, generator=g) * 3).to(BF), torch.randn(64, 96, generator=g).to(BF)
    with torch.inference_mode():
        total, normed = KERNELS.rms_norm(x, w, 1e-6, delta)
        separate = KERNELS.rms_norm(x + delta, w, 1e-6)
    ref = (torch.nn.functional.rms_norm((x + delta).float(), (96,), None, 1e-6) * w).to(BF)
    assert torch.equal(total, x + delta) and torch.equal(normed, separate)
    assert ulps(normed, ref) <= 1 and (normed == ref).float().mean() > 0.97


def attention_setup(c: ModelConfig, seed: int):
    g = torch.Generator().manual_seed(seed)
    attn = Attention(c, layer=0).to(BF)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    cos, sin = Transformer.rope_tables(c, 64)
    return attn, cos, sin, g


def run_attention(attn, c, cos, sin, cache, x, slots, starts, lengths):
    fb = ForwardBatch.build(slots, starts, lengths, cache)
    with torch.inference_mode():
        return attn(x, cos[fb.positions].to(BF)[:, :, None], sin[fb.positions].to(BF)[:, :, None], cache, fb)


@pytest.mark.parametrize("heads,kv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_rope_attention_is_as_accurate_as_the_torch_ops_and_writes_the_same_cache(heads, kv):
    """A padded prefill, then ragged decode steps, in non-contiguous slots: fused, torch ops in bf16, and
    torch ops in fp32 as the reference. The fused kernel keeps scores in fp32 where the bf16 matmul rounds
    them, so its error against fp32 may differ from the torch ops', but not grow."""
    c = cfg(heads=heads, kv=kv)
    attn, cos, sin, _ = attention_setup(c, 2)
    x = torch.randn(2, 9, 96, generator=torch.Generator().manual_seed(3)).to(BF)
    runs = {}
    for name, dtype in (("fused", BF), ("torch", BF), ("fp32", torch.float32)):
        module = attn if dtype == BF else copy.deepcopy(attn).float()
        cache = KVCache(1, 4, 63, kv, 16, dtype)
        with contextlib.nullcontext() if name == "fused" else cpu_kernels.disabled():
            outs = [run_attention(module, c, cos, sin, cache, x.to(dtype), [3, 0], [0, 0], [9, 4]),
                    run_attention(module, c, cos, sin, cache, x[:, :3].to(dtype), [3, 0], [9, 4], [3, 1])]
        # pads' outputs are dropped by the engine: keep the real tokens
        runs[name] = (torch.cat([outs[0][0], outs[0][1, :4], outs[1][0], outs[1][1, :1]]).float(), cache)
    # Rope and the cache write round as apply_rope does: the cached keys and values are the same bits.
    # (The trash block, where the torch ops write pads and the kernel writes nothing, aside.)
    real = slice(0, runs["fused"][1].num_blocks)
    assert torch.equal(runs["fused"][1].k[:, real], runs["torch"][1].k[:, real])
    assert torch.equal(runs["fused"][1].v[:, real], runs["torch"][1].v[:, real])
    ref = runs["fp32"][0]
    fused_err, torch_err = ((runs[n][0] - ref).abs().max().item() for n in ("fused", "torch"))
    assert fused_err <= 1.5 * torch_err, (fused_err, torch_err)
    assert fused_err < 0.02 * ref.abs().max().item()


def test_a_rows_attention_is_the_same_alone_in_a_batch_and_in_a_verify():
    """The engine's greedy identity (speculative == plain) needs a row's bits to be independent of the
    batch's other rows and of how many tokens its own forward feeds."""
    c = cfg()
    attn, cos, sin, _ = attention_setup(c, 4)
    seq = torch.randn(1, 30, 96, generator=torch.Generator().manual_seed(5)).to(BF)
    other = torch.randn(1, 30, 96, generator=torch.Generator().manual_seed(6)).to(BF)

    def decode_alone():
        cache = KVCache(1, 4, 63, 2, 16, BF)
        run_attention(attn, c, cos, sin, cache, seq[:, :25], [1], [0], [25])
        return torch.cat([run_attention(attn, c, cos, sin, cache, seq[:, t:t + 1], [1], [t], [1])
                          for t in range(25, 30)], 1)

    def verify_in_a_batch():
        cache = KVCache(1, 4, 63, 2, 16, BF)
        run_attention(attn, c, cos, sin, cache, torch.cat([seq[:, :25], other[:, :25]]), [1, 2], [0, 0], [25, 12])
        x = torch.cat([seq[:, 25:30], other[:, 12:17]])
        return run_attention(attn, c, cos, sin, cache, x, [1, 2], [25, 12], [5, 2])[:1]

    assert torch.equal(decode_alone(), verify_in_a_batch())


def test_pads_write_nothing():
    c = cfg()
    attn, cos, sin, g = attention_setup(c, 7)
    cache = KVCache(1, 2, 63, 2, 16, BF)
    x = torch.randn(2, 6, 96, generator=g).to(BF)
    run_attention(attn, c, cos, sin, cache, x, [0, 1], [0, 0], [6, 2])
    slot1 = cache.slot_blocks(1)[0]  # row 1 fed 2 tokens and 4 pads: positions 2.. of its first block stay empty
    assert cache.k[0, slot1, :, :2].abs().sum() > 0 and cache.k[0, slot1, :, 2:].abs().sum() == 0
    assert cache.k[0, cache.trash_block].abs().sum() == 0


def test_an_unknown_setting_is_refused_not_read_as_on(tmp_path):
    code = ("import torch; from pipeline.engine.model import RMSNorm\n"
            "with torch.inference_mode(): RMSNorm(8, 1e-5).to(torch.bfloat16)(torch.ones(2, 8, dtype=torch.bfloat16))")
    env = {**os.environ, "PIPELINE_KERNELS": "of", "PIPELINE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "PIPELINE_KERNELS='of' is not a setting: use one of auto, off," in done.stderr


def test_without_a_compiler_the_torch_ops_run_and_say_why(tmp_path):
    code = ("import torch; from pipeline.engine import cpu_kernels; from pipeline.engine.model import RMSNorm\n"
            "n = RMSNorm(8, 1e-5).to(torch.bfloat16)\n"
            "with torch.inference_mode(): n(torch.ones(2, 8, dtype=torch.bfloat16))\n"
            "print(cpu_kernels.status())")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PIPELINE_HOME": str(tmp_path), "PIPELINE_KERNELS": "auto"}
    env.pop("PIPELINE_KERNEL_CACHE", None)  # the run's shared builds: this process must find none and build
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch ops: building them failed"), done.stdout


def test_describe_says_which_small_ops_run():
    model = Transformer(cfg(), 64).to(BF)
    assert model.describe()["kernels"]["norm, rope, attention, silu"].startswith(
        f"fused C, {cpu_kernels.path_name(KERNELS)} build (cpu_kernels-")
    with cpu_kernels.disabled():
        assert model.describe()["kernels"]["norm, rope, attention, silu"] == "off (PIPELINE_KERNELS=off)"
    assert "norm, rope, attention, silu" not in Transformer(cfg(), 64).half().describe()["kernels"]  # fp16: torch ops


@pytest.mark.parametrize("block", [-1, "past"])
def test_a_block_outside_the_cache_raises_and_writes_nothing(block):
    c = cfg()
    attn, cos, sin, g = attention_setup(c, 8)
    cache = KVCache(1, 2, 63, 2, 16, BF)
    fb = ForwardBatch.build([1], [0], [3], cache)
    fb.block_table[0, 0] = -1 if block == -1 else cache.num_blocks + 1  # the trash block is the last one
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the KV cache"):
        attn(torch.randn(1, 3, 96, generator=g).to(BF), cos[:3].to(BF)[None, :, None], sin[:3].to(BF)[None, :, None],
             cache, fb)
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0


# ---- weight-quantized linears (quant_linear) ------------------------------------------------------


def quantized(bits: int, n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale [n, k/group], the dequantized weight in float64)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    w = q.double() * scale.double().repeat_interleave(group, dim=1)
    return q, scale, w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_quant_linear_matches_the_dequantized_matmul(bits, dtype):
    q, scale, w = quantized(bits, 48, 192, 64)
    blocks, scales = cpu_kernels.block_weights(q, bits), cpu_kernels.block_scales(scale)
    assert torch.equal(cpu_kernels.unblock_weights(blocks, bits), q)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 192, generator=g).to(dtype)  # tiles of 4 + 4 + 1 rows
    pre = torch.rand(192, generator=g) + 0.5
    with torch.inference_mode():
        y = KERNELS.quant_linear(x, blocks, bits, scales, out_dtype=torch.float32)
        y_pre = KERNELS.quant_linear(x, blocks, bits, scales, pre_scale=pre)
    ref = x.double() @ w.t()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)  # fp32 accumulation
    assert y_pre.dtype == dtype
    tol = {torch.float32: 1e-4, BF: 0.05}[dtype]  # bf16 output rounds once
    torch.testing.assert_close(y_pre.double(), (x.double() * pre.double()) @ w.t(), atol=tol, rtol=0.01)


def test_quant_linear_gives_a_row_the_same_bits_alone_and_in_any_batch():
    q, scale, _ = quantized(4, 64, 256, 32, seed=2)
    blocks, scales = cpu_kernels.block_weights(q, 4), cpu_kernels.block_scales(scale)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3)).to(BF)
    with torch.inference_mode():
        alone = torch.cat([KERNELS.quant_linear(x[i:i + 1], blocks, 4, scales) for i in range(11)])
        for rows in (2, 3, 4, 5, 7, 11):  # each row count takes another mix of the 1-4-row variants
            assert torch.equal(KERNELS.quant_linear(x[:rows], blocks, 4, scales), alone[:rows]), rows


def test_quant_linear_refuses_a_layout_it_cannot_hold():
    q, scale, _ = quantized(4, 16, 96, 32)
    with pytest.raises(ValueError, match="not a layout"):  # 96 inputs in 5 scale groups: not whole groups
        KERNELS.quant_linear(torch.zeros(1, 96, dtype=BF), cpu_kernels.block_weights(q, 4), 4,
                             cpu_kernels.block_scales(torch.rand(16, 5)))
    assert cpu_kernels.quant_layout_reason(100, 96, 32) is not None  # 100 outputs: not whole blocks of 16
    assert cpu_kernels.quant_layout_reason(96, 96, 6) is not None  # a group of 6: not a multiple of 4


# ---- bf16 linears on AMX --------------------------------------------------------------------------

needs_amx = pytest.mark.skipif(KERNELS is None or not KERNELS.amx, reason="no AMX tiles on this CPU (or not granted)")


@needs_amx
def test_amx_linear_matches_fp32_and_gives_a_row_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(80, 192, generator=g) * 0.1).to(BF)
    pairs = cpu_kernels.pair_blocks(w)
    assert torch.equal(cpu_kernels.unpair_blocks(pairs), w)
    x = torch.randn(37, 192, generator=g).to(BF)  # 16 + 16 + 5 rows: two full tiles and a short one
    with torch.inference_mode():
        y = KERNELS.bf16_linear(x, pairs, out_dtype=torch.float32)
        alone = torch.cat([KERNELS.bf16_linear(x[i:i + 1], pairs, out_dtype=torch.float32) for i in range(37)])
        rounded = KERNELS.bf16_linear(x, pairs)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)
    assert torch.equal(alone, y)
    assert rounded.dtype == BF and torch.equal(rounded, y.to(BF))  # rounded once, from the fp32 sums


def kernel_and_fallback(lin, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed Linear's output on its kernel, and on torch once its plain weight is released (the engine holds
    the weight once) and the kernels are switched off: the fallback reads the packed layout back."""
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(8)).to(dtype)
    with torch.inference_mode():
        fast = lin(x)
        lin.release_plain()
        with cpu_kernels.disabled():
            return fast, lin(x)


@needs_amx
def test_a_bf16_linear_takes_amx_and_falls_back_to_torch_when_the_kernels_are_off():
    from pipeline.engine.linear import Linear
    lin = Linear(64, 48, bias=True).to(BF)
    with torch.no_grad():
        lin.weight.normal_(0, 0.1), lin.bias.normal_(0, 0.1)
    lin.pack()
    assert lin.layout == "amx" and "packed=amx" in repr(lin)
    fast, slow = kernel_and_fallback(lin, BF)
    torch.testing.assert_close(fast, slow, atol=0.02, rtol=0.01)  # two summation orders, the bias added in bf16
    odd = Linear(64, 40, bias=False).to(BF)  # 40 outputs: not whole blocks of 16
    odd.pack()
    assert odd.layout != "amx"


# ---- dense linears (dense_linear: bf16 and fp32 on any CPU) ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("n,k", [(80, 192), (77, 191), (5, 33)], ids=["blocks", "ragged", "tiny"])
def test_dense_linear_matches_float64_and_gives_a_row_the_same_bits_in_any_batch(dtype, n, k):
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    blocks = cpu_kernels.dense_blocks(w)
    assert torch.equal(cpu_kernels.undense_blocks(blocks, n, k), w)
    x = torch.randn(37, k, generator=g).to(dtype)  # whole tiles (8 rows on AVX-512, 4 elsewhere) and a short one
    with torch.inference_mode():
        y = KERNELS.dense_linear(x, blocks, n, out_dtype=torch.float32)
        alone = torch.cat([KERNELS.dense_linear(x[i:i + 1], blocks, n, out_dtype=torch.float32) for i in range(37)])
        rounded = KERNELS.dense_linear(x, blocks, n)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=1e-5, rtol=1e-5)  # fp32 sums
    assert torch.equal(alone, y)
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 16, 17):  # every tile shape, and mixes of them
        with torch.inference_mode():
            assert torch.equal(KERNELS.dense_linear(x[:rows], blocks, n, out_dtype=torch.float32), y[:rows]), rows
    assert rounded.dtype == dtype and torch.equal(rounded, y.to(dtype))  # rounded once, from the fp32 sums


def test_dense_linear_sums_in_order_and_a_wrong_order_is_caught():
    """The bits are those of one fp32 accumulator per output, k in order, multiply then add (no FMA): the
    contract every path computes, written out here in torch. A pairwise order (a negative control) differs."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(32, 40, generator=g), torch.randn(3, 40, generator=g)
    acc = torch.zeros(3, 32)
    for k in range(40):
        acc = acc + x[:, k:k + 1] * w[:, k]  # each product rounded to fp32, then the add
    with torch.inference_mode():
        y = KERNELS.dense_linear(x, cpu_kernels.dense_blocks(w), 32)
    assert torch.equal(y, acc)
    pairwise = (x[:, 0::2, None] * w.t()[0::2]).sum(1) + (x[:, 1::2, None] * w.t()[1::2]).sum(1)
    assert not torch.equal(y, pairwise)


def test_dense_linear_refuses_what_it_cannot_hold():
    w = cpu_kernels.dense_blocks(torch.randn(32, 64).to(BF))
    with pytest.raises(ValueError, match="not what it takes"):  # fp32 x on bf16 weights
        KERNELS.dense_linear(torch.randn(1, 64), w, 32)
    with pytest.raises(ValueError, match="not what it takes"):  # blocks for another shape
        KERNELS.dense_linear(torch.randn(1, 62).to(BF), w, 32)


# ---- every build gives the same bits ---------------------------------------------------------------------


def runnable_caps() -> list[str]:
    """The capped builds this CPU can run (cpu_kernels.ISA_MARCH), the native one included."""
    return [isa for isa in ("portable", "avx2", "avx512", "auto") if cpu_kernels.isa_refusal(isa) is None]


@pytest.mark.slow  # compiles every build this CPU runs, ~13 s
def test_every_build_this_cpu_runs_computes_the_same_bits():
    """A user's CPU runs the AVX-512, the AVX2 or the portable code: each must give every op the bits the others
    give, so a test passing here passes there. (AMX's bf16 linear sums its own way; it is not among them.)"""
    compiler = os.environ.get("CC") or "cc"
    builds = {isa: cpu_kernels.CpuKernels(cpu_kernels._build(compiler, cpu_kernels.isa_flags(isa)))
              for isa in runnable_caps()}
    assert builds["portable"].isa == "portable"
    if len({b.isa for b in builds.values()}) < 2:
        pytest.skip("this CPU runs one code path only")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=g)
    c = cfg()
    attn, cos, sin, _ = attention_setup(c, 9)
    qkv = (torch.randn(2, 5, c.num_heads + 2 * c.num_kv_heads, c.head_dim, generator=g)).to(BF)
    cos5, sin5 = (t[:5].to(BF)[None, :, None].expand(2, 5, 1, c.head_dim) for t in (cos, sin))
    results = {}
    for isa, k in builds.items():
        out = []
        with torch.inference_mode():
            for dtype in (torch.float32, BF):
                w = (torch.randn(48, 128, generator=torch.Generator().manual_seed(5)) * 0.1).to(dtype)
                out.append(k.dense_linear(x.to(dtype), cpu_kernels.dense_blocks(w), 48, out_dtype=torch.float32))
            for bits in (4, 8):
                q, scale, _ = quantized(bits, 32, 128, 64, seed=bits)
                blocks, scales = cpu_kernels.block_weights(q, bits), cpu_kernels.block_scales(scale)
                out.append(k.quant_linear(x.to(BF), blocks, bits, scales, out_dtype=torch.float32))
            xb = (x * 3).to(BF).reshape(6, 128)
            out += [*k.rms_norm(xb, torch.ones(128, dtype=BF) * 0.7, 1e-5, xb.flip(0)), k.silu_mul(xb)]
            cache = KVCache(1, 3, 63, c.num_kv_heads, c.head_dim, BF)
            table = torch.tensor([cache.slot_blocks(2), cache.slot_blocks(0)])
            out.append(k.rope_attend(qkv, cos5, sin5, cache.k[0], cache.v[0], table,
                                     torch.arange(5).repeat(2, 1), c.num_heads, c.num_kv_heads))
            out += [cache.k, cache.v]
        results[isa] = out
    for isa, out in results.items():
        for i, (a, b) in enumerate(zip(out, results["portable"])):
            assert torch.equal(a, b), f"{isa} and portable differ in result {i}"


def test_a_cap_this_cpu_cannot_run_is_refused_in_one_line():
    assert cpu_kernels.isa_refusal("avx512", "flags : fpu avx2 fma") is not None  # (or: not an x86-64 CPU)
    msg = cpu_kernels.isa_refusal("avx2", "flags : fpu sse2")
    assert msg and "avx2" in msg and "\n" not in msg
    assert cpu_kernels.isa_refusal("portable", "flags : fpu") is None


def test_linears_take_the_engines_own_kernels_and_say_why():
    from pipeline.engine.linear import Linear
    for dtype in (torch.float32, BF):
        lin = Linear(64, 40, bias=True).to(dtype)  # 40 outputs: not whole blocks of 16, so not AMX
        with torch.no_grad():
            lin.weight.normal_(0, 0.1), lin.bias.normal_(0, 0.1)
        lin.pack()
        assert lin.layout == "dense" and "by construction" in lin.why
        assert KERNELS.isa in lin.kernel_name()
        fast, slow = kernel_and_fallback(lin, dtype)
        torch.testing.assert_close(fast, slow, atol=0.02 if dtype == BF else 1e-5, rtol=0.01)


def test_the_fast_lossless_dtype_is_bf16_on_the_kernels_and_fp32_where_bf16_would_be_emulated(monkeypatch):
    dtype, why = cpu_kernels.fast_lossless_dtype()
    assert dtype == "bf16" and cpu_kernels.path_name(KERNELS) in why
    assert cpu_kernels.fast_lossless_dtype(build=False)[0] == "bf16"  # a compiler here: the build's probe agrees
    with cpu_kernels.disabled():  # no kernels: the CPU's bf16 instructions decide
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu avx2 avx512f avx512bw")  # Ice Lake
        dtype, why = cpu_kernels.fast_lossless_dtype()
        assert dtype == "fp32" and "no bf16 instructions" in why and "\n" not in why
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu avx2 avx512f avx512_bf16")  # Zen 4
        assert cpu_kernels.fast_lossless_dtype()[0] == "bf16"


def test_kernels_are_built_into_their_cache_folder_or_the_homes(tmp_path, monkeypatch):
    from pipeline.home import kernel_cache

    monkeypatch.delenv("PIPELINE_KERNEL_CACHE")
    assert kernel_cache() == tmp_path / "home" / "kernels"  # conftest's home for this test
    monkeypatch.setenv("PIPELINE_KERNEL_CACHE", str(tmp_path / "shared"))
    lib = cpu_kernels._build(os.environ.get("CC") or "cc", cpu_kernels.isa_flags("portable"))
    assert lib.parent == tmp_path / "shared" and lib.is_file()
    assert cpu_kernels._build("no-such-cc", cpu_kernels.isa_flags("portable")) == lib  # found: nothing is built
