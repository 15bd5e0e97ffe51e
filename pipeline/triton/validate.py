"""Checks on one client request, shared by the models that read the ensemble's inputs (preprocessing, and the
LLM-API route's frontend). Pure: each takes the request's tensors through `get(name) -> array | None` and
raises RequestError with the one line the client sees.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.errors import RequestError
from pipeline.triton.interface import IGNORED_INPUTS, UNSUPPORTED_INPUTS

Get = Callable[[str], "np.ndarray | None"]
SPECULATION = ("auto", "on", "off")


def check_unsupported(get: Get) -> None:
    """Upstream ensemble inputs this pipeline doesn't implement: fine at their neutral value, refused otherwise."""
    for name, (neutral, message) in UNSUPPORTED_INPUTS.items():
        value = get(name)
        if value is None or not value.size:
            continue
        values = value.reshape(-1).tolist()
        if neutral is None:
            if any(v not in (b"", "") for v in values):
                raise RequestError(message)
        elif not all(v == neutral for v in values):
            raise RequestError(f"{name} {values[0]!r}: {message}")
    min_tokens = get("min_tokens")
    if min_tokens is not None and min_tokens.size and int(min_tokens.reshape(-1)[0]) > 1:
        raise RequestError(f"min_tokens {int(min_tokens.reshape(-1)[0])} isn't supported (an answer may end at its "
                           f"first token); send 0 or 1, or leave it out")
    for name in IGNORED_INPUTS:  # accepted, but still checked for sanity
        value = get(name)
        if value is not None and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise RequestError(f"{name} must be a finite number")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not (np.isfinite(temperature) and temperature >= 0) or not (np.isfinite(top_p) and 0 < top_p <= 1) \
            or top_k < 0:
        raise RequestError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0, all finite")


def check_speculation(speculation: str, num_draft_tokens: int) -> None:
    if speculation not in SPECULATION:
        raise RequestError(f"speculation must be auto, on or off (got {speculation!r})")
    if num_draft_tokens < 1:
        raise RequestError(f"num_draft_tokens must be >= 1 (got {num_draft_tokens}); send speculation=off instead")


def check_max_tokens(max_tokens: int, max_seq_len: int) -> None:
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1 (got {max_tokens})")
    if max_tokens >= max_seq_len:
        raise RequestError(f"max_tokens {max_tokens} is beyond the engine's max_seq_len {max_seq_len}")


def check_length(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    if prompt_tokens + max_tokens > max_seq_len:
        raise RequestError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) is over the engine's "
                           f"max_seq_len {max_seq_len}; shorten the prompt or lower max_tokens")
