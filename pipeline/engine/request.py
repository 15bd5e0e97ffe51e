"""A generation request and its lifecycle."""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.engine.block_manager import BlockTable
from pipeline.engine.sampling import SamplingParams, sample, sample_keyed
from pipeline.errors import RequestError
from pipeline.policy.draft_plan import AcceptanceEstimate


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was produced (it is not part of the output)
    LENGTH = "length"  # max_tokens, or the engine's max_seq_len
    CANCELLED = "cancelled"
    ERROR = "error"  # something tied to this request failed; `Request.error` says what


SPECULATION_MODES = ("auto", "on", "off")

_ids = itertools.count()


def fresh_seed() -> int:
    """An unseeded sampled request's generator seed: the OS's entropy (tests replace it to replay a run)."""
    return int.from_bytes(os.urandom(8), "little")


# Called with (request, new token ids) each time a request produces tokens, and with (request, [])
# when it finishes without producing more.
TokenCallback = Callable[["Request", list[int]], None]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    speculation: str = "auto"  # "on"/"off" override the engine's gate for this request
    on_tokens: TokenCallback | None = None
    num_draft_tokens: int | None = None  # k for this request, at most the engine's; None = the engine's
    # The requests that share a group (one client request's n choices) share the batch's slots with other groups
    # fairly (LLMEngine._admit); None: a group of its own.
    group: int | None = None
    decoded_at: int = 0  # the engine step it last decoded in (LLMEngine._fair_rows)
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    num_resumed: int = 0  # of output_ids, those a client already had when it resumed the request (add_request)
    ahead: bool = False  # queued ahead of new requests: resumed, or a retry of one a lost server held (add_request)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    slot: int | None = None  # its row in a draft model's or EAGLE-3 head's per-slot cache
    blocks: BlockTable = field(default_factory=BlockTable)  # its blocks in the target's KV cache
    # Tokens whose K/V are in the target cache. Once prefilled, the last token of all_ids is always pending (not
    # yet fed); the next forward feeds it.
    target_len: int = 0
    prefill_target: int = 0  # tokens to prefill before the first new token (the prompt; a preempted request's all)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    stop_ids: frozenset[int] = frozenset()  # stop tokens + the model's eos, set by the engine
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0  # target steps that verified at least one drafted token
    # Decode steps in which it drafted nothing, by reason (see policy/draft_plan.py).
    skip_reasons: dict[str, int] = field(default_factory=dict)
    # Verification steps by how many drafts they accepted ("0", "1", ...): vLLM's per-request histogram.
    accepted_per_step: dict[str, int] = field(default_factory=dict)
    # Its acceptance, one estimate per draft source: a proposer that drafts from two (NgramFirst: lookup where the
    # context matches, a head elsewhere) sets `source` each step, and the planner reads that source's estimate.
    estimates: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    source: str = ""
    # The engine's acceptance per draft source (a defaultdict of draft_plan.SharedAcceptance), each estimate's prior
    # for a greedy request; None: the fixed one
    shared_acceptance: dict | None = None
    proposer_failed: bool = False  # the proposer raised for it: it decodes on without drafts
    generator: torch.Generator | None = None
    error: str | None = None  # one line, set when finish_reason is ERROR
    # Per output token, when params.logprobs is set: its log prob and the top-N (pipeline/engine/logprobs.py); None
    # for a resumed answer's first num_resumed tokens, which this run didn't draw.
    logprobs: list = field(default_factory=list)
    # Per prompt token after the first, when params.prompt_logprobs is set: its TokenLogprob under the target, filled
    # as the prompt is prefilled (chunk by chunk); complete once len(prompt_logprobs) == len(prompt_ids) - 1.
    prompt_logprobs: list = field(default_factory=list)
    # With prompt_logprobs and logprobs: the stop token that ended the answer and its TokenLogprob (not an output id).
    stop_logprob: tuple | None = None
    stop_strings: object | None = None  # a StopStrings, set by the engine when params.stop is
    guide: object | None = None  # a Guide (guide.py), set by the engine when params.guide is
    # Set when a stop string ended the answer: characters of the output's text to keep, and the string.
    stop_text_len: int | None = None
    stop_reason: str | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise RequestError("the prompt is empty; give at least one token")
        if self.speculation not in SPECULATION_MODES:
            raise RequestError(f"speculation must be one of {', '.join(SPECULATION_MODES)} (got {self.speculation!r})")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise RequestError(f"num_draft_tokens must be >= 0 (got {self.num_draft_tokens})")
        if not self.params.greedy and self.params.seed is None:  # a seeded one draws keyed noise, no generator
            self.generator = torch.Generator().manual_seed(fresh_seed())

    @property
    def keyed(self) -> bool:
        """Whether its tokens are drawn by (seed, position) (sampling.sample_keyed): a sampled request with a seed."""
        return self.params.seed is not None and not self.params.greedy

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token at sequence position `position` from probs [V]: keyed by the seed where there is one (the same
        token however it was drafted, batched or resumed), else from the request's own generator."""
        if self.keyed:
            return sample_keyed(probs, self.params.seed, position)
        return sample(probs, self.generator)

    @property
    def acceptance(self) -> AcceptanceEstimate:
        """The estimate of this step's draft source."""
        est = self.estimates.get(self.source)
        if est is None:
            # A sampled request's drafts consume its random stream, so which steps draft must follow from its own
            # history alone (a seeded request then replays): the engine's shared prior is a greedy request's only.
            shared = self.shared_acceptance[self.source] \
                if self.shared_acceptance is not None and self.params.greedy else None
            est = self.estimates[self.source] = AcceptanceEstimate(shared=shared)
        return est

    @property
    def group_key(self) -> tuple:
        return ("group", self.group) if self.group is not None else ("request", self.id)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.status is RequestStatus.RUNNING and self.target_len < self.prefill_target

    @property
    def scoring(self) -> bool:
        """Its prompt's log probs are asked for and not all computed yet: its prompt is prefilled in full, alone, with
        logits at every position, and never from the prefix cache (whose positions have no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
