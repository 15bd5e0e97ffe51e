"""Seeded tiny random Llama-family checkpoints (pipeline.models.tiny) and a greedy reference for tests."""

from __future__ import annotations

from pathlib import Path

from pipeline.models.tiny import BYTE_VOCAB, CHAT_TEMPLATE, SPECIALS, byte_tokenizer, make_tiny_llama  # noqa: F401

DRAFT_VOCAB = 100  # make_tiny_eagle3_head's default draft vocabulary
# A tiny Gemma 3's own config keys (make_tiny_llama's config=): a window of 8 keys in every other layer (from layer
# 0), shorter than the tests' prompts and answers, so a token's window moves on as it decodes, verifies and is
# prefilled in chunks; and a query scale that isn't head_dim's.
GEMMA3_WINDOW = dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24)


def greedy_reference(engine, default_max_tokens: int):
    """prompt ids (, max_tokens) -> the engine's greedy output ids, one request at a time, memoized: the
    ground truth the greedy-equivalence tests compare speculative and batched runs against."""
    from pipeline.engine.sampling import SamplingParams

    cache: dict = {}

    def ref(prompt: list[int], max_tokens: int = default_max_tokens) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].output_ids
        return cache[key]

    return ref


def staggered_past_the_gate(engine, prompts: list[list[int]], budgets: list[int]):
    """The gate-flip scenario: the first request decodes alone for 4 steps, then the rest arrive at once, so the
    decoding batch crosses a gate of 2 (FLIP_GATE) both ways while requests are mid-decode. Returns the requests,
    all finished."""
    from pipeline.engine.sampling import SamplingParams

    reqs = [engine.add_request(prompts[0], SamplingParams(max_tokens=budgets[0]))]
    for _ in range(4):
        engine.step()
    reqs += [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[1:], budgets[1:])]
    while engine.has_unfinished():
        engine.step()
    return reqs


def flip_gate():
    """Speculate at <= 2 decoding, off above 2, back on at <= 1; every request long enough to speculate."""
    from pipeline.policy.gate_policy import GatePolicy

    return GatePolicy(max_batch_size=2, hysteresis=1, min_tokens=0)


def make_tiny_eagle3_head(path: Path, target: Path, seed: int = 0, layout: str = "modelopt",
                          draft_vocab: int = DRAFT_VOCAB, std: float = 0.1) -> Path:
    """A seeded random EAGLE-3 head for `target`, written in one of the three checkpoint layouts."""
    import json

    import torch
    from safetensors.torch import save_file

    from pipeline.engine.config import ModelConfig
    from pipeline.engine.eagle3 import default_aux_layer_ids

    tcfg = ModelConfig.from_folder(target)
    H, heads, kv, hd, inter = tcfg.hidden_size, 4, 2, tcfg.hidden_size // 4, 2 * tcfg.hidden_size
    aux = default_aux_layer_ids(tcfg.num_layers)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1 + rand(H) * 3

    kept = torch.randperm(tcfg.vocab_size, generator=g)[:draft_vocab].sort().values  # target ids in the draft vocab
    p = "midlayer." if layout == "eagle" else "layers.0."
    t = {
        "fc.weight": rand(H, len(aux) * H), p + "hidden_norm.weight": norm(), p + "input_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": rand(heads * hd, 2 * H), p + "self_attn.k_proj.weight": rand(kv * hd, 2 * H),
        p + "self_attn.v_proj.weight": rand(kv * hd, 2 * H), p + "self_attn.o_proj.weight": rand(H, heads * hd),
        p + "post_attention_layernorm.weight": norm(), p + "mlp.gate_proj.weight": rand(inter, H),
        p + "mlp.up_proj.weight": rand(inter, H), p + "mlp.down_proj.weight": rand(H, inter),
        "norm.weight": norm(), "lm_head.weight": rand(draft_vocab, H) * 10,
        "d2t": kept - torch.arange(draft_vocab),
    }
    layer = {"model_type": "llama", "hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv,
             "head_dim": hd, "intermediate_size": inter, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "vocab_size": tcfg.vocab_size, "max_position_embeddings": 1024}
    if layout == "modelopt":  # what export_speculative_decoding writes (run on a tiny model, ModelOpt 0.47)
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
               "rope_scaling": {"rope_type": "default", "rope_theta": 10000},
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True,
                                "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True}}
    elif layout == "eagle":  # yuhuili/EAGLE3-*: aux layers implied by the target's depth
        t["t2d"] = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        t["t2d"][kept] = True
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
    else:  # vLLM speculators
        t["t2d"] = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        t["t2d"][kept] = True
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": False,
               "target_hidden_size": H}
    path.mkdir(parents=True, exist_ok=True)
    if layout == "eagle":  # the published heads ship a pytorch_model.bin, with the target's embeddings
        t["embed_tokens.weight"] = rand(tcfg.vocab_size, H)
        torch.save(t, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
