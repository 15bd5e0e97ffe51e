"""Qwen2 and Qwen2.5: Llama's decoder with biases on q, k and v, always (transformers' Qwen2Attention)."""

from pipeline.models.families.base import Family, Features


def features(cfg: dict) -> Features:
    return Features(qkv_bias=True)


FAMILY = Family("qwen2", ("qwen2",), features, "Qwen2ForCausalLM", "Qwen2Config", "qwen", head_layer=True)
