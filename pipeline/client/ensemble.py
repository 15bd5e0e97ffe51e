"""Call a served repository's `ensemble` over gRPC: the library behind `pipeline generate --url`.

The ensemble has a decoupled step (the speculation gate), so Triton serves it only over the gRPC
streaming RPC; unary ModelInfer refuses decoupled models. Every request therefore goes over a stream,
with `enable_empty_final_response` so the end is marked by the `triton_final_response` parameter, and
every input carries a batch dimension ([[value]]), as the ensemble's max_batch_size > 0 requires.
`stream=False` asks the server for one response holding the whole answer, on that same stream.

A `Connection` holds one channel and one stream and runs one request at a time on it; concurrent
requests use one connection each (`generate_many`). tritonclient loses the request id on error
responses, so one request per stream is what makes an error attributable to its request.

A request left early (Ctrl-C, a sibling's failure, a consumer that stops reading) is stopped, not cancelled: the
repository's `stop_request` model is asked to stop it by its id, and the stream is read to the final response the
gate then sends. Cancelling a stream as its last response goes out is what the bundled tritonserver 2.51 can die of
(docs/reliability.md); a cancel is left for a repository without that model, or an end that doesn't come within
STOP_WITHIN_S.
tritonclient is imported inside the functions that use it, so `pipeline --help` stays fast.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from pipeline.errors import MissingDependencyError, PipelineError, RequestError, ServeError
from pipeline.policy.draft_plan import add_counts, read_counts, speculation_summary
from pipeline.policy.serving_gate import BUSY_PREFIX
from pipeline.polling import wait_until

if TYPE_CHECKING:
    from pipeline.engine.guide import GuideSpec

ENSEMBLE = "ensemble"
SPECULATION_MODES = ("auto", "on", "off")
_ENSEMBLE_PREFIX = f"in ensemble '{ENSEMBLE}', "
STOP_MODEL = "stop_request"  # pipeline.triton.config.STOP_REQUEST
# How long a stopped request's stream is read for its final response before it is cancelled after all: the gate sees
# the stop at the engine's next response (at most a stream interval or a queued request's keepalive, 1 s, away).
STOP_WITHIN_S = 2.0


# gRPC channel options: tritonclient's own (its message size, its keepalive defaults), with the reconnect backoff
# capped. A lost server is back in about ten seconds; at gRPC's default backoff (1 s, growing 1.6x a try to 120 s) the
# channel then stayed down for seconds more, and every resumed answer waited for it (scripts/soak.py --chaos). At 500
# ms, with readiness asked every 500 ms, a resumed answer's next token came 1.2 s after the server's return (median).
RECONNECT_BACKOFF_MS = 200
READY_EVERY_S = 0.2  # how often a client waiting for a server (wait_s, resume_s) asks whether it is ready
BUSY_RETRY_S = 1.0  # a resumed answer refused as busy tries again this much later
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                   ("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.keepalive_timeout_ms", 20_000),
                   ("grpc.keepalive_permit_without_calls", False), ("grpc.http2.max_pings_without_data", 2),
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
                   ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]


def request_id(prefix: str) -> str:
    """A request's id: unguessable, since it is what a stop names (stop_request), so no other client can stop it."""
    return f"{prefix}-{secrets.token_hex(16)}"


def stop_inputs(request_id: str) -> list:
    """The stop_request model's inputs for one id (pipeline.triton.interface.STOP_INPUTS, with a batch of 1)."""
    import numpy as np

    ids = _grpcclient().InferInput("request_id", [1, 1], "BYTES")
    ids.set_data_from_numpy(np.array([[request_id.encode()]], np.object_))
    return [ids]


class Cancelled(PipelineError):
    """A request stopped because a sibling request failed or the user interrupted (generate_many)."""


class LostServer(ServeError):
    """The server went away mid-request (killed, restarted, stopping): the request may be resumed once it is back."""


@dataclass(frozen=True)
class RequestOptions:
    """One request's settings; None leaves the repository's default (its num_draft_tokens, seed 0)."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    speculation: str = "auto"  # auto: the server's gate decides; on / off override it
    num_draft_tokens: int | None = None
    stream: bool = True
    apply_chat_template: bool | None = None  # None: the repository's setting; rendered conversations never are
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()  # stop strings: the answer's text ends just before the first one
    logprobs: int | None = None  # None: none; N: each token's log prob and the N most likely alternatives
    guide: GuideSpec | None = None  # guided decoding: upstream's guided_decoding_guide_type and _guide inputs
    min_tokens: int = 0  # no stop before this many tokens
    ignore_eos: bool = False  # the model's end tokens don't end the answer
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias -100..100)
    prompt_logprobs: int | None = None  # None: none; N: the prompt's own log probs, N alternatives each
    prompt_ids: tuple[int, ...] | None = None  # the prompt as token ids, taken as they are (the text only names it)
    stream_interval_ms: int | None = None  # None: the server's cadence; more: fewer responses (interface.py)
    request_group: int | None = None  # requests sharing one share the engine's slots fairly with others (interface.py)
    # The answer's tokens already received, from a run a lost server cut off: the server goes on after them
    # (interface.py's resume_token_ids). Connection.generate fills it in itself when it resumes.
    resume_ids: tuple[int, ...] = ()
    # A retry of a request a lost server held, with or without resume_ids: it queues ahead of new requests
    # (interface.py's resumed). Connection.generate sets it itself when it resumes.
    resumed: bool = False

    def validate(self) -> RequestOptions:
        """Check what the server would refuse anyway, so a typo fails before any connection."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (got {self.max_tokens}); pass --max-tokens N with N >= 1")
        if self.speculation not in SPECULATION_MODES:
            raise RequestError(f"speculation must be auto, on or off (got {self.speculation!r})")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise RequestError(f"num_draft_tokens must be >= 1 (got {self.num_draft_tokens}); "
                               "use --speculation off to decode without drafts")
        from pipeline.policy.sampling_limits import check_sampling_values

        check_sampling_values(self.temperature, self.top_p, self.top_k)
        from pipeline.policy.sampling_limits import check_logprobs, check_penalty_values, check_stop_strings

        check_penalty_values(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs)
        check_stop_strings(self.stop)
        if self.stream_interval_ms is not None:
            from pipeline.triton.validate import check_stream_interval

            check_stream_interval(self.stream_interval_ms)
        for name in ("seed", "request_group"):  # UINT64 tensors
            value = getattr(self, name)
            if value is not None and not 0 <= value < 2**64:
                raise RequestError(f"{name} must be in [0, 2**64) (got {value})")
        return self


@dataclass(frozen=True)
class ClientOptions:
    url: str  # HOST:PORT of tritonserver's gRPC endpoint
    model: str = ENSEMBLE
    connect_timeout_s: float = 10.0  # server and model readiness checks
    response_timeout_s: float = 300.0  # longest wait for the next response of a stream
    wait_s: float = 0.0  # keep retrying an unreachable or loading server this long (a server just started)
    # A request cut off by a lost server (a crash and the supervisor's restart, a rolling update) waits this long for
    # it to be ready again, then resumes from the tokens it has: greedy or seeded, the answer is the one an
    # uninterrupted run gives. 0: fail at once, as before.
    resume_s: float = 120.0


@dataclass(frozen=True)
class Chunk:
    """One response: the text it adds and the drafts it accepted and drafted; t_s since the request was sent."""

    text: str
    accepted: int
    drafted: int
    t_s: float
    tokens: int  # new tokens in this response (the ensemble's num_output_tokens)
    draft_steps: int = 0  # decode steps in this response that drafted (num_draft_steps)
    skipped: dict[str, int] = field(default_factory=dict)  # those that didn't, by reason (skipped_steps)
    # j -> verification steps in this response that accepted exactly j drafts (acceptance_histogram)
    acceptance_histogram: dict[int, int] = field(default_factory=dict)
    # With logprobs: per new token [token id, log prob, [[id, log prob], ...]] (the ensemble's top_log_probs)
    logprobs: list = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (prefix_cache_hit_tokens)
    # With prompt_logprobs, in the first response: per prompt token [id, log prob, [[id, lp], ...]], the first's null
    prompt_logprobs: list = field(default_factory=list)
    token_ids: tuple[int, ...] = ()  # the new tokens' ids (output_token_ids): what a resumed request resends


@dataclass(frozen=True)
class Result:
    prompt: str
    text: str
    chunks: list[Chunk]
    max_tokens: int
    streamed: bool
    total_s: float
    resumed: int = 0  # times the server was lost mid-answer and the answer went on from the tokens it had

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.chunks)

    @property
    def drafted(self) -> int:
        return sum(c.drafted for c in self.chunks)

    @property
    def acceptance_rate(self) -> float | None:
        return round(self.accepted / self.drafted, 4) if self.drafted else None

    @property
    def draft_steps(self) -> int:
        return sum(c.draft_steps for c in self.chunks)

    @property
    def skipped_steps(self) -> dict[str, int]:
        return add_counts(c.skipped for c in self.chunks)

    @property
    def tokens(self) -> int:
        """New tokens: the sum of each response's num_output_tokens."""
        return sum(c.tokens for c in self.chunks)

    @property
    def ttft_s(self) -> float | None:
        """Time to the first response that carries text (the whole answer when not streaming)."""
        return next((c.t_s for c in self.chunks if c.text), self.chunks[0].t_s if self.chunks else None)

    @property
    def tokens_per_s(self) -> float | None:
        return round(self.tokens / self.total_s, 2) if self.tokens and self.total_s > 0 else None

    def stats(self) -> dict:
        return {"tokens": self.tokens, "responses": len(self.chunks), "accepted_tokens": self.accepted,
                "drafted_tokens": self.drafted, "acceptance_rate": self.acceptance_rate,
                "draft_steps": self.draft_steps, "skipped_steps": self.skipped_steps,
                "ttft_s": _round(self.ttft_s), "total_s": _round(self.total_s), "tokens_per_s": self.tokens_per_s,
                "resumed": self.resumed}

    def to_json_dict(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "stats": self.stats()}


def _skipped(result) -> dict[str, int]:
    """A response's skipped_steps; {} from a server whose ensemble predates it."""
    raw = result.as_numpy("skipped_steps")
    return read_counts(raw.reshape(-1)[0]) if raw is not None and raw.size else {}


def _draft_steps(result) -> int:
    raw = result.as_numpy("num_draft_steps")
    return int(raw.reshape(-1)[0]) if raw is not None else 0


def chunk_of(result, t_s: float) -> Chunk:
    """One ensemble response (a tritonclient InferResult that carries outputs) as a Chunk."""
    def scalar(name: str) -> int:
        return int(result.as_numpy(name).reshape(-1)[0])

    histogram = result.as_numpy("acceptance_histogram")  # absent from a server whose ensemble predates it
    top = result.as_numpy("top_log_probs")  # these two as well
    cached = result.as_numpy("prefix_cache_hit_tokens")
    prompt = result.as_numpy("prompt_log_probs")
    ids = result.as_numpy("output_token_ids")  # absent from a server whose ensemble predates it
    return Chunk(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace"),
                 scalar("num_accepted_tokens"), scalar("num_drafted_tokens"), t_s, scalar("num_output_tokens"),
                 _draft_steps(result), _skipped(result),
                 {int(j): n for j, n in read_counts(histogram.reshape(-1)[0]).items()}
                 if histogram is not None and histogram.size else {},
                 json.loads(top.reshape(-1)[0]) if top is not None and top.size else [],
                 int(cached.reshape(-1)[0]) if cached is not None and cached.size else 0,
                 json.loads(prompt.reshape(-1)[0]) if prompt is not None and prompt.size else [],
                 tuple(int(t) for t in ids.reshape(-1)) if ids is not None else ())


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def grpc_target(url: str) -> str:
    """HOST:PORT for tritonclient.grpc from what a user types (grpc:// allowed; http URLs are the wrong port)."""
    target = url.strip()
    if target.startswith(("http://", "https://")):
        raise RequestError(f"--url {url} is an HTTP URL; pass tritonserver's gRPC endpoint as HOST:PORT "
                           "(`pipeline serve` prints it, default 127.0.0.1:8001)")
    target = target.removeprefix("grpc://").rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestError(f"--url {url!r} is not HOST:PORT; pass tritonserver's gRPC endpoint, e.g. 127.0.0.1:8001")
    return target


def _grpcclient():
    try:
        import tritonclient.grpc as grpcclient
    except ImportError:
        raise MissingDependencyError("tritonclient is not installed; pip install 'tritonclient[grpc]'") from None
    return grpcclient


def stream_error_status(error: Exception) -> str:
    """The gRPC status of a stream error: "" for a model's error response, a StatusCode for a gRPC failure."""
    status = error.status() if hasattr(error, "status") and callable(error.status) else None
    return str(status) if status else ""


def _message(err: Exception) -> str:
    msg = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    return " ".join(str(msg or err).split()).removeprefix(_ENSEMBLE_PREFIX)


def _unreachable(target: str, err: Exception) -> ServeError:
    reason = _message(err).split(";")[0]  # grpc appends per-address details; the first clause says what failed
    return ServeError(f"cannot reach tritonserver at {target} ({reason}); start it with "
                      "`pipeline serve` or check --url (the gRPC port, default 8001)")


def build_inputs(prompt: str, options: RequestOptions) -> list:
    """The ensemble's input tensors for one request; optional ones only when set."""
    import numpy as np

    grpcclient = _grpcclient()

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    tensors = [tensor("text_input", np.array([[prompt.encode()]], np.object_), "BYTES"),
               tensor("max_tokens", np.array([[options.max_tokens]], np.int32), "INT32"),
               tensor("stream", np.array([[options.stream]], np.bool_), "BOOL"),
               tensor("temperature", np.array([[options.temperature]], np.float32), "FP32"),
               tensor("top_p", np.array([[options.top_p]], np.float32), "FP32"),
               tensor("top_k", np.array([[options.top_k]], np.int32), "INT32"),
               tensor("speculation", np.array([[options.speculation.encode()]], np.object_), "BYTES")]
    if options.seed is not None:
        tensors.append(tensor("seed", np.array([[options.seed]], np.uint64), "UINT64"))
    if options.num_draft_tokens is not None:
        tensors.append(tensor("num_draft_tokens", np.array([[options.num_draft_tokens]], np.int32), "INT32"))
    if options.apply_chat_template is not None:
        tensors.append(tensor("apply_chat_template", np.array([[options.apply_chat_template]], np.bool_), "BOOL"))
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(options, name)
        if value != RequestOptions.__dataclass_fields__[name].default:
            tensors.append(tensor(name, np.array([[value]], np.float32), "FP32"))
    if options.stop:
        tensors.append(tensor("stop_words", np.array([[s.encode() for s in options.stop]], np.object_), "BYTES"))
    if options.logprobs is not None:
        tensors.append(tensor("return_log_probs", np.array([[True]], np.bool_), "BOOL"))
        tensors.append(tensor("num_logprobs", np.array([[options.logprobs]], np.int32), "INT32"))
    if options.min_tokens:
        tensors.append(tensor("min_tokens", np.array([[options.min_tokens]], np.int32), "INT32"))
    if options.ignore_eos:
        tensors.append(tensor("ignore_eos", np.array([[True]], np.bool_), "BOOL"))
    if options.logit_bias:
        bias = json.dumps({str(t): b for t, b in options.logit_bias}).encode()
        tensors.append(tensor("logit_bias", np.array([[bias]], np.object_), "BYTES"))
    if options.prompt_logprobs is not None:
        tensors.append(tensor("prompt_logprobs", np.array([[options.prompt_logprobs]], np.int32), "INT32"))
    if options.stream_interval_ms is not None:
        tensors.append(tensor("stream_interval_ms", np.array([[options.stream_interval_ms]], np.int32), "INT32"))
    if options.request_group is not None:
        tensors.append(tensor("request_group", np.array([[options.request_group]], np.uint64), "UINT64"))
    if options.prompt_ids is not None:
        tensors.append(tensor("prompt_token_ids", np.array([options.prompt_ids], np.int32), "INT32"))
    if options.resume_ids:
        tensors.append(tensor("resume_token_ids", np.array([options.resume_ids], np.int32), "INT32"))
    if options.resumed:
        tensors.append(tensor("resumed", np.array([[True]], np.bool_), "BOOL"))
    if options.guide is not None:
        tensors.append(tensor("guided_decoding_guide_type", np.array([[options.guide.type.encode()]], np.object_),
                              "BYTES"))
        tensors.append(tensor("guided_decoding_guide", np.array([[options.guide.guide.encode()]], np.object_),
                              "BYTES"))
    return tensors


class Connection:
    """One gRPC channel and one stream to tritonserver; one request at a time. Use as a context manager."""

    def __init__(self, options: ClientOptions, cancel: threading.Event | None = None):
        self.options = options
        self.cancel = cancel  # set from another thread: the request in flight is cancelled, stream() raises Cancelled
        self.target = grpc_target(options.url)
        grpcclient = _grpcclient()
        self._client = grpcclient.InferenceServerClient(self.target, channel_args=CHANNEL_OPTIONS)
        self._responses: queue.Queue = queue.Queue()
        self._streaming = False
        self._stops: bool | None = None  # whether the repository has STOP_MODEL; asked once
        # How each request's stream ended: read to its end, stopped early and then read to its end, or cancelled.
        self.stream_ends = {"read": 0, "stopped": 0, "cancelled": 0}

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop_stream(cancel=False)
        self._client.close()

    def check_ready(self) -> None:
        """A one-line ServeError unless the server answers and the model is ready (within wait_s)."""
        if (failed := self._not_ready_after(self.options.wait_s)) is not None:
            raise failed

    def _not_ready_after(self, seconds: float) -> ServeError | None:
        """None once the server and the model are ready, tried every READY_EVERY_S for `seconds`; else why not."""
        failed: list[ServeError] = []

        def probe() -> bool | None:
            try:
                self._check_ready_once()
                return True
            except ServeError as err:
                failed[:] = [err]
                return None

        return None if wait_until(probe, seconds, READY_EVERY_S) is not None else failed[0]

    def _check_ready_once(self) -> None:
        from tritonclient.utils import InferenceServerException

        timeout = self.options.connect_timeout_s
        try:
            live = self._client.is_server_live(client_timeout=timeout)
        except InferenceServerException as err:
            raise _unreachable(self.target, err) from None
        if not live:
            raise ServeError(f"tritonserver at {self.target} is not live; restart it with `pipeline serve`")
        try:
            ready = self._client.is_model_ready(self.options.model, client_timeout=timeout)
        except InferenceServerException as err:
            raise _unreachable(self.target, err) from None
        if not ready:
            raise ServeError(f"model '{self.options.model}' is not ready on {self.target}; serve a repository made "
                             "by `pipeline assemble` (`pipeline serve --repo DIR`) and wait for it to load")

    def _start_stream(self) -> None:
        if not self._streaming:
            # tritonclient calls back with keywords, from its own stream thread.
            self._client.start_stream(callback=lambda result=None, error=None: self._responses.put((result, error)))
            self._streaming = True

    def _stop_stream(self, cancel: bool) -> None:
        if self._streaming:
            self._streaming = False
            try:
                self._client.stop_stream(cancel_requests=cancel)
            except Exception:  # noqa: BLE001  a broken stream is already gone; nothing left to stop
                pass
            self._responses = queue.Queue()

    def stream(self, prompt: str, options: RequestOptions) -> Iterator[Chunk]:
        """Send one request; yield its responses as they arrive. Closing the iterator early (Ctrl-C, break)
        cancels the request on the server."""
        from tritonclient.utils import InferenceServerException

        rid = request_id("pipeline")
        self._start_stream()
        responses = self._responses
        done = False
        try:
            t0 = time.perf_counter()
            try:
                self._client.async_stream_infer(self.options.model, build_inputs(prompt, options),
                                                request_id=rid, enable_empty_final_response=True)
            except InferenceServerException as err:
                raise LostServer(str(_unreachable(self.target, err))) from None
            deadline = time.monotonic() + self.options.response_timeout_s
            while True:
                try:
                    # Short waits, so a cancel from another thread is seen; an arriving response returns at once.
                    result, error = responses.get(timeout=0.1)
                except queue.Empty:
                    if self.cancel is not None and self.cancel.is_set():
                        raise Cancelled(f"request {rid} cancelled") from None
                    if time.monotonic() > deadline:
                        raise ServeError(f"no response from {self.target} in {self.options.response_timeout_s:g} s; "
                                         "the server may be overloaded: raise --timeout or check its log") from None
                    continue
                deadline = time.monotonic() + self.options.response_timeout_s
                if error is not None:
                    done = True
                    if stream_error_status(error):  # a gRPC failure: the stream is broken, start a fresh one next time
                        self._stop_stream(cancel=True)
                    # A model's error response ends the request, not the stream, which stays open: cancelling a
                    # stream whose request has finished costs tritonserver 2.51 about 0.8 KB it never frees.
                    raise self._error(error)
                response = result.get_response()
                if response.id != rid:
                    continue  # a late final response of an earlier request on this stream
                if response.outputs:
                    yield chunk_of(result, time.perf_counter() - t0)
                if response.parameters["triton_final_response"].bool_param:
                    done = True
                    return
        finally:
            if done:
                self.stream_ends["read"] += 1
            elif self._stop(rid, responses):
                self.stream_ends["stopped"] += 1
            else:
                self._stop_stream(cancel=True)
                self.stream_ends["cancelled"] += 1

    def _stop(self, rid: str, responses: queue.Queue) -> bool:
        """Stop a request left early through the engine (the stop_request model) and read the stream to the final
        response the gate then sends; False where the repository has no such model, or the end doesn't come within
        STOP_WITHIN_S (the caller cancels the stream then)."""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + STOP_WITHIN_S
        try:
            if self._stops is None:
                self._stops = self._client.is_model_ready(STOP_MODEL, client_timeout=STOP_WITHIN_S)
            if not self._stops:
                return False
            self._client.infer(STOP_MODEL, stop_inputs(rid), client_timeout=STOP_WITHIN_S)
            while (left := deadline - time.monotonic()) > 0:
                result, error = responses.get(timeout=left)
                if error is not None:
                    return not stream_error_status(error)  # the request's error ends it; a broken stream doesn't
                response = result.get_response()
                if response.id == rid and response.parameters["triton_final_response"].bool_param:
                    return True
        except (InferenceServerException, queue.Empty):
            pass
        return False

    def _error(self, error: Exception) -> Exception:
        """A model's error response -> RequestError; a broken or cancelled stream (a gRPC status) -> ServeError."""
        message = _message(error)
        status = stream_error_status(error)
        # A dead engine stub fails its requests before the supervisor restarts the server (docs/reliability.md).
        if "UNAVAILABLE" in status or "server is stopping" in message.lower() or "is not healthy" in message:
            return LostServer(f"lost tritonserver at {self.target} ({message[:160]}); check it is still running "
                              "(`pipeline serve`) and retry")
        if status:
            return LostServer(f"the stream to {self.target} failed ({status}: {message[:160]}); retry, or check "
                              "the server's log")
        return RequestError(f"the server refused the request: {message}")

    def generate(self, prompt: str, options: RequestOptions, on_chunk=None) -> Result:
        """Run one request to the end; on_chunk(chunk) is called for each response as it arrives. A server lost
        mid-answer is waited for (ClientOptions.resume_s) and the request resumed from the tokens received, so the
        chunks read as one answer: none repeated, none missing, the counts summed."""
        t0 = time.perf_counter()
        chunks: list[Chunk] = []
        resumed, deadline = 0, 0.0
        while True:
            have = tuple(t for c in chunks for t in c.token_ids)
            if len(options.resume_ids) + len(have) >= options.max_tokens:  # all came; only the final flag was lost
                break
            try:
                again = replace(options, resume_ids=options.resume_ids + have, resumed=options.resumed or resumed > 0)
                for chunk in self.stream(prompt, again):
                    chunks.append(chunk)
                    if on_chunk is not None:
                        on_chunk(chunk)
                break
            except LostServer as lost:
                # Resumable only where every token received came with its id (not the LLM-API route's text).
                ids = sum(len(c.token_ids) for c in chunks)
                deadline = time.monotonic() + self.options.resume_s
                if not self.options.resume_s or ids != sum(c.tokens for c in chunks) \
                        or not self._back_within(self.options.resume_s):
                    raise lost
                resumed += 1
            except RequestError as refused:
                # A restarted server meets every resumed answer at once: one refused as busy waits its turn, within
                # the resume's deadline, rather than lose the answer it had.
                if not resumed or BUSY_PREFIX not in str(refused) or time.monotonic() >= deadline:
                    raise
                time.sleep(BUSY_RETRY_S)
        return Result(prompt, "".join(c.text for c in chunks), chunks, options.max_tokens, options.stream,
                      time.perf_counter() - t0, resumed)

    def _back_within(self, seconds: float) -> bool:
        """Whether the server is ready again within `seconds` (a supervisor's restart takes about ten)."""
        return self._not_ready_after(seconds) is None


def run_request(client: ClientOptions, prompt: str, options: RequestOptions, on_chunk=None) -> Result:
    """Check the server, then run one request to the end."""
    options.validate()
    with Connection(client) as conn:
        conn.check_ready()
        return conn.generate(prompt, options, on_chunk)


@dataclass(frozen=True)
class BatchResult:
    results: list[Result]
    wall_s: float
    concurrency: int
    target: str = ""
    options: dict = field(default_factory=dict)

    def stats(self) -> dict:
        known = sum(r.tokens for r in self.results)
        ttfts = [r.ttft_s for r in self.results if r.ttft_s is not None]
        drafted = sum(r.drafted for r in self.results)
        return {"requests": len(self.results), "concurrency": self.concurrency, "tokens": known,
                "wall_s": round(self.wall_s, 4),
                "tokens_per_s": round(known / self.wall_s, 2) if known and self.wall_s > 0 else None,
                "ttft_s_mean": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
                "accepted_tokens": sum(r.accepted for r in self.results), "drafted_tokens": drafted,
                "acceptance_rate": round(sum(r.accepted for r in self.results) / drafted, 4) if drafted else None,
                "draft_steps": sum(r.draft_steps for r in self.results),
                "skipped_steps": add_counts(r.skipped_steps for r in self.results)}

    def to_json_dict(self) -> dict:
        return {"outputs": [r.to_json_dict() for r in self.results], "stats": self.stats(),
                "config": {"url": self.target, **self.options}}


def generate_many(client: ClientOptions, prompts: list[str], options: RequestOptions,
                  concurrency: int | None = None) -> BatchResult:
    """Send every prompt, up to `concurrency` at once (default: all), one connection each; results in order.

    The first failure cancels what is still running and raises.
    """
    options.validate()
    if not prompts:
        raise RequestError("no prompt given; pass PROMPT or --prompts-file FILE")
    workers = max(1, min(concurrency or len(prompts), len(prompts)))
    with Connection(client) as probe:
        probe.check_ready()
        target = probe.target
    pending = list(enumerate(prompts))
    lock = threading.Lock()
    results: list[Result | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    stop = threading.Event()  # the first failure (or Ctrl-C) cancels every request still running

    def worker() -> None:
        with Connection(client, cancel=stop) as conn:
            while not stop.is_set():
                with lock:
                    if not pending:
                        return
                    i, prompt = pending.pop(0)
                try:
                    results[i] = conn.generate(prompt, options)
                except Cancelled:
                    return
                except BaseException as err:
                    with lock:
                        errors.append(err)
                    stop.set()
                    return

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="pipeline-client")
    futures = [pool.submit(worker) for _ in range(workers)]
    try:
        for future in futures:
            future.result()
    except BaseException:  # Ctrl-C while waiting: cancel the requests in flight, then let the workers close
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True)
    if errors:
        raise errors[0]
    return BatchResult(list(results), time.perf_counter() - t0, workers, target, asdict(options))


def remote_stats_line(results: list[Result], wall_s: float, url: str) -> str:
    """One human line for what the server did: tokens, tok/s, TTFT and acceptance."""
    tokens = [r.tokens for r in results]
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    parts = [f"[{url}, {len(results)} request{'s' if len(results) > 1 else ''}]"]
    rate = f", {sum(tokens) / wall_s:.1f} tok/s" if wall_s > 0 else ""
    parts.append(f"{sum(tokens)} tokens{rate}")
    if ttfts:
        parts.append(f"TTFT {ttfts[0]:.3f} s" if len(ttfts) == 1 else f"TTFT {ttfts[0]:.3f}-{ttfts[-1]:.3f} s")
    if drafted:
        parts.append(f"acceptance {accepted / drafted:.2f} ({accepted}/{drafted} drafts)")
    # Why steps didn't draft, never a bare "no drafts" (docs/gate.md has the reasons).
    parts.append(speculation_summary(sum(r.draft_steps for r in results),
                                     add_counts(r.skipped_steps for r in results)))
    return ", ".join(parts[:1]) + " " + ", ".join(parts[1:])
