"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no qkv bias) with a mixture-of-experts MLP (transformers'
Qwen3MoeSparseMoeBlock): a bias-free router over num_experts, a softmax in fp32, each token's top num_experts_per_tok
renormalized where norm_topk_prob, and the experts' SwiGLU outputs summed by those weights. A layer has the experts
unless it is in mlp_only_layers or (layer + 1) is not a multiple of decoder_sparse_step; the others keep a dense MLP
of intermediate_size (Qwen3-30B-A3B: 48 layers, all sparse, 128 experts, top 8, moe_intermediate_size 768)."""

from pipeline.errors import ModelFormatError
from pipeline.models.families.base import Family, Features, Moe


def features(cfg: dict) -> Features:
    # transformers 5 writes num_local_experts; the published checkpoints' config.json says num_experts
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    layers_total = int(cfg.get("num_hidden_layers", 0))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    moe = None
    if experts > 0:
        top_k = int(cfg.get("num_experts_per_tok", 0))
        if not 0 < top_k <= experts:
            raise ModelFormatError(f"config.json's num_experts_per_tok ({top_k}) must be 1..num_experts ({experts})")
        moe = Moe(num_experts=experts, top_k=top_k, intermediate_size=int(cfg["moe_intermediate_size"]),
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  layers=tuple(i for i in range(layers_total) if i not in dense and (i + 1) % step == 0))
    return Features(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, moe=moe)


# No TensorRT-LLM export: not checked against upstream's converter (issue 54).
FAMILY = Family("qwen3_moe", ("qwen3_moe",), features, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", None)
