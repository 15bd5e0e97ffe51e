"""Seeded tiny random checkpoints of the supported families, written as real Hugging Face folders by transformers'
own class for the family (pipeline.models.families).

Small enough to build in a second and need no download: the tests' models, and the pair
scripts/smoke_trtllm.py builds TensorRT-LLM engines from inside NVIDIA's container.
"""

from __future__ import annotations

from pathlib import Path

BYTE_VOCAB = 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(extra_tokens: int = 0):
    """A byte-level tokenizer with no merges: 256 byte tokens, then the specials (+ extra_tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for j in range(extra_tokens):
        vocab[f"<extra_{j}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(path: Path, seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, vocab_size: int = 320, tie: bool = False,
                    model_type: str = "llama", rope_scaling: dict | None = None, attention_bias: bool = False,
                    init_std: float = 0.1, extra_tokens: int = 0, max_positions: int = 1024,
                    head_dim: int | None = None, moe: dict | None = None, config: dict | None = None) -> Path:
    """Write a seeded random model + byte tokenizer to `path`. init_std is larger than the usual 0.02
    so that logits are well separated: greedy tests then don't hinge on near-ties. head_dim: where it isn't
    hidden / heads (Qwen3's own). moe: a mixture-of-experts family's config keys (num_experts,
    num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers). config: other
    config keys of the family (Gemma 3's sliding_window, sliding_window_pattern, query_pre_attn_scalar)."""
    import torch
    import transformers

    from pipeline.models.families import family_of

    family = family_of(model_type)
    tok = byte_tokenizer(extra_tokens)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie, initializer_range=init_std,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, rms_norm_eps=1e-5)
    if head_dim is not None:
        common["head_dim"] = head_dim
    common.update(moe or {})
    common.update(config or {})
    torch.manual_seed(seed)
    cfg = getattr(transformers, family.hf_config)(**common, attention_bias=attention_bias)
    if rope_scaling:
        cfg.rope_parameters = {"rope_theta": 500000.0, **rope_scaling}
    model = getattr(transformers, family.hf_model)(cfg)
    # Norms that scale by 1 + w (Gemma's) start at w = 0: random ones make the offset, and each norm's place, matter
    offset = family.features(cfg.to_dict()).norm_offset
    with torch.no_grad():  # biases default to zero and per-head q/k norms to one; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, init_std)
            elif offset and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones would hide a missing or misplaced one
                p.uniform_(0.5, 1.5)
    model.config.architectures = [type(model).__name__]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
