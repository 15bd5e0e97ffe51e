"""Proposers: where draft tokens come from. They share one small interface.

- NgramProposer: prompt lookup. Free to run; pays on outputs that copy from the context.
- DraftModelProposer: a smaller model with the same tokenizer, with its own KV cache that it keeps
  in sync with the target's accepted tokens (and catches up after speculation was off).
- NgramFirst: n-gram lookup where the context has a match, another proposer (an EAGLE-3 head) elsewhere.
- Eagle3Proposer (pipeline/engine/eagle3.py): an EAGLE-3 head that reads the target's hidden states.
  It sets `capture_layers`, and the engine then hands it the target's states of every token the target
  settles through `on_target_hidden(req, states)`. Proposers without `capture_layers` get neither, so
  their target forward is unchanged.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipeline.engine.cuda_graphs import GraphedForward
from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.model import Transformer
from pipeline.engine.request import Request
from pipeline.engine.sampling import probs_from_logits
from pipeline.engine.speculative import Proposal


class Proposer(Protocol):
    name: str

    def propose(self, reqs: list[Request], ks: list[int]) -> Proposal:
        """Draft up to ks[i] tokens after reqs[i].all_ids. Every ks[i] >= 1."""

    def on_verified(self, req: Request, prev_len: int, drafted: int, accepted: int) -> None:
        """The target kept `accepted` of `drafted` tokens after a sequence of length prev_len."""

    def release(self, req: Request) -> None:
        """The request left the batch."""


class NgramProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens
    (longest n first) and propose the tokens that followed it."""

    name = "ngram"
    LOOKUP_MAX = 64  # tokens a lookup keeps (more than any k): one scan serves the planner and the proposal

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._found: dict[int, tuple[int, list[int]]] = {}  # request id -> (its length, its lookup's tokens)

    def lookup(self, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            suffix = ids[n_ids - n:]
            # Scan right to left: the most recent match best predicts what comes next.
            for start in range(n_ids - n - 1, -1, -1):
                if ids[start:start + n] == suffix:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def lookup_of(self, req: Request) -> list[int]:
        """The row's lookup at its current length, scanned once a step for the planner (row_hits, NgramFirst's
        row_sources) and then propose (which match a lookup finds doesn't depend on how many tokens it keeps)."""
        found = self._found.get(req.id)
        if found is None or found[0] != req.num_tokens:
            found = self._found[req.id] = (req.num_tokens, self.lookup(req.all_ids, self.LOOKUP_MAX))
        return found[1]

    def row_hits(self, reqs: list[Request]) -> list[bool | None]:
        """Whether each row's lookup has drafts this step, known before the planner picks its k: a lookup costs
        nothing to ask, so the planner needn't guess from the row's past (an answer's first tokens match nothing,
        and a guess learned from them kept a batch from drafting once the answer began to repeat)."""
        return [bool(self.lookup_of(r)) for r in reqs]

    def propose(self, reqs: list[Request], ks: list[int]) -> Proposal:
        return Proposal(tokens=[self.lookup_of(r)[:k] for r, k in zip(reqs, ks)])

    def on_verified(self, req, prev_len, drafted, accepted):
        pass

    def release(self, req):
        self._found.pop(req.id, None)


class NgramFirst:
    """A row drafts by n-gram lookup where its context has a match of at least MIN_MATCH tokens, and by the inner
    proposer (an EAGLE-3 head) where it has none: per row and per step, so an answer that copies (code, quoted
    text) drafts for free and the rest drafts with the head. Everything else is the inner proposer's: the states
    the target hands it, its rollback and its graphs. A row it skips simply catches up at its next proposal, as
    after a step with speculation off.

    On four held-out code prompts with SmolLM2 (scripts/bench_eagle3.py, a 10-minute head), n-gram alone ran 1.39x
    plain, the head alone 1.19x, and the head behind lookup 1.48x."""

    MIN_MATCH = 2  # a 1-token match is mostly chance: the head drafts better there
    LOOKUP = "ngram"
    FREE_SOURCES = frozenset({LOOKUP})  # lookup costs the planner nothing but the verify's width

    def __init__(self, inner: Proposer):
        self.inner = inner
        self.ngram = NgramProposer(min_ngram=self.MIN_MATCH)
        self.name = f"{inner.name}+ngram"
        self.sources = {self.LOOKUP: 0, inner.name: 0}  # rows drafted by each, for describe() and the benchmarks

    # The inner proposer's: the target states it reads, its head, its graphs.
    @property
    def capture_layers(self) -> tuple[int, ...]:
        return getattr(self.inner, "capture_layers", ())

    @property
    def head(self):
        return self.inner.head

    @property
    def graphed(self):
        return self.inner.graphed

    @graphed.setter
    def graphed(self, value) -> None:
        self.inner.graphed = value

    def capture_graphs(self, max_batch: int, max_width: int, replay: bool) -> None:
        self.inner.capture_graphs(max_batch, max_width, replay)

    def on_target_hidden(self, req: Request, aux: torch.Tensor) -> None:
        self.inner.on_target_hidden(req, aux)

    def row_hits(self, reqs: list[Request]) -> list[bool | None]:
        """A lookup row has drafts this step; a head row's chance is the planner's estimate (None)."""
        return [True if self.ngram.lookup_of(r) else None for r in reqs]

    def row_sources(self, reqs: list[Request]) -> list[str]:
        """Where each row's drafts come from this step, before the planner picks its k: the planner keeps an
        acceptance estimate per source (lookup rows in code accept far longer runs than the head's) and charges
        lookup rows no proposal time."""
        return [self.LOOKUP if self.ngram.lookup_of(r) else self.inner.name for r in reqs]

    def propose(self, reqs: list[Request], ks: list[int]) -> Proposal:
        tokens = [self.ngram.lookup_of(r)[:k] for r, k in zip(reqs, ks)]
        rest = [i for i, t in enumerate(tokens) if not t]
        self.sources[self.LOOKUP] += len(reqs) - len(rest)
        self.sources[self.inner.name] += len(rest)
        if not rest:
            return Proposal(tokens=tokens)
        sub = self.inner.propose([reqs[i] for i in rest], [ks[i] for i in rest])
        for i, t in zip(rest, sub.tokens):
            tokens[i] = t
        if sub.probs is None:
            return Proposal(tokens=tokens)
        # n-gram rows are deterministic (one-hot q): only the inner proposer's sampled rows carry probs.
        probs = sub.probs.new_zeros(len(reqs), *sub.probs.shape[1:])
        probs[rest] = sub.probs
        return Proposal(tokens=tokens, probs=probs, stochastic_rows=frozenset(rest[j] for j in sub.stochastic_rows))

    def on_verified(self, req, prev_len, drafted, accepted):
        self.inner.on_verified(req, prev_len, drafted, accepted)

    def release(self, req):
        self.ngram.release(req)
        self.inner.release(req)


DraftStep = tuple[list[int], ForwardBatch, torch.Tensor, torch.Tensor]


def draft_plan(reqs: list[Request], ks: list[int], pos: list[int], feeds: list[list[int]], cache,
               dev) -> list[DraftStep]:
    """Every greedy draft step laid out before the first runs (positions follow from the lengths alone): per step,
    (its rows, their batch, each row's last position, the rows whose draft feeds the next step). The first step
    feeds each row's catch-up, the rest one token a row. pos advances, in place, past everything fed."""
    rows, plan = list(range(len(reqs))), []
    for j in range(max(ks)):
        lengths = [len(feeds[i]) if j == 0 else 1 for i in rows]
        fb = ForwardBatch.build([reqs[i].slot for i in rows], [pos[i] for i in rows], lengths, cache, dev)
        last = torch.tensor(lengths, device=dev)[:, None] - 1
        going_on = [n for n, i in enumerate(rows) if ks[i] > j + 1]  # the rows whose draft feeds the next step
        plan.append((rows, fb, last, torch.tensor(going_on, dtype=torch.long, device=dev)))
        for n, i in enumerate(rows):
            pos[i] += lengths[n]
        rows = [rows[n] for n in going_on]
        if not rows:
            break
    return plan


def padded_ids(feeds: list[list[int]], dev) -> torch.Tensor:
    T = max(len(f) for f in feeds)
    return torch.tensor([f + [0] * (T - len(f)) for f in feeds], device=dev)


def drafts_of(plan: list[DraftStep], picked: list[int], n: int) -> list[list[int]]:
    """Each of the n rows' drafts, from the steps' picks in the order the plan ran them."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    at = 0
    for rows, *_ in plan:
        for i in rows:
            tokens[i].append(picked[at])
            at += 1
    return tokens


class GuidedDrafts:
    """The grammars of a proposal's guided rows while they draft: each step's logits masked by the state after
    that row's drafts so far; every pushed draft popped when the proposal ends (the verify decides what stays)."""

    def __init__(self, reqs: list[Request]):
        self.pushed = {id(r): 0 for r in reqs if r.guide is not None}
        self.lost: set[int] = set()  # rows whose grammar refused a draft: unguided for the rest of the proposal
        self.reqs = [r for r in reqs if r.guide is not None]

    def mask(self, rows: list[Request], logits: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """logits [b, W] of `rows`, each guided row's masked at its grammar's state; index: the
        drafter's ids' target ids, where its vocabulary is its own (an EAGLE-3 head's). A new tensor: the
        forward's may be an inference tensor, or a graph's static output."""
        logits = logits.clone()
        for n, r in enumerate(rows):
            if id(r) in self.pushed and id(r) not in self.lost:
                refused = r.guide.draft_refusals(logits.shape[-1], index)
                if refused is not None:
                    logits[n].masked_fill_(refused, float("-inf"))
        return logits

    def push(self, r: Request, token: int) -> None:
        if id(r) in self.pushed and id(r) not in self.lost:
            if r.guide.push(token, r.stop_ids):
                self.pushed[id(r)] += 1
            else:
                self.lost.add(id(r))

    def pop_all(self) -> None:
        for r in self.reqs:
            r.guide.pop(self.pushed[id(r)])


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: Transformer, num_slots: int, max_seq_len: int):
        self.model = model
        self.cache = model.new_cache(num_slots, max_seq_len)
        self.cached: dict[int, int] = {}  # request id -> tokens of its sequence with K/V in the draft cache
        self.graphed: GraphedForward | None = None  # set by capture_graphs where the engine's steps replay graphs

    def capture_graphs(self, max_batch: int, max_width: int, replay: bool) -> None:
        """The draft's catch-up (up to max_width tokens) and draft steps from CUDA graphs."""
        self.graphed = GraphedForward(self.model, self.cache, max_batch, max_width, replay=replay)
        self.graphed.capture()

    def propose(self, reqs: list[Request], ks: list[int]) -> Proposal:
        stochastic = frozenset(i for i, r in enumerate(reqs) if not r.params.greedy)
        if not stochastic and all(r.guide is None for r in reqs):
            return Proposal(tokens=self._greedy_drafts(reqs, ks))
        # A guided row drafts under its grammar (guide.py): each step masked by the state after its drafts so far.
        guides = GuidedDrafts(reqs)
        try:
            return self._stepwise(reqs, ks, stochastic, guides)
        finally:
            guides.pop_all()

    def _stepwise(self, reqs: list[Request], ks: list[int], stochastic: frozenset[int],
                  guides: "GuidedDrafts") -> Proposal:
        """Drafts one step at a time through the host: sampled rows (their generators live there) and guided
        rows (their grammars do)."""
        B, K = len(reqs), max(ks)
        V = self.model.cfg.vocab_size
        seqs = [r.all_ids for r in reqs]
        probs = torch.zeros(B, K, V) if stochastic else None
        tokens: list[list[int]] = [[] for _ in reqs]
        # First forward: catch up on every token the draft hasn't seen (a whole prompt for a new
        # request, or all tokens decoded while speculation was off), ending with the pending one.
        starts = [self.cached.get(r.id, 0) for r in reqs]
        feeds = [s[c:] for s, c in zip(seqs, starts)]
        rows = list(range(B))
        dev = self.model.embed.weight.device
        for j in range(K):
            lengths = [len(feeds[i]) for i in rows]
            T = max(lengths)
            ids = torch.tensor([feeds[i] + [0] * (T - len(feeds[i])) for i in rows], device=dev)
            fb = ForwardBatch.build([reqs[i].slot for i in rows], [starts[i] for i in rows], lengths, self.cache, dev)
            last = torch.tensor(lengths, device=dev)[:, None] - 1
            # Sampling happens on the CPU, with each request's own CPU generator.
            logits = guides.mask([reqs[i] for i in rows], self._last_logits(ids, fb, last).cpu())  # [b, V]
            greedy_next = logits.argmax(-1).tolist()
            for n, i in enumerate(rows):
                self.cached[reqs[i].id] = starts[i] + lengths[n]
                if i in stochastic:
                    q = probs_from_logits(logits[n], reqs[i].params)
                    probs[i, j] = q
                    tokens[i].append(reqs[i].draw(q, reqs[i].num_tokens + j))  # position j past the pending token
                else:
                    tokens[i].append(greedy_next[n])
                guides.push(reqs[i], tokens[i][-1])
                starts[i] += lengths[n]
                feeds[i] = tokens[i][-1:]
            rows = [i for i in rows if ks[i] > j + 1]
            if not rows:
                break
        return Proposal(tokens=tokens, probs=probs, stochastic_rows=stochastic)

    def _last_logits(self, ids: torch.Tensor, fb: ForwardBatch, last: torch.Tensor) -> torch.Tensor:
        """[b, V]: each row's logits at its position `last` ([b, 1])."""
        graphed = self.graphed(ids, fb) if self.graphed is not None else None
        if graphed is not None:  # every position's logits, then the last: the same bits (rows are their own)
            return graphed[0][torch.arange(ids.shape[0], device=ids.device), last[:, 0]]
        return self.model(ids, fb, self.cache, logits_index=last)[:, 0]

    def _greedy_drafts(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Drafts for greedy rows only. Every step's positions follow from the lengths alone, and each step feeds the
        previous one's argmax, which stays on the device: so every step's inputs are laid out before the first
        runs, the forwards queue back to back, and the drafts reach the host in one copy at the end. (A copy of a
        step's logits to the host each step made a GPU wait for the host k times.)"""
        dev = self.model.embed.weight.device
        pos = [self.cached.get(r.id, 0) for r in reqs]
        feeds = [r.all_ids[p:] for r, p in zip(reqs, pos)]  # catch up: the whole prompt, or what was decoded since
        plan = draft_plan(reqs, ks, pos, feeds, self.cache, dev)
        ids, picks = padded_ids(feeds, dev), []
        for _, fb, last, going_on in plan:
            nxt = self._last_logits(ids, fb, last).argmax(-1)  # [b]
            picks.append(nxt)
            ids = nxt[going_on][:, None]
        for r, p in zip(reqs, pos):
            self.cached[r.id] = p
        return drafts_of(plan, torch.cat(picks).tolist(), len(reqs))  # the one wait for the device

    def on_verified(self, req, prev_len, drafted, accepted):
        # The draft was fed the sequence through its pending token (prev_len tokens) and then
        # d1..d_{k-1}; of those, only the accepted drafts are still part of the sequence.
        self.cached[req.id] = min(self.cached.get(req.id, 0), prev_len + min(accepted, max(drafted - 1, 0)))

    def release(self, req):
        self.cached.pop(req.id, None)
