"""Typed configs for the portable engine, validated in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.engine.gate_policy import GatePolicy  # noqa: F401  (re-exported: part of the engine's config)
from pipeline.errors import ConfigError, ModelFormatError

SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "mistral"}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"model_type {model_type!r} is not supported by the portable engine; "
                f"use a Llama-family model ({', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        # transformers 5 moved rope_theta/rope_scaling into "rope_parameters"; accept both layouts.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ModelFormatError(f"rope type {rope_type!r} is not supported; supported: default, llama3")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them when attention_bias is set.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelFormatError(f"{path} is missing; a model folder needs config.json (Hugging Face layout)")
        return cls.from_hf_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # KV-cache slots: the most requests decoding at once
    max_seq_len: int = 2048  # prompt + generated tokens per request
    dtype: str = "fp32"
    device: str = "cpu"
    num_draft_tokens: int = 4  # k: tokens the proposer drafts per step
    gate: GatePolicy = field(default_factory=GatePolicy)

    def __post_init__(self):
        parse_dtype(self.dtype)
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size must be >= 1")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len must be >= 2")
        if self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens (k) must be >= 1; use --draft none to turn speculation off")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
