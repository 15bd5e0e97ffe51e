"""Each model family on the portable engine, against transformers' own class for it (pipeline/models/families).

test_model.py compares each family's logits with transformers' on prefill, cached decoding, ragged batches and
verify steps. Here: whole greedy answers against transformers' `generate`, and the lossless contract for the family
(speculated, batched, prefix-cached and chunk-prefilled greedy output is the batch-1 plain output), in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import ModelFormatError
from tiny_models import make_tiny_llama

# Qwen3's own parts are exercised: its per-head q/k norms (random weights, see tiny.py) and a head_dim that isn't
# hidden / heads (64 / 4 = 16; 32 here).
FAMILIES = {"qwen3": dict(model_type="qwen3", head_dim=32)}
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
                            heads=2, kv_heads=1, intermediate=64, **kw)
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


def test_an_unsupported_family_is_one_line_naming_the_supported_ones(tmp_path):
    import json

    from pipeline.engine.config import ModelConfig

    path = make_tiny_llama(tmp_path / "m", seed=0, layers=1)
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelFormatError, match=r"model_type 'gemma3' is not supported .*supported: llama, mistral, "
                                               r"qwen2, qwen3$"):
        ModelConfig.from_hf_dict({**cfg, "model_type": "gemma3"})
