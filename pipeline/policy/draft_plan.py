"""Per-request draft lengths: each step, how many tokens each running request drafts (0 = none), chosen
to maximise the batch's expected tokens per second under the measured cost model.

The model (SmartSpec, Liu et al. 2024, uses the same goodput idea for one shared k):
- a row that drafts k tokens emits E(a, c, k) = 1 + a + a c + ... + a c^(k-1) tokens in expectation (drafts are
  checked in order and the first rejection ends the row's run), where a is the chance its first draft is accepted
  and c the chance each later one is, given the one before. Drafts run together: where the text is predictable
  the whole run passes. A 60-minute EAGLE-3 head on SmolLM2, drafting 4 every step on code, passed its first draft
  58% of the time and each later one 64-70%; a 10-minute head 49%, then 60, 57, 45%. c = a is the geometric model
  this planner used before (and falls back to until later drafts have been checked); on those heads the two chose
  within noise of each other (1.40x against 1.35x, 1.31x against 1.33x, 1.57x against 1.56x). When its proposer
  finds drafts only with probability h (an n-gram lookup without a match proposes nothing, yet the row
  still pays the step's width), that is 1 + h * (E(a, c, k) - 1);
- the step costs one target forward over B rows padded to the widest row, W = max k + 1, plus one
  proposal of W - 1 tokens for the rows that draft: cost.step_s(B, W) + cost.draft_s(n, W - 1), where n leaves
  out free rows (an n-gram lookup's, under NgramFirst), which only widen the verify.
For each width the best rows to draft are the free ones and those with the most to gain, so the search is over
the width and a prefix of the rows sorted by (free, gain): K * B candidates, each O(1) with prefix sums.

Every row that doesn't draft gets a reason, so users see why (`skip_reasons` in the stats):
- override: the request asked for speculation "off";
- short: it asked for fewer new tokens than the gate's min_tokens;
- load: more rows decode than the operator's ceiling (the gate's max_batch_size, with hysteresis);
- end: no room left to draft (its last token, or max_seq_len);
- acceptance: its own drafts don't pay at this step's width, while others' do, or even alone;
- cost: its drafts would pay alone, but not in a batch this large;
and three the engine adds after the plan: empty (the proposer had nothing, as an n-gram lookup without a
match), proposer_failed (the proposer raised for it once; it decodes on without drafts) and memory (the KV
cache had no blocks free for its drafts this step).
A row skipped for acceptance is probed with a short draft every `probe_every` steps, so a request whose
text turns predictable can win its drafts back. A greedy request's estimate starts from the engine's own recent
acceptance for that draft source (SharedAcceptance), not a fixed prior; while that has little evidence, a greedy
row skipped for cost is probed now and then (LLMEngine._plan), so that a batch too large for the fixed prior's
drafts to pay still learns whether its drafts do. Other requests' history changes which steps draft, never a token.

Pure: no torch, no engine; the engine and the unit tests call it the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.policy.cost_model import CostModel

OVERRIDE, SHORT, LOAD, END, ACCEPTANCE, COST = "override", "short", "load", "end", "acceptance", "cost"
EMPTY, PROPOSER_FAILED, MEMORY = "empty", "proposer_failed", "memory"
SKIP_REASONS = (OVERRIDE, SHORT, LOAD, END, ACCEPTANCE, COST, EMPTY, PROPOSER_FAILED, MEMORY)
PROBE_K = 2  # drafts in a probe: enough to see acceptance, little to pay when it fails


@dataclass(frozen=True)
class Row:
    """One running request, as the planner sees it this step."""

    cap: int  # drafts it may take this step (its own k limit, room left in max_tokens and max_seq_len)
    acceptance: float  # its estimated chance the first draft is accepted, in [0, 1]
    continuation: float | None = None  # and each later draft, given the one before (None: the same as the first)
    hit: float = 1.0  # the chance the proposer has drafts for it at all (an n-gram lookup often has none)
    mode: str = "auto"  # "auto", or the client's "on"/"off" override
    short: bool = False  # asked for fewer new tokens than the gate's min_tokens
    probe: bool = False  # skipped for acceptance long enough: draft a little to measure again
    free: bool = False  # its drafts cost no proposal time (an n-gram lookup's): only the wider verify


@dataclass(frozen=True)
class Plan:
    ks: tuple[int, ...]  # drafts per row
    reasons: tuple[str | None, ...]  # why a row drafts nothing (None where it drafts)
    expected_tokens_per_s: float


def expected_tokens(acceptance: float, k: int, continuation: float | None = None) -> float:
    """1 + a + a c + ... + a c^(k-1): the tokens a row emits from k drafts, the target's own one included, with
    a = acceptance the first draft's chance and c = continuation each later one's (default a: 1 + a + ... + a^k)."""
    a = min(max(acceptance, 0.0), 1.0)
    c = a if continuation is None else min(max(continuation, 0.0), 1.0)
    if k <= 0:
        return 1.0
    return 1.0 + a * (float(k) if c >= 1.0 else (1.0 - c ** k) / (1.0 - c))


def plan_drafts(rows: list[Row], cost: CostModel, load_open: bool = True) -> Plan:
    """Choose each row's k (see the module docstring). load_open: the operator's ceiling lets auto
    requests draft this step."""
    B = len(rows)
    K = cost.max_drafts
    reasons: list[str | None] = [None] * B
    forced: dict[int, int] = {}  # row -> k it drafts whatever the cost says
    candidates: list[int] = []
    for i, r in enumerate(rows):
        cap = min(r.cap, K)
        auto = r.mode == "auto"
        # The request's own settings first, then the batch's load, then the room left.
        if r.mode == "off":
            reasons[i] = OVERRIDE
        elif auto and r.short:
            reasons[i] = SHORT
        elif auto and not load_open:
            reasons[i] = LOAD
        elif cap <= 0:
            reasons[i] = END
        elif not auto:
            forced[i] = cap
        elif r.probe:
            forced[i] = min(cap, PROBE_K)
        else:
            candidates.append(i)
    if not B:
        return Plan((), (), 0.0)

    forced_tokens = sum(_row_tokens(rows[i], k) for i, k in forced.items())
    base_tokens = (B - len(forced)) + forced_tokens
    min_width = max(forced.values(), default=0)
    forced_paid = sum(not rows[i].free for i in forced)
    best = (base_tokens / _step_time(cost, B, min_width, len(forced), forced_paid), min_width, 0, [])
    for width in range(max(min_width, 1), K + 1):
        # Free rows first (at a fixed width they only add tokens), then the rest by gain: the best set of each size
        # is then a prefix.
        gains = sorted(((rows[i].free, g, i) for i in candidates
                        if (g := _row_tokens(rows[i], min(width, rows[i].cap)) - 1.0) > 0.0), reverse=True)
        tokens, paid = base_tokens, forced_paid
        for n, (_, gain, i) in enumerate(gains, start=1):
            tokens += gain
            paid += not rows[i].free
            rate = tokens / _step_time(cost, B, width, len(forced) + n, paid)
            if rate > best[0] * (1.0 + 1e-9):  # ties go to fewer drafts
                best = (rate, width, n, [i for *_, i in gains[:n]])
    rate, width, _, chosen = best

    ks = [0] * B
    for i, k in forced.items():
        ks[i] = k
    for i in chosen:
        ks[i] = min(width, rows[i].cap)
    for i in candidates:
        if not ks[i]:
            reasons[i] = ACCEPTANCE if chosen or not _pays_alone(rows[i], cost) else COST
    return Plan(tuple(ks), tuple(reasons), rate)


def _row_tokens(row: Row, k: int) -> float:
    """Expected tokens from a row drafting k: its proposer's hit rate times what drafts add, plus one."""
    return 1.0 + min(max(row.hit, 0.0), 1.0) * (expected_tokens(row.acceptance, k, row.continuation) - 1.0)


def _step_time(cost: CostModel, rows: int, width: int, drafting: int, paid: int) -> float:
    """A step of `rows` rows, `drafting` of them drafting up to `width` tokens, `paid` of those at a proposal's cost
    (the rest are free: lookup rows)."""
    if width <= 0 or drafting <= 0:
        return cost.step_s(rows, 1)
    return cost.step_s(rows, width + 1) + cost.draft_s(paid, width)


def _pays_alone(row: Row, cost: CostModel) -> bool:
    """Whether this row, alone in the batch, would be faster drafting at some k."""
    plain = 1.0 / cost.step_s(1, 1)
    return any(_row_tokens(row, k) / _step_time(cost, 1, k, 1, int(not row.free)) > plain
               for k in range(1, min(row.cap, cost.max_drafts) + 1))


def speculation_summary(draft_steps: int, skipped: dict[str, int]) -> str:
    """'drafted in 12 of 40 steps; not in 28: acceptance 20, end 1, short 7': why speculation did or didn't run."""
    total = draft_steps + sum(skipped.values())
    line = f"drafted in {draft_steps} of {total} steps"
    if skipped:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
        line += f"; not in {sum(skipped.values())}: {reasons}"
    return line


def add_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Reason -> steps, summed over responses or requests, sorted by reason."""
    total: dict[str, int] = {}
    for c in counts:
        for reason, n in c.items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items()))


def read_counts(text) -> dict[str, int]:
    """A served response's skipped_steps (JSON text or bytes: reason -> steps) as a dict of positive counts;
    {} for a missing or malformed value, so a client of an older server still works."""
    try:
        counts = json.loads(text) if text else {}
        return {str(k): int(v) for k, v in counts.items() if int(v) > 0}
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
        return {}


# ---- a request's acceptance -----------------------------------------------------------------------

PRIOR_ACCEPTANCE = 0.6  # an engine's assumed acceptance before any draft was checked: high enough to try drafting
PRIOR_TRIALS = 2.0  # the prior weighs as much as this many draft checks
DECAY = 0.9  # per verify step: older evidence fades, so an estimate follows the text it drafts for
PROBE_EVERY = 16  # steps skipped for acceptance before a probe
SHARED_DECAY = 0.98  # per verified row, for the engine's own acceptance (SharedAcceptance): it follows the workload
EXPLORE_CHECKS = 4.0  # the engine's evidence below which a row skipped for cost is probed (SharedAcceptance.thin)
EXPLORE_EVERY = 4  # steps between those probes: a handful of steps, then a few verify checks tell


@dataclass
class SharedAcceptance:
    """What one draft source's first drafts have achieved lately in this engine, over the greedy requests that let
    the engine choose (speculation "auto"): the prior each greedy request's own estimate starts from, in place of the
    fixed PRIOR_ACCEPTANCE (a sampled request keeps the fixed one: its drafts consume its random stream, so which
    steps draft must follow from its own history for a seeded request to replay). A new request then drafts at once
    where the workload's drafts pass (a loop, code being edited) and not where they don't, and a batch too large for
    the fixed prior's drafts to pay still speculates once the engine has seen that they do. It changes which steps
    draft, never a token (the verify decides those)."""

    accepted: float = 0.0
    checks: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.accepted = self.accepted * SHARED_DECAY + (accepted > 0)
            self.checks = self.checks * SHARED_DECAY + 1.0

    @property
    def first(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (self.checks + PRIOR_TRIALS)

    @property
    def thin(self) -> bool:
        """Too little evidence to trust: a row skipped for cost is probed now and then (LLMEngine._plan), since
        without drafts nobody would ever learn the prior is too low for this batch."""
        return self.checks < EXPLORE_CHECKS


@dataclass
class AcceptanceEstimate:
    """A request's acceptance: accepted drafts over draft checks (each accepted draft is one check, and a rejection
    ends the run with one more), with older steps decayed, starting from a prior; kept for a step's first draft and
    for its later ones apart (`first`, `continuation`: Row's two rates)."""

    prior: float = PRIOR_ACCEPTANCE  # used where there is no `shared` estimate
    shared: SharedAcceptance | None = None  # the engine's for this draft source: the prior, as it stands now
    first_accepted: float = 0.0
    first_checks: float = 0.0
    later_accepted: float = 0.0
    later_checks: float = 0.0
    skipped: int = 0  # consecutive steps skipped for acceptance; reset when the request drafts
    asked: float = 0.0  # steps it was to draft, decayed, and those the proposer had drafts for
    found: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        rejected = accepted < drafted
        self.first_accepted = self.first_accepted * DECAY + (accepted > 0)
        self.first_checks = self.first_checks * DECAY + 1.0
        # Later drafts were checked only past an accepted first one.
        self.later_accepted = self.later_accepted * DECAY + max(accepted - 1, 0)
        self.later_checks = self.later_checks * DECAY + (accepted - 1 + rejected if accepted else 0)
        self.skipped = 0

    def skipped_for(self, reason: str) -> None:
        """A step it drafted nothing: only skips for its own acceptance bring a probe nearer."""
        if reason == ACCEPTANCE:
            self.skipped += 1

    def proposed(self, found: bool) -> None:
        """A step it was to draft: whether the proposer had drafts for it."""
        self.asked = self.asked * DECAY + 1.0
        self.found = self.found * DECAY + float(found)

    @property
    def first(self) -> float:
        prior = self.shared.first if self.shared is not None else self.prior
        return (self.first_accepted + prior * PRIOR_TRIALS) / (self.first_checks + PRIOR_TRIALS)

    @property
    def continuation(self) -> float:
        # Its prior is the first draft's estimate, not the fixed one: until later drafts have been checked the model
        # is the geometric one, so drafts whose first token always fails stop as soon as the geometric model stops them.
        return (self.later_accepted + self.first * PRIOR_TRIALS) / (self.later_checks + PRIOR_TRIALS)

    @property
    def hit_rate(self) -> float:
        """The chance the proposer has drafts for it (prior: always, worth PRIOR_TRIALS steps)."""
        return (self.found + PRIOR_TRIALS) / (self.asked + PRIOR_TRIALS)

    @property
    def probe_due(self) -> bool:
        return self.skipped >= PROBE_EVERY
