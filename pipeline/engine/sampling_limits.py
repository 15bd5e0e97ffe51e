"""The sampling values a request may carry: one rule, free of torch, for the engine, the Triton models and the client.

Every value is checked finite and in range, and refused with its own one-line message, never clamped:
a NaN temperature used to pass `temperature < 0` and then failed the engine's sampling step for every
request in the batch. A positive temperature below MIN_TEMPERATURE overflows logits / T in float32
(1e-45 gives inf, then NaN probabilities), so it is refused rather than quietly turned into greedy:
at 1e-5, logits of a few hundred still divide to well inside float32's range.
"""

from __future__ import annotations

import math

from pipeline.errors import RequestError

MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4  # uniform long before this; refuses typos like 1e9


def check_sampling_values(temperature: float, top_p: float, top_k: int, vocab_size: int | None = None) -> None:
    """Raise RequestError with the fix unless every value is usable as it is."""
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be a finite number >= 0 (got {temperature}); use 0 for greedy")
    if 0 < temperature < MIN_TEMPERATURE:
        raise RequestError(f"temperature {temperature:g} is too small to sample with; send 0 for greedy, or at "
                           f"least {MIN_TEMPERATURE:g}")
    if temperature > MAX_TEMPERATURE:
        raise RequestError(f"temperature {temperature:g} is over {MAX_TEMPERATURE:g}; send a smaller one")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1] (got {top_p})")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0 (got {top_k}); use 0 to disable")
    if vocab_size is not None and top_k > vocab_size:
        raise RequestError(f"top_k {top_k} is over the vocabulary's {vocab_size} tokens; send at most that, or 0")
