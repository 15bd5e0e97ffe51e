"""Log probabilities of the chosen tokens, and the top-N alternatives, from the target's distribution.

"The distribution" is the one the token was drawn from: for a sampled request the probabilities after
penalties, temperature, top-k and top-p (so a token top-p dropped has -inf); for a greedy one the
softmax of the penalised logits. A verify row's logits are the same bits as plain decoding's at that
position, and each row is computed alone (never as a [T, V] batch, whose reduction could take another
path), so the numbers are identical with and without speculation. A token drawn from the residual
after a rejected draft is reported under p, the target's distribution, as it is distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.engine.sampling import SamplingParams, probs_from_logits


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # the chosen token's
    top: tuple[tuple[int, float], ...]  # the N most likely tokens and their log probs, most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[TokenLogprob]:
    """logits: [M, V] fp32 (penalised), row i the distribution tokens[i] came from."""
    n = params.logprobs or 0
    out = []
    for i, tok in enumerate(tokens):
        row = logits[i]
        if params.greedy:
            lp = torch.log_softmax(row, dim=-1)
        else:
            lp = probs_from_logits(row, params).log()
        top = ()
        if n:
            values, ids = lp.topk(n)
            top = tuple((int(t), _finite(float(v))) for t, v in zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprob(_finite(float(lp[tok])), top))
    return out


def _finite(x: float) -> float:
    # JSON has no -inf: a token top-k/top-p ruled out is reported as OpenAI's floor, -9999.0.
    return x if math.isfinite(x) else -9999.0
