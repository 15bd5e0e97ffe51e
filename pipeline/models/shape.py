"""A Llama-family decoder's shape: the one torch-free type every stage reads from a config.json.

The planner sizes weights and KV cache from it, quantization checks its block sizes against it, the presets
carry one so `pipeline plan` needs no weights, and the engine's ModelConfig is built from it (adding what
only the engine needs: rope, norm epsilon, biases, special tokens)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ModelFormatError
from pipeline.models.families import Moe, family_for, text_config


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    moe: Moe | None = None  # mixture-of-experts MLPs (a family's feature: Qwen3-MoE)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        """From a Hugging Face config.json, or a TensorRT-LLM checkpoint's, which spells two keys its own way
        (tensorrt_llm/models/modeling_utils.py, PretrainedConfig: head_size, share_embedding_table). A multimodal
        checkpoint's text model where a family reads it (families.text_config)."""
        cfg = text_config(cfg)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelFormatError(f"config.json has no {', '.join(missing)}; the pipeline reads Llama-family "
                                   "configs (Hugging Face layout)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        family = family_for(str(cfg.get("model_type", "llama")))
        return cls(
            model_type=str(cfg.get("model_type", "llama")),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg.get("head_size") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("share_embedding_table", False))),
            moe=family.features(cfg).moe if family is not None else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelShape":
        return cls.from_hf_config(read_config(folder))

    @property
    def param_count(self) -> int:
        """Parameters as Hugging Face counts them (a tied lm_head once)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size + 2 * h  # q,o + k,v + gate/up/down + 2 norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        total = self.num_layers * layer + self.vocab_size * h + head + h
        if self.moe is not None:  # its layers' experts and router in place of the dense MLP
            m = self.moe
            total += len(m.layers) * (m.num_experts * 3 * h * m.intermediate_size + m.num_experts * h
                                      - 3 * h * self.intermediate_size)
        return total

    @property
    def active_param_count(self) -> int:
        """Parameters one token reads: all of them, but of each layer's experts only its top_k (and the router)."""
        if self.moe is None:
            return self.param_count
        m = self.moe
        return self.param_count - len(m.layers) * (m.num_experts - m.top_k) * 3 * self.hidden_size * m.intermediate_size

    @property
    def in_features(self) -> dict[str, int]:
        """Input features of each linear: q/k/v/gate/up read the hidden state, o_proj the heads, down_proj the MLP."""
        dims = {"hidden_size": self.hidden_size, "num_heads*head_dim": self.num_heads * self.head_dim,
                "intermediate_size": self.intermediate_size}
        if self.moe is not None:  # an expert's down_proj reads its own intermediate size
            dims["moe_intermediate_size"] = self.moe.intermediate_size
        return dims


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{path} is missing; a model folder needs config.json (Hugging Face layout)")
    return json.loads(path.read_text())
