"""Repetition, presence and frequency penalties: the target's logits adjusted by the sequence so far.

Order and formulas are vLLM's (and OpenAI's for presence/frequency), applied to the raw logits before
temperature, top-k and top-p:
  repetition (CTRL, Keskar et al. 2019): a token seen in the prompt or the output has its logit divided
    by p when positive, multiplied by p when negative;
  frequency: logit -= p x (times the token is in the output);
  presence:  logit -= p if the token is in the output at all.

A verify forward scores [pending, d1..dk]: row j predicts the token after d_j, so its output already
holds d1..d_j. Each row is penalised with exactly the sequence plain decoding would have had there, so
greedy speculation still equals greedy decoding, penalties included. Every op is elementwise on one row,
so a row's bits don't depend on how many rows the forward had.
"""

from __future__ import annotations

import torch

from pipeline.engine.sampling import SamplingParams


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
             drafts: list[int] = ()) -> torch.Tensor:
    """logits: [T, V] fp32, row j scored after output_ids + drafts[:j] -> penalised [T, V] (a new tensor)."""
    T, V = logits.shape
    out = logits.clone()
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=V).to(logits.dtype) \
        if output_ids else torch.zeros(V, dtype=logits.dtype)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
    for j in range(T):
        if j:
            d = drafts[j - 1]
            counts[d] += 1
            seen[d] = True
        row = out[j]
        if params.repetition_penalty != 1.0:
            was_seen = seen | (counts > 0)
            p = params.repetition_penalty
            row.copy_(torch.where(was_seen, torch.where(row > 0, row / p, row * p), row))
        if params.frequency_penalty != 0.0:
            row.sub_(counts * params.frequency_penalty)
        if params.presence_penalty != 0.0:
            row.sub_((counts > 0).to(row.dtype) * params.presence_penalty)
    return out
