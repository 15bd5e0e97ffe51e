"""Load a Hugging Face Llama-family checkpoint (config.json + *.safetensors) into the engine's layout.

A ModelOpt-quantized export (hf_quant_config.json) loads the same way: its quantized projections
become quantized engine linears (pipeline/engine/quant.py), everything else loads as usual.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from pipeline.engine.config import ModelConfig
from pipeline.engine.linear import Linear
from pipeline.engine.model import Transformer
from pipeline.engine.quant import QuantizedWeight, build_quantized_linear, read_quant_config
from pipeline.errors import ModelFormatError


# safetensors' dtype names (its format spec) -> torch's
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointTensors(Mapping):
    """A folder's *.safetensors as name -> tensor, each read from disk when asked for.

    Loading then never holds the checkpoint whole: each tensor is read, cast to the engine's dtype, fused,
    packed and dropped, so the load's peak is the model plus one layer's pieces. Reading every file into
    a dict first held the fp32 checkpoint, its fused copies and the cast model at once. Tensors are read
    with pread into fresh memory rather than through a memory map: a mapped file's pages count in the
    process's RSS for as long as the map lives, which put the whole fp32 file (538 MB for SmolLM2) on top of
    the model at its peak. The format is safetensors' own: an 8-byte little-endian header length, a JSON
    header of {name: {dtype, shape, data_offsets}}, then the data.
    """

    def __init__(self, folder: Path):
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"no *.safetensors in {folder}; convert the checkpoint to safetensors first")
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for name, info in header.items():
                self._where[name] = (f, 8 + size, info)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, base, info = self._where[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelFormatError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which the engine "
                                   "doesn't read")
        start, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        with open(path, "rb", buffering=0) as fh:
            fh.seek(base + start)
            if out.numel() and fh.readinto(view) != end - start:
                raise ModelFormatError(f"{path.name} is truncated (tensor {name}); copy the checkpoint again")
        return out

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's *.safetensors, in memory (small checkpoints: an EAGLE-3 head)."""
    tensors = CheckpointTensors(folder)
    return {name: tensors[name] for name in tensors}


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


def engine_tensors(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, skip: frozenset[str] = frozenset()
                   ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """The engine's tensor names, each with how to build it from Hugging Face's: renamed, with q/k/v and
    gate/up fused. Engine linears named in `skip` (already built, quantized) are left out. The builders
    read lazily, so the caller casts and places one tensor before the next is read."""
    take = _taker(hf)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in hf:
        raise ModelFormatError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    yield "embed.weight", lambda: take("embed_tokens.weight")
    yield "norm.weight", lambda: take("norm.weight")
    for engine_name, hf_names in linear_groups(cfg).items():
        if engine_name in skip:
            continue
        yield engine_name + ".weight", lambda names=hf_names: _fused([take(n + ".weight") for n in names])
        if engine_name.endswith(".qkv") and cfg.qkv_bias:
            yield engine_name + ".bias", lambda names=hf_names: _fused([take(n + ".bias") for n in names])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        yield p + "input_norm.weight", lambda p=p: take(p + "input_layernorm.weight")
        yield p + "post_norm.weight", lambda p=p: take(p + "post_attention_layernorm.weight")


def _fused(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def to_engine_layout(hf: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every engine tensor at once (engine_tensors, materialized)."""
    return {name: build() for name, build in engine_tensors(hf, cfg, skip)}


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
                     device: str | torch.device = "cpu", keep_plain: bool = True) -> Transformer:
    """keep_plain=False: linears that get a packed (oneDNN) copy drop their plain weight, so the weights are
    held once; such a model can't be re-packed, cast or moved (the engine never does)."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    hf = CheckpointTensors(folder)
    quant = read_quant_config(folder, hf)
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len)
    model.quant_config = quant
    quantized = install_quantized_linears(model, hf, dtype, device) if quant else frozenset()
    for name, build in engine_tensors(hf, cfg, quantized):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(build().to(device=device, dtype=dtype), requires_grad=False))
        if isinstance(module, Linear) and attr == "weight":
            _pack(module, keep_plain)  # now, while this weight alone is in flight
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # the embedding keeps its plain copy for the lookup
    for module in model.modules():  # the tied head, and quantized linears that fell back to dense
        if isinstance(module, Linear) and module.packed is None and not module.weight.is_meta:
            _pack(module, keep_plain)
    # Rope tables are buffers computed at construction; rebuild them off the meta device.
    rebuilt = Transformer.rope_tables(cfg, max_seq_len)
    model.rope_cos, model.rope_sin = (t.to(device) for t in rebuilt)
    missing = [n for n, p in model.named_parameters() if p.is_meta and not _released(model, n)]
    if missing:
        raise ModelFormatError(f"checkpoint in {folder} is missing {missing[0]}")
    return model.eval()


def _pack(module: Linear, keep_plain: bool) -> None:
    module.pack()
    if not keep_plain and module.packed is not None:
        module.release_plain()


def _released(model: Transformer, name: str) -> bool:
    module = model.get_submodule(name.rpartition(".")[0])
    return isinstance(module, Linear) and module.packed is not None
