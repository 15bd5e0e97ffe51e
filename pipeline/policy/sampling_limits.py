"""The sampling values a request may carry: one rule, free of torch, for the engine, the Triton models and the client.

Every value is checked finite and in range, and refused with its own one-line message, never clamped:
a NaN temperature passes `temperature < 0` and then fails the engine's sampling step for every request in
the batch. A positive temperature below MIN_TEMPERATURE overflows logits / T in float32
(1e-45 gives inf, then NaN probabilities), so it is refused rather than quietly turned into greedy:
at 1e-5, logits of a few hundred still divide to well inside float32's range.
"""

from __future__ import annotations

import math

from pipeline.errors import RequestError

MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4  # uniform long before this; refuses typos like 1e9
MIN_TOP_P = 1e-30  # float32's smallest normal is 1.2e-38: a smaller top_p is 0 once sent, and refused as 0 was
# A penalised token's logit is divided (or multiplied) by it: past this it is as good as banned, and near
# float32's limits a multiplied logit overflows to -inf, and a row of them to NaN.
MAX_REPETITION_PENALTY = 1e4
# Its mirror below 1: a logit divided by 1e-38 is infinite (an empty greedy answer; NaN probabilities sampled).
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY


def check_sampling_values(temperature: float, top_p: float, top_k: int, vocab_size: int | None = None) -> None:
    """Raise RequestError with the fix unless every value is usable as it is, and still is in float32, the type
    every route sends it as (top_p 1e-300 is 0 there)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be a finite number >= 0 (got {temperature}); use 0 for greedy")
    if 0 < temperature < MIN_TEMPERATURE:
        raise RequestError(f"temperature {temperature:g} is too small to sample with; send 0 for greedy, or at "
                           f"least {MIN_TEMPERATURE:g}")
    if temperature > MAX_TEMPERATURE:
        raise RequestError(f"temperature {temperature:g} is over {MAX_TEMPERATURE:g}; send a smaller one")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1] (got {top_p})")
    if top_p < MIN_TOP_P:
        raise RequestError(f"top_p {top_p:g} is under {MIN_TOP_P:g}, too small to send as a float32; send at least "
                           f"that (it keeps only the most likely token), or temperature 0 for greedy")
    check_top_k(top_k, vocab_size)


def check_top_k(top_k: int, vocab_size: int | None = None) -> None:
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0 (got {top_k}); use 0 to disable")
    if vocab_size is not None and top_k > vocab_size:
        raise RequestError(f"top_k {top_k} is over the vocabulary's {vocab_size} tokens; send at most that, or 0")


def check_num_draft_tokens(num_draft_tokens: int, max_draft_tokens: int) -> None:
    """A request may ask for fewer drafts per step than the engine was built for (`max_draft_tokens`, its k),
    never more: refused, not clamped. An unbounded one once sized a 10^9-entry histogram."""
    if num_draft_tokens > max_draft_tokens:
        raise RequestError(f"num_draft_tokens {num_draft_tokens} is more than the {max_draft_tokens} drafts this "
                           f"server's engine makes per step; send at most {max_draft_tokens}, or leave it out")

MAX_LOGPROBS = 20  # top-N log probs per token, as OpenAI's top_logprobs allows
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_penalty_values(repetition_penalty: float, presence_penalty: float, frequency_penalty: float) -> None:
    """Raise RequestError unless the penalties are usable: repetition > 0 (1 = off), presence and frequency in
    [-2, 2] (0 = off), OpenAI's and vLLM's ranges."""
    if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be a finite number > 0 (got {repetition_penalty}); use 1 for none")
    if repetition_penalty < MIN_REPETITION_PENALTY:
        raise RequestError(f"repetition_penalty {repetition_penalty:g} is under {MIN_REPETITION_PENALTY:g}; send a "
                           "larger one (1 for none)")
    if repetition_penalty > MAX_REPETITION_PENALTY:
        raise RequestError(f"repetition_penalty {repetition_penalty:g} is over {MAX_REPETITION_PENALTY:g}; send a "
                           "smaller one (1 for none)")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not math.isfinite(value) or not -2 <= value <= 2:
            raise RequestError(f"{name} must be in [-2, 2] (got {value}); use 0 for none")


def check_logprobs(logprobs: int | None) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the top-N alternatives per token; "
                           f"0 for the chosen token's only) (got {logprobs!r})")


def check_stop_strings(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"{len(stop)} stop strings; send at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty text (got {s!r})")
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"stop string {s[:20]!r}... is {len(s)} characters; send at most {MAX_STOP_CHARS}")


MAX_LOGIT_BIAS = 300  # entries of a logit bias (OpenAI's limit); a bias is -100..100 (OpenAI's range)


def check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int | None = None) -> None:
    """(token id, bias) pairs: at most MAX_LOGIT_BIAS, each id a token of the vocabulary, each bias finite in
    [-100, 100] (-100 bans the token, 100 all but forces it)."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries; send at most {MAX_LOGIT_BIAS}")
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                vocab_size is not None and token >= vocab_size):
            bound = f" [0, {vocab_size})" if vocab_size is not None else ""
            raise RequestError(f"logit_bias names token {token!r}, not a token id of the vocabulary{bound}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise RequestError(f"logit_bias for token {token} must be a number in [-100, 100] (got {value!r})")


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise RequestError(f"min_tokens must be an integer >= 0 (got {min_tokens!r})")
    if min_tokens > max_tokens:
        raise RequestError(f"min_tokens {min_tokens} is over max_tokens {max_tokens}; send at most max_tokens")
