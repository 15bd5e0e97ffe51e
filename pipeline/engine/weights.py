"""Load a Hugging Face Llama-family checkpoint (config.json + *.safetensors) into the engine's layout.

A ModelOpt-quantized export (hf_quant_config.json) loads the same way: its quantized projections
become quantized engine linears (pipeline/engine/quant.py), everything else loads as usual.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from pipeline.engine import cpu_kernels
from pipeline.engine.config import ModelConfig
from pipeline.engine.linear import Linear
from pipeline.engine.model import Transformer, unit_offset_norm
from pipeline.engine.quant import Int4Linear, Int8Head, QuantizedWeight, build_quantized_linear, read_quant_config
from pipeline.errors import ModelFormatError


READ_CHUNK = 8 << 20  # bytes per read
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
        return self.read(name)

    def read(self, name: str, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor as stored, or cast to `dtype`, or into `out` (contiguous, of its shape). A cast reads
        READ_CHUNK bytes at a time, so it never holds the stored tensor whole (SmolLM2's fp32 embedding is
        113 MB, twice its bf16 self)."""
        path, base, info = self._where[name]
        stored = _DTYPES.get(info["dtype"])
        if stored is None:
            raise ModelFormatError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which the engine "
                                   "doesn't read")
        if out is None:
            out = torch.empty(info["shape"], dtype=dtype or stored)
        start, end = info["data_offsets"]
        flat = out.view(-1)
        if flat.numel() * stored.itemsize != end - start:
            raise ModelFormatError(f"{path.name}: tensor {name} doesn't hold {list(out.shape)} of {info['dtype']}")
        # Pieces of READ_CHUNK bytes, cast or not: one read() stops short of 2 GiB on Linux, and a 70B
        # model's embedding is 2.1 GB in bf16.
        step = max(1, READ_CHUNK // stored.itemsize)
        buf = None if out.dtype == stored else torch.empty(min(step, flat.numel()), dtype=stored)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(base + start)
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                part = flat[i:i + n] if buf is None else buf[:n]
                if fh.readinto(memoryview(part.view(torch.uint8).numpy())) != n * stored.itemsize:
                    raise ModelFormatError(f"{path.name} is truncated (tensor {name}); copy the checkpoint again")
                if buf is not None:
                    flat[i:i + n].copy_(part)
        return out

    def shape(self, name: str) -> list[int]:
        return list(self._where[name][2]["shape"])

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
        if cfg.moe is not None and i in cfg.moe.layers:  # the router, then each expert's SwiGLU
            groups[f"layers.{i}.mlp.router"] = [mlp + "gate"]
            for e in range(cfg.moe.num_experts):
                expert = f"{mlp}experts.{e}."
                groups[f"layers.{i}.mlp.experts.{e}.gate_up"] = [expert + "gate_proj", expert + "up_proj"]
                groups[f"layers.{i}.mlp.experts.{e}.down"] = [expert + "down_proj"]
        else:
            groups[f"layers.{i}.mlp.gate_up"] = [mlp + "gate_proj", mlp + "up_proj"]
            groups[f"layers.{i}.mlp.down"] = [mlp + "down_proj"]
    if not cfg.tie_word_embeddings:
        groups["lm_head"] = ["lm_head"]
    return groups


# Where a checkpoint keeps its decoder's tensors: a CausalLM's "model.", none, or a multimodal checkpoint's text model
# (Gemma 3 4B and up: "language_model.model." as published, "model.language_model." as transformers 5 saves it).
PREFIXES = ("model.", "", "language_model.model.", "model.language_model.")


def _namer(hf: Mapping[str, torch.Tensor]) -> Callable[[str], str]:
    """A Hugging Face tensor's name as this checkpoint spells it (PREFIXES)."""
    def name_of(name: str) -> str:
        for prefix in PREFIXES:
            if prefix + name in hf:
                return prefix + name
        raise ModelFormatError(f"checkpoint is missing tensor {name!r}; is this a Llama-family checkpoint?")

    return name_of


def _taker(hf: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    name_of = _namer(hf)
    return lambda name: hf[name_of(name)]


def _hf_prefix(hf: dict[str, torch.Tensor], name: str) -> str:
    return next((p + name for p in PREFIXES if f"{p}{name}.weight" in hf), name)


def engine_tensors(hf: CheckpointTensors, cfg: ModelConfig, skip: frozenset[str] = frozenset()
                   ) -> Iterator[tuple[str, Callable[[torch.dtype], torch.Tensor]]]:
    """The engine's tensor names, each with how to build it in a dtype from Hugging Face's: renamed, with
    q/k/v and gate/up fused (read straight into their rows of the fused tensor). Engine linears named in
    `skip` (already built, quantized) are left out. The builders read when called, so the caller places
    one tensor before the next is read."""
    name_of = _namer(hf)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in hf:
        raise ModelFormatError("checkpoint has no lm_head.weight and tie_word_embeddings is false")

    def one(hf_name):
        return lambda dtype: hf.read(name_of(hf_name), dtype)

    def norm(hf_name):  # Gemma's (1 + w), held in fp32 whatever the dtype (model.unit_offset_norm)
        if cfg.features.norm_offset:
            return lambda dtype: unit_offset_norm(hf.read(name_of(hf_name), torch.float32))
        return one(hf_name)

    def fused(hf_names):
        def build(dtype):
            names = [name_of(n) for n in hf_names]
            shapes = [hf.shape(n) for n in names]
            out = torch.empty([sum(s[0] for s in shapes), *shapes[0][1:]], dtype=dtype)
            row = 0
            for n, s in zip(names, shapes):
                hf.read(n, out=out[row:row + s[0]])
                row += s[0]
            return out
        return build

    yield "embed.weight", one("embed_tokens.weight")
    yield "norm.weight", norm("norm.weight")
    for engine_name, hf_names in linear_groups(cfg).items():
        if engine_name in skip:
            continue
        yield engine_name + ".weight", fused([n + ".weight" for n in hf_names])
        if engine_name.endswith(".qkv") and cfg.qkv_bias:
            yield engine_name + ".bias", fused([n + ".bias" for n in hf_names])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        yield p + "input_norm.weight", norm(p + "input_layernorm.weight")
        if cfg.features.sandwich_norms:  # Gemma's post_attention_layernorm norms attention's output
            yield p + "attn_out_norm.weight", norm(p + "post_attention_layernorm.weight")
            yield p + "post_norm.weight", norm(p + "pre_feedforward_layernorm.weight")
            yield p + "mlp_out_norm.weight", norm(p + "post_feedforward_layernorm.weight")
        else:  # Llama's post_attention_layernorm is the MLP's input norm
            yield p + "post_norm.weight", norm(p + "post_attention_layernorm.weight")
        if cfg.qk_norm:
            yield p + "attn.q_norm.weight", norm(p + "self_attn.q_norm.weight")
            yield p + "attn.k_norm.weight", norm(p + "self_attn.k_norm.weight")


def install_quantized_linears(model: Transformer, hf: CheckpointTensors, dtype: torch.dtype,
                              device: str | torch.device) -> frozenset[str]:
    """Swap in a quantized module for every engine linear whose checkpoint weights are quantized;
    return their names."""
    cfg, take = model.cfg, _taker(hf)
    installed = set()
    for engine_name, hf_names in linear_groups(cfg).items():
        prefixes = [_hf_prefix(hf, n) for n in hf_names]
        if not any(f"{prefix}.weight_scale" in hf for prefix in prefixes):
            continue  # dense: engine_tensors reads it once, rather than reading it here to find that out
        pieces = [QuantizedWeight.take(hf, prefix) for prefix in prefixes]
        if any(p.weight is None for p in pieces):
            continue  # engine_tensors reports the missing tensor
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


def weight_bytes(model: nn.Module) -> int:
    """The bytes of a model's parameters, each storage once (a tied head shares the embedding's): what a decode
    step at batch 1 reads, for the benchmarks' bandwidth floor."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def load_transformer(folder: str | Path, max_seq_len: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", keep_plain: bool = True,
                     lm_head: str = "checkpoint") -> Transformer:
    """keep_plain=False: linears that get a packed (oneDNN) copy drop their plain weight, so the weights are
    held once; such a model can't be re-packed, cast or moved (the engine never does). lm_head: see
    EngineConfig.lm_head."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    hf = CheckpointTensors(folder)
    quant = read_quant_config(folder, hf)
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len)
    model.quant_config = quant
    quantized = install_quantized_linears(model, hf, dtype, device) if quant else frozenset()
    _trim_heap()  # the unpacked int4 weights and their conversions
    int8_head = _int8_head(lm_head, model, device)
    for name, build in engine_tensors(hf, cfg, quantized):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(build(dtype).to(device=device), requires_grad=False))
        if isinstance(module, Linear) and attr == "weight" and not (int8_head and module is model.lm_head):
            _pack(module, keep_plain)  # now, while this weight alone is in flight
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # the embedding keeps its plain copy for the lookup
    if int8_head:
        model.lm_head = Int8Head(model.lm_head.weight.detach())
        _trim_heap()
    for module in model.modules():  # the tied head, and quantized linears that fell back to dense
        if isinstance(module, Linear) and module.packed is None and not module.weight.is_meta:
            _pack(module, keep_plain)
    model.set_rope_tables(max_seq_len, device)  # buffers made at construction: made again off the meta device
    missing = [n for n, p in model.named_parameters() if p.is_meta and not _released(model, n)]
    if missing:
        raise ModelFormatError(f"checkpoint in {folder} is missing {missing[0]}")
    return model.eval()


def _int8_head(choice: str, model: Transformer, device: str | torch.device) -> bool:
    if choice == "checkpoint" or torch.device(device).type != "cpu" or not cpu_kernels.usable():
        return False
    if Int8Head.unsupported_reason(model.cfg.vocab_size, model.cfg.hidden_size):
        return False
    if choice == "int8":
        return True
    return any(isinstance(m, Int4Linear) for m in model.modules())  # auto: an INT4 checkpoint


def _pack(module: Linear, keep_plain: bool) -> None:
    module.pack()
    if not keep_plain and module.packed is not None:
        module.release_plain()
        _trim_heap()


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim). The plain weight just released sits in
    the heap's free lists otherwise: loading SmolLM2 in bf16 ended 110 MB above what it holds, and that
    was the run's peak RSS."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


try:
    _LIBC = ctypes.CDLL(None)  # the process's own symbols: glibc's where it is the C library
except OSError:  # pragma: no cover - a platform without dlopen(NULL)
    _LIBC = None


def _released(model: Transformer, name: str) -> bool:
    module = model.get_submodule(name.rpartition(".")[0])
    return isinstance(module, Linear) and module.packed is not None
