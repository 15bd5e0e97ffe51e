"""Model families: what sets each apart, one module per family (llama.py, qwen2.py, qwen3.py, qwen3_moe.py,
gemma3.py).

The engine reads features, never a family's name. A family module turns a checkpoint's config.json into those
features, names transformers' own classes for it (the reference the tests compare the engine against), and the
decoder type ModelOpt's TensorRT-LLM export takes for it. A new family is a new module, listed in FAMILIES.
Torch-free: the planner, quantizer and presets read it too.
"""

from __future__ import annotations

from pipeline.errors import ModelFormatError
from pipeline.models.families import gemma3, llama, qwen2, qwen3, qwen3_moe
from pipeline.models.families.base import Family, Features, Moe, Window  # noqa: F401  (re-exported)


FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, gemma3.FAMILY)


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for f in FAMILIES for t in f.model_types))


def family_for(model_type: str) -> Family | None:
    """The family of a config.json's model_type, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def text_config(cfg: dict) -> dict:
    """config.json as the engine reads it: a multimodal checkpoint's text model where a family reads it (Gemma 3's
    model_type gemma3: its text_config; the vision tower is left out), with the family's defaults under what the
    file says."""
    outer = cfg.get("model_type")
    wrapping = next((f for f in FAMILIES if outer in f.wrappers), None)
    if wrapping is not None and isinstance(cfg.get("text_config"), dict):
        cfg = {"model_type": wrapping.model_types[0], **cfg["text_config"]}
    family = family_for(str(cfg.get("model_type", "llama")))
    return {**family.defaults, **cfg} if family is not None else cfg


def family_of(model_type: str) -> Family:
    """The family of a config.json's model_type; one line naming the supported ones otherwise."""
    if family := family_for(model_type):
        return family
    raise ModelFormatError(f"model_type {model_type!r} is not supported by the portable engine; supported: "
                           f"{', '.join(supported_model_types())}")
