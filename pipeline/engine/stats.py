"""Engine counters, exposed by the engine and in the CLI's JSON."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0  # engine iterations that ran a target forward
    spec_steps: int = 0  # iterations where at least one row verified drafts
    nonspec_steps: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens the target computed (prefix-cache hits aren't)
    preemptions: int = 0  # requests that gave their KV blocks back to wait and resume (the pool ran short)
    rows_held_back: int = 0  # (row, step) pairs a group over its share of a shared batch sat out (_fair_rows)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verified_rows: int = 0  # (row, target forward) pairs that verified at least one draft
    generated_tokens: int = 0
    failed_requests: int = 0  # requests ended by an error tied to them (the others carried on)
    proposer_failures: int = 0  # proposals that raised; their rows went on without speculation
    step_time_s: float = 0.0  # time inside step(): prefill and decode, not model loading
    # What drafting costs beside the target: the proposer's calls (its drafted tokens), and the decode steps'
    # target verification (the forward and the acceptance), split by whether the step verified drafts.
    proposer_time_s: float = 0.0
    proposals: int = 0
    proposed_tokens: int = 0
    plain_verify_s: float = 0.0
    plain_verifies: int = 0
    spec_verify_s: float = 0.0
    spec_verifies: int = 0
    # Row-steps that drafted nothing, by reason (policy/draft_plan.py), summed over requests.
    skip_reasons: dict[str, int] = field(default_factory=dict)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record_verification(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verified_rows += 1
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per target forward for a speculating row: accepted drafts + the one the target adds."""
        return (self.accepted_tokens + self.verified_rows) / self.verified_rows if self.verified_rows else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft j accepted | drafted), for j = 1..k."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def draft_cost(self) -> dict | None:
        """The proposer's time beside the target's, None before anything was drafted: a proposal, and each drafted
        token, in ms and against a plain decode step (the target alone, where the run had any) and a verify step
        (the target over the pending token and the drafts). Decode steps only: prefill is left out."""
        if not self.proposals:
            return None

        def ms(seconds: float, n: int) -> float | None:
            return round(1e3 * seconds / n, 3) if n else None

        proposal, plain, verify = (ms(self.proposer_time_s, self.proposals), ms(self.plain_verify_s, self.plain_verifies),
                                   ms(self.spec_verify_s, self.spec_verifies))
        return {"proposal_ms": proposal, "per_drafted_token_ms": ms(self.proposer_time_s, self.proposed_tokens),
                "plain_step_ms": plain, "verify_step_ms": verify,
                "proposal_vs_plain_step": round(proposal / plain, 4) if plain else None,
                "proposal_vs_verify_step": round(proposal / verify, 4) if verify else None}

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.step_time_s if self.step_time_s else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "verified_rows": self.verified_rows,
            "spec_steps": self.spec_steps,
            "nonspec_steps": self.nonspec_steps,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "skip_reasons": dict(sorted(self.skip_reasons.items())),
            "failed_requests": self.failed_requests,
            "proposer_failures": self.proposer_failures,
            "draft_cost": self.draft_cost(),
        }


def cost_line(cost: dict) -> str:
    """One line for EngineStats.draft_cost: what a proposal costs against the target's steps."""
    def vs(key: str, what: str) -> str:
        return f", {cost[key]:.2f} of a {what} step ({cost[what + '_step_ms']:.1f} ms)" if cost[key] else ""

    return (f"a proposal {cost['proposal_ms']:.1f} ms ({cost['per_drafted_token_ms']:.1f} ms a drafted token)"
            + vs("proposal_vs_plain_step", "plain") + vs("proposal_vs_verify_step", "verify"))


def drafted_by(sources: dict[str, int]) -> str:
    """describe()["draft"]["ngram_first"], the rows each source drafted behind n-gram lookup: "ngram 12 / eagle3 30"."""
    return " / ".join(f"{name} {n}" for name, n in sources.items())
