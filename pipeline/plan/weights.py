"""Weight and KV-cache bytes of a Llama-family model per quantization format. Pure: arithmetic on shapes.

What ModelOpt exports (and TensorRT-LLM loads), per format, for one linear of in x out features:
  none      2 bytes/param (bf16)
  fp8       1 byte/param + a per-tensor weight scale and input scale (fp32)
  int4_awq  0.5 byte/param + one fp16 scale per 128 input features per output + the AWQ pre-quant scale
  w4a8_awq  as int4_awq + an FP8 input scale
  int8_sq   1 byte/param + a per-channel fp32 scale + the SmoothQuant smoothing vector
Embeddings, the lm_head, norms and the EAGLE-3 fc stay 16-bit in every format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.models.shape import ModelShape

WEIGHT_FORMATS = ("none", "fp8", "int4_awq", "w4a8_awq", "int8_sq")
AWQ_GROUP = 128
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
# The yuhuili EAGLE-3 heads (EAGLE3-LLaMA3.1-Instruct-8B, EAGLE3-LLaMA3.3-Instruct-70B) predict over a
# 32000-token subset of the target's vocabulary (config.json: draft_vocab_size).
EAGLE3_DRAFT_VOCAB = 32000


@dataclass(frozen=True)
class WeightBytes:
    """Bytes split by how tensor parallelism places them."""

    sharded: int  # split tp ways: attention and MLP linears, the lm_head (TensorRT-LLM splits it by vocab)
    replicated: int  # on every GPU: the embedding (unless --use_parallel_embedding), norms

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_gpu(self, tp: int) -> int:
        return math.ceil(self.sharded / tp) + self.replicated

    def __add__(self, other: "WeightBytes") -> "WeightBytes":
        return WeightBytes(self.sharded + other.sharded, self.replicated + other.replicated)


def linear_bytes(qformat: str, in_features: int, out_features: int) -> int:
    n = in_features * out_features
    if qformat == "none":
        return 2 * n
    if qformat == "fp8":
        return n + 2 * 4
    if qformat in ("int4_awq", "w4a8_awq"):
        scales = math.ceil(in_features / AWQ_GROUP) * out_features * 2
        return n // 2 + scales + 2 * in_features + (4 if qformat == "w4a8_awq" else 0)
    if qformat == "int8_sq":
        return n + 4 * out_features + 2 * in_features + 4
    raise ValueError(f"unknown weight format {qformat!r}")


def _layer_linears(shape: ModelShape, attn_in: int) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's linears; `attn_in` is what q/k/v read (2 x hidden in an EAGLE-3 layer)."""
    h, q, kv, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    return [(attn_in, q), (attn_in, kv), (attn_in, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def model_weight_bytes(shape: ModelShape, qformat: str) -> WeightBytes:
    """A whole decoder model. A tied lm_head is still counted: TensorRT-LLM checkpoints store it as its own tensor.
    A layer with experts holds every expert (quantized as the dense MLP would be) and its router (which ModelOpt
    leaves unquantized) in place of the dense MLP."""
    h = shape.hidden_size
    linears = _layer_linears(shape, h)
    layer = sum(linear_bytes(qformat, i, o) for i, o in linears)
    layers = shape.num_layers * layer
    if shape.moe is not None:
        m = shape.moe
        dense_mlp = sum(linear_bytes(qformat, i, o) for i, o in linears[4:])
        expert = 2 * linear_bytes(qformat, h, m.intermediate_size) + linear_bytes(qformat, m.intermediate_size, h)
        layers += len(m.layers) * (m.num_experts * expert + linear_bytes("none", h, m.num_experts) - dense_mlp)
    lm_head = 2 * shape.vocab_size * h
    embedding = 2 * shape.vocab_size * h
    norms = 2 * h * (2 * shape.num_layers + 1)
    return WeightBytes(sharded=layers + lm_head, replicated=embedding + norms)


def eagle3_weight_bytes(target: ModelShape, qformat: str, draft_vocab: int = EAGLE3_DRAFT_VOCAB) -> WeightBytes:
    """An EAGLE-3 head for `target`: one decoder layer at the target's width whose q/k/v read
    [embedding, hidden] (2 x hidden), fc fusing three target hidden states (3 x hidden -> hidden),
    and an lm_head over the draft vocabulary. The embedding is the target's (the yuhuili checkpoints
    ship none; TensorRT-LLM shares the target's), so it is not counted again."""
    h = target.hidden_size
    layer = sum(linear_bytes(qformat, i, o) for i, o in _layer_linears(target, 2 * h))
    fc = 2 * 3 * h * h
    lm_head = 2 * draft_vocab * h
    norms = 2 * h * 4  # input, hidden, post-attention and final norms
    vocab_maps = 8 * draft_vocab + target.vocab_size  # d2t (int64) and t2d (bool)
    return WeightBytes(sharded=layer + fc + lm_head, replicated=norms + vocab_maps)


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """TP splits the KV heads; past num_kv_heads GPUs each one holds a replicated head."""
    return max(1, shape.num_kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, num_layers: int, kv_dtype: str, tp: int = 1) -> int:
    """K and V, every layer, one token, on one GPU of a tp group."""
    return 2 * num_layers * kv_heads_per_gpu(shape, tp) * shape.head_dim * KV_DTYPE_BYTES[kv_dtype]
