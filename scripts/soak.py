"""Soak a served repository: N concurrent streams for T minutes, then count what went wrong.

Each of --streams worker threads holds one tritonclient gRPC client and runs one request at a time on
its stream, back to back, until the time is up. Every --burst-every-s, --burst-streams more clients
arrive at once, send one request each and leave. Each request is drawn from a seeded mix:

- bad (--bad-share): an input the server must refuse in one line (NaN temperature, top_p 0, beam
  search, ...). Refused with the expected text: "errored as expected"; anything else is unexpected.
- cancel (--cancel-share): a greedy stream the client walks away from after 1-3 responses
  (stop_stream(cancel_requests=True)). Not an error; one that ends before the client leaves counts
  as completed and is checked as greedy.
- sampled (--sampled-share of the rest): temperature 0.8 with its own seed; it only has to complete.
- greedy (the rest; a quarter of them not streamed): its text must equal the prompt's reference,
  the same server's answer to that prompt sent alone before the load starts. Under load the gate
  turns speculation off, so this also checks that greedy output is the target's either way.

A request refused at once because the engine's queue is full ("server busy: ...", the repository's
max_queue_size) counts as refused as busy, not as a failure: that is the server shedding load as
designed. The client then waits a second before its next request, as a retrying client would.

A request with no response for --hang-s seconds is hung (the client cancels it and goes on). The RSS
of every server process (tritonserver and each python stub, from /proc) is read at the start, after
warm-up and at the end; growth after warm-up must stay under --rss-growth-pct. Exit status 1 when
anything hung, failed unexpectedly, mismatched, grew too much, or the server's load gauges (the gate's
in-flight count, the engine's running and waiting requests) did not return to zero once the load drained.

    python scripts/soak.py --repo triton_repo                     # start tritonserver on it: 64 streams, 10 min
    python scripts/soak.py --url 127.0.0.1:8001 --server-pid 4242 --minutes 2 --json
    python scripts/soak.py --repo triton_repo --streams 16 --minutes 1 --burst-every-s 20 --no-rss-check

--chaos (with --repo) kills the server every 30-90 s (--kill-every-s), tritonserver and the engine's python stub by
turns, with SIGKILL; the script's supervisor (pipeline serve's own) restarts it. Greedy and sampled requests then go
through `pipeline`'s own client, which waits for the server and resumes each answer from the tokens it has
(pipeline.client.ensemble): every one must end, equal to its solo reference (sampled ones draw their seed from
CHAOS_SEEDS, each with its own reference), none lost. The report adds how many answers were resumed and, per kill
and resumed answer, how long after the server was back the answer's next response came (the target: 2 s at the
p99), beside each resumed answer's time against the median of its kind's and that median's own spread.

    python scripts/soak.py --repo triton_repo --chaos --streams 32 --minutes 10

--openai-streams N (with --repo) starts the OpenAI frontend beside tritonserver, as `pipeline serve --openai-port`
does, and N more clients send greedy and sampled chats through it with the `openai` SDK, streamed or whole: greedy
answers must equal the frontend's own solo answer to the prompt, sampled ones (seeded) theirs where --chaos gives
them references. The frontend resumes what a kill cut off itself, so any error it returns is a failure.

    python scripts/soak.py --repo triton_repo --chaos --streams 32 --openai-streams 32 --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

# The benchmark scripts' own helpers (scripts/ is on sys.path when this runs as a script).
from bench_serving import fmt, print_markdown  # noqa: E402
from pipeline.policy.serving_gate import BUSY_PREFIX  # noqa: E402
from pipeline.triton.ports import free_ports  # noqa: E402

# What a hostile or careless client sends -> the one line it gets back (tests/test_serving.py sends these too).
BAD_REQUESTS = {
    "nan temperature": (dict(temperature=("FP32", float("nan"))), "temperature must be a finite number"),
    "tiny temperature": (dict(temperature=("FP32", 1e-45)), "too small to sample with"),
    "top_p 0": (dict(top_p=("FP32", 0.0)), "top_p must be in (0, 1]"),
    "top_k past the vocabulary": (dict(top_k=("INT32", 10_000_000)), "over the vocabulary"),
    "nan penalty": (dict(repetition_penalty=("FP32", float("nan"))), "repetition_penalty"),
    "beam search": (dict(beam_width=("INT32", 4)), "beam_width 4"),
    # Bounded by the engine, never clamped: an unbounded k once sized a 10^9-entry histogram (issue 39).
    "drafts past the engine's k": (dict(num_draft_tokens=("INT32", 1_000_000)),
                                   "num_draft_tokens 1000000 is more than"),
    "huge repetition penalty": (dict(repetition_penalty=("FP32", 1e6)), "repetition_penalty 1e+06 is over"),
}

# The greedy reference pool: answers that copy from the prompt (where n-gram drafts pay) and free-form ones.
PROMPTS = (
    "Write a Python function that reverses a string.",
    "Repeat this list back in reverse order: apple, banana, cherry, date, elderberry, fig, grape.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is to a ten-year-old.",
    "Fix the bug: def add(a, b): return a - b",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List five prime numbers and say why each is prime.",
    "Rename x to count in: x = 0\nfor i in range(10):\n    x += i\nprint(x)",
    "Write a haiku about autumn rain.",
    "Summarize: The meeting moved from Tuesday to Thursday because the room was booked.",
    "Give three tips for writing clear commit messages.",
    "Convert this JSON to YAML: {\"name\": \"soak\", \"streams\": 64, \"minutes\": 10}",
    "What does HTTP status 404 mean?",
    "Write a SQL query that counts the rows of a table named orders.",
    "Describe the water cycle in three steps.",
    "Complete the sequence: 2, 4, 8, 16, 32,",
)

SAMPLED_TEMPERATURE = 0.8
CHAOS_SEEDS = 4  # --chaos: sampled requests draw one of these seeds, so each (prompt, seed) has a solo reference
# --chaos: a resumed streamed answer's next response may come this long after the server is ready again (issue 55's
# target): the poll that sees the server back, the resume's own prefill, and its turn among the other resumed ones.
RESUME_SLACK_S = 2.0
# A full engine queue refuses a request at once with a line starting BUSY_PREFIX (max_queue_size); the client
# waits BUSY_BACKOFF_S before its next request, as a client that retries would.
BUSY_BACKOFF_S = 1.0
# After a gRPC failure (the server is gone) a client waits this long before its next request, as a client that
# retries would, rather than failing thousands of times while the server restarts.
TRANSPORT_BACKOFF_S = 0.2
# A transport failure this long before the supervisor saw the server dead, or after it was ready again, still counts
# as lost to the restart: the poll runs every supervise.POLL_S, and clients see a dead server before it does.
RESTART_GRACE_S = 2.0
BAD_MAX_TOKENS = 8  # refused before decoding; short in case a bad request is wrongly served
PROGRESS_EVERY_S = 60.0
GAUGES_EVERY_S = 2.0
# The server's load, read from its /metrics: requests the gate holds, and those decoding or queued in the engine.
GAUGES = ("pipeline_gate_in_flight", "pipeline_engine_requests_running", "pipeline_engine_requests_waiting")


class Kind(str, Enum):
    GREEDY = "greedy"
    SAMPLED = "sampled"
    BAD = "bad"
    CANCEL = "cancel"


class Outcome(str, Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"  # the client left after 1-3 responses, as planned
    ERRORED_EXPECTED = "errored_expected"
    BUSY = "refused_busy"  # the engine's queue was full (max_queue_size): refused at once, the client backs off
    ERRORED_UNEXPECTED = "errored_unexpected"
    HUNG = "hung"
    MISMATCHED = "mismatched"
    # With --repo: a gRPC failure while the server was down and being restarted (Restart); each restart is judged by
    # what killed the server, the requests it took with it are not failures of their own.
    LOST_TO_RESTART = "lost_to_restart"
    # --chaos: a greedy or sampled answer that did not survive a kill (its client resumes them): a failure.
    LOST = "lost"


FAILING = (Outcome.ERRORED_UNEXPECTED, Outcome.HUNG, Outcome.MISMATCHED, Outcome.LOST)


@dataclass(frozen=True)
class SoakOptions:
    streams: int = 64
    minutes: float = 10.0
    max_tokens: int = 64
    bad_share: float = 0.1
    cancel_share: float = 0.1
    sampled_share: float = 0.3  # of the requests that are neither bad nor cancelled
    burst_every_s: float = 60.0  # 0: no bursts
    burst_streams: int = 64
    hang_s: float = 60.0
    seed: int = 0
    warmup_s: float | None = None  # None: 10% of the run, at least 30 s, at most half of it
    rss_growth_pct: float = 10.0
    chaos: bool = False  # kill the server every kill_every_s; greedy and sampled answers must resume
    kill_every_s: tuple[float, float] = (30.0, 90.0)
    openai_streams: int = 0  # clients beside `streams` sending greedy and sampled chats through the OpenAI frontend
    resume: bool = True  # --chaos: False is the negative control: the gRPC clients don't resume (resume_s 0)

    def __post_init__(self):
        for name in ("bad_share", "cancel_share", "sampled_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1] (got {getattr(self, name)})")
        if self.bad_share + self.cancel_share > 1.0:
            raise ValueError("--bad-share plus --cancel-share must be at most 1")
        if self.streams < 1 or self.minutes <= 0 or self.max_tokens < 1 or self.hang_s <= 0:
            raise ValueError("--streams, --minutes, --max-tokens and --hang-s must be positive")
        if self.openai_streams < 0:
            raise ValueError(f"--openai-streams must be >= 0 (got {self.openai_streams})")
        if not 0 < self.kill_every_s[0] <= self.kill_every_s[1]:
            raise ValueError(f"--kill-every-s takes LOW HIGH with 0 < LOW <= HIGH (got {self.kill_every_s})")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_at_s(self) -> float:
        if self.warmup_s is not None:
            return min(self.warmup_s, self.duration_s)
        return min(max(0.1 * self.duration_s, 30.0), 0.5 * self.duration_s)


@dataclass(frozen=True)
class Request:
    kind: Kind
    prompt: int  # index into PROMPTS
    max_tokens: int
    stream: bool = True
    seed: int | None = None  # sampled only
    bad: str | None = None  # a BAD_REQUESTS key
    leave_after: int | None = None  # cancel only: responses before the client walks away
    openai: bool = False  # sent through the OpenAI frontend (--openai-streams), not gRPC

    @property
    def key(self) -> str:
        """What the tally counts it as: its kind, and the API it went through."""
        return f"openai {self.kind.value}" if self.openai else self.kind.value


def draw_openai(rng: random.Random, options: SoakOptions) -> Request:
    """An --openai-streams client's next request: greedy or sampled (seeded as draw's), streamed or whole."""
    prompt = rng.randrange(len(PROMPTS))
    if rng.random() < options.sampled_share:
        return Request(Kind.SAMPLED, prompt, options.max_tokens, stream=rng.random() >= 0.25,
                       seed=rng.randrange(CHAOS_SEEDS if options.chaos else 2**32), openai=True)
    return Request(Kind.GREEDY, prompt, options.max_tokens, stream=rng.random() >= 0.25, openai=True)


def draw(rng: random.Random, options: SoakOptions) -> Request:
    """The next request of the mix, from this client's own seeded generator."""
    prompt, u = rng.randrange(len(PROMPTS)), rng.random()
    if u < options.bad_share:
        return Request(Kind.BAD, prompt, BAD_MAX_TOKENS, bad=rng.choice(sorted(BAD_REQUESTS)))
    if u < options.bad_share + options.cancel_share:
        return Request(Kind.CANCEL, prompt, options.max_tokens, leave_after=rng.randint(1, 3))
    if rng.random() < options.sampled_share:
        return Request(Kind.SAMPLED, prompt, options.max_tokens,
                       seed=rng.randrange(CHAOS_SEEDS if options.chaos else 2**32))
    return Request(Kind.GREEDY, prompt, options.max_tokens, stream=rng.random() >= 0.25)


# ---- one client ---------------------------------------------------------------------------------


@dataclass
class Reply:
    text: str = ""
    responses: int = 0
    error: str | None = None
    hung: bool = False
    left: bool = False  # the client walked away (cancel)
    aborted: bool = False  # the soak was interrupted (Ctrl-C): not counted
    first_s: float | None = None  # from sending to the first response (an error counts): queueing shows here
    transport: bool = False  # the error is gRPC's (the stream or the server broke), not a model's error response
    ended_at: float = 0.0  # time.monotonic() when the client had its answer
    sent_at: float = 0.0  # time.monotonic() when it was sent
    resumed: int = 0  # --chaos: times its answer was cut off by a kill and resumed
    times: list[float] = field(default_factory=list)  # time.monotonic() of each response (of the answer, at its end)
    lost: bool = False  # --chaos: its resuming client gave up (the server did not come back in time)


def request_inputs(request: Request) -> list:
    """The ensemble's inputs: the client library's, with a bad request's tensors put in their place."""
    from pipeline.client.ensemble import RequestOptions, build_inputs
    from tritonclient.grpc import InferInput

    options = RequestOptions(max_tokens=request.max_tokens, stream=request.stream,
                             temperature=SAMPLED_TEMPERATURE if request.kind is Kind.SAMPLED else 0.0,
                             seed=request.seed)
    tensors = {t.name(): t for t in build_inputs(PROMPTS[request.prompt], options)}
    if request.bad is not None:
        for name, (dtype, value) in BAD_REQUESTS[request.bad][0].items():
            t = InferInput(name, [1, 1], dtype)
            t.set_data_from_numpy(np.array([[value]], {"FP32": np.float32, "INT32": np.int32}[dtype]))
            tensors[name] = t
    return list(tensors.values())


class Client:
    """One gRPC client and one stream, one request at a time. The stream is reopened after a gRPC failure,
    a cancel or a hang; responses are matched by request id, so a late one is never read as the next's."""

    def __init__(self, url: str, hang_s: float, abort: threading.Event):
        self.url = url
        self.client = self._new_client()
        self.hang_s = hang_s
        self.abort = abort
        self.responses: queue.Queue | None = None
        self.ids = 0

    def close(self) -> None:
        self._stop(cancel=True)
        self.client.close()

    def _stop(self, cancel: bool) -> None:
        if self.responses is not None:
            self.responses = None
            try:
                self.client.stop_stream(cancel_requests=cancel)
            except Exception:  # noqa: BLE001  a broken stream is already gone
                pass

    def _broke_while_idle(self) -> bool:
        """Whether the stream failed between requests (a server killed while this client had nothing in flight,
        --chaos): its error waits in the queue, and tritonclient refuses the next request on that stream."""
        from pipeline.client.ensemble import stream_error_status

        broke = False
        while self.responses is not None and not self.responses.empty():
            _, error = self.responses.get_nowait()
            broke = broke or (error is not None and bool(stream_error_status(error)))
        return broke

    def _send(self, request: Request, request_id: str) -> None:
        if self.responses is None:
            got = self.responses = queue.Queue()
            # tritonclient calls back with keywords, from its own stream thread.
            self.client.start_stream(callback=lambda result=None, error=None: got.put((result, error)))
        self.client.async_stream_infer("ensemble", request_inputs(request), request_id=request_id,
                                       enable_empty_final_response=True)

    def call(self, request: Request) -> Reply:
        if self._broke_while_idle():
            self._stop(cancel=True)
        reply = self._once(request)
        if reply.error is not None and STALE_STREAM in reply.error:
            # The stream broke before this request went out (a server killed while this client was idle): the
            # request never reached a server. Once more, on a new client (tritonclient keeps a stream that broke
            # under it as its current one: stopping and starting again sent on the broken one).
            self._stop(cancel=True)
            self.client.close()
            self.client = self._new_client()
            reply = self._once(request)
        return reply

    def _new_client(self):
        """pipeline's own channel options: reconnecting within half a second of a restarted server, not seconds
        after it (gRPC's default backoff), when requests sent on a channel still down would fail."""
        import tritonclient.grpc as grpcclient

        from pipeline.client.ensemble import CHANNEL_OPTIONS

        return grpcclient.InferenceServerClient(self.url, channel_args=CHANNEL_OPTIONS)

    def _once(self, request: Request) -> Reply:
        self.ids += 1
        request_id = f"soak-{threading.get_ident()}-{self.ids}"
        reply = Reply()
        try:
            self._send(request, request_id)
        except Exception as err:  # noqa: BLE001  counted as an unexpected error
            self._stop(cancel=True)
            reply.error, reply.transport = message(err), True
            return reply
        sent = last = time.monotonic()
        while True:
            try:
                result, error = self.responses.get(timeout=0.5)  # short waits, so an abort is seen
            except queue.Empty:
                if self.abort.is_set() or time.monotonic() - last > self.hang_s:
                    reply.aborted = self.abort.is_set()
                    reply.hung = not reply.aborted
                    self._stop(cancel=True)
                    return reply
                continue
            last = time.monotonic()
            if reply.first_s is None:
                reply.first_s = last - sent
            if error is not None:
                reply.error = message(error)
                from pipeline.client.ensemble import stream_error_status

                if stream_error_status(error) or STALE_STREAM in reply.error:  # a gRPC failure: the stream broke
                    reply.transport = True
                    self._stop(cancel=True)
                # else a model's error response, which ends the request and leaves the stream open, as the
                # pipeline client does: cancelling a stream whose request has finished leaks in tritonserver 2.51.
                return reply
            response = result.get_response()
            if response.id != request_id:
                continue  # cannot happen on a fresh stream; never counted against this request
            if response.outputs:
                reply.responses += 1
                reply.text += result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace")
            if response.parameters["triton_final_response"].bool_param:
                return reply
            if request.leave_after is not None and reply.responses >= request.leave_after:
                reply.left = True
                self._stop(cancel=True)
                return reply


class ResumingClient:
    """--chaos: `pipeline`'s own client (Connection.generate) for greedy and sampled requests; it waits for a lost
    server and resumes the answer from the tokens it has."""

    def __init__(self, url: str, hang_s: float, abort: threading.Event, resume: bool = True):
        from pipeline.client.ensemble import ClientOptions, Connection

        self.conn = Connection(ClientOptions(url, response_timeout_s=hang_s, resume_s=RESUME_WITHIN_S if resume else 0),
                               cancel=abort)

    def close(self) -> None:
        self.conn.close()

    def call(self, request: Request) -> Reply:
        from pipeline.client.ensemble import Cancelled, LostServer, RequestOptions
        from pipeline.errors import PipelineError

        options = RequestOptions(max_tokens=request.max_tokens, stream=request.stream, seed=request.seed,
                                 temperature=SAMPLED_TEMPERATURE if request.kind is Kind.SAMPLED else 0.0)
        reply = Reply(sent_at=time.monotonic())
        try:
            result = self.conn.generate(PROMPTS[request.prompt], options)
        except Cancelled:
            reply.aborted = True
        except PipelineError as err:
            reply.error = message(err)
            reply.lost = isinstance(err, LostServer)
            reply.hung = "no response from" in reply.error  # response_timeout_s
        else:
            reply.text, reply.responses, reply.resumed = result.text, len(result.chunks), result.resumed
            reply.first_s = result.chunks[0].t_s if result.chunks else None
            reply.times = [reply.sent_at + c.t_s for c in result.chunks]
        return reply


RESUME_WITHIN_S = 120.0  # --chaos: how long a resuming client waits for the server (a restart takes about ten)


class OpenAIClient:
    """--openai-streams: one `openai` SDK client on the frontend, a chat at a time. The frontend resumes an answer a
    kill cut off (its own Ensemble client), so this client never retries: an error is the frontend's answer."""

    def __init__(self, url: str, hang_s: float):
        from openai import OpenAI

        self.api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=hang_s + RESUME_WITHIN_S)

    def close(self) -> None:
        self.api.close()

    def call(self, request: Request) -> Reply:
        import openai

        kwargs = dict(model=OPENAI_MODEL, messages=[{"role": "user", "content": PROMPTS[request.prompt]}],
                      max_tokens=request.max_tokens, seed=request.seed,
                      temperature=SAMPLED_TEMPERATURE if request.kind is Kind.SAMPLED else 0.0)
        reply = Reply(sent_at=time.monotonic())
        try:
            if request.stream:
                text = []
                for chunk in self.api.chat.completions.create(**kwargs, stream=True):
                    reply.first_s = reply.first_s or time.monotonic() - reply.sent_at
                    reply.times.append(time.monotonic())
                    if chunk.choices and chunk.choices[0].delta.content:
                        text.append(chunk.choices[0].delta.content)
                        reply.responses += 1
                reply.text = "".join(text)
            else:
                answer = self.api.chat.completions.create(**kwargs)
                reply.first_s = time.monotonic() - reply.sent_at
                reply.times.append(time.monotonic())
                reply.text, reply.responses = answer.choices[0].message.content or "", 1
        except openai.APITimeoutError:
            reply.hung, reply.error = True, "no response within the client's timeout"
        except openai.OpenAIError as err:
            reply.error = message(err)
        return reply


OPENAI_MODEL = "soak"  # the frontend's --served-model-name


STALE_STREAM = "stream is no longer in valid state"  # tritonclient, asked to send on a stream that broke


def message(err: Exception) -> str:
    text = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    return " ".join(str(text or err).split())


def judge(request: Request, reply: Reply, references: list[str],
          sampled: dict[tuple[int, int], str] | None = None) -> tuple[Outcome, str | None]:
    """The outcome of one request, and a line saying what went wrong when it counts as a failure. sampled: (prompt,
    seed) -> the solo answer a sampled request must equal (--chaos); None: sampled answers only have to complete."""
    what = f"{request.key} request on prompt {request.prompt}"
    if reply.lost:
        return Outcome.LOST, f"{what} (seed {request.seed}): {reply.error}"
    if reply.hung:
        return Outcome.HUNG, f"{what}: no response for --hang-s after {reply.responses} response(s)"
    if request.kind is Kind.BAD:
        expected = BAD_REQUESTS[request.bad][1]
        if reply.error is not None and expected in reply.error:
            return Outcome.ERRORED_EXPECTED, None
        got = f"error {reply.error!r}" if reply.error else "an answer"
        return Outcome.ERRORED_UNEXPECTED, f"bad request '{request.bad}': expected {expected!r}, got {got}"
    if reply.error is not None and BUSY_PREFIX in reply.error:  # after the ensemble's "in ensemble ..." prefix
        return Outcome.BUSY, None
    if reply.error is not None:
        return Outcome.ERRORED_UNEXPECTED, f"{what}: {reply.error}"
    if reply.left:
        return Outcome.CANCELLED, None
    if request.kind in (Kind.GREEDY, Kind.CANCEL) and reply.text != references[request.prompt]:
        where = divergence(reply.text, references[request.prompt])
        return Outcome.MISMATCHED, f"{what} (stream={request.stream}): {where}"
    want = None if sampled is None or request.kind is not Kind.SAMPLED else sampled[request.prompt, request.seed]
    if want is not None and reply.text != want:
        return Outcome.MISMATCHED, f"{what} (seed {request.seed}, resumed {reply.resumed}): " \
                                   f"{divergence(reply.text, want)}"
    return Outcome.COMPLETED, None


def divergence(got: str, want: str, context: int = 30) -> str:
    """Where two texts part, with a little of each from there."""
    at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    start = max(0, at - 10)
    return f"from char {at}: {got[start:at + context]!r} != reference {want[start:at + context]!r}"


# ---- the tally ------------------------------------------------------------------------------------


PROBLEMS_SHOWN = 20


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)  # per kind
    outcomes: Counter = field(default_factory=Counter)  # per outcome
    # The first failure lines, with when each request ended and whether its error was gRPC's (settle may move
    # those to LOST_TO_RESTART).
    failures: list[tuple[float, bool, str]] = field(default_factory=list)
    # gRPC failures counted as unexpected so far: when each ended.
    transport_failures: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    # --chaos: completed greedy and sampled answers as ((kind, stream), seconds from sending to the answer, times
    # resumed): what a kill added to the resumed ones, against the others of their kind.
    durations: list[tuple[tuple[str, bool], float, int]] = field(default_factory=list)
    # --chaos: the resumed answers' (kind, streamed, sent_at, ended_at, response times), for the time a kill stalled
    # each.
    resumed_replies: list[tuple[str, bool, float, float, list[float]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: Request, reply: Reply, outcome: Outcome, problem: str | None) -> None:
        with self.lock:
            self.sent[request.key] += 1
            self.outcomes[outcome.value] += 1
            if outcome is Outcome.COMPLETED and reply.sent_at:
                self.durations.append(((request.key, request.stream), reply.ended_at - reply.sent_at,
                                       reply.resumed))
                if reply.resumed:
                    self.resumed_replies.append((request.key, request.stream, reply.sent_at, reply.ended_at,
                                                 reply.times))
            transport = outcome is Outcome.ERRORED_UNEXPECTED and reply.transport
            if transport:
                self.transport_failures.append(reply.ended_at)
            if reply.first_s is not None:
                self.first_s.append(reply.first_s)
            if problem is not None and len(self.failures) < 50 * PROBLEMS_SHOWN:
                self.failures.append((reply.ended_at, transport, problem))

    def settle(self, windows: list[tuple[float, float]]) -> None:
        """Move the gRPC failures that ended while the server was down (a window of (from, to)) from unexpected
        errors to LOST_TO_RESTART."""
        def lost(t: float) -> bool:
            return any(start <= t <= end for start, end in windows)

        with self.lock:
            moved = sum(lost(t) for t in self.transport_failures)
            self.outcomes[Outcome.ERRORED_UNEXPECTED.value] -= moved
            self.outcomes[Outcome.LOST_TO_RESTART.value] += moved
            self.transport_failures = [t for t in self.transport_failures if not lost(t)]
            self.failures = [f for f in self.failures if not (f[1] and lost(f[0]))]

    @property
    def problems(self) -> list[str]:
        with self.lock:
            return [line for _, _, line in self.failures[:PROBLEMS_SHOWN]]

    def first_response_s(self) -> dict[str, float | None]:
        with self.lock:
            xs = sorted(self.first_s)
        return {"p50": _at(xs, 0.5), "p99": _at(xs, 0.99), "max": _at(xs, 1.0)}

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"sent": sum(self.sent.values()), **{o.value: self.outcomes[o.value] for o in Outcome},
                    "resumed": sum(1 for _, _, n in self.durations if n)}

    def stalled_by_kills(self, restarts: list[Restart], openai: bool | None = None,
                         stream: bool | None = None) -> list[float]:
        """--chaos: per kill a resumed answer was in flight at, the time from the server's return (ready again) to
        the answer's next response: what the kill cost it beyond the restart itself. Conservative: an answer still
        queued at the kill counts the queueing it had ahead of it anyway, and a whole answer (one response) all of
        its generation after the kill. openai: as added_by_kills; stream: streamed answers (True) or whole ones."""
        with self.lock:
            rows = [r for r in self.resumed_replies if (openai is None or r[0].startswith("openai ") == openai)
                    and (stream is None or r[1] == stream)]
        out = []
        for _, _, sent_at, ended_at, times in rows:
            for r in restarts:
                if r.ready_at is not None and sent_at < r.died_at < ended_at:
                    out.append(next((t for t in times if t > r.died_at), ended_at) - r.ready_at)
        return sorted(out)

    def unresumed_spread(self) -> list[float]:
        """--chaos: each answer no kill touched, less the median of its kind: added_by_kills' own noise (a queue's
        waits differ from answer to answer, kill or not)."""
        with self.lock:
            rows = list(self.durations)
        median = _unresumed_medians(rows)
        return sorted(took - median[key] for key, took, resumed in rows if not resumed)

    def added_by_kills(self, openai: bool | None = None) -> list[float]:
        """--chaos: per resumed answer, its time less the median of the answers of its kind that weren't resumed;
        openai: only those through the OpenAI API (True) or gRPC (False)."""
        with self.lock:
            rows = [r for r in self.durations if openai is None or r[0][0].startswith("openai ") == openai]
        median = _unresumed_medians(rows)
        return sorted(took - median.get(key, 0.0) for key, took, resumed in rows if resumed)


def _unresumed_medians(rows: list[tuple[tuple[str, bool], float, int]]) -> dict[tuple[str, bool], float]:
    """Of Tally.durations' rows: per kind (and streamed or not), the median time of the answers no kill touched."""
    plain: dict[tuple[str, bool], list[float]] = {}
    for key, took, resumed in rows:
        if not resumed:
            plain.setdefault(key, []).append(took)
    return {key: sorted(xs)[len(xs) // 2] for key, xs in plain.items()}


# ---- RSS of the server's processes ---------------------------------------------------------------


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def server_processes(server_pid: int) -> dict[int, str]:
    """pid -> name for tritonserver and every process in its group: python stubs by their model."""
    from pipeline.triton.server import group_members
    from pipeline.triton.supervise import python_stubs

    try:
        pgid = os.getpgid(server_pid)
    except OSError:
        return {}
    names = {pid: "" for pid in group_members(pgid)}
    names.update({stub.pid: stub.model for stub in python_stubs(pgid)})
    for pid, name in names.items():
        if pid == server_pid:
            names[pid] = "tritonserver"
        elif not name:
            try:
                names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                names[pid] = "?"
    names.setdefault(server_pid, "tritonserver")
    return names


def rss_sample(server_pid: int | None) -> dict[int, tuple[str, int]]:
    """pid -> (name, RSS KiB) for the server's live processes; {} when no server pid is known."""
    if server_pid is None:
        return {}
    sample = {}
    for pid, name in server_processes(server_pid).items():
        kib = rss_kib(pid)
        if kib is not None:
            sample[pid] = (name, kib)
    return sample


@dataclass
class RssRow:
    process: str
    pid: int
    start_mib: float | None
    warm_mib: float | None
    end_mib: float | None

    @property
    def growth_pct(self) -> float | None:
        """Growth from after warm-up to the end; None when the process was not there for both."""
        if not self.warm_mib or self.end_mib is None:
            return None
        return round(100.0 * (self.end_mib - self.warm_mib) / self.warm_mib, 1)


def rss_rows(start: dict, warm: dict, end: dict) -> list[RssRow]:
    def mib(sample, pid):
        return round(sample[pid][1] / 1024, 1) if pid in sample else None

    pids = sorted({*start, *warm, *end}, key=lambda p: (p not in start, p))
    rows = [RssRow(next(s[pid][0] for s in (end, warm, start) if pid in s), pid, mib(start, pid), mib(warm, pid),
                   mib(end, pid)) for pid in pids]
    if rows:
        both = [r for r in rows if r.warm_mib is not None and r.end_mib is not None]

        def total(attr):
            return round(sum(getattr(r, attr) for r in both), 1) if both else None

        rows.append(RssRow("total (warm-up to end)", 0, total("start_mib") if all(r.start_mib for r in both) else None,
                           total("warm_mib"), total("end_mib")))
    return rows


# ---- the soak ---------------------------------------------------------------------------------------


@dataclass
class Restart:
    """One death of the server under the soak (--repo), and the supervisor's restart (pipeline serve's own)."""

    died: str  # supervise's line: what died and, for a known upstream crash, which
    log_tail: str  # the server's log as it died, its last SERVER_LOG_LINES
    died_at: float  # time.monotonic() when the supervisor saw it dead
    ready_at: float | None  # when it was ready again; None: it never came back (the error is in `died`)
    known: str | None  # supervise.known_crash (an upstream bug this project can't fix), KILLED, else None

    @property
    def window(self) -> tuple[float, float]:
        end = float("inf") if self.ready_at is None else self.ready_at + RESTART_GRACE_S
        return self.died_at - RESTART_GRACE_S, end

    def failure(self) -> str | None:
        if self.ready_at is None:
            return f"the server did not come back: {self.died}"
        if self.known is None:
            return f"{self.died}; its log ends:\n{self.log_tail}"
        return None


@dataclass
class Report:
    options: SoakOptions
    url: str
    counts: dict[str, int]
    sent_by_kind: dict[str, int]
    bursts: int
    wall_s: float
    rss: list[RssRow]
    rss_measured: bool
    # The server's load gauges (GAUGES) once the load has drained, and the most seen during it; {}: not read.
    gauges_after: dict[str, float]
    gauges_max: dict[str, float]
    first_response_s: dict[str, float | None]  # p50, p99, max over the requests counted
    problems: list[str]
    # Each process's RSS every PROGRESS_EVERY_S: whether growth levels off (allocator high-water marks after
    # the bursts) or keeps climbing (a leak) shows here, not in start and end alone.
    rss_series: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)  # --repo: each death of the server and its restart
    added_by_kills: list[float] = field(default_factory=list)  # --chaos: seconds a kill added to each resumed answer
    added_by_kills_openai: list[float] = field(default_factory=list)  # the same, of those through the OpenAI API
    frontend_resumed: float | None = None  # --openai-streams: the frontend's pipeline_frontend_resumed_total
    # --chaos: per kill and resumed streamed answer, from the server's return to the answer's next response (the
    # target); those through the OpenAI API; whole answers, to their end (their generation after the kill included);
    # and the unresumed answers' spread about their median (added_by_kills' noise).
    stalled_by_kills: list[float] = field(default_factory=list)
    stalled_by_kills_openai: list[float] = field(default_factory=list)
    stalled_whole: list[float] = field(default_factory=list)
    unresumed_spread: list[float] = field(default_factory=list)

    @property
    def longest_restart_s(self) -> float | None:
        downs = [r.ready_at - r.died_at for r in self.restarts if r.ready_at is not None]
        return max(downs) if downs else None

    def stalled_p99_s(self) -> float | None:
        return _at(self.stalled_by_kills, 0.99)

    def failures(self, rss_check: bool = True) -> list[str]:
        out = [f for r in self.restarts if (f := r.failure())]
        if self.options.chaos:
            if not self.restarts:
                out.append("--chaos killed nothing: run longer than --kill-every-s")
            p99 = self.stalled_p99_s()
            if p99 is not None and p99 > RESUME_SLACK_S:
                out.append(f"a kill stalled its resumed answers {p99:.1f} s past its restart (p99), over "
                           f"{RESUME_SLACK_S:g} s")
        out += [f"{self.counts[o.value]} {o.value.replace('_', ' ')}" for o in FAILING if self.counts[o.value]]
        if self.counts[Outcome.COMPLETED.value] == 0:
            out.append("no request completed")
        if rss_check:
            grown = [r for r in self.rss if r.pid and r.growth_pct is not None
                     and r.growth_pct > self.options.rss_growth_pct]
            out += [f"{r.process} ({r.pid}) RSS grew {r.growth_pct}% after warm-up" for r in grown]
        out += [f"{name} is still {value:g} after the load drained" for name, value in self.gauges_after.items()
                if value]
        return out

    def to_json_dict(self, rss_check: bool = True) -> dict:
        return {"options": asdict(self.options), "url": self.url, "counts": self.counts,
                "sent_by_kind": self.sent_by_kind, "bursts": self.bursts, "wall_s": round(self.wall_s, 1),
                "rss_measured": self.rss_measured,
                "rss": [{**asdict(r), "growth_pct": r.growth_pct} for r in self.rss],
                "gauges_after": self.gauges_after, "gauges_max": self.gauges_max,
                "first_response_s": self.first_response_s,
                "rss_series": [{"t_s": t, "mib": mib} for t, mib in self.rss_series],
                "problems": self.problems,
                "added_by_kills_s": {"p50": _at(self.added_by_kills, 0.5), "p99": _at(self.added_by_kills, 0.99),
                                     "max": _at(self.added_by_kills, 1.0), "resumed": len(self.added_by_kills),
                                     "openai_p99": _at(self.added_by_kills_openai, 0.99),
                                     "openai_resumed": len(self.added_by_kills_openai),
                                     "frontend_resumed": self.frontend_resumed,
                                     "unresumed_spread_p99": _at(self.unresumed_spread, 0.99)},
                "stalled_past_restart_s": {q: _at(self.stalled_by_kills, p) for q, p in
                                           (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}
                | {"openai_p99": _at(self.stalled_by_kills_openai, 0.99), "n": len(self.stalled_by_kills),
                   "whole_p50": _at(self.stalled_whole, 0.5), "whole_p99": _at(self.stalled_whole, 0.99),
                   "whole_n": len(self.stalled_whole)},
                "restarts": [{"died": r.died, "known": r.known,
                              "down_s": None if r.ready_at is None else round(r.ready_at - r.died_at, 1),
                              "log_tail": r.log_tail} for r in self.restarts],
                "failures": self.failures(rss_check)}


def _at(xs: list[float], q: float) -> float | None:
    """The q-quantile of sorted xs, rounded; None for none."""
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def references(url: str, options: SoakOptions) -> list[str]:
    """Each prompt's greedy answer, sent alone on an idle server: what every greedy request must match."""
    abort = threading.Event()
    client = Client(url, options.hang_s, abort)
    try:
        texts = []
        for i in range(len(PROMPTS)):
            reply = client.call(Request(Kind.GREEDY, i, options.max_tokens))
            if reply.error or reply.hung:
                raise RuntimeError(f"the reference for prompt {i} failed: {reply.error or 'no response'}")
            texts.append(reply.text)
        return texts
    finally:
        client.close()


def sampled_references(url: str, options: SoakOptions) -> dict[tuple[int, int], str]:
    """--chaos: each (prompt, seed)'s sampled answer, sent alone: what every sampled request must match."""
    client = ResumingClient(url, options.hang_s, threading.Event())
    try:
        texts = {}
        for i in range(len(PROMPTS)):
            for seed in range(CHAOS_SEEDS):
                reply = client.call(Request(Kind.SAMPLED, i, options.max_tokens, seed=seed))
                if reply.error or reply.hung:
                    raise RuntimeError(f"the sampled reference for prompt {i}, seed {seed} failed: {reply.error}")
                texts[i, seed] = reply.text
        return texts
    finally:
        client.close()


def openai_references(url: str, options: SoakOptions) -> tuple[list[str], dict[tuple[int, int], str] | None]:
    """--openai-streams: each prompt's greedy chat answer through the frontend, sent alone, and with --chaos each
    (prompt, seed)'s sampled one: what the OpenAI clients' answers must equal (the frontend renders the chat
    template itself, so these are its own, not the gRPC references)."""
    client = OpenAIClient(url, options.hang_s)
    try:
        def one(request: Request) -> str:
            reply = client.call(request)
            if reply.error or reply.hung:
                raise RuntimeError(f"the OpenAI reference for {request.key} prompt {request.prompt} failed: "
                                   f"{reply.error}")
            return reply.text

        greedy = [one(Request(Kind.GREEDY, i, options.max_tokens, openai=True)) for i in range(len(PROMPTS))]
        sampled = {(i, seed): one(Request(Kind.SAMPLED, i, options.max_tokens, seed=seed, openai=True))
                   for i in range(len(PROMPTS)) for seed in range(CHAOS_SEEDS)} if options.chaos else None
        return greedy, sampled
    finally:
        client.close()


def gauges(metrics_url: str | None, names: tuple[str, ...] = GAUGES) -> dict[str, float]:
    """`names` (the server's GAUGES unless given) as a /metrics page has them now (summed over labels); {} when
    unread."""
    if metrics_url is None:
        return {}
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def frontend_resumed(openai_url: str | None) -> float | None:
    """The OpenAI frontend's count of the answers it resumed after a lost server; None when unread."""
    name = "pipeline_frontend_resumed_total"
    return gauges(f"{openai_url}/metrics" if openai_url else None, (name,)).get(name)


def drained_gauges(metrics_url: str | None, timeout_s: float = 30.0) -> dict[str, float]:
    """The gauges once they all read 0, or as they are after timeout_s (cancels are noticed a step late,
    and a request its client left may still be decoding)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = gauges(metrics_url)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def soak(url: str, options: SoakOptions, server_pid: int | Callable[[], int] | None = None,
         metrics_url: str | None = None, say=lambda line: print(line, file=sys.stderr, flush=True),
         restarts: list[Restart] | None = None, loading: threading.Event | None = None,
         openai_url: str | None = None) -> Report:
    """Run the mix against a ready server at url (HOST:PORT, gRPC); server_pid: read its processes' RSS (a callable:
    the current one, for a server that may be restarted). restarts: filled by a supervisor as the soak runs; the
    gRPC failures of requests in flight while the server was down count as lost to the restart. loading: set once the
    references are taken and the load starts (--chaos kills from then on). openai_url: the OpenAI frontend in front
    of it, for options.openai_streams."""
    restarts = [] if restarts is None else restarts

    def pid() -> int | None:
        return server_pid() if callable(server_pid) else server_pid

    rss_start = rss_sample(pid())
    say(f"soak: references for {len(PROMPTS)} prompts, one at a time")
    refs = references(url, options)
    sampled = sampled_references(url, options) if options.chaos else None
    if options.openai_streams and openai_url is None:
        raise ValueError("--openai-streams needs the OpenAI frontend: pass --repo")
    openai_refs, openai_sampled = openai_references(openai_url, options) if options.openai_streams else ([], None)
    tally, abort = Tally(), threading.Event()
    t0 = time.monotonic()
    end_at = t0 + options.duration_s

    def run(client_id: str, until: float | None) -> None:
        """Requests back to back until `until`; None: one request (a burst client)."""
        rng = random.Random(f"{options.seed}-{client_id}")
        client = Client(url, options.hang_s, abort)
        resuming = ResumingClient(url, options.hang_s, abort, options.resume) if options.chaos else None
        try:
            while not abort.is_set():
                request = draw(rng, options)
                by = resuming if resuming is not None and request.kind in (Kind.GREEDY, Kind.SAMPLED) else client
                reply = by.call(request)
                reply.ended_at = time.monotonic()
                if reply.aborted:
                    return
                outcome, problem = judge(request, reply, refs, sampled)
                tally.add(request, reply, outcome, problem)
                if until is None or time.monotonic() >= until:
                    return
                if outcome is Outcome.BUSY:
                    abort.wait(BUSY_BACKOFF_S)
                elif reply.transport:
                    abort.wait(TRANSPORT_BACKOFF_S)
        finally:
            client.close()
            if resuming is not None:
                resuming.close()

    def run_openai(client_id: str, until: float) -> None:
        rng = random.Random(f"{options.seed}-{client_id}")
        client = OpenAIClient(openai_url, options.hang_s)
        try:
            while not abort.is_set() and time.monotonic() < until:
                request = draw_openai(rng, options)
                reply = client.call(request)
                reply.ended_at = time.monotonic()
                # The frontend resumes out of sight: an answer in flight when the supervisor saw the server dead
                # was cut off and resumed (the frontend's own count is its pipeline_frontend_resumed_total).
                reply.resumed = sum(reply.sent_at < r.died_at < reply.ended_at for r in list(restarts))
                outcome, problem = judge(request, reply, openai_refs, openai_sampled)
                tally.add(request, reply, outcome, problem)
                if outcome is Outcome.BUSY:  # the frontend's 503, as a client that retries would
                    abort.wait(BUSY_BACKOFF_S)
        finally:
            client.close()

    bursts_line = (f"bursts of {options.burst_streams} every {options.burst_every_s:g} s" if options.burst_every_s
                   else "no bursts")
    openai = f" + {options.openai_streams} through the OpenAI API" if options.openai_streams else ""
    say(f"soak: {options.streams} streams{openai} for {options.minutes:g} min, {bursts_line}")
    threads = [threading.Thread(target=run, args=(f"w{i}", end_at), daemon=True) for i in range(options.streams)]
    threads += [threading.Thread(target=run_openai, args=(f"o{i}", end_at), daemon=True)
                for i in range(options.openai_streams)]
    for t in threads:
        t.start()
    if loading is not None:
        loading.set()
    bursts, rss_warm, most = 0, None, Counter()
    series: list[tuple[int, dict[str, float]]] = []  # (seconds in, {"name (pid)": MiB}) every PROGRESS_EVERY_S
    next_burst = t0 + options.burst_every_s if options.burst_every_s else float("inf")
    next_progress, next_gauges, warm_at = t0 + PROGRESS_EVERY_S, t0, t0 + options.warmup_at_s
    try:
        while (now := time.monotonic()) < end_at:
            if now >= warm_at and rss_warm is None:
                rss_warm = rss_sample(pid())
            if now >= next_burst:
                bursts += 1
                burst = [threading.Thread(target=run, args=(f"b{bursts}-{i}", None), daemon=True)
                         for i in range(options.burst_streams)]
                for t in burst:
                    t.start()
                threads += burst
                next_burst += options.burst_every_s
            if now >= next_progress:
                sample = rss_sample(pid())
                series.append((round(now - t0), {f"{name} ({pid})": round(kib / 1024, 1)
                                                 for pid, (name, kib) in sample.items()}))
                rss_now = f" RSS {sum(kib for _, kib in sample.values()) / 1024:.0f} MiB" if sample else ""
                say(f"soak: {now - t0:.0f} s {tally.snapshot()} server {gauges(metrics_url)}{rss_now}")
                next_progress += PROGRESS_EVERY_S
            if now >= next_gauges:
                for name, value in gauges(metrics_url).items():
                    most[name] = max(most[name], value)
                next_gauges += GAUGES_EVERY_S
            time.sleep(0.2)
        say("soak: time is up; waiting for the requests in flight")
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        abort.set()
        for t in threads:
            t.join(timeout=5)
        raise
    wall = time.monotonic() - t0
    after = drained_gauges(metrics_url)
    rss_end = rss_sample(pid())
    tally.settle([r.window for r in restarts])
    return Report(options, url, tally.snapshot(), dict(tally.sent), bursts, wall,
                  rss_rows(rss_start, rss_warm or {}, rss_end), server_pid is not None, after, dict(most),
                  tally.first_response_s(), tally.problems, series, list(restarts), tally.added_by_kills(),
                  tally.added_by_kills(openai=True), frontend_resumed(openai_url),
                  tally.stalled_by_kills(restarts, stream=True),
                  tally.stalled_by_kills(restarts, openai=True, stream=True),
                  tally.stalled_by_kills(restarts, stream=False), tally.unresumed_spread())


def soak_repo(repo: Path, options: SoakOptions, say=lambda line: print(line, file=sys.stderr, flush=True)) -> Report:
    """Start tritonserver on a repository (free ports), soak it, stop it."""
    from pipeline.triton.server import ServeOptions, TritonServer

    from pipeline.errors import ServeError
    from pipeline.triton.supervise import READY_TIMEOUT_S
    from pipeline.triton.supervise import CANCEL_RACE, MAX_RESTARTS, RestartBudget, supervise

    grpc, http, metrics, openai_port = free_ports(4)
    say(f"soak: starting tritonserver on {repo}")
    server = TritonServer(ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics))
    restarts: list[Restart] = []

    def tail(log: str) -> str:
        return "\n".join(log.splitlines()[-SERVER_LOG_LINES:])

    kills: list[tuple[float, str]] = []  # --chaos: (when, what) of each kill

    def restarted(died: str, log: str, died_at: float, ready_at: float) -> None:
        # supervise names the upstream crash in its line where the server's log shows it (known_crash); a death
        # that follows one of --chaos's kills is that kill
        killed = any(at <= died_at <= at + KILL_SEEN_WITHIN_S for at, _ in kills[-1:])
        known = KILLED if killed else CANCEL_RACE if CANCEL_RACE in died else None
        restarts.append(Restart(died, tail(log), died_at, ready_at, known))

    def chaos() -> None:
        """Kill tritonserver and the engine's stub by turns every kill_every_s, each once the last kill's restart is
        ready (supervise has restarted it)."""
        import signal

        from pipeline.triton.supervise import python_stubs

        rng = random.Random(f"{options.seed}-chaos")
        while not loading.wait(0.5):  # the references are taken on a server nobody kills
            if stop.is_set():
                return
        while not stop.wait(rng.uniform(*options.kill_every_s)):
            if restarts and restarts[-1].ready_at is None:
                return  # the supervisor gave up: nothing restarts a server killed now
            if len(restarts) < len(kills) or server.process is None:
                continue  # still restarting from the last one
            try:
                if len(kills) % 2 == 0:
                    victim, pid = "tritonserver", server.process.pid
                else:
                    stub = next(s for s in python_stubs(os.getpgid(server.process.pid)) if s.model == "torch_engine")
                    victim, pid = "the torch_engine stub", stub.pid
                kills.append((time.monotonic(), victim))
                os.kill(pid, signal.SIGKILL)
            except (OSError, StopIteration):
                kills.pop()
                continue
            say(f"soak: --chaos killed {victim} (pid {pid})")

    def watch() -> None:
        # pipeline serve's own supervisor: a dead server is restarted, its clients in flight get an error at once.
        # Its ration of restarts (a crash loop stops serve) counts real crashes: --chaos's own kills come on top.
        kills_at_most = int(options.duration_s // options.kill_every_s[0]) + 1 if options.chaos else 0
        budget = RestartBudget(limit=MAX_RESTARTS + kills_at_most)
        try:
            supervise(server, lambda line: say(f"soak: {line}"), READY_TIMEOUT_S, budget, stop=stop,
                      on_restart=restarted)
        except ServeError as err:
            restarts.append(Restart(str(err), tail(server.log()), time.monotonic(), None, None))

    stop, loading = threading.Event(), threading.Event()
    with server:
        frontend = None
        if options.openai_streams:  # as `pipeline serve --openai-port` runs it: a process of its own, never killed
            from pipeline.openai_api.process import FrontendOptions, FrontendProcess

            frontend = FrontendProcess(FrontendOptions(port=openai_port, model_name=OPENAI_MODEL), repo,
                                       server.endpoints.grpc, server.endpoints.metrics,
                                       server.log_path.with_name("openai-frontend.log")).start()
            frontend.wait_ready()
            say(f"soak: the OpenAI frontend on {frontend.url}")
        watcher = threading.Thread(target=watch, name="soak-supervisor", daemon=True)
        watcher.start()
        killer = threading.Thread(target=chaos, name="soak-chaos", daemon=True) if options.chaos else None
        if killer is not None:
            killer.start()
        try:
            return soak(server.endpoints.grpc, options, lambda: server.process.pid if server.process else None,
                        server.endpoints.metrics, say, restarts, loading, frontend.url if frontend else None)
        finally:
            stop.set()
            if killer is not None:
                killer.join()
            watcher.join()
            if frontend is not None:
                frontend.stop()


SERVER_LOG_LINES = 40
KILLED = "killed by --chaos"  # a Restart's `known`: the death was the soak's own kill
KILL_SEEN_WITHIN_S = 10.0  # a death the supervisor sees this soon after a kill is that kill (it polls twice a second)


# ---- output -------------------------------------------------------------------------------------------


def print_report(report: Report, rss_check: bool) -> None:
    o, c = report.options, report.counts
    kinds = ", ".join(f"{report.sent_by_kind.get(k.value, 0)} {k.value}" for k in Kind)
    if o.openai_streams:
        kinds += "; through the OpenAI API: " + ", ".join(
            f"{report.sent_by_kind.get(f'openai {k.value}', 0)} {k.value}" for k in (Kind.GREEDY, Kind.SAMPLED))
    rows = [("requests sent", str(c["sent"]), kinds),
            ("completed", str(c["completed"]), "greedy ones equal to their solo reference"),
            ("cancelled by the client", str(c["cancelled"]), "left after 1-3 responses"),
            ("errored as expected", str(c["errored_expected"]), "bad requests refused with their line"),
            ("refused as busy", str(c["refused_busy"]), f"engine queue full; the client waited {BUSY_BACKOFF_S:g} s"),
            ("errored unexpectedly", str(c["errored_unexpected"]), "target 0"),
            ("hung", str(c["hung"]), f"no response for {o.hang_s:g} s; target 0"),
            ("mismatched", str(c["mismatched"]), "greedy text != solo reference; target 0"),
            ("lost to a server restart", str(c["lost_to_restart"]),
             f"in flight when the server died ({len(report.restarts)} restarts)"
             + ("; cancels and bad requests, which don't resume" if o.chaos else "")),
            *([("lost", str(c["lost"]), "--chaos: greedy or sampled answers that did not survive a kill; target 0"),
               ("resumed", str(c["resumed"]), "--chaos: answers a kill cut off, resumed to their solo reference"),
               ("stalled past the restart p50/p99/max s",
                "/".join(fmt(_at(report.stalled_by_kills, q), ".1f") for q in (0.5, 0.99, 1.0)),
                f"per kill and resumed streamed answer, from the server's return (longest restart "
                f"{fmt(report.longest_restart_s, '.1f')} s) to its next response; target p99 <= {RESUME_SLACK_S:g} s"),
               ("whole answers: return to end p50/p99/max s",
                "/".join(fmt(_at(report.stalled_whole, q), ".1f") for q in (0.5, 0.99, 1.0)),
                f"{len(report.stalled_whole)}; their generation after the kill included"),
               *([("of them through the OpenAI API", "/".join(fmt(_at(report.stalled_by_kills_openai, q), ".1f")
                                                               for q in (0.5, 0.99, 1.0)),
                   f"{len(report.stalled_by_kills_openai)} streamed; the frontend counts "
                   f"{fmt(report.frontend_resumed, 'g')} resumed (its /metrics)")] if o.openai_streams else []),
               ("took over its kind's median p50/p99/max s",
                "/".join(fmt(_at(report.added_by_kills, q), ".1f") for q in (0.5, 0.99, 1.0)),
                f"per resumed answer (restart included); answers no kill touched: p99 "
                f"{fmt(_at(report.unresumed_spread, 0.99), '.1f')} s over theirs (a queue's own spread)")]
              if o.chaos else []),
            *([(f"{name.removeprefix('pipeline_')} max/after", f"{fmt(report.gauges_max.get(name), 'g')}/"
                f"{fmt(report.gauges_after.get(name), 'g')}", "server gauge: most during the load / once drained, "
                "target 0") for name in GAUGES] if report.gauges_after else
              [("server gauges", "not read", "pass --metrics-url with --url")]),
            ("first response p50/p99/max s", "/".join(fmt(v, ".2f") for v in report.first_response_s.values()),
             "from sending, of those that got one; a queue shows here")]
    print_markdown(("measure", "value", "note"), rows)
    if report.rss_measured:
        print_markdown(("process", "pid", "RSS start MiB", "after warm-up MiB", "end MiB", "growth after warm-up"),
                       [(r.process, str(r.pid) if r.pid else "", fmt(r.start_mib), fmt(r.warm_mib), fmt(r.end_mib),
                         "n/a" if r.growth_pct is None else f"{r.growth_pct:+.1f}%") for r in report.rss])
    if report.rss_series:
        print(f"\nRSS MiB every {PROGRESS_EVERY_S:g} s (from {report.rss_series[0][0]} s):")
        for name in report.rss_series[-1][1]:
            print(f"  {name}: " + " ".join(fmt(mib.get(name)) for _, mib in report.rss_series))
    failures = report.failures(rss_check)
    openai = f" + {o.openai_streams} through the OpenAI API" if o.openai_streams else ""
    print(f"\n{report.url}: {o.streams} streams{openai} for {o.minutes:g} min ({report.wall_s:.0f} s with the drain), "
          + (f"{report.bursts} bursts of {o.burst_streams}" if o.burst_every_s else "no bursts")
          + f", max {o.max_tokens} tokens, seed {o.seed}; RSS "
          + (f"warm-up at {o.warmup_at_s:g} s, limit +{o.rss_growth_pct:g}%"
             + ("" if rss_check else " (not checked)") if report.rss_measured else "not measured (no --server-pid)")
          + f".\n{'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}")
    for r in report.restarts:
        down = "never came back" if r.ready_at is None else f"back after {r.ready_at - r.died_at:.1f} s"
        print(f"  restart: {r.died} ({down})")
    for line in report.problems[:10]:
        print(f"  {line}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's gRPC endpoint, HOST:PORT")
    where.add_argument("--repo", type=Path, help="start tritonserver on this repository (free ports) and stop it after")
    ap.add_argument("--server-pid", type=int, default=None, help="with --url: tritonserver's pid, to read the RSS "
                    "of its process group (tritonserver and the python stubs)")
    ap.add_argument("--metrics-url", default=None, help="with --url: the server's /metrics, to check that the "
                    "gate's in-flight count returns to 0")
    ap.add_argument("--streams", type=int, default=64, help="concurrent client streams")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bad-share", type=float, default=0.1)
    ap.add_argument("--cancel-share", type=float, default=0.1)
    ap.add_argument("--sampled-share", type=float, default=0.3, help="of the requests neither bad nor cancelled")
    ap.add_argument("--burst-every-s", type=float, default=60.0, help="0: no bursts")
    ap.add_argument("--burst-streams", type=int, default=64)
    ap.add_argument("--hang-s", type=float, default=60.0, help="a request with no response this long is hung")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="when to take the warm RSS sample (default: 10%% of the run, 30 s to half of it)")
    ap.add_argument("--rss-growth-pct", type=float, default=10.0)
    ap.add_argument("--no-rss-check", action="store_true", help="report RSS growth without failing on it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--openai-streams", type=int, default=0, help="with --repo: more clients, sending greedy and "
                    "sampled chats through the OpenAI frontend (started beside the server) [default: 0]")
    ap.add_argument("--chaos", action="store_true", help="with --repo: kill tritonserver and the engine's stub by "
                    "turns (SIGKILL); greedy and sampled answers must resume to their solo references")
    ap.add_argument("--kill-every-s", type=float, nargs=2, default=(30.0, 90.0), metavar=("LOW", "HIGH"),
                    help="--chaos: seconds between kills, drawn uniformly (default 30 90)")
    ap.add_argument("--no-resume", dest="resume", action="store_false", help="--chaos's negative control: the gRPC "
                    "clients don't resume, so the answers a kill cuts off are lost (the soak fails)")
    ap.add_argument("--json", dest="json_", action="store_true", help="also print the numbers as JSON")
    args = ap.parse_args(argv)
    if args.chaos and args.repo is None:
        ap.error("--chaos needs --repo: the script kills and restarts the server it started")
    if args.openai_streams and args.repo is None:
        ap.error("--openai-streams needs --repo: the script starts the OpenAI frontend beside the server it starts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.client.ensemble import ClientOptions, Connection
    from pipeline.errors import PipelineError

    try:
        options = SoakOptions(args.streams, args.minutes, args.max_tokens, args.bad_share, args.cancel_share,
                              args.sampled_share, args.burst_every_s, args.burst_streams, args.hang_s, args.seed,
                              args.warmup_s, args.rss_growth_pct, args.chaos, tuple(args.kill_every_s),
                              args.openai_streams, args.resume)
    except ValueError as err:
        raise SystemExit(f"soak.py: {err}") from None
    try:
        if args.repo is not None:
            report = soak_repo(args.repo, options)
        else:
            with Connection(ClientOptions(args.url, wait_s=30)) as probe:
                probe.check_ready()
                url = probe.target
            report = soak(url, options, args.server_pid, args.metrics_url)
    except (PipelineError, RuntimeError) as err:
        raise SystemExit(f"soak.py: {err}") from None
    rss_check = not args.no_rss_check
    print_report(report, rss_check)
    if args.json_:
        print(json.dumps(report.to_json_dict(rss_check), indent=2))
    return 1 if report.failures(rss_check) else 0


if __name__ == "__main__":
    sys.exit(main())
