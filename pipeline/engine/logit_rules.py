"""What a request asks of the target's logits before a token is chosen, row by row, in vLLM's order: penalties
(penalties.py), then the logit bias, then min_tokens. A guide's mask (guide.py) comes after all three.

A verify forward scores [pending, d1..dk]: row j comes after the output so far plus d1..d_j, so each rule sees the
sequence plain decoding would have had there (the penalties count the drafts; min_tokens counts them too). Greedy
speculation then still equals greedy decoding with the same rules, and each op is elementwise on its row.
"""

from __future__ import annotations

import torch

from pipeline.engine.penalties import penalize
from pipeline.engine.sampling import SamplingParams


def adjust(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
           stop_ids: frozenset[int], drafts: list[int] = ()) -> torch.Tensor:
    """logits [T, V] fp32 (row j after output_ids + drafts[:j]) -> a new [T, V] with the request's rules."""
    out = penalize(logits, params, prompt_ids, output_ids, drafts) if params.penalized else logits.clone()
    V = out.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        keep = ids < V  # checked against the vocabulary at add_request; a draft model's may be narrower
        out[:, ids[keep]] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype)[keep]
    if params.min_tokens:
        stops = torch.tensor(sorted(t for t in stop_ids if t < V), dtype=torch.long)
        for j in range(out.shape[0]):
            if len(output_ids) + j < params.min_tokens:  # row j chooses output token number len + j
                out[j, stops] = float("-inf")
    return out
