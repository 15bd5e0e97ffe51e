"""Model references -> local Hugging Face folders: presets, local folders, GGUF files, hub ids."""

from pipeline.models.presets import PRESETS, Preset, get_preset
from pipeline.models.resolve import ResolvedModel, resolve_model

__all__ = ["PRESETS", "Preset", "ResolvedModel", "get_preset", "resolve_model"]
