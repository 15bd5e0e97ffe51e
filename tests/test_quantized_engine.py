"""Quantized ModelOpt checkpoints in the portable engine (pipeline/engine/quant.py).

Each format is exported by `pipeline quantize` from one seeded tiny Llama (hidden and intermediate
are multiples of 128: AWQ's block size). The engine's logits are checked against a reference built
here independently: Hugging Face's fp32 model with the export's weights dequantized by this file's
own code, and the activations transformed by forward pre-hooks (pre_quant_scale, then per-tensor
fake quantization with input_scale). FP8 is also checked against ModelOpt's own calibrated model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import GEMMA3_WINDOW, make_tiny_llama

from pipeline.engine import cpu_kernels
from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.linear import Linear
from pipeline.engine.quant import DequantizedLinear, Int4Linear, Int8Head, QuantizedWeight, build_quantized_linear
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.weights import load_transformer
from pipeline.errors import ConfigError, ModelFormatError

MAX_LEN = 128
VOCAB = 320
FORMATS = ["int4_awq", "w4a8_awq", "fp8", "int8_sq"]
# Mean cosine similarity and top-1 agreement of logits with the unquantized model.
COSINE_FLOOR = {"int4_awq": 0.85, "w4a8_awq": 0.85, "fp8": 0.97, "int8_sq": 0.85}
TOP1_FLOOR = {"int4_awq": 0.35, "w4a8_awq": 0.35, "fp8": 0.7, "int8_sq": 0.35}
ALGOS = {"int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("qbase"), seed=0, layers=2, hidden=128, intermediate=256,
                           heads=4, kv_heads=2)


_exports: dict = {}


# test_isa_caps.py's runs of the identity tests share their exports through this folder: the seeded base is the
# same in each, and ModelOpt's import and calibration were a fifth of a run's time.
SHARED_EXPORTS = "PIPELINE_TEST_EXPORTS"


def export(base, tmp_path_factory, qformat: str, kv_cache_dtype: str = "none"):
    """A ModelOpt export of `base`, made once per module (or once in $PIPELINE_TEST_EXPORTS) through `pipeline
    quantize`'s library."""
    import os

    key = (qformat, kv_cache_dtype)
    if key not in _exports:
        shared = os.environ.get(SHARED_EXPORTS)
        out = (Path(shared) if shared else tmp_path_factory.mktemp("q")) / f"{qformat}-{kv_cache_dtype}"
        if not out.is_dir():  # quantize writes a temp folder and renames it: whole or absent
            from pipeline.quantize import QuantizeOptions, quantize

            quantize(QuantizeOptions(model=str(base), output=out, qformat=qformat, kv_cache_dtype=kv_cache_dtype,
                                     calib_size=4, calib_seq_len=64, eval_size=1, batch_size=4))
        _exports[key] = out
    return _exports[key]


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, base, tmp_path_factory):
    return request.param, export(base, tmp_path_factory, request.param)


def ids(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


def engine_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    B, T = tokens.shape
    cache = model.new_cache(B, MAX_LEN)
    return model(tokens, ForwardBatch.build(list(range(B)), [0] * B, [T] * B, cache), cache)


# Tests of the engine's C kernels themselves: they skip where the kernels aren't built (no compiler, or
# PIPELINE_KERNELS=off, as test_isa_caps runs the identity tests), where torch's kernels run instead.
needs_kernels = pytest.mark.skipif(not cpu_kernels.usable(), reason=f"no C kernels here: {cpu_kernels.status()}")


# ---- the reference: this file's own reading of the export format ----------------------------------


def dequantize(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    w, s = t[name + ".weight"], t[name + ".weight_scale"].float()
    if w.dtype == torch.uint8:  # int4: two signed nibbles per byte, along the output dim, low first
        nib = torch.empty(w.shape[0] * 2, w.shape[1], dtype=torch.int16)
        nib[0::2], nib[1::2] = (w & 15).short(), (w >> 4).short()
        q = torch.where(nib >= 8, nib - 16, nib).float()
        deq = q * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
        if name + ".weight_scale_2" in t:  # W4A8: ModelOpt rounds the int4 weight to fp8 as well
            s2 = t[name + ".weight_scale_2"]
            deq = (deq / s2).to(torch.float8_e4m3fn).float() * s2
        return deq
    return w.float() * (s[:, None] if s.dim() == 1 else s)


def reference_model(folder):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    t = load_file(str(folder / "model.safetensors"))
    cfg = AutoConfig.from_pretrained(folder)
    cfg.quantization_config = None
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {}
    for key, value in t.items():
        name, _, field = key.rpartition(".")
        if field == "weight" and name + ".weight_scale" in t:
            state[key] = dequantize(t, name)
        elif field in ("weight", "bias"):
            state[key] = value.float()
    missing, _ = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if "rotary" not in k]
    for name, mod in model.named_modules():
        pqs, scale = t.get(name + ".pre_quant_scale"), t.get(name + ".input_scale")
        if pqs is None and scale is None:
            continue
        int8 = t[name + ".weight"].dtype == torch.int8

        def hook(mod, args, pqs=pqs, scale=scale, int8=int8):
            x = args[0] if pqs is None else args[0] * pqs
            if scale is not None:
                x = ((x / scale).round().clamp(-128, 127) if int8 else
                     (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()) * scale
            return (x,)

        mod.register_forward_pre_hook(hook)
    return model


# ---- logits ---------------------------------------------------------------------------------------


def test_quantized_logits_match_a_dequantized_reference(quantized):
    qformat, folder = quantized
    tokens = ids(2, 24, seed=1)
    with torch.no_grad():
        ref = reference_model(folder)(tokens).logits
    out = engine_logits(load_transformer(folder, MAX_LEN, torch.float32), tokens)
    if qformat == "int4_awq":  # the int4 kernel's activations and scales are bf16: bf16-model accuracy
        assert (out - ref).abs().max() <= 0.15
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    else:
        assert_matches_fake_quant(out, ref)


def assert_matches_fake_quant(out: torch.Tensor, ref: torch.Tensor):
    """With activations fake-quantized, a one-ulp difference between two implementations upstream
    can flip one fp8/int8 rounding (a 6% step in one element), so a rare flip is allowed for: most
    positions' logits agree to fp32 precision, none by much. Leaving the activations unquantized misses this
    by 0.6-1.4 at the max and ~0.1 on average. How many positions see a flip depends on how far the two
    implementations' summation orders are apart: the reference's MKL against the engine's own linears (one
    fp32 accumulator per output, in order) flipped one in six positions in fp8, against none through oneDNN."""
    diff = (out - ref).abs()
    exact = (diff.amax(-1) <= 1e-4).float().mean().item()
    assert exact >= 0.75 and diff.max() <= 0.2, (exact, diff.max().item())
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_quantized_logits_stay_close_to_the_unquantized_model(quantized, base):
    qformat, folder = quantized
    tokens = ids(4, 32, seed=2)
    dense = engine_logits(load_transformer(base, MAX_LEN, torch.float32), tokens)
    for dtype in (torch.float32, torch.bfloat16):
        out = engine_logits(load_transformer(folder, MAX_LEN, dtype), tokens)
        cos = torch.nn.functional.cosine_similarity(out, dense, dim=-1).mean().item()
        top1 = (out.argmax(-1) == dense.argmax(-1)).float().mean().item()
        # Measured: fp8 0.99 / 0.82, the others 0.89-0.94 / 0.43-0.54. Quantization costs a random tiny
        # model, with its near-tied logits and 4 calibration samples, far more than a trained one.
        assert cos > COSINE_FLOOR[qformat], (qformat, dtype, cos)
        assert top1 > TOP1_FLOOR[qformat], (qformat, dtype, top1)


def test_fp8_engine_matches_modelopts_own_calibrated_model(base, tmp_path):
    """The activation fake quantization the engine simulates is ModelOpt's, not just our reading."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(ids(1, 64, seed=s)) for s in range(4)])
    tokens = ids(2, 24, seed=3)
    with torch.no_grad():
        ref = model(tokens).logits
    export_hf_checkpoint(model, export_dir=tmp_path)
    out = engine_logits(load_transformer(tmp_path, MAX_LEN, torch.float32), tokens)
    assert_matches_fake_quant(out, ref)


def test_fp8_experts_match_modelopts_own_calibrated_qwen3_moe(tmp_path):
    """A Qwen3-MoE checkpoint quantized by ModelOpt: each expert's projections are FP8 linears in the engine (the
    router stays dense, as ModelOpt leaves it), and the logits are ModelOpt's own fake-quantized model's."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    base = make_tiny_llama(tmp_path / "base", seed=0, layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2,
                           model_type="qwen3_moe", head_dim=32, moe=moe)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(ids(1, 64, seed=s)) for s in range(4)])
    tokens = ids(2, 24, seed=3)
    with torch.no_grad():
        ref = model(tokens).logits
    export_hf_checkpoint(model, export_dir=tmp_path / "fp8")
    engine = load_transformer(tmp_path / "fp8", MAX_LEN, torch.float32)
    block = engine.layers[0].mlp
    assert all(type(e.gate_up) is not Linear and type(e.down) is not Linear for e in block.experts)
    assert type(block.router) is Linear
    assert_matches_fake_quant(engine_logits(engine, tokens), ref)


# Each family's own parts under FP8: Qwen3's per-head q/k norms and wide heads; Gemma 3's (1 + w) norms after
# attention and the MLP, GeGLU and a window of 8 keys in layer 0, shorter than the 24 tokens compared.
FAMILY_MODELS = {"qwen3": dict(model_type="qwen3", head_dim=32),
                 "gemma3_text": dict(model_type="gemma3_text", head_dim=32, config=GEMMA3_WINDOW)}


@pytest.mark.parametrize("qformat", ["fp8", "int4_awq"])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_each_family_quantized_matches_modelopts_own_calibrated_model(family, qformat, tmp_path):
    """ModelOpt's export of a family's checkpoint: every projection a quantized linear in the engine. FP8's logits are
    ModelOpt's own fake-quantized model's. AWQ's are the export's, dequantized into transformers' class for the
    family (its scales folded into Gemma's (1 + w) norms as ModelOpt folds them): ModelOpt's model in memory is not
    that reference, since its export averages the scales of the linears that share a norm (a Llama is 2.3 off)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    base = make_tiny_llama(tmp_path / "base", seed=0, layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2,
                           **FAMILY_MODELS[family])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    config = {"fp8": mtq.FP8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}[qformat]
    mtq.quantize(model, config, lambda m: [m(ids(1, 64, seed=s)) for s in range(4)])
    tokens = ids(2, 24, seed=3)
    with torch.no_grad():
        ref = model(tokens).logits
    export_hf_checkpoint(model, export_dir=tmp_path / qformat)
    engine = load_transformer(tmp_path / qformat, MAX_LEN, torch.float32)
    layer = engine.layers[0]
    assert all(type(lin) is not Linear for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down))
    assert engine.describe()["weights"] == qformat
    out = engine_logits(engine, tokens)
    if qformat == "int4_awq":  # the int4 kernel's activations and scales are bf16: bf16-model accuracy
        with torch.no_grad():
            ref = reference_model(tmp_path / qformat)(tokens).logits
        assert (out - ref).abs().max() <= 0.15 and (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    else:
        assert_matches_fake_quant(out, ref)


# ---- kernels and memory ---------------------------------------------------------------------------


@needs_kernels
def test_int4_awq_runs_on_the_c_kernel_at_a_quarter_of_the_memory(base, tmp_path_factory):
    folder = export(base, tmp_path_factory, "int4_awq")
    dense = load_transformer(base, MAX_LEN, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_transformer(folder, MAX_LEN, dtype)
        layer = model.layers[0]
        for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
            assert isinstance(lin, Int4Linear) and lin.blocks.dtype == torch.uint8
            assert lin.blocks.shape == (lin.out_features // 16, lin.in_features // 2, 16)
        assert layer.attn.o.pre_scale is not None  # AWQ scale not foldable into a norm
        desc = model.describe()
        assert desc["weights"] == "int4_awq" and desc["quant_algo"] == "W4A16_AWQ"
        assert "quant_linear" in desc["kernels"]["int4"]
        ratio = desc["layer_weight_bytes"] / dense.describe()["layer_weight_bytes"]
        assert ratio < 0.3, ratio  # int4 plus one fp32 scale per group of 128 weights


def test_int4_awq_without_the_c_kernels_runs_on_torchs_int4_kernel(base, tmp_path_factory):
    folder = export(base, tmp_path_factory, "int4_awq")
    with cpu_kernels.disabled():
        model = load_transformer(folder, MAX_LEN, torch.bfloat16)
        lin = model.layers[0].mlp.gate_up
        assert not lin.c_kernel and not hasattr(lin, "blocks") and lin._torch_pack[0].dtype == torch.uint8
        assert "_weight_int4pack_mm_for_cpu" in model.describe()["kernels"]["int4"]
        with torch.inference_mode():
            torch_logits = engine_logits(model, ids(2, 6))
    c_model = load_transformer(folder, MAX_LEN, torch.bfloat16)
    with torch.inference_mode():
        c_logits = engine_logits(c_model, ids(2, 6))
    # Two kernels, two roundings (torch's takes bf16 scales and activations): close, not equal.
    assert torch.nn.functional.cosine_similarity(c_logits, torch_logits, dim=-1).min() > 0.99


@pytest.mark.parametrize("qformat, kernel", [("fp8", "no fp8 GEMM"), ("int8_sq", "dequantized"),
                                             ("w4a8_awq", "dequantized")])
def test_describe_says_which_formats_are_dequantized(base, tmp_path_factory, qformat, kernel):
    model = load_transformer(export(base, tmp_path_factory, qformat), MAX_LEN, torch.bfloat16)
    desc = model.describe()
    assert desc["dtype"] == "bf16" and desc["quant_algo"] == ALGOS[qformat]
    text = desc["kernels"][{"fp8": "fp8", "int8_sq": "int8", "w4a8_awq": "w4a8"}[qformat]]
    assert kernel in text and "bf16 at load" in text
    assert "fake-quantized" in desc["activations"]
    assert isinstance(model.layers[0].attn.qkv, DequantizedLinear)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("out_features, group", [(96, 128), (96, 64), (100, 64), (96, 16), (96, 6)])
def test_int4_linear_matches_dequantized_matmul_or_falls_back(out_features, group, kernels):
    if kernels == "c" and not cpu_kernels.usable():
        pytest.skip(f"no C kernels here: {cpu_kernels.status()}")
    g = torch.Generator().manual_seed(0)
    K = 192 if group == 6 else 256
    q = torch.randint(-8, 8, (out_features, K), generator=g, dtype=torch.int8)
    scale = torch.rand(out_features, K // group, generator=g) * 0.02 + 0.01
    packed = ((q[1::2] & 15) << 4 | (q[0::2] & 15)).view(torch.uint8)  # ModelOpt's layout
    piece = QuantizedWeight(weight=packed, weight_scale=scale)
    assert torch.equal(piece.int4()[0], q)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(3, 5, K, generator=g).bfloat16().float()  # bf16-exact: torch's kernel's input
    with contextlib.nullcontext() if kernels == "c" else cpu_kernels.disabled(), torch.inference_mode():
        lin = build_quantized_linear([piece], bias, torch.float32, torch.device("cpu"))
        y = lin(x)
    takes = out_features % 16 == 0 and (group % 4 == 0 if kernels == "c" else group >= 32)
    if takes and kernels == "c":  # fp32 scales and activations, fp32 accumulation
        assert isinstance(lin, Int4Linear) and lin.c_kernel
        ref = x @ (q.float() * scale.repeat_interleave(group, 1)).t() + bias
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    elif takes:
        assert isinstance(lin, Int4Linear) and not lin.c_kernel
        ref = x @ (q.float() * scale.bfloat16().float().repeat_interleave(group, 1)).t() + bias
        torch.testing.assert_close(y, ref, atol=0.05, rtol=0.01)  # bf16 output rounding
    else:
        assert isinstance(lin, DequantizedLinear) and "dequantized to fp32" in lin.kernel
        torch.testing.assert_close(y, x @ piece.dequantize().t() + bias, atol=1e-4, rtol=0)


# ---- the engine's int8 lm_head --------------------------------------------------------------------


@needs_kernels
def test_an_int4_checkpoint_gets_an_int8_lm_head_that_keeps_its_top_tokens(base, tmp_path_factory):
    folder = export(base, tmp_path_factory, "int4_awq")
    stored = load_transformer(folder, MAX_LEN, torch.bfloat16, lm_head="checkpoint")
    model = load_transformer(folder, MAX_LEN, torch.bfloat16, lm_head="auto")
    assert type(stored.lm_head) is Linear and "lm_head" not in stored.describe()["kernels"]
    assert isinstance(model.lm_head, Int8Head) and "int8" in model.describe()["kernels"]["lm_head"]
    with torch.inference_mode():
        want, got = engine_logits(stored, ids(4, 16)), engine_logits(model, ids(4, 16))
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_int8_head_fallback_computes_what_the_kernel_does():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    head = Int8Head(w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.inference_mode():
        fast = head(x)
        with cpu_kernels.disabled():
            slow = head(x)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-5)  # same weights, another summation order
    exact = x.float() @ w.float().t()
    assert (fast - exact).abs().max() < 0.02 * exact.abs().max()  # int8's rounding, per 64 inputs


@needs_kernels
def test_lm_head_choice_for_a_dense_model_and_a_bad_choice(base):
    assert type(load_transformer(base, MAX_LEN, torch.bfloat16, lm_head="auto").lm_head) is Linear
    assert isinstance(load_transformer(base, MAX_LEN, torch.bfloat16, lm_head="int8").lm_head, Int8Head)
    with pytest.raises(ConfigError, match="lm_head 'int4' is not a choice"):
        EngineConfig(lm_head="int4")


# ---- speculation ----------------------------------------------------------------------------------


@pytest.mark.identity
@pytest.mark.parametrize("qformat", ["int4_awq", "fp8"])
def test_greedy_output_with_a_quantized_draft_identical_to_target_only(base, tmp_path_factory, qformat):
    draft = export(base, tmp_path_factory, qformat)
    config = EngineConfig(max_batch_size=4, max_seq_len=MAX_LEN, num_draft_tokens=3,
                          gate=GatePolicy(min_tokens=0))
    prompts = [ids(1, n, seed=10 + n)[0].tolist() for n in (5, 12, 20, 9)]
    params = SamplingParams(max_tokens=30)
    target_only = LLMEngine.load(base, config)
    want = [r.output_ids for r in target_only.generate(prompts, params)]
    engine = LLMEngine.load(base, config, draft=draft)
    assert [r.output_ids for r in engine.generate(prompts, params)] == want
    assert engine.stats.drafted_tokens > 0 and engine.stats.acceptance_rate > 0
    desc = engine.describe()
    assert desc["target"]["weights"] == "dense" and desc["draft"]["weights"] == qformat


@pytest.mark.identity
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_int4_target_gives_the_same_greedy_tokens_alone_batched_and_speculated(base, tmp_path_factory, dtype):
    # The C int4 kernel and the int8 head see a verify's k+1 rows per request and a decode's one row:
    # a row's bits must not depend on that, nor on the batch around it.
    target = export(base, tmp_path_factory, "int4_awq")
    config = EngineConfig(max_batch_size=4, max_seq_len=MAX_LEN, dtype=dtype, num_draft_tokens=3,
                          gate=GatePolicy(min_tokens=0))
    prompts = [ids(1, n, seed=20 + n)[0].tolist() for n in (5, 12, 20, 9)]
    params = SamplingParams(max_tokens=30)
    plain = LLMEngine.load(target, config)
    if cpu_kernels.usable():  # else (PIPELINE_KERNELS=off, under test_isa_caps) torch's int4 kernel, checked
        assert "int8" in plain.describe()["target"]["kernels"]["lm_head"]
    want = [r.output_ids for r in plain.generate(prompts, params)]
    assert [plain.generate([p], params)[0].output_ids for p in prompts] == want
    speculated = LLMEngine.load(target, config, draft=base)  # the unquantized model drafts for its INT4 self
    assert [r.output_ids for r in speculated.generate(prompts, params)] == want
    assert speculated.stats.drafted_tokens > 0 and speculated.stats.acceptance_rate > 0.3


@needs_kernels
def test_generate_json_config_describes_the_quantized_engine(base, tmp_path_factory):
    from pipeline.generate import GenerateOptions, generate, stats_line

    folder = export(base, tmp_path_factory, "int4_awq")
    result = generate(GenerateOptions(prompts=("hello",), model=str(folder), max_tokens=4, raw=True,
                                      max_seq_len=MAX_LEN))
    described = result.to_json_dict()["config"]["engine"]
    assert described["target"]["weights"] == "int4_awq"
    assert "quant_linear" in described["target"]["kernels"]["int4"]
    assert "int8" in described["target"]["kernels"]["lm_head"]  # generate runs EngineConfig's lm_head="auto"
    json.dumps(described)
    assert "int4_awq weights" in stats_line(result)


# ---- formats it can't run -------------------------------------------------------------------------


def test_fp8_kv_cache_checkpoint_loads_and_runs(base, tmp_path_factory):
    folder = export(base, tmp_path_factory, "fp8", kv_cache_dtype="fp8")
    model = load_transformer(folder, MAX_LEN, torch.float32)
    desc = model.describe()
    assert desc["kv_cache"].startswith("FP8") and "ignored" in desc["kv_cache"]
    assert torch.isfinite(engine_logits(model, ids(1, 16))).all()


@pytest.mark.parametrize("where", ["hf_quant_config", "config"])
def test_unsupported_quant_algo_is_a_one_line_model_format_error(base, tmp_path, where):
    folder = tmp_path / "nvfp4"
    shutil.copytree(base, folder)
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    if where == "hf_quant_config":
        (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": q}))
    else:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = {**q, "quant_method": "modelopt"}
        (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError) as err:
        load_transformer(folder, MAX_LEN)
    msg = str(err.value)
    assert "NVFP4" in msg and "\n" not in msg


def test_non_modelopt_quantization_is_a_model_format_error(base, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    tensors[name + ".qweight"] = torch.zeros(16, 128, dtype=torch.int32)  # GPTQ's packed weight
    del tensors[name + ".weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelFormatError, match="gptq"):
        load_transformer(folder, MAX_LEN)


def test_a_dequantized_gguf_conversion_keeps_loading(base, tmp_path):
    """transformers dequantizes a GGUF on load but keeps its quantization_config when saving."""
    folder = tmp_path / "from-gguf"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_transformer(folder, MAX_LEN).describe()["weights"] == "dense"


def test_fused_pieces_with_different_pre_quant_scales_are_folded_exactly():
    """Should an export leave q/k/v with different AWQ scales, the engine folds the ratios into
    dequantized weights rather than running them on one shared (wrong) scale."""
    g = torch.Generator().manual_seed(1)
    K = 128
    pieces = []
    for n, pqs in ((32, torch.rand(K, generator=g) + 0.5), (16, None)):
        q = torch.randint(-8, 8, (n, K), generator=g, dtype=torch.int8)
        packed = ((q[1::2] & 15) << 4 | (q[0::2] & 15)).view(torch.uint8)
        pieces.append(QuantizedWeight(weight=packed, weight_scale=torch.rand(n, 1, generator=g) * 0.02,
                                      pre_quant_scale=pqs))
    lin = build_quantized_linear(pieces, None, torch.float32, torch.device("cpu"))
    assert isinstance(lin, DequantizedLinear) and "pre_quant_scale" in lin.kernel
    x = torch.randn(2, K, generator=g)
    want = torch.cat([(x * pieces[0].pre_quant_scale) @ pieces[0].dequantize().t(), x @ pieces[1].dequantize().t()], -1)
    torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.identity
@pytest.mark.parametrize("weights", ["int4_awq", "bf16", "qwen3", "qwen3_moe", "gemma3_text"])
def test_the_layer_stack_in_c_calls_gives_the_module_loops_bits(base, tmp_path_factory, weights):
    folder = export(base, tmp_path_factory, "int4_awq") if weights == "int4_awq" else base
    if weights.startswith(("qwen3", "gemma3")):  # base's shape in bf16, with Qwen3's per-head q/k norms (random
        # weights) in the stack; for Qwen3-MoE experts in layer 0 (the stack's MoE entry) before a dense layer 1; for
        # Gemma 3 its fp32 (1 + w) norms, four a layer, GeGLU, and a window of 8 keys with its own rope in layer 0
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                   mlp_only_layers=[1]) if weights == "qwen3_moe" else None
        folder = make_tiny_llama(tmp_path_factory.mktemp(weights), seed=0, layers=2, hidden=128, intermediate=256,
                                 heads=4, kv_heads=2, model_type=weights, moe=moe,
                                 config=GEMMA3_WINDOW if weights == "gemma3_text" else None)
    model = load_transformer(folder, MAX_LEN, torch.bfloat16)
    if not cpu_kernels.usable():
        pytest.skip(f"no C kernels for {weights} here: {cpu_kernels.status()}")
    assert model.layer_stack() is not None and "one C call" in model.describe()["kernels"]["decoder layers"]

    def run(one_call: bool):
        model._layer_stack = None if one_call else False  # False: the per-module loop
        cache = model.new_cache(3, MAX_LEN)
        with torch.inference_mode():
            out = [model(ids(3, 20), ForwardBatch.build([0, 1, 2], [0] * 3, [20, 9, 20], cache), cache)]
            for i in range(3):  # verify-shaped steps of ragged lengths
                fb = ForwardBatch.build([0, 1, 2], [20 + 4 * i] * 3, [4, 2, 1], cache)
                out.append(model(ids(3, 4, seed=i + 1), fb, cache))
            # EAGLE-3's: layer inputs captured (the final output too), the stack run between them in C calls.
            fb = ForwardBatch.build([0, 1, 2], [32] * 3, [3, 3, 1], cache)
            logits, captured = model(ids(3, 3, seed=9), fb, cache, capture_layers=(1, 2, model.cfg.num_layers))
            out += [logits, *captured]
        return out, cache

    (want, want_cache), (got, got_cache) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    cache = model.new_cache(2, MAX_LEN)
    with pytest.raises(IndexError, match="outside the KV cache"), torch.inference_mode():
        model(ids(1, 3), ForwardBatch.build([5], [0], [3], cache), cache)  # slot 5 of 2
    assert not cache.k.any()  # nothing written
    if weights == "int4_awq":  # a group size the int4 kernel refuses: a plan bug, said as such, not as a bad slot
        stack, x = model.layer_stack(), model.embed(ids(1, 3))
        cos = model.rope_cos[:3].to(x.dtype)[None, :, None, :]
        with pytest.raises(ValueError, match="can't hold"), torch.inference_mode():
            cpu_kernels.load().layers(x, stack.table, 6, model.cfg, cos, cos, cache,
                                      ForwardBatch.build([0], [0], [3], cache))
        assert not cache.k.any()


def test_a_model_with_a_onednn_layer_keeps_the_module_loop(base):
    model = load_transformer(base, MAX_LEN, torch.bfloat16)
    model.layers[1].mlp.down.pack("onednn")  # a projection the C stack can't run
    assert model.layer_stack() is None
