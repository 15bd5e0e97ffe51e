"""Llama (and Mistral, whose decoder is Llama's): biases on q/k/v only where config.json's attention_bias says so."""

from pipeline.models.families.base import Family, Features


def features(cfg: dict) -> Features:
    return Features(qkv_bias=bool(cfg.get("attention_bias", False)))


# ModelOpt's export maps Mistral to the llama decoder too (quantize/formats.py's table before this module).
FAMILY = Family("llama", ("llama", "mistral"), features, "LlamaForCausalLM", "LlamaConfig", "llama", head_layer=True)
