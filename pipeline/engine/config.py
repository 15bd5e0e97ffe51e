"""Typed configs for the portable engine, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from pipeline.engine.device import DeviceChoice, check_fraction
from pipeline.errors import ConfigError, ModelFormatError
from pipeline.models.families import Features, family_of, text_config
from pipeline.models.shape import ModelShape, read_config
from pipeline.models.tokenizer import config_eos_ids
from pipeline.policy.gate_policy import GatePolicy  # noqa: F401  (re-exported: part of the engine's config)
from pipeline.setting import MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS

LM_HEAD_CHOICES = ("auto", "checkpoint", "int8")

# The kernels of a forward on a GPU: "invariant" (the default) runs the engine's own Triton kernels, whose result
# for a row depends on nothing but that row (the lossless contract: see gpu_kernels.py); "vendor" runs cuBLAS and
# SDPA, which pick a kernel and a reduction split by shape, so a row's bits move with the batch, a verify's width
# and a prefix-cache hit: an explicit opt-out, named in describe(), the metrics and every answer.
GPU_KERNEL_CHOICES = ("invariant", "vendor")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: Llama 3's frequency-dependent kind ("rope_type": "llama3"), or every frequency divided by
    `factor` ("linear": Gemma 3's global layers on its 4B and larger)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelShape):
    """What the engine needs to run a decoder of a supported family: its ModelShape plus rope, norm epsilon, the
    family's features (pipeline.models.families) and special tokens, read from a Hugging Face config.json."""

    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before rope (Qwen3)
    features: Features = Features()  # the family's parts (pipeline.models.families.base), Gemma's read from here
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        cfg = text_config(cfg)
        shape = ModelShape.from_hf_config(cfg)
        features = family_of(shape.model_type).features(cfg)
        # transformers 5 moved rope_theta/rope_scaling into "rope_parameters"; accept both layouts.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        if isinstance(rope.get("full_attention"), dict):  # one set per layer type (Gemma 3): the global layers'
            rope = rope["full_attention"]
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
        elif rope_type == "linear":
            scaling = RopeScaling(factor=float(rope["factor"]), kind="linear")
        elif rope_type not in ("default", None):
            raise ModelFormatError(f"rope type {rope_type!r} is not supported; supported: default, llama3, linear")
        return cls(
            **{f.name: getattr(shape, f.name) for f in fields(ModelShape)},
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=features.qkv_bias,
            qk_norm=features.qk_norm,
            features=features,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=config_eos_ids(cfg),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(read_config(folder))

    @property
    def shape(self) -> ModelShape:
        """The shape alone (a ModelConfig never equals a ModelShape: dataclasses compare their classes too)."""
        return ModelShape(**{f.name: getattr(self, f.name) for f in fields(ModelShape)})


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # KV-cache slots: the most requests decoding at once
    max_seq_len: int = 2048  # prompt + generated tokens per request
    dtype: str = "fp32"
    # cpu, cuda or cuda:N; "auto" is resolved before the config is made (pipeline.engine.device.resolve_device)
    device: str = "cpu"
    num_draft_tokens: int = 4  # k: tokens the proposer drafts per step
    # An EAGLE-3 head drafts only where n-gram lookup finds no match of 2+ tokens in the context (proposers.NgramFirst):
    # copying drafts for free, and the head's own cost is paid where it is needed. False: the head drafts every step.
    ngram_first: bool = True
    gate: GatePolicy = field(default_factory=GatePolicy)
    # The output projection: "checkpoint" runs it as stored; "int8" quantizes it at load (one fp32 scale per 64
    # inputs, like llama.cpp's Q8_0 head) onto the C kernel; "auto" does that for an INT4 checkpoint only, whose
    # ModelOpt export leaves the (tied) head in bf16: half the bytes a decode step reads (see quant.Int8Head).
    lm_head: str = "auto"
    # The target's KV cache: a pool of 16-token blocks, this many bytes (None: room for max_batch_size requests of
    # max_seq_len tokens each; on a GPU, at most gpu_memory_fraction of the memory free once the weights are
    # loaded). Requests hold only the blocks their tokens fill.
    kv_cache_bytes: int | None = None
    # On a GPU with kv_cache_bytes None: the share of the free memory the KV pool may take (TensorRT-LLM's
    # free_gpu_memory_fraction); the rest is left for activations. A CPU ignores it.
    gpu_memory_fraction: float = 0.9
    prefix_caching: bool = True  # reuse full blocks of a prompt prefix another request already computed
    # Prompt tokens prefilled per step, at most (chunked prefill): a long prompt is prefilled over several steps,
    # each also decoding the running requests, so it never stalls their tokens for its whole prefill.
    prefill_chunk: int = 256
    gpu_kernels: str = "invariant"  # GPU_KERNEL_CHOICES; a CPU ignores it (its own kernels are row-invariant)
    # Decode and verify steps replayed from CUDA graphs captured at load (cuda_graphs.py): on a GPU with the
    # invariant kernels only; a CPU ignores it.
    cuda_graphs: bool = True

    def __post_init__(self):
        parse_dtype(self.dtype)
        if DeviceChoice(self.device).auto:
            raise ConfigError(f"EngineConfig needs a device (cpu, cuda or cuda:N), got {self.device!r}; resolve a "
                              f"choice first: pipeline.engine.device.resolve_device({self.device!r})")
        check_fraction(self.gpu_memory_fraction)
        if self.gpu_kernels not in GPU_KERNEL_CHOICES:
            raise ConfigError(f"gpu_kernels {self.gpu_kernels!r} is not a choice; use one of "
                              f"{', '.join(GPU_KERNEL_CHOICES)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be > 0 (got {self.kv_cache_bytes})")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 token (got {self.prefill_chunk})")
        MAX_BATCH_SIZE.check(self.max_batch_size, by_flag=False)
        MAX_SEQ_LEN.check(self.max_seq_len, by_flag=False)
        NUM_DRAFT_TOKENS.check(self.num_draft_tokens, by_flag=False, fix="use --draft none to turn speculation off")
        if self.lm_head not in LM_HEAD_CHOICES:
            raise ConfigError(f"lm_head {self.lm_head!r} is not a choice; use one of {', '.join(LM_HEAD_CHOICES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
