"""Each model family on the portable engine, against transformers' own class for it (pipeline/models/families).

test_model.py compares each family's logits with transformers' on prefill, cached decoding, ragged batches and
verify steps. Here: whole greedy answers against transformers' `generate`, and the lossless contract for the family
(speculated, batched, prefix-cached and chunk-prefilled greedy output is the batch-1 plain output), in fp32 and bf16.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import ModelFormatError
from tiny_models import GEMMA3_WINDOW, make_tiny_llama

# Qwen3's own parts are exercised: its per-head q/k norms (random weights, see tiny.py) and a head_dim that isn't
# hidden / heads (64 / 4 = 16; 32 here).
# Qwen3-MoE: top 2 of 8 experts (renormalized) in layer 0, a dense MLP in layer 1; the draft's one layer has experts.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
# Gemma 3: GEMMA3_WINDOW (the target's layer 0 and the draft's one layer are local).
FAMILIES = {"qwen3": dict(model_type="qwen3", head_dim=32),
            "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, moe={**MOE, "mlp_only_layers": [1]}),
            "gemma3": dict(model_type="gemma3_text", head_dim=32, config=GEMMA3_WINDOW)}
GENERATE_TOKENS = 64


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(L),), generator=g).tolist()
            for L in torch.randint(3, 30, (n,), generator=g)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, target, a smaller draft of the same family)."""
    kw = FAMILIES[request.param]
    target = make_tiny_llama(tmp_path_factory.mktemp(f"{request.param}_target"), seed=5, layers=2, **kw)
    draft = make_tiny_llama(tmp_path_factory.mktemp(f"{request.param}_draft"), seed=6, layers=1, hidden=32,
                            heads=2, kv_heads=1, intermediate=64, **{**kw, "moe": MOE if "moe" in kw else None})
    return request.param, target, draft


def test_fp32_greedy_equals_transformers_generate(family):
    from transformers import AutoModelForCausalLM

    _, target, _ = family
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: an end token is a token (min_new_tokens bans it)
    engine = LLMEngine.load(target, EngineConfig(max_batch_size=8, max_seq_len=128))
    ps = prompts(8, seed=1)
    got = engine.generate(ps, SamplingParams(max_tokens=GENERATE_TOKENS, ignore_eos=True))
    for p, r in zip(ps, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=GENERATE_TOKENS, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert r.output_ids == ref[0, len(p):].tolist()


@pytest.mark.identity
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_is_the_batch_one_plain_output_speculated_batched_cached_and_chunked(family, dtype):
    _, target, draft = family
    long = list(range(40, 80))
    ps = prompts(6, seed=2) + [long]
    later = [long[:35] + [1, 2, 3]]  # two 16-token blocks that `long` computed: a prefix-cache hit
    params = SamplingParams(max_tokens=24)
    plain = LLMEngine.load(target, EngineConfig(max_batch_size=1, max_seq_len=128, dtype=dtype))
    ref = [plain.generate([p], params)[0].output_ids for p in ps + later]
    gate = GatePolicy(min_tokens=0)
    for batch, spec in ((4, None), (32, "ngram"), (4, draft)):
        cfg = EngineConfig(max_batch_size=batch, max_seq_len=128, dtype=dtype, num_draft_tokens=3, gate=gate,
                           prefill_chunk=8)  # prompts over several steps, beside others' decoding
        engine = LLMEngine.load(target, cfg, draft=spec)
        out = [r.output_ids for r in engine.generate(ps, params) + engine.generate(later, params)]
        assert out == ref, (batch, spec)
        if spec is not None:
            assert engine.stats.drafted_tokens > 0
        assert engine.blocks.hit_tokens > 0


@pytest.mark.identity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_experts_and_output_are_its_own_whatever_else_is_in_the_step(dtype):
    """MoE routing is a row's own: a token routed alone and among 1..40 others (the batch, a verify's width, a
    prefill chunk) gets the same experts, the same weights and the same output bits. 64 experts, top 4: many
    tokens share an expert, so each expert runs on different row counts."""
    from pipeline.engine.linear import pack_linears
    from pipeline.engine.moe import SparseMoE
    from pipeline.models.families import Moe

    torch.manual_seed(0)
    block = SparseMoE(64, Moe(num_experts=64, top_k=4, intermediate_size=32, norm_topk_prob=False, layers=(0,)))
    for p in block.parameters():
        p.data = (torch.randn_like(p) * 0.2).to(dtype)
    pack_linears(block)
    x = torch.randn(41, 64).to(dtype)
    with torch.inference_mode():  # as the engine runs (the C kernels don't run under autograd)
        weights, experts = block.route(x)
        out = block(x)
        assert len(torch.unique(experts)) > 32  # most experts run, on different row counts
        for n in (1, 2, 5, 16, 41):
            for i in range(0, 41, n):
                w, e = block.route(x[i:i + n])
                assert torch.equal(w, weights[i:i + n]) and torch.equal(e, experts[i:i + n])
                assert torch.equal(block(x[i:i + n]), out[i:i + n]), (n, i)


def test_sampling_with_a_draft_of_the_family_follows_the_targets_exact_distribution(family, tmp_path):
    """test_speculative.py's end-to-end check on the family: a 16-token vocabulary, 4096 sampled answers of three
    tokens drafted by a smaller model of the family (as many as that file's negative control needs to catch a wrong
    rule), against P(x1, x2, x3) from transformers' own class."""
    from test_speculative import E2E_PROMPT, E2E_VOCAB, PASS_P, engine_fits, run_engine, single_thread
    from transformers import AutoModelForCausalLM

    from pipeline.engine.sampling import probs_from_logits

    name, _, _ = family
    kw = {**FAMILIES[name], "vocab_size": E2E_VOCAB, "init_std": 0.2}
    target = make_tiny_llama(tmp_path / "target", seed=0, layers=2, **kw)
    draft = make_tiny_llama(tmp_path / "draft", seed=1, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                            **{**kw, "moe": MOE if "moe" in kw else None})
    params = SamplingParams(temperature=1.0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    V, prompt = E2E_VOCAB, torch.tensor([E2E_PROMPT])
    with torch.no_grad():  # P(x1), P(x2 | x1), P(x3 | x1, x2) for every x1, x2
        p1 = probs_from_logits(model(prompt).logits[0, -1].double(), params)
        ctx1 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = probs_from_logits(model(ctx1).logits[:, -1].double(), params)
        pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
        p3 = probs_from_logits(model(torch.cat([prompt.expand(V * V, -1), pairs], 1)).logits[:, -1].double(),
                               params).view(V, V, V)
    j = p1[:, None, None] * p2[:, :, None] * p3
    joint = {combo: float(j[combo]) for combo in itertools.product(range(V), repeat=3)}
    with single_thread():
        streams, engine = run_engine(target, draft, params, n_requests=4096, batch=512)
    assert engine.stats.drafted_tokens > 4096 and 0.0 < engine.stats.acceptance_rate < 1.0
    for what, (pv, _, _, bad) in engine_fits(streams, joint).items():
        assert bad == 0 and pv > PASS_P, (name, what, pv, bad)


def test_an_unsupported_family_is_one_line_naming_the_supported_ones(tmp_path):
    import json

    from pipeline.engine.config import ModelConfig

    path = make_tiny_llama(tmp_path / "m", seed=0, layers=1)
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelFormatError, match=r"model_type 'gpt_oss' is not supported .*supported: gemma3_text, "
                                               r"llama, mistral, qwen2, qwen3, qwen3_moe$"):
        ModelConfig.from_hf_dict({**cfg, "model_type": "gpt_oss"})


# Each part of Gemma 3's layer, and the family's features without it.
GEMMA3_PARTS = {
    "sliding window": lambda f: replace(f, window=None),
    "the window's rope base": lambda f: replace(f, window=replace(f.window, rope_theta=1e6)),
    "(1 + w) norms": lambda f: replace(f, norm_offset=False),
    "norms after attention and MLP": lambda f: replace(f, sandwich_norms=False),
    "GeGLU": lambda f: replace(f, activation="silu"),
    "embedding scale": lambda f: replace(f, embed_scale=False),
    "query_pre_attn_scalar": lambda f: replace(f, query_scale=None),
    "per-head q/k norms": lambda f: replace(f, qk_norm=False),
}


@pytest.fixture(scope="module")
def gemma3_and_its_logits(tmp_path_factory):
    """A tiny Gemma 3 (fp32) and transformers' logits for a 40-token sequence: 5 windows of 8."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama(tmp_path_factory.mktemp("gemma3_parts"), seed=3, layers=2, **FAMILIES["gemma3"])
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return path, ids, model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("part", list(GEMMA3_PARTS))
def test_the_engine_without_any_one_of_gemma3s_parts_no_longer_matches_transformers(part, gemma3_and_its_logits,
                                                                                     monkeypatch):
    """The negative control of the Gemma 3 checks above and in test_model.py: with the family's features as read,
    the engine's logits are transformers' to 1e-4; with any one part left out, they are off by more than 0.1."""
    from pipeline.engine.kv_cache import ForwardBatch
    from pipeline.engine.weights import load_transformer
    from pipeline.models import families

    path, ids, want = gemma3_and_its_logits

    def logits() -> torch.Tensor:
        model = load_transformer(path, 128)
        cache = model.new_cache(1, 128)
        return model(torch.tensor([ids]), ForwardBatch.build([0], [0], [len(ids)], cache), cache)[0]

    assert (logits() - want).abs().max() < 1e-4
    gemma = families.family_of("gemma3_text")
    without = replace(gemma, features=lambda cfg: GEMMA3_PARTS[part](gemma.features(cfg)))
    monkeypatch.setattr(families, "FAMILIES", tuple(without if f is gemma else f for f in families.FAMILIES))
    assert (logits() - want).abs().max() > 0.1, part


def test_a_multimodal_gemma3_checkpoint_gives_its_text_models_logits(tmp_path):
    """Gemma 3 4B and up are published as Gemma3ForConditionalGeneration (model_type gemma3): the engine reads its
    text_config, whose keys at their defaults transformers leaves out, and its language model's tensors (the vision
    tower left unread), and gives transformers' own logits for text."""
    import json

    import transformers

    from pipeline.engine.kv_cache import ForwardBatch
    from pipeline.engine.weights import load_transformer
    from pipeline.models.families import gemma3
    from pipeline.models.tiny import byte_tokenizer

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=8, sliding_window_pattern=2,
                query_pre_attn_scalar=24)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    path = tmp_path / "gemma3"
    model.save_pretrained(path)
    byte_tokenizer(0).save_pretrained(path)
    # As Google publishes it: text_config holds only what differs from Gemma3TextConfig's defaults
    written = json.loads((path / "config.json").read_text())
    default = transformers.Gemma3TextConfig().to_dict()
    written["text_config"] = {k: v for k, v in written["text_config"].items()
                              if k == "model_type" or default.get(k, object()) != v}
    assert "rms_norm_eps" not in written["text_config"] and "rope_parameters" not in written["text_config"]
    (path / "config.json").write_text(json.dumps(written))
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
    engine = load_transformer(path, 64)
    cache = engine.new_cache(1, 64)
    got = engine(ids, ForwardBatch.build([0], [0], [30], cache), cache)[0]
    assert engine.cfg.features.window.layers == (0,) and engine.cfg.rms_norm_eps == 1e-6
    # the family's defaults are transformers' own (the rope bases under rope_parameters in transformers 5; the
    # pattern as the layer_types it builds)
    rope = default["rope_parameters"]
    theirs = {**default, "rope_theta": rope["full_attention"]["rope_theta"],
              "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
              "sliding_window_pattern": default["layer_types"].index("full_attention") + 1}
    assert {k: theirs[k] for k in gemma3.DEFAULTS} == gemma3.DEFAULTS
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow  # compiles, assembles and starts a server
def test_a_served_gemma3_repository_speculating_with_a_gemma3_draft_answers_the_in_process_greedy_text(tmp_path):
    """The whole portable route for a family beside Llama's (Gemma 3, with its local layers): compile with a draft
    model of the family, assemble, serve, gRPC. Greedy answers speculated through the server are the in-process
    engine's plain ones, and drafts ran."""
    from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions
    from pipeline.compiler import CompileOptions, compile_model
    from serving_checks import expected_texts, served_engine

    kw = FAMILIES["gemma3"]
    target = make_tiny_llama(tmp_path / "target", seed=5, layers=2, **kw)
    draft = make_tiny_llama(tmp_path / "draft", seed=6, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                            **kw)
    engine_dir = tmp_path / "engine"
    compile_model(CompileOptions("torch", target, engine_dir, draft=str(draft), num_draft_tokens=3, max_batch_size=4,
                                 max_seq_len=256, gate_batch_size=4, calibrate=False))
    prompts = ["the window slides on", "abc abc abc abc abc", "hello"]
    expected = expected_texts(engine_dir, prompts, 40)
    with served_engine(engine_dir, tmp_path, gate_batch_size=4, min_spec_tokens=0) as srv, \
            Connection(ClientOptions(srv.endpoints.grpc, wait_s=60)) as conn:
        got = [conn.generate(p, RequestOptions(max_tokens=40, speculation="on")) for p in prompts]
    assert [g.text for g in got] == expected
    assert sum(g.draft_steps for g in got) > 0


def test_the_llm_api_route_refuses_an_eagle3_head_on_a_family_whose_upstream_class_cant_feed_one(tmp_path):
    """TensorRT-LLM's Gemma3ForCausalLM is a DecoderModelForCausalLM whose forward hands no hidden states to a head
    (pipeline.trtllm.upstream.LLMAPI_EAGLE3): the build is refused in one line before anything runs in NVIDIA's
    container; Qwen3's class takes a head, so its config is written."""
    from click.testing import CliRunner
    from cli_checks import assert_one_line_error
    from tiny_models import make_tiny_eagle3_head

    from pipeline.cli import main

    for family in ("gemma3", "qwen3"):
        target = make_tiny_llama(tmp_path / family, seed=1, layers=2, **FAMILIES[family])
        head = make_tiny_eagle3_head(tmp_path / f"{family}-head", target)
        result = CliRunner().invoke(main, ["compile", "-b", "trtllm", "--route", "llmapi", "-t", str(target), "-d",
                                           f"eagle3:{head}", "--dry-run", "-o", str(tmp_path / f"{family}-engine")])
        if family == "gemma3":
            assert_one_line_error(result, "can't feed an EAGLE-3 head from a gemma3_text target", "modeling_gemma3.py",
                                  "--draft ngram")
        else:
            assert result.exit_code == 0, result.output
