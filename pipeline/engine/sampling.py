"""Sampling parameters and the logits -> probabilities transform shared by target and draft.

Speculation is lossless only if the draft's q and the target's p are processed the same way
(temperature, then top-k, then top-p), so both go through `probs_from_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (got {self.top_k}); use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] fp32 -> probabilities [..., V] after temperature, top-k and top-p."""
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one token id."""
    return int(torch.multinomial(probs, 1, generator=generator))
