"""The engine's decoder against Hugging Face transformers on the same weights.

Every variant the engine supports (GQA, tied embeddings, Qwen2 qkv bias, Llama-3 rope scaling, Qwen3's
q/k norms and own head_dim, Qwen3-MoE's experts, Gemma 3's sliding window and norms) is
checked in fp32 (tight) and bf16 (loose), for a full prefill, for decoding one token at a time
through the KV cache, and for a ragged padded batch whose rows sit in non-contiguous cache slots
at different positions. Every linear back end is covered: auto (in bf16 the engine's AMX kernel where
the CPU has AMX), oneDNN-packed weights and plain F.linear.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import GEMMA3_WINDOW, make_tiny_llama

from pipeline.engine import cpu_kernels
from pipeline.engine.config import ModelConfig
from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.linear import Linear
from pipeline.engine.weights import load_transformer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
VARIANTS = {
    "llama_gqa": dict(heads=4, kv_heads=2),
    "tied": dict(tie=True),
    "qwen2": dict(model_type="qwen2"),
    "llama3_rope": dict(rope_scaling=LLAMA3_ROPE),
    # per-head q/k norms (random weights, not ones), and a head_dim that isn't hidden / heads
    "qwen3": dict(model_type="qwen3", head_dim=32),
    # experts in layer 0, a dense MLP in layer 1 (mlp_only_layers); top 2 of 8, renormalized
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, moe=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    # Gemma 3: layer 0 local (a window of 8 keys, shorter than every sequence here, rope base 10k), layer 1 global
    # (1M); (1 + w) norms with random w, four a layer and per head; GeGLU; the embedding and query scales
    "gemma3": dict(model_type="gemma3_text", head_dim=32, config=GEMMA3_WINDOW),
}
# (dtype, max |engine - HF| allowed). Logits have std ~0.8 on these models.
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.06}
MAX_LEN = 128
VOCAB = 320


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    path = make_tiny_llama(tmp_path_factory.mktemp(name), seed=3, layers=2, **VARIANTS[name])
    return name, path


_hf_cache: dict = {}


def hf_logits(path, dtype, ids: torch.Tensor) -> torch.Tensor:
    """Logits of HF's model on each row of ids [B, n] on its own (no padding), in fp32."""
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype)
    if key not in _hf_cache:
        _hf_cache.clear()
        _hf_cache[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return _hf_cache[key](ids).logits.float()


def engine(path, dtype, backend):
    model = load_transformer(path, MAX_LEN, dtype)
    model.pack_weights(backend)
    return model


def seqs(n_rows: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n_rows, n), generator=torch.Generator().manual_seed(seed))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype):
    diff = (out - ref).abs().max().item()
    assert diff <= TOL[dtype], f"max |engine - HF| = {diff:.3g} > {TOL[dtype]}"
    if dtype == torch.float32:  # argmax must agree too (bf16 may flip near-ties)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
BACKENDS = pytest.mark.parametrize("backend", ["auto", "onednn", "torch"])


def test_llama3_rope_scaling_reaches_both_models(tmp_path):
    path = make_tiny_llama(tmp_path, rope_scaling=LLAMA3_ROPE)
    written = json.loads((path / "config.json").read_text())
    rope = {**(written.get("rope_scaling") or {}), **(written.get("rope_parameters") or {})}
    assert rope.get("rope_type") == "llama3"
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(path)
    hf_rope = getattr(hf_cfg, "rope_parameters", None) or hf_cfg.rope_scaling
    assert hf_rope["rope_type"] == "llama3" and hf_rope["factor"] == 8.0
    assert ModelConfig.from_folder(path).rope_scaling.factor == 8.0


@DTYPES
@BACKENDS
def test_prefill_matches_hf(variant, dtype, backend):
    _, path = variant
    model = engine(path, dtype, backend)
    ids = seqs(2, 40, seed=1)
    ref = hf_logits(path, dtype, ids)
    cache = model.new_cache(4, MAX_LEN)
    out = model(ids, ForwardBatch.build([1, 3], [0, 0], [40, 40], cache), cache)
    assert out.dtype == torch.float32 and out.shape == (2, 40, VOCAB)
    assert_close(out, ref, dtype)
    # logits_index picks positions; the last-position logits are what prefill asks for.
    cache2 = model.new_cache(2, MAX_LEN)
    last = model(ids, ForwardBatch.build([0, 1], [0, 0], [40, 40], cache2), cache2,
                 logits_index=torch.tensor([[39], [5]]))
    assert_close(last, torch.stack([ref[0, 39:40], ref[1, 5:6]]), dtype)


@DTYPES
def test_incremental_decoding_matches_hf(variant, dtype):
    _, path = variant
    model = engine(path, dtype, "onednn")
    ids = seqs(2, 36, seed=2)
    ref = hf_logits(path, dtype, ids)
    cache = model.new_cache(3, MAX_LEN)
    slots = [2, 0]
    outs = [model(ids[:, :24], ForwardBatch.build(slots, [0, 0], [24, 24], cache), cache)]
    for t in range(24, 36):  # one token per row per step, through the cache
        outs.append(model(ids[:, t:t + 1], ForwardBatch.build(slots, [t, t], [1, 1], cache), cache))
    assert_close(torch.cat(outs, 1), ref, dtype)


@DTYPES
@BACKENDS
def test_ragged_padded_batch_matches_hf(variant, dtype, backend):
    """Rows at different start positions with different lengths, in non-contiguous slots."""
    _, path = variant
    model = engine(path, dtype, backend)
    cache = model.new_cache(6, MAX_LEN)
    # (slot, tokens already in the cache, tokens fed now)
    rows = [(4, 10, 6), (0, 0, 12), (5, 20, 1), (2, 7, 5)]
    full = seqs(len(rows), 32, seed=4)
    for i, (slot, start, _) in enumerate(rows):  # prefill each row's prefix on its own
        if start:
            model(full[i:i + 1, :start], ForwardBatch.build([slot], [0], [start], cache), cache)
    T = max(n for _, _, n in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (_, start, n) in enumerate(rows):
        ids[i, :n] = full[i, start:start + n]
    fb = ForwardBatch.build([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], cache)
    out = model(ids, fb, cache)
    for i, (_, start, n) in enumerate(rows):
        ref = hf_logits(path, dtype, full[i:i + 1, : start + n])[0, start:]
        assert_close(out[i, :n], ref, dtype)
    # pads wrote only to the trash row: a second identical forward gives the same logits
    assert torch.equal(model(ids, fb, cache), out)


def test_ragged_padded_batch_matches_hf_through_the_torch_small_ops(variant):
    """The bf16 tests above run the fused C kernels where they built (pipeline/engine/cpu_kernels.py); the
    torch ops they replace, which run where no compiler is, must match HF as well."""
    with cpu_kernels.disabled():
        test_ragged_padded_batch_matches_hf(variant, torch.bfloat16, "onednn")


@pytest.mark.identity
def test_verify_step_matches_single_token_steps(variant):
    """A T=k+1 forward (speculative verify) equals k+1 single-token steps, in fp32."""
    _, path = variant
    model = engine(path, torch.float32, "onednn")
    ids = seqs(2, 25, seed=5)
    a, b = model.new_cache(2, MAX_LEN), model.new_cache(2, MAX_LEN)
    for c in (a, b):
        model(ids[:, :20], ForwardBatch.build([0, 1], [0, 0], [20, 20], c), c)
    wide = model(ids[:, 20:], ForwardBatch.build([0, 1], [20, 20], [5, 5], a), a)
    steps = torch.cat([model(ids[:, t:t + 1], ForwardBatch.build([0, 1], [t, t], [1, 1], b), b)
                       for t in range(20, 25)], 1)
    torch.testing.assert_close(wide, steps, atol=1e-4, rtol=0)


def test_capture_layers_match_hf_hidden_states(variant):
    _, path = variant
    model = engine(path, torch.float32, "onednn")
    ids = seqs(1, 16, seed=6)
    cache = model.new_cache(1, MAX_LEN)
    logits, captured = model(ids, ForwardBatch.build([0], [0], [16], cache), cache, capture_layers=(0, 1))
    hf_logits(path, torch.float32, ids)
    with torch.no_grad():
        hs = _hf_cache[(str(path), torch.float32)](ids, output_hidden_states=True).hidden_states
    for got, want in zip(captured, hs[:2]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_packing_is_cpu_only_and_rebuildable(variant):
    _, path = variant
    model = engine(path, torch.float32, "onednn")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if torch.backends.mkldnn.is_available():
        assert all(m.packed is not None for m in linears)
    model.pack_weights("torch")
    assert all(m.packed is None and m.layout in ("torch", "rowwise") for m in linears)
    model.pack_weights()  # auto: the engine's own kernels where they are built; else these tiny weights on F.linear
    if cpu_kernels.usable():
        assert all(m.layout == "dense" and m.packed is not None for m in linears)
    else:
        assert all(m.packed is None for m in linears)
    if onednn_takes(torch.bfloat16):
        model.to(torch.bfloat16).pack_weights("onednn")  # re-pack after a cast
        assert all(m.packed is not None and m.packed.dtype == torch.bfloat16 for m in linears)


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs this dtype here: its bf16 path needs AVX-512BW/VL/DQ (ONEDNN_MAX_CPU_ISA=AVX2 refuses)."""
    from pipeline.engine.linear import _onednn_reorder

    return torch.backends.mkldnn.is_available() and _onednn_reorder(torch.zeros(16, 16, dtype=dtype)) is not None


@DTYPES
def test_a_model_loaded_to_hold_its_weights_once_gives_the_same_logits(variant, dtype, monkeypatch):
    """keep_plain=False (what the engine loads): packed linears drop their plain weight, nothing else
    changes, and asking to re-pack says why it can't."""
    if not onednn_takes(dtype):
        pytest.skip(f"oneDNN doesn't pack {dtype} here: nothing is packed, so nothing is released")
    monkeypatch.setenv("PIPELINE_LINEAR", "onednn")  # pack even these tiny weights
    _, path = variant
    ids = seqs(2, 9, seed=5)
    logits = []
    for keep in (True, False):
        model = load_transformer(path, MAX_LEN, dtype, keep_plain=keep)
        cache = model.new_cache(2, MAX_LEN)
        logits.append(model(ids, ForwardBatch.build([0, 1], [0, 0], [9, 9], cache), cache))
    assert torch.equal(logits[0], logits[1])
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight.is_meta and m.packed is not None for m in linears)
    assert not model.embed.weight.is_meta  # the lookup needs it, tied or not
    with pytest.raises(ValueError, match="plain weight was released"):
        linears[0].pack()


# ---- batch invariance: a row's bits never depend on the rows beside it ------------------------------
# Greedy output stays the target's own only if every token's logits come out bit for bit the same
# alone, beside other requests and inside a speculative verify. These shapes are SmolLM2's, where
# the CPU kernels change code path with the row count (oneDNN past 32 rows, MKL's fp32 at 1 and 16).


@pytest.mark.identity
@DTYPES
@BACKENDS
@pytest.mark.parametrize("in_f, out_f", [(576, 3072), (1536, 576)])
def test_a_linear_rows_result_does_not_depend_on_how_many_rows_share_the_call(dtype, backend, in_f, out_f):
    torch.manual_seed(0)
    lin = Linear(in_f, out_f, bias=False)
    lin.weight.data.normal_(0, 0.05)
    lin = lin.to(dtype)
    lin.pack(backend)
    x = torch.randn(80, in_f).to(dtype)
    with torch.inference_mode():  # as the engine runs (under autograd the AMX layout falls back to F.linear)
        alone = torch.cat([lin(x[r:r + 1]) for r in range(80)])
        for rows in (2, 5, 16, 33, 40, 80):
            assert torch.equal(lin(x[:rows]), alone[:rows]), f"{rows} rows in one call"
        assert torch.equal(lin(x.view(8, 10, in_f)).view(80, out_f), alone)  # [B, T, in] as the model calls it


@pytest.mark.identity
def test_the_load_time_check_catches_a_kernel_whose_rows_depend_on_the_call():
    """row_invariance is what keeps a vendor GEMM out of decoding where it isn't row-invariant on this CPU. A
    kernel planted to round differently past 5 rows (as oneDNN's bf16 path did past 32 on some CPUs) fails it;
    one that computes each row alike passes."""
    from pipeline.engine import row_invariance

    w = torch.randn(24, 40)

    def invariant(x):
        return torch.stack([(row * w).sum(-1) for row in x])

    def by_count(x):  # another summation order once the call is big enough
        y = invariant(x)
        return y if x.shape[0] <= 5 else (x[:, None, :20] * w[:, :20]).sum(-1) + (x[:, None, 20:] * w[:, 20:]).sum(-1)

    assert row_invariance.rows_invariant(invariant, ("planted", "invariant"), 40, torch.float32, 4, 8)
    assert not row_invariance.rows_invariant(by_count, ("planted", "by-count"), 40, torch.float32, 4, 8)


@pytest.mark.identity
@DTYPES
def test_a_vendor_kernel_that_fails_the_check_runs_one_row_a_call(dtype, monkeypatch):
    from pipeline.engine import row_invariance

    monkeypatch.setattr(row_invariance, "rows_invariant", lambda *a, **k: False)
    torch.manual_seed(0)
    lin = Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.1), lin.bias.normal_(0, 0.1)
    lin = lin.to(dtype)
    lin.pack("torch")
    assert lin.layout == "rowwise" and "changed with the row count" in lin.why
    x = torch.randn(10, 96).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(10)])
        assert torch.equal(lin(x), alone) and torch.equal(lin(x.view(2, 5, 96)).view(10, 40), alone)
        tol = {torch.float32: 1e-5, torch.bfloat16: 0.02}[dtype]  # a summation order, and the bias added apart
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=tol, rtol=tol)


@pytest.mark.identity
def test_short_calls_from_two_threads_never_share_a_padding_buffer():
    """A 1-row call is padded through a reused buffer; a second thread calling the same Linear gets its own."""
    import threading

    lin = Linear(64, 32, bias=False)
    lin.weight.data.normal_(0, 0.05)
    lin.pack("onednn")
    xs = [torch.randn(200, 1, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = [torch.cat([lin(x[i:i + 1].repeat(4, 1, 1))[:1] for i in range(200)]) for x in xs]
    got = [None, None]

    def work(j):
        got[j] = torch.cat([lin(xs[j][i]) for i in range(200)])

    threads = [threading.Thread(target=work, args=(j,)) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j in (0, 1):
        assert torch.equal(got[j].view(200, 1, 32), want[j])


def bare_attention(kv_heads: int, head_dim: int):
    """An Attention with no weights: enough to call grouped_attention, which reads n_kv and the scale."""
    from pipeline.engine.model import Attention

    attn = Attention.__new__(Attention)
    attn.n_kv, attn.scale = kv_heads, head_dim ** -0.5
    return attn


@pytest.mark.identity
def test_attention_row_is_the_same_whatever_keys_the_batch_pads_it_with():
    """A row of a batched decode reads the batch's longest key length, its own extra keys masked out;
    the output must equal the row's output alone. Queries are scaled so softmax is peaked, as real
    attention is: that is when bf16's kernel choice by key count showed (seed 20 with 191 keys + 5)."""
    kv, d = 3, 64
    attn = bare_attention(kv, d)
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(20, 300, (1,), generator=g))
        q = (torch.randn(1, 3 * kv, 1, d, generator=g) * 3).bfloat16()
        k = torch.randn(1, kv, n + 16, d, generator=g).bfloat16()
        v = torch.randn(1, kv, n + 16, d, generator=g).bfloat16()
        alone = attn.grouped_attention(q, k[:, :, :n], v[:, :, :n], None)
        for pad in range(1, 16):
            mask = torch.zeros(1, 1, 1, n + pad, dtype=torch.bool)
            mask[..., :n] = True
            out = attn.grouped_attention(q, k[:, :, :n + pad], v[:, :, :n + pad], mask)
            assert torch.equal(out, alone), f"seed {seed}: {n} keys padded by {pad}"
        # beside a second row 300 keys longer (past fp32's own change of summation order at ~512)
        other = [torch.randn(1, *t.shape[1:-2], n + 300, d, generator=g).bfloat16() for t in (k, v)]
        keys, values = (torch.cat([torch.cat([t, t.new_zeros(1, kv, 284, d)], 2), o]) for t, o in zip((k, v), other))
        mask = torch.ones(2, 1, 1, n + 300, dtype=torch.bool)
        mask[0, ..., n:] = False
        out = attn.grouped_attention(torch.cat([q, q]), keys, values, mask)[:1]
        assert torch.equal(out, alone), f"seed {seed}: {n} keys beside a row of {n + 300}"


@pytest.mark.identity
def test_a_prompt_prefilled_beside_a_longer_one_gets_the_same_attention():
    """A padded prefill runs every prompt at the longest one's T and L, its pad keys masked. Rows with
    fewer than 16 visible keys are where softmax's CPU kernel changes code path (prompts of 3-15
    tokens moved in a batch)."""
    kv, d = 3, 64
    attn = bare_attention(kv, d)
    g = torch.Generator().manual_seed(0)
    for n in range(1, 20):
        q = (torch.randn(1, 3 * kv, n + 40, d, generator=g) * 3).bfloat16()
        k, v = (torch.randn(1, kv, n + 40, d, generator=g).bfloat16() for _ in range(2))
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        alone = attn.grouped_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal)
        for pad in (1, 9, 40):
            t = n + pad
            mask = torch.zeros(1, 1, t, t, dtype=torch.bool)
            mask[..., :n, :n] = causal
            mask[..., n:, 0] = True  # pad queries see key 0 only, as ForwardBatch.build makes them
            out = attn.grouped_attention(q[:, :, :t], k[:, :, :t], v[:, :, :t], mask)[:, :, :n]
            assert torch.equal(out, alone), f"a {n}-token prompt padded to {t}"


def test_a_truncated_checkpoint_is_refused_in_one_line(tmp_path):
    from pipeline.errors import ModelFormatError

    path = make_tiny_llama(tmp_path / "m", seed=3, layers=2)
    weights = next(path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match="is truncated"):
        load_transformer(path, MAX_LEN)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_checkpoint_tensors_read_in_pieces_what_safetensors_reads(tmp_path, monkeypatch, dtype):
    """Reads go in READ_CHUNK pieces, cast or not; shrunk to 1 KB here, every tensor takes many."""
    from safetensors.torch import load_file

    from pipeline.engine import weights

    path = make_tiny_llama(tmp_path / "m", seed=3, layers=2)
    monkeypatch.setattr(weights, "READ_CHUNK", 1000)
    expected = load_file(str(next(path.glob("*.safetensors"))))
    tensors = weights.CheckpointTensors(path)
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        got = tensors.read(name, dtype)
        assert torch.equal(got, want if dtype is None else want.to(dtype)), name


def test_the_c_kernels_build_wherever_a_compiler_is_on_path():
    """A kernel source that doesn't compile only skips the kernel tests and leaves everything else on torch's ops,
    where the rest still passes (a first draft of the MoE kernel did that): so the build itself is a test."""
    from pipeline.engine import cpu_kernels

    if cpu_kernels.setting() == "off" or cpu_kernels._compiler() is None:
        pytest.skip(f"kernels not asked for here: {cpu_kernels.status()}")
    assert cpu_kernels.usable(), cpu_kernels.status()
