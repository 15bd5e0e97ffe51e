"""What a family module declares (pipeline.models.families)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts MLP: a router picks each token's top_k of num_experts SwiGLU experts (each of
    intermediate_size), whose outputs are summed weighted by the router's probabilities, renormalized over the
    top_k where norm_topk_prob. `layers`: the decoder layers that have one (the others keep a dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Window:
    """Sliding-window attention in some layers: a token there attends to its last `size` keys, itself included
    (transformers' sliding_window_overlay: key > query - size), with rope of its own base."""

    size: int
    layers: tuple[int, ...]
    rope_theta: float


@dataclass(frozen=True)
class Features:
    """The decoder parts that differ between families; the rest (rope, RMSNorm, a gated MLP, GQA) is common."""

    qkv_bias: bool = False  # the q, k and v projections carry biases
    qk_norm: bool = False  # each head of q and of k goes through its own RMSNorm before rope
    moe: Moe | None = None  # mixture-of-experts MLPs, in some or all layers
    # Gemma's RMSNorm: the normalized row times (1 + w), in fp32, rounded once (Llama's rounds, then times w)
    norm_offset: bool = False
    sandwich_norms: bool = False  # attention's and the MLP's outputs are normed too, before their residual adds
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # the embedding times sqrt(hidden_size), rounded to the model's dtype
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    window: Window | None = None


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json's model_type values this family reads
    features: Callable[[dict], Features]  # from config.json
    hf_model: str  # transformers' ForCausalLM class for it: the reference
    hf_config: str  # and its config class
    trtllm_decoder: str | None  # ModelOpt's export_tensorrt_llm_checkpoint decoder_type; None: --export hf only
    # config.json keys a checkpoint may leave out, at transformers' defaults for the family's class (transformers
    # writes a nested text_config as its difference from them)
    defaults: dict = field(default_factory=dict)
    # model_types of multimodal checkpoints whose text model is this family, under their config's text_config
    wrappers: tuple[str, ...] = ()
    # An EAGLE-3 head's one decoder layer may be of this family (its config.json names it). Published heads and
    # ModelOpt's are Llama layers, whatever their target; a layer named as another family is read as a Llama one.
    head_layer: bool = False
