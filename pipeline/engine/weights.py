"""Load a Hugging Face Llama-family checkpoint (config.json + *.safetensors) into the engine's layout."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.engine.config import ModelConfig
from pipeline.engine.model import Transformer
from pipeline.errors import ModelFormatError


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors in {folder}; convert the checkpoint to safetensors first")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def to_engine_layout(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors and fuse q/k/v and gate/up the way Transformer expects."""

    def take(name: str) -> torch.Tensor:
        for prefix in ("model.", ""):
            if prefix + name in hf:
                return hf[prefix + name]
        raise ModelFormatError(f"checkpoint is missing tensor {name!r}; is this a Llama-family checkpoint?")

    out = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in hf:
            raise ModelFormatError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        out[p + "attn.qkv.weight"] = torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[p + "attn.qkv.bias"] = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
        out[p + "attn.o.weight"] = take(attn + "o_proj.weight")
        out[p + "mlp.gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[p + "mlp.down.weight"] = take(p + "mlp.down_proj.weight")
        out[p + "input_norm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return out


def load_transformer(folder: str | Path, max_seq_len: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Transformer:
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len)
    state = {k: v.to(device=device, dtype=dtype) for k, v in to_engine_layout(read_safetensors(folder), cfg).items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    # Rope tables are buffers computed at construction; rebuild them off the meta device.
    rebuilt = Transformer.rope_tables(cfg, max_seq_len)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rebuilt)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFormatError(f"checkpoint in {folder} is missing {missing[0]}")
    return model.eval().pack_weights()
