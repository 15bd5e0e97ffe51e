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


def staggered_past_the_gate(engine, prompts: list[list[int]], budgets: list[int]):
    """The gate-flip scenario: the first request decodes alone for 4 steps, then the rest arrive at once, so the
    decoding batch crosses a gate of 2 (FLIP_GATE) both ways while requests are mid-decode. Returns the requests,
    all finished."""
    from pipeline.engine.sampling import SamplingParams

    reqs = [engine.add_request(prompts[0], SamplingParams(max_tokens=budgets[0]))]
    for _ in range(4):
        engine.step()
    reqs += [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[1:], budgets[1:])]
    while engine.has_unfinished():
        engine.step()
    return reqs


def flip_gate():
    """Speculate at <= 2 decoding, off above 2, back on at <= 1; every request long enough to speculate."""
    from pipeline.engine.gate_policy import GatePolicy

    return GatePolicy(max_batch_size=2, hysteresis=1, min_tokens=0)
