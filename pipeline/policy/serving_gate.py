"""The serving gate's admission policy: which requests may speculate, given the load.

Pure Python (no Triton, no torch), so it is tested directly; the `speculation_gate` python model holds
one `ServingGate` and calls it from its threads, hence the lock.

Per request, in this order:
- `speculation` "on"/"off" from the client overrides everything;
- max_tokens below `min_tokens` never speculates: the draft's prefill and per-step cost don't pay back;
- load: more than `max_batch_size` requests in flight turns speculation off, and it comes back only at
  or below `max_batch_size - hysteresis`, so a load hovering at the threshold doesn't flap.
Before all that, a request that would find the engine full (its slots and its queue: `capacity`) is refused
as busy here, so it never reaches the engine: a refusal the engine sends back through BLS costs
tritonserver 2.51 about 0.45 KB it never frees (docs/reliability.md, "Where tritonserver's memory went").
A retry of a request a lost server held (`resumed`: a restart or a drain cut it off, with or without tokens to
resume from) may go one capacity past that (`queue_is_full`), and the engine queues it ahead of new requests: it
was admitted once already, and a restarted server meets every request it held at once, beside its clients' new ones.
How well drafts pay is judged per request and per step, from that request's own acceptance
(policy/draft_plan.py): one request whose drafts fail never turns speculation off for the others. The
rolling acceptance kept here feeds the metrics only.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.policy.gate import SpeculationGate
from pipeline.policy.gate_policy import GatePolicy

# Reasons, for metrics labels and logs.
OVERRIDE, SHORT, LOAD, OPEN = "override", "short", "load", "open"


# How a refusal as busy begins: clients tell it from other refusals by it (a 503, a resumed answer's wait).
BUSY_PREFIX = "server busy:"


def busy_message(waiting: int, slots: int, max_queue_size: int) -> str:
    """The one line a request refused as busy gets, from the gate or from the engine itself."""
    return (f"{BUSY_PREFIX} {waiting} requests are already waiting for the engine's {slots} slots (max_queue_size "
            f"{max_queue_size}); retry in a moment, or serve a repository assembled with a larger --max-queue-size")


# A server being stopped (pipeline.triton.drain) refuses each new request with this line, as UNAVAILABLE: a client
# retries it elsewhere, and the OpenAI frontend answers 503, as for a busy server.
STOPPING_PREFIX = "the server is stopping:"
STOPPING_MESSAGE = (f"{STOPPING_PREFIX} it finishes the requests it holds and takes no new ones; send this one again "
                    "(another replica, or this server once it is back)")


def queue_is_full(waiting: int, max_queue_size: int, slots: int, resumed: bool) -> bool:
    """Whether a request that finds `waiting` requests queued for the engine's slots is refused as busy. A `resumed`
    one (a retry of a request a lost server held) may queue past max_queue_size by one more engine's worth (slots +
    max_queue_size: all a server that died could have held), so the requests a restart cut off are not turned away
    by the new ones that arrive with them. Bounded, since any client can say it resumes: memory stays bounded, and
    new requests wait behind at most one more capacity of retries."""
    return waiting >= max_queue_size + (slots + max_queue_size if resumed else 0)


class Busy(PipelineError):
    """The engine's slots and queue are all taken: the request is refused before it is counted in flight."""


@dataclass(frozen=True)
class Decision:
    speculate: bool
    reason: str


class ServingGate:
    def __init__(self, policy: GatePolicy, window: int = 512, slots: int = 0, max_queue_size: int = 0):
        self.policy = policy
        self.window = window
        # The engine holds slots + max_queue_size requests; more are refused (Busy). 0 for either: no bound
        # here (the TensorRT-LLM route, or a repository from before this check; the engine still refuses).
        self.slots, self.max_queue_size = slots, max_queue_size
        self.capacity = slots + max_queue_size if slots and max_queue_size else 0
        self.rejected = 0
        self.lock = threading.Lock()
        self.in_flight = 0
        self.load = SpeculationGate(policy)  # the load half of the state, with hysteresis, over in-flight requests
        self._recent: deque[tuple[int, int, int]] = deque()  # (drafted, accepted, verify_steps) per response
        self._sums = [0, 0, 0]

    # ---- requests ------------------------------------------------------------------------------

    def admit(self, requested: str, max_tokens: int, resumed: bool = False) -> Decision:
        """A request arrives: count it in flight and decide. Every admit needs one `leave`; one refused
        as Busy is not counted and needs none. `resumed`: a retry of a request a lost server held."""
        with self.lock:
            if self.capacity and queue_is_full(self.in_flight - self.slots, self.max_queue_size, self.slots,
                                               resumed):
                self.rejected += 1
                raise Busy(busy_message(self.in_flight - self.slots, self.slots, self.max_queue_size))
            self.in_flight += 1
            self.load.update(self.in_flight)
            if requested in ("on", "off"):
                return Decision(requested == "on", OVERRIDE)
            if max_tokens < self.policy.min_tokens:
                return Decision(False, SHORT)
            if not self.load.on:
                return Decision(False, LOAD)
            return Decision(True, OPEN)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1
            self.load.update(self.in_flight)

    def record(self, drafted: int, accepted: int, verify_steps: int) -> None:
        """One response's verification counts, into the rolling window."""
        if drafted <= 0:
            return
        with self.lock:
            self._recent.append((drafted, accepted, verify_steps))
            for i, v in enumerate((drafted, accepted, verify_steps)):
                self._sums[i] += v
            # Keep at least the newest entry, and no more than `window` drafted tokens beyond it.
            while len(self._recent) > 1 and self._sums[0] - self._recent[0][0] >= self.window:
                for i, v in enumerate(self._recent.popleft()):
                    self._sums[i] -= v

    # ---- state -----------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        drafted, accepted, _ = self._sums
        return accepted / drafted if drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own token) + accepted drafts per step."""
        _, accepted, steps = self._sums
        return 1.0 + accepted / steps if steps else 0.0

    @property
    def flips(self) -> int:
        return self.load.flips

    @property
    def speculating(self) -> bool:
        """Whether an auto request with enough max_tokens may speculate now."""
        with self.lock:
            return self.load.on
