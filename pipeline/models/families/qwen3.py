"""Qwen3 (dense): Qwen2's decoder without the q/k/v biases (attention_bias, default False), and an RMSNorm over each
head of q and of k before rope (transformers' Qwen3Attention: q_norm, k_norm, each of head_dim weights). head_dim is
config.json's own, not hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128)."""

from pipeline.models.families.base import Family, Features


def features(cfg: dict) -> Features:
    return Features(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)


# No TensorRT-LLM export yet: not checked against upstream's converter (issue 54).
FAMILY = Family("qwen3", ("qwen3",), features, "Qwen3ForCausalLM", "Qwen3Config", None)
