"""Load a Hugging Face Llama-family checkpoint (config.json + *.safetensors) into the engine's layout.

A ModelOpt-quantized export (hf_quant_config.json) loads the same way: its quantized projections
become quantized engine linears (pipeline/engine/quant.py), everything else loads as usual.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.engine.config import ModelConfig
from pipeline.engine.model import Transformer
from pipeline.engine.quant import QuantizedWeight, build_quantized_linear, read_quant_config
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


def linear_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """Engine linear -> the Hugging Face linears fused into it, along the output dim, in order."""
    groups = {}
    for i in range(cfg.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        groups[f"layers.{i}.attn.qkv"] = [attn + f"{n}_proj" for n in "qkv"]
        groups[f"layers.{i}.attn.o"] = [attn + "o_proj"]
        groups[f"layers.{i}.mlp.gate_up"] = [mlp + "gate_proj", mlp + "up_proj"]
        groups[f"layers.{i}.mlp.down"] = [mlp + "down_proj"]
    if not cfg.tie_word_embeddings:
        groups["lm_head"] = ["lm_head"]
    return groups


def _taker(hf: dict[str, torch.Tensor]):
    def take(name: str) -> torch.Tensor:
        for prefix in ("model.", ""):
            if prefix + name in hf:
                return hf[prefix + name]
        raise ModelFormatError(f"checkpoint is missing tensor {name!r}; is this a Llama-family checkpoint?")

    return take


def _hf_prefix(hf: dict[str, torch.Tensor], name: str) -> str:
    return "model." + name if f"model.{name}.weight" in hf else name


def to_engine_layout(hf: dict[str, torch.Tensor], cfg: ModelConfig,
                     skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors and fuse q/k/v and gate/up the way Transformer expects.
    Engine linears named in `skip` (already built, quantized) are left out."""
    take = _taker(hf)
    out = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not cfg.tie_word_embeddings and "lm_head.weight" not in hf:
        raise ModelFormatError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    for engine_name, hf_names in linear_groups(cfg).items():
        if engine_name in skip:
            continue
        out[engine_name + ".weight"] = torch.cat([take(n + ".weight") for n in hf_names])
        if engine_name.endswith(".qkv") and cfg.qkv_bias:
            out[engine_name + ".bias"] = torch.cat([take(n + ".bias") for n in hf_names])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "input_norm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return out


def install_quantized_linears(model: Transformer, hf: dict[str, torch.Tensor], dtype: torch.dtype,
                              device: str | torch.device) -> frozenset[str]:
    """Swap in a quantized module for every engine linear whose checkpoint weights are quantized;
    return their names."""
    cfg, take = model.cfg, _taker(hf)
    installed = set()
    for engine_name, hf_names in linear_groups(cfg).items():
        pieces = [QuantizedWeight.take(hf, _hf_prefix(hf, n)) for n in hf_names]
        if any(p.weight is None for p in pieces):
            continue  # to_engine_layout reports the missing tensor
        bias = None
        if engine_name.endswith(".qkv") and cfg.qkv_bias:
            bias = torch.cat([take(n + ".bias") for n in hf_names])
        module = build_quantized_linear(pieces, bias, dtype, torch.device(device))
        if module is None:
            continue
        parent, _, attr = engine_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
        installed.add(engine_name)
    return frozenset(installed)


def load_transformer(folder: str | Path, max_seq_len: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Transformer:
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    hf = read_safetensors(folder)
    quant = read_quant_config(folder, hf)
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len)
    model.quant_config = quant
    quantized = install_quantized_linears(model, hf, dtype, device) if quant else frozenset()
    state = {k: v.to(device=device, dtype=dtype) for k, v in to_engine_layout(hf, cfg, quantized).items()}
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
