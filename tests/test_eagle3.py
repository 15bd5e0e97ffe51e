"""EAGLE-3 heads in the portable engine: lossless drafting, the proposer's own cache kept in step
with the target (catch-up, rollback, joins and leaves), and the three checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy, ModelConfig
from pipeline.engine.eagle3 import Eagle3Proposer, load_eagle3_head
from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.request import Request
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import DraftMismatchError, ModelFormatError
from tiny_models import (DRAFT_VOCAB, GEMMA3_WINDOW, flip_gate, greedy_reference, make_tiny_eagle3_head,
                         make_tiny_llama, staggered_past_the_gate)

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    # 8 layers, so the low/middle/high aux layers (1, 3, 4) are three distinct layers.
    return make_tiny_llama(tmp_path_factory.mktemp("eagle-target"), seed=0, layers=8)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target) -> Path:
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle-head"), target, seed=3)


def config(**kw) -> EngineConfig:
    # The head drafts every step unless a test asks for n-gram lookup first: these tests check the head's own state.
    gate = kw.pop("gate", GatePolicy(min_tokens=0))
    return EngineConfig(**{"max_batch_size": 8, "max_seq_len": 256, "gate": gate, "ngram_first": False, **kw})


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(LLMEngine.load(target, config(max_batch_size=1)), MAX_TOKENS)


class Recorder:
    """Wraps an Eagle3Proposer and records, per greedy proposal, the sequence it drafted after."""

    def __init__(self, proposer: Eagle3Proposer):
        self.proposer, self.records = proposer, []
        original = proposer.propose

        def propose(reqs, ks):
            prop = original(reqs, ks)
            for r, k, toks in zip(reqs, ks, prop.tokens):
                self.records.append((list(r.all_ids), r.target_len, k, list(toks)))
            return prop

        proposer.propose = propose


def drafts_from_scratch(engine: LLMEngine, ids: list[int], target_len: int, k: int) -> list[int]:
    """What a fresh head drafts after `ids`, fed the target's states for the whole prefix at once."""
    model, proposer = engine.model, engine.proposer
    cache = model.new_cache(1, engine.config.max_seq_len)
    fb = ForwardBatch.build([0], [0], [target_len], cache)
    _, captured = model(torch.tensor([ids[:target_len]]), fb, cache, capture_layers=proposer.capture_layers)
    fresh = Eagle3Proposer(proposer.head, model, 1, engine.config.max_seq_len)
    req = Request(list(ids), SamplingParams(max_tokens=1))
    req.slot = 0
    fresh.on_target_hidden(req, torch.cat(captured, -1)[0])
    return fresh.propose([req], [k]).tokens[0]


def check_incremental_drafts(engine: LLMEngine, rec: Recorder, every: int = 3) -> int:
    checked = 0
    for ids, target_len, k, toks in rec.records[::every]:
        assert toks == drafts_from_scratch(engine, ids, target_len, k)
        checked += 1
    return checked


@pytest.mark.identity
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("ngram_first", [False, True], ids=["head", "ngram-first"])
def test_greedy_output_identical_to_target_only_with_an_eagle3_head(target, head, reference, batch, k, ngram_first):
    engine = LLMEngine.load(target, config(num_draft_tokens=k, ngram_first=ngram_first), draft=f"eagle3:{head}")
    prompts = make_prompts(batch, seed=k + batch)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(p)
    assert engine.stats.drafted_tokens > 0
    assert engine.describe()["draft"]["kind"] == "eagle3"


@pytest.mark.identity
def test_ngram_first_drafts_by_lookup_where_it_matches_and_the_head_catches_up_elsewhere(target, head, reference):
    # Prompts that repeat themselves: rows draft by lookup on some steps and by the head on others. A head proposal
    # after lookup steps must still be what a fresh head drafts from the whole prefix (its catch-up).
    engine = LLMEngine.load(target, config(num_draft_tokens=3, ngram_first=True), draft=f"eagle3:{head}")
    assert engine.describe()["proposer"] == "eagle3+ngram"
    rec = Recorder(engine.proposer.inner)  # the head's proposals alone
    prompts = [p * 3 for p in make_prompts(4, seed=11)]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(p)
    sources = engine.describe()["draft"]["ngram_first"]
    assert sources["ngram"] > 0 and sources["eagle3"] > 0, sources
    assert check_incremental_drafts(engine, rec, every=1) >= 3
    # The planner kept one acceptance estimate per source, from that source's own verifies.
    assert any(r.estimates["ngram"].first_checks > 0 and r.estimates["eagle3"].first_checks > 0 for r in reqs)
    assert not engine.proposer.inner.pending and not engine.proposer.inner.head_len  # released with their requests
    assert not engine.proposer.ngram._found  # the lookups' cache too


@pytest.mark.identity
def test_drafts_equal_a_fresh_head_after_joins_leaves_and_gate_flips(target, head, reference):
    # The head's incremental cache (catch-up after the gate was off, rollback past rejected drafts,
    # rows joining and leaving) must give exactly the drafts a fresh head computes from the whole prefix.
    engine = LLMEngine.load(target, config(num_draft_tokens=3, gate=flip_gate()), draft=f"eagle3:{head}")
    rec = Recorder(engine.proposer)
    prompts = make_prompts(4, seed=5)
    budgets = [30, 10, 16, 30]
    reqs = staggered_past_the_gate(engine, prompts, budgets)
    for p, n, r in zip(prompts, budgets, reqs):
        assert r.output_ids == reference(p, n)
    assert engine.gate.flips >= 2 and engine.stats.nonspec_steps > 0
    # (The random head's drafts mostly fail, and the engine learns that from the first request's: the later ones
    # draft less than with the fixed prior, which gave 5 and more proposals here.)
    assert check_incremental_drafts(engine, rec, every=1) >= 4
    assert not engine.proposer.pending and not engine.proposer.head_len  # released with their requests


@pytest.mark.identity
def test_drafts_equal_a_fresh_head_after_prefix_hits_and_chunked_prefills(target, head, reference):
    # A cached prefix skips the target's forward over it: the head gets those tokens' states from the cache.
    engine = LLMEngine.load(target, config(num_draft_tokens=3, prefill_chunk=20), draft=f"eagle3:{head}")
    rec = Recorder(engine.proposer)
    system = make_prompts(1, seed=9)[0] * 3  # 3 x its length: several whole blocks
    prompts = [system + p[:5] for p in make_prompts(3, seed=10)]
    reqs = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS))
    reqs += engine.generate(prompts[1:], SamplingParams(max_tokens=MAX_TOKENS))
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference(p)
    assert all(r.num_cached_tokens >= 16 for r in reqs[1:])
    assert check_incremental_drafts(engine, rec, every=2) >= 4  # (fewer from the 2nd request on: see above)


def test_incremental_drafts_check_catches_a_proposer_that_drops_target_states(target, head, reference, monkeypatch):
    engine = LLMEngine.load(target, config(num_draft_tokens=3), draft=f"eagle3:{head}")
    rec = Recorder(engine.proposer)
    prompts = make_prompts(3, seed=9)
    engine.generate(prompts, SamplingParams(max_tokens=20))
    assert check_incremental_drafts(engine, rec, every=1) > 0
    # Negative control: a proposer that forgets to consume a verification's states drifts from the
    # fresh head, and the same check sees it.
    broken = LLMEngine.load(target, config(num_draft_tokens=3), draft=f"eagle3:{head}")
    rec2 = Recorder(broken.proposer)
    real = broken.proposer.on_target_hidden
    monkeypatch.setattr(broken.proposer, "on_target_hidden", lambda r, aux: real(r, aux[:1]))
    broken.generate(prompts, SamplingParams(max_tokens=20))
    with pytest.raises((AssertionError, RuntimeError, IndexError)):
        check_incremental_drafts(broken, rec2, every=1)


def test_sampled_generation_runs_and_is_seeded(target, head):
    engine = LLMEngine.load(target, config(num_draft_tokens=3), draft=f"eagle3:{head}")
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    a = engine.generate(make_prompts(2, seed=1), params)
    b = engine.generate(make_prompts(2, seed=1), params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert engine.stats.drafted_tokens > 0


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_published_and_speculators_layouts_load_the_same_weights(tmp_path, target, layout):
    ref = load_eagle3_head(make_tiny_eagle3_head(tmp_path / "mo", target, seed=4), ModelConfig.from_folder(target), 64)
    other = load_eagle3_head(make_tiny_eagle3_head(tmp_path / layout, target, seed=4, layout=layout),
                             ModelConfig.from_folder(target), 64)
    assert other.cfg.layout == layout and ref.cfg.layout == "modelopt"
    assert other.cfg.aux_layer_ids == ref.cfg.aux_layer_ids == (1, 3, 4)
    assert torch.equal(other.draft_to_target, ref.draft_to_target)
    for (n, a), (_, b) in zip(ref.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    # ModelOpt trains the fused state through input_layernorm and then hidden_norm; the others don't.
    assert ref.cfg.hidden_norm_after_input_norm and not other.cfg.hidden_norm_after_input_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout,normed_residual", [("modelopt", False), ("eagle", False), ("speculators", True)])
def test_the_head_layer_in_one_c_call_gives_the_modules_bits(tmp_path, target, dtype, layout, normed_residual):
    from dataclasses import replace

    from pipeline.engine import cpu_kernels

    head = load_eagle3_head(make_tiny_eagle3_head(tmp_path, target, seed=5, layout=layout),
                            ModelConfig.from_folder(target), 64, dtype=dtype)
    if not cpu_kernels.usable():
        pytest.skip(f"no C kernels here: {cpu_kernels.status()}")
    head.cfg = replace(head.cfg, norm_before_residual=normed_residual)  # speculators' option, either way
    assert head.layer_row() is not None and head.layer_row().flags == (layout == "modelopt") + 2 * normed_residual
    H, module_calls = head.cfg.hidden_size, []
    head.attn.register_forward_hook(lambda *_: module_calls.append(1))

    def run(fused: bool):
        head.fused = fused
        cache, g, out = head.new_cache(2, 64), torch.Generator().manual_seed(0), []
        with torch.inference_mode():  # a ragged catch-up, then draft-shaped steps
            for starts, lengths in [((0, 0), (7, 4)), ((7, 4), (3, 1)), ((10, 5), (1, 1))]:
                T = max(lengths)
                emb, state = (torch.randn(2, T, H, generator=g).to(dtype) for _ in range(2))
                fb = ForwardBatch.build([0, 1], list(starts), list(lengths), cache)
                out += head(emb, state, fb, cache, torch.tensor([[n - 1] for n in lengths]))
        return out, cache

    (want, want_cache), calls = run(False), len(module_calls)
    got, got_cache = run(True)
    assert calls == 3 and len(module_calls) == calls  # the modules ran, then the one call did
    assert "one C call" in head.kernel_name()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    cache = head.new_cache(2, 64)
    x = torch.zeros(1, 1, H, dtype=dtype)
    with pytest.raises(IndexError, match="outside the head's KV cache"), torch.inference_mode():
        head(x, x, ForwardBatch.build([5], [0], [1], cache), cache, torch.tensor([[0]]))  # slot 5 of 2
    assert not cache.k.any()


def test_head_for_another_target_is_refused(tmp_path, target, head):
    other = make_tiny_llama(tmp_path / "other", seed=1, layers=8, hidden=32, heads=2, kv_heads=1, intermediate=64)
    with pytest.raises(DraftMismatchError, match="trained for this target"):
        LLMEngine.load(other, config(), draft=f"eagle3:{head}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="config.json"):
        LLMEngine.load(target, config(), draft=f"eagle3:{tmp_path / 'empty'}")


def test_no_capture_without_an_eagle3_proposer(target, monkeypatch):
    engine = LLMEngine.load(target, config(num_draft_tokens=3), draft="ngram")
    seen = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **kw: (seen.append(kw.get("capture_layers", ())),
                                                                    forward(*a, **kw))[1])
    engine.generate(make_prompts(2, seed=2), SamplingParams(max_tokens=8))
    assert seen and not any(seen)


# Targets of the other families a head is trained for: the head reads the target's embeddings as ModelOpt's
# training does, through the base model's embed_tokens (Gemma's scaled by sqrt(hidden)).
HEAD_TARGETS = {"qwen3": dict(model_type="qwen3", head_dim=32),
                "gemma3_text": dict(model_type="gemma3_text", head_dim=16, config=GEMMA3_WINDOW)}


@pytest.mark.parametrize("family", ["llama", *HEAD_TARGETS])
def test_head_matches_modelopt_drafts(tmp_path, target, family):
    """Our head, loaded from ModelOpt's export, drafts exactly what ModelOpt's own
    pseudo_speculative_generate drafts (random weights, norms far from 1, a random d2t), on a target of each
    family."""
    import copy

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if family != "llama":
        target = make_tiny_llama(tmp_path / family, seed=0, layers=8, **HEAD_TARGETS[family])
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, intermediate_size=128, num_hidden_layers=1,
                                            draft_vocab_size=DRAFT_VOCAB, rope_theta=10000.0, rms_norm_eps=1e-5)
    cfg.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={})
    mtsp.convert(m, [("eagle", cfg)])
    em = m.eagle_module
    rope_config = copy.copy(em.config)  # as train.py builds it: one rope, whatever the target's layer types
    rope_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    em.rotary_emb = LlamaRotaryEmbedding(config=rope_config)
    with torch.no_grad():
        for n, prm in em.named_parameters():
            prm.copy_(1 + 0.5 * torch.randn_like(prm) if "norm" in n else 0.1 * torch.randn_like(prm))
        em.d2t.copy_(torch.randint(0, 200, (DRAFT_VOCAB,)))
    m.eval()
    export_speculative_decoding(m, export_dir=tmp_path / "export")
    engine = LLMEngine.load(target, config(max_batch_size=1), draft=f"eagle3:{tmp_path / 'export'}")
    agree = 0
    for prompt in make_prompts(4, seed=13):
        base, theirs = m.pseudo_speculative_generate(torch.tensor([prompt]), steps=4)
        req = engine.add_request(prompt, SamplingParams(max_tokens=8))
        engine.step()  # admits and prefills it: the first token, no decode yet
        assert req.output_ids == base[0].tolist()
        ours = engine.proposer.propose([req], [4]).tokens[0]
        engine.cancel(req)
        assert ours == theirs[0].tolist()
        agree += len(set(ours)) > 1
    assert agree >= 2  # drafts that vary, not one token repeated


def test_compile_torch_engine_with_an_eagle3_head_and_generate_with_it(tmp_path, target, head):
    from click.testing import CliRunner

    from pipeline.cli import main

    runner = CliRunner()
    out = tmp_path / "engine"
    res = runner.invoke(main, ["compile", "-b", "torch", "-t", str(target), "-d", f"eagle3:{head}", "-k", "3",
                               "--no-ngram-first", "-o", str(out)])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "engine.json").read_text())
    assert manifest["draft"]["kind"] == "eagle3" and (out / "draft" / "model.safetensors").is_file()
    assert manifest["ngram_first"] is False
    args = ["generate", "hello there", "--dtype", "fp32", "-n", "56", "--raw", "--json"]  # > 50: the folder gate's min tokens
    from_dir = json.loads(runner.invoke(main, [*args, "--model", str(out)]).output)
    direct = json.loads(runner.invoke(main, [*args, "--model", str(target), "--draft", f"eagle3:{head}", "-k", "3"]).output)
    overridden = json.loads(runner.invoke(main, [*args, "--model", str(out), "--ngram-first"]).output)
    plain = json.loads(runner.invoke(main, [*args, "--model", str(target)]).output)
    assert from_dir["config"]["draft"] == direct["config"]["draft"] == "eagle3"
    assert from_dir["stats"]["drafted_tokens"] > 0 and direct["stats"]["drafted_tokens"] > 0
    # The folder's setting (the head drafts every step), the default (n-gram lookup first), and an override
    assert from_dir["config"]["engine"]["proposer"] == "eagle3"
    assert direct["config"]["engine"]["proposer"] == overridden["config"]["engine"]["proposer"] == "eagle3+ngram"
    tokens = [r["outputs"][0]["token_ids"] for r in (from_dir, direct, overridden, plain)]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]


def test_compile_refuses_a_plain_model_as_an_eagle3_head(tmp_path, target):
    from click.testing import CliRunner

    from cli_checks import assert_one_line_error
    from pipeline.cli import main

    res = CliRunner().invoke(main, ["compile", "-b", "torch", "-t", str(target), "-d", f"eagle3:{target}",
                                    "-o", str(tmp_path / "e")])
    assert_one_line_error(res, "not an EAGLE-3 head")


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_compile_takes_published_and_speculators_heads_and_output_stays_the_targets(tmp_path, target, layout):
    from click.testing import CliRunner

    from pipeline.cli import main

    head = make_tiny_eagle3_head(tmp_path / "head", target, layout=layout)
    runner = CliRunner()
    out = tmp_path / "engine"
    res = runner.invoke(main, ["compile", "-b", "torch", "-t", str(target), "-d", f"eagle3:{head}", "-k", "3",
                               "-o", str(out)])
    assert res.exit_code == 0, res.output
    args = ["generate", "hello there", "--dtype", "fp32", "-n", "56", "--raw", "--json"]
    served = json.loads(runner.invoke(main, [*args, "--model", str(out)]).output)
    plain = json.loads(runner.invoke(main, [*args, "--model", str(target)]).output)
    assert served["stats"]["drafted_tokens"] > 0
    assert served["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]


@pytest.mark.parametrize("model_type, read_as, bias", [("llama", "llama", False), ("qwen2", "qwen2", True),
                                                       ("qwen3", "llama", False), ("gemma3_text", "llama", False),
                                                       ("no_such_family", "llama", False)])
def test_a_heads_layer_is_its_named_familys_only_where_the_family_takes_heads(model_type, read_as, bias):
    """Published and ModelOpt heads are Llama layers whatever their target (families' head_layer); Qwen2's keeps
    its q/k/v biases."""
    from pipeline.engine.eagle3 import read_eagle3_config

    target = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    head = read_eagle3_config(dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2), {"layers.0.x"}, target)
    assert head.layer.model_type == read_as and head.layer.qkv_bias == bias
