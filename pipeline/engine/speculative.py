"""Speculative decoding as plain functions: a proposal, and its verification against the target.

propose (a Proposer) -> verify (one target forward over [pending, d1..dk] per row) -> accept (here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.request import Request
from pipeline.engine.sampling import probs_from_logits, sample


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row: the drafted tokens d1..dk_i (k_i may be 0)
    # Draft distributions q, [B, K, V], for rows that sample. None, or a row's entry unused, means the
    # proposer is deterministic (n-gram): q is one-hot on the drafted token.
    probs: torch.Tensor | None = None
    stochastic_rows: frozenset[int] = frozenset()  # rows whose tokens were sampled from probs


def accept_greedy(argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """argmax: the target's argmax at [pending, d1..dk]. Returns (accepted count m, next token).

    Greedy: keep drafts while each equals the target's argmax; the token after the last kept one is
    the target's own argmax there, so the output is exactly target-only greedy decoding.
    """
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return m, argmax[m]


def accept_keyed(logits: torch.Tensor, drafts: list[int], req: Request) -> tuple[int, int]:
    """logits: [T, V]; a seeded request's verify (sampling.sample_keyed): the target's own token at each position,
    drawn with that position's noise, and drafts kept while each equals it, as greedy keeps argmax matches. Every
    token emitted is the one plain decoding would draw there, so the output follows p exactly and does not depend
    on the drafts. The draft drew with the same noise, which is what makes it likely to match."""
    base = req.num_tokens  # the sequence position of the token after the pending one
    for j, d in enumerate(drafts):
        token = req.draw(probs_from_logits(logits[j], req.params), base + j)
        if token != d:
            return j, token
    return len(drafts), req.draw(probs_from_logits(logits[len(drafts)], req.params), base + len(drafts))


def accept_sampled(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, req: Request) -> tuple[int, int]:
    """logits: [T, V]; q: [K, V] draft probabilities, or None for a deterministic (one-hot) proposer.

    Rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
      accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
      at the first rejection, sample from the residual norm(max(p_j - q_j, 0)) and stop;
      if all k are accepted, sample a bonus token from p_{k+1}. Every token is then distributed as p.
    """
    k = len(drafts)
    p = probs_from_logits(logits[: k + 1], req.params)  # [k+1, V]
    u = torch.rand(k, generator=req.generator).tolist() if k else []
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        p_d = float(p[j, d])
        if u[j] * q_d < p_d:  # u < p/q without dividing by a tiny q
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: a rejection here has probability ~0; fall back to p
            residual, total = p[j], 1.0
        return j, sample(residual / total, req.generator)
    return k, sample(p[k], req.generator)
