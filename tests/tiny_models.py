"""Seeded tiny random Llama-family checkpoints (pipeline.models.tiny) and a greedy reference for tests."""

from __future__ import annotations

from pipeline.models.tiny import BYTE_VOCAB, CHAT_TEMPLATE, SPECIALS, byte_tokenizer, make_tiny_llama  # noqa: F401


def greedy_reference(engine, default_max_tokens: int):
    """prompt ids (, max_tokens) -> the engine's greedy output ids, one request at a time, memoized: the
    ground truth the greedy-equivalence tests compare speculative and batched runs against."""
    from pipeline.engine.sampling import SamplingParams

    cache: dict = {}

    def ref(prompt: list[int], max_tokens: int = default_max_tokens) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].output_ids
        return cache[key]

    return ref
