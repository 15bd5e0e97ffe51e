"""Gemma 3, text only (transformers' Gemma3ForCausalLM, model_type gemma3_text): local layers with a sliding window
and a rope base of their own (10k) between global ones (1M, with linear scaling on the 4B and larger), a q/k RMSNorm
per head, norms before and after both attention and the MLP, RMSNorms that scale by (1 + w) in fp32, a GeGLU MLP
(gelu, tanh approximation), the embedding scaled by sqrt(hidden_size) and attention scaled by
query_pre_attn_scalar ** -0.5. Which layers are local: config.json's layer_types (transformers 5), or every layer
but each sliding_window_pattern-th (the published checkpoints' transformers 4 configs)."""

from pipeline.errors import ModelFormatError
from pipeline.models.families.base import Family, Features, Window


def features(cfg: dict) -> Features:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap) is not None:  # Gemma 2's; Gemma 3 dropped both
            raise ModelFormatError(f"config.json sets {cap}, which the portable engine doesn't apply (Gemma 3 "
                                   "has none; Gemma 2 isn't supported)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelFormatError("config.json sets use_bidirectional_attention: an encoder, not a decoder to serve")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelFormatError(f"hidden_activation {cfg['hidden_activation']!r} is not supported; Gemma 3's is "
                               "gelu_pytorch_tanh")
    n = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
                                       else "sliding_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    window = None
    if cfg.get("sliding_window") and "sliding_attention" in types:
        window = Window(size=int(cfg["sliding_window"]),
                        layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                        rope_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))))
    return Features(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, norm_offset=True,
                    sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                    query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, window=window)


# transformers' Gemma3TextConfig defaults (models/gemma3/configuration_gemma3.py, 5.25), which the published
# multimodal configs' text_config leaves out
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "sliding_window_pattern": 6}

# No TensorRT-LLM export: not checked against upstream's converter (issue 54). The 4B and larger checkpoints are
# Gemma3ForConditionalGeneration (model_type gemma3): their text model is read, the vision tower left out.
FAMILY = Family("gemma3", ("gemma3_text",), features, "Gemma3ForCausalLM", "Gemma3TextConfig", None,
                defaults=DEFAULTS, wrappers=("gemma3",))
