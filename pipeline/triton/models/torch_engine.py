"""Triton python model `torch_engine` (decoupled): the portable engine, continuous batching in one model.

The engine folder loads once. ONE scheduler thread owns the engine: it admits queued requests,
calls engine.step(), and sends every response. execute() only queues; token callbacks only
record. A decoupled model sending from many Python threads at once crashed tritonserver's python
backend at 40 streams (boost lock_exception / SIGSEGV); one sender thread held.
"""

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.engine.device import DeviceChoice
from pipeline.engine.folder import load_engine, read_engine_manifest
from pipeline.engine.request import RequestStatus
from pipeline.engine.sampling import SamplingParams
from pipeline.models.tokenizer import load_tokenizer, visible_text
from pipeline.policy.gate_policy import GatePolicy
from pipeline.policy.serving_gate import busy_message, queue_is_full
from pipeline.triton import cancel_marks
from pipeline.triton.client_errors import client_message
from pipeline.triton.config import served_device
from pipeline.triton.interface import STREAM_INTERVAL_MS
from pipeline.triton.stop_text import sendable
from pipeline.triton.stub_exit import exit_without_teardown
from pipeline.triton.validate import read_engine_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Text-bearing tokens resent before each chunk, so postprocessing can rebuild a character split across
# chunks (at most 4 bytes; byte-fallback tokens carry one each). Special tokens, and ids past the
# tokenizer's vocabulary (a model's padded embedding rows), decode to nothing there, so they don't
# count: a run of them would push the split bytes out of the prefix.
PREFIX_TOKENS = 6
METRICS_EVERY_S = 0.1  # metric updates are IPC round trips: at most this often
# A stream gets at most one response per STREAM_INTERVAL_MS (its first at once; tokens made meanwhile go
# together in the next). Each response costs a postprocessing call and an ensemble hop, a few ms of Python:
# a fast engine sending one per token put thousands a second in front of postprocessing at 64 streams, and a
# client's cancel, noticed only when postprocessing reached it, came after its whole answer had been decoded
# for nobody. 20 responses a second still reads as smooth streaming (vLLM's --stream-interval, in time). A request
# may ask for fewer (stream_interval_ms): a whole answer read at its end needs them only to notice a client that left.
# A streamed request still waiting for a slot gets an empty response (no text, no tokens) every KEEPALIVE_S.
# Triton 2.51 tells no model that a client left before any response of its request flowed: postprocessing
# learns it only from a response. Without this, a request whose client gave up in the queue was decoded in
# full for nobody once a slot freed, and a queue of such requests starved live ones. Clients already see
# empty chunks (a character split across tokens); genai-perf skips them for time to first token.
KEEPALIVE_S = 1.0
# A sender's is_cancelled() is a round trip to tritonserver. Asked for every stream before every step, it took the
# scheduler thread 0.9 ms a step (p90 3.2 ms) at 17 streams, with the steps 13-16 ms. A stream is asked at most this
# often; a client of the ensemble that leaves is seen sooner, by its cancel mark (one listdir a step).
CANCEL_POLL_S = 0.1


class EngineMetrics:
    """The engine's Prometheus families (running/waiting requests, finishes by reason, tokens).
    Touched only by the scheduler thread."""

    def __init__(self, model: str):
        self.labels = {"model": model}  # as Triton's own metrics; label-less samples did not show
        F = pb_utils.MetricFamily
        # Each Metric needs its family kept referenced, or every update fails with
        # "the corresponding 'MetricFamily' has been deleted".
        self.families = []

        def keep(family):
            self.families.append(family)
            return family

        self.running = keep(F(name="pipeline_engine_requests_running", kind=F.GAUGE,
                             description="Requests holding a KV-cache slot")).Metric(labels=self.labels)
        self.waiting = keep(F(name="pipeline_engine_requests_waiting", kind=F.GAUGE,
                             description="Requests queued for a slot")).Metric(labels=self.labels)
        self.finished = keep(F(name="pipeline_engine_requests_finished_total", kind=F.COUNTER,
                              description="Finished requests by reason (stop, length, cancelled, error, "
                                          "rejected: refused as busy)"))
        self.tokens = keep(F(name="pipeline_engine_generation_tokens_total", kind=F.COUNTER,
                            description="Tokens generated")).Metric(labels=self.labels)
        # vLLM's kv_cache_usage_perc, as a ratio: the target's KV blocks held (by running requests; cached blocks
        # nobody holds are free) over the pool's.
        self.kv_usage = keep(F(name="pipeline_engine_kv_cache_usage_ratio", kind=F.GAUGE,
                               description="Fraction of the target's KV-cache blocks held by running requests"
                               )).Metric(labels=self.labels)
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up, and those found cached.
        self.prefix_queries = keep(F(name="pipeline_engine_prefix_cache_queries_total", kind=F.COUNTER,
                                     description="Prompt tokens looked up in the prefix cache")).Metric(labels=self.labels)
        self.prefix_hits = keep(F(name="pipeline_engine_prefix_cache_hits_total", kind=F.COUNTER,
                                  description="Prompt tokens whose KV blocks came from the prefix cache"
                                  )).Metric(labels=self.labels)
        self._prefix_sent = (0, 0)
        self._by_reason: dict = {}
        self._tokens_sent = 0
        self._published = None
        self.last = 0.0

    def finish(self, reason: str):
        if reason not in self._by_reason:
            self._by_reason[reason] = self.finished.Metric(labels={**self.labels, "reason": reason})
        self._by_reason[reason].increment(1)

    def publish(self, engine):
        self.last = time.monotonic()
        blocks = engine.blocks
        state = (len(engine.running), len(engine.waiting), engine.stats.generated_tokens, blocks.num_held,
                 blocks.queried_tokens, blocks.hit_tokens)
        if state == self._published:  # idle: no IPC round trips
            return
        self._published = state
        self.running.set(state[0])
        self.waiting.set(state[1])
        self.kv_usage.set(blocks.num_held / blocks.num_blocks)
        queried, hits = blocks.queried_tokens, blocks.hit_tokens
        if queried > self._prefix_sent[0]:
            self.prefix_queries.increment(queried - self._prefix_sent[0])
        if hits > self._prefix_sent[1]:
            self.prefix_hits.increment(hits - self._prefix_sent[1])
        self._prefix_sent = (queried, hits)
        generated = state[2]
        if generated > self._tokens_sent:
            self.tokens.increment(generated - self._tokens_sent)
            self._tokens_sent = generated


@dataclass
class Stream:
    """One request's sending state, touched only by the scheduler thread."""

    sender: object
    stream: bool
    interval_s: float = STREAM_INTERVAL_MS / 1000  # the least time between two responses (stream_interval_ms)
    new: list = field(default_factory=list)  # tokens produced since the last response
    sent: int = 0  # output tokens already sent
    drafted: int = 0  # req.num_drafted / num_accepted / num_verify_steps at the last response
    accepted: int = 0
    verify_steps: int = 0
    skipped: dict = field(default_factory=dict)  # req.skip_reasons at the last response
    histogram: dict = field(default_factory=dict)  # req.accepted_per_step at the last response
    stream_id: str = ""  # the gate's id for this stream: its cancel mark is "engine-<id>"
    last_sent: float = 0.0  # time.monotonic() of the last response; 0 before the first
    probed_at: float = field(default_factory=time.monotonic)  # when it was queued, then its last keepalive
    polled_at: float = 0.0  # when its sender was last asked is_cancelled() (CANCEL_POLL_S)


def _since(counts: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The counts added since `before` (a request's skipped steps, or its steps by drafts accepted)."""
    return {key: n - before.get(key, 0) for key, n in counts.items() if n > before.get(key, 0)}


def _entry(token: int, lp) -> list:
    """One token's log probs as top_log_probs and prompt_log_probs carry them: [id, log prob, [[id, log prob], ...]]."""
    return [token, lp.logprob, [list(pair) for pair in lp.top]]


def _prompt_entries(req) -> list:
    """The prompt's log probs as prompt_log_probs carries them: an _entry per prompt token, the first's log prob and
    alternatives null (nothing predicts it)."""
    return [[req.prompt_ids[0], None, None]] + [_entry(tok, lp) for tok, lp in zip(req.prompt_ids[1:],
                                                                                   req.prompt_logprobs)]


def _generation_response(ids: list[int], prefix_length: int, accepted: int, drafted: int, verify_steps: int,
                         skipped: dict | None = None, histogram: dict | None = None,
                         logprobs: list[float] | None = None, top: list | None = None, text_limit: int = -1,
                         cached_tokens: int = 0, prompt: list | None = None):
    """One response in the engine's output tensors (pipeline.triton.interface GENERATION_TENSORS, less stream_id)."""
    def scalar(value, dtype=np.int32):
        return np.array([[value]], dtype)

    extras = [
        pb_utils.Tensor("output_log_probs", np.array([logprobs or [0.0] * len(ids)], np.float32)),
        pb_utils.Tensor("top_log_probs", scalar(json.dumps(top or []).encode(), np.object_)),
        pb_utils.Tensor("text_limit", scalar(text_limit)),
        pb_utils.Tensor("cached_tokens", scalar(cached_tokens)),
        pb_utils.Tensor("prompt_log_probs", scalar(json.dumps(prompt or []).encode(), np.object_)),
    ]

    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("output_ids", np.array([ids], np.int32)),
        pb_utils.Tensor("prefix_length", scalar(prefix_length)),
        pb_utils.Tensor("accepted_tokens", scalar(accepted)),
        pb_utils.Tensor("drafted_tokens", scalar(drafted)),
        pb_utils.Tensor("verify_steps", scalar(verify_steps)),
        pb_utils.Tensor("skipped_steps", scalar(json.dumps(skipped or {}).encode(), np.object_)),
        pb_utils.Tensor("acceptance_histogram", scalar(json.dumps(histogram or {}).encode(), np.object_)),
        *extras,
    ])


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()
        config = json.loads(args["model_config"])
        engine_dir = config["parameters"]["engine_dir"]["string_value"]
        # The repository's speculation_gate decides load and short outputs for every request (its own ceiling
        # and min tokens, which `pipeline bench --apply` rewrites) and sends "off" where they say no. The
        # engine folder's gate would be a second ceiling, from compile's defaults, on the "auto" requests the
        # repository's let through (a build with --gate-batch-size 64 skipped steps for load past 32): here
        # it never binds, and the planner still chooses each auto request's drafts step by step.
        manifest = read_engine_manifest(engine_dir)
        # `pipeline serve --device` (DEVICE_ENV) wins over the repository's own `device` (assemble's); auto is picked
        # here, in the process that runs the engine.
        device, line = DeviceChoice(served_device(config["parameters"], os.environ)).choose()
        pb_utils.Logger.log_info(f"{config['name']}: {line}")
        gate = GatePolicy(max_batch_size=manifest["max_batch_size"], hysteresis=0, min_tokens=0)
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict = {}  # Request -> Stream
        self.stopping = threading.Event()
        self.ready = threading.Event()
        # The engine is loaded on the thread that steps it. OpenMP gives each thread that starts parallel work a
        # team of its own; with a second team alive (the loader's) the threads outnumber the cores, libgomp stops
        # spinning between parallel regions, and each region waits for a futex wake: SmolLM2's steps on 2 cores
        # took 15 ms instead of 10 at one row, 19 instead of 13 at five.
        loaded: queue.Queue = queue.Queue()
        self.scheduler = threading.Thread(target=self._load_and_run, args=(loaded, engine_dir, device, gate),
                                          name="torch_engine-scheduler", daemon=True)
        self.scheduler.start()
        engine = loaded.get()
        if isinstance(engine, BaseException):
            raise engine
        self.engine = engine
        try:
            # Requests that may wait for a slot (0: no bound); past it a request is refused at once as busy.
            self.max_queue_size = int(config["parameters"].get("max_queue_size", {}).get("string_value", "0"))
            tokenizer = load_tokenizer(Path(engine_dir) / manifest["tokenizer"],
                                       config["parameters"].get("tokenizer_class", {}).get("string_value", ""))
            # The answer's text as postprocessing writes it (skip_special_tokens), for stop strings.
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            self.engine.detokenize = self.decode
            self.engine.tokenizer = tokenizer  # guided decoding's grammars read its vocabulary
            # llguidance's view of it, made now rather than at the first guided request: its 0.3 s (SmolLM2) in
            # Python would hold the GIL while every running request's steps waited. A tokenizer llguidance can't
            # read fails guided requests alone, as before, not the model.
            try:
                self.engine.guide_tokenizer()
            except Exception as err:  # noqa: BLE001
                pb_utils.Logger.log_warn(f"torch_engine: guided decoding unavailable: {client_message(err)}")
            self.text_vocab = len(tokenizer)
            self.special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
                i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
            self.metrics = EngineMetrics(config["name"]) if hasattr(pb_utils, "MetricFamily") else None
        except BaseException:
            self.stopping.set()  # the scheduler thread ends instead of stepping a half-made model
            raise
        finally:
            self.ready.set()

    def execute(self, requests):
        for request in requests:
            self.inbox.put((self._parse(request), request.get_response_sender()))
        return None

    def finalize(self):
        self.stopping.set()
        self.scheduler.join(timeout=10)

    def _parse(self, request):
        """The request's arguments, or the one line refusing it (sent by the scheduler thread). Its guide is compiled
        here, on the thread Triton calls execute on: a large grammar takes a while, and on the scheduler thread
        every running request's steps would wait for it."""
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        try:
            parsed = read_engine_request(get)
            parsed["compiled_guide"] = None if parsed["guide"] is None else self.engine.compile_guide(parsed["guide"])
            return parsed
        except Exception as err:  # noqa: BLE001  a malformed request fails alone
            return client_message(err, "torch_engine")

    # ---- the scheduler thread: everything below runs on it ------------------------------------

    def _load_and_run(self, loaded: queue.Queue, engine_dir: str, device: str, gate: GatePolicy):
        try:
            engine = load_engine(engine_dir, device=device, gate=gate)
        except BaseException as err:  # noqa: BLE001  initialize raises it: the model fails to load, in one line
            loaded.put(err)
            return
        loaded.put(engine)
        self.ready.wait()  # initialize sets up the rest (the tokenizer, the metrics) first
        self._run()

    def _run(self):
        while not self.stopping.is_set():
            try:
                self._admit(block=not self.engine.has_unfinished())
                self._cancel_abandoned()
                if self.engine.has_unfinished():
                    self.engine.step()
                self._send()
            except Exception as err:  # noqa: BLE001  a failed step fails its requests, not the model
                for req, state in list(self.streams.items()):
                    self.engine.cancel(req)
                    self._send_error(state, f"engine step failed: {client_message(err)}")
                self.streams.clear()
            if self.metrics is not None and time.monotonic() - self.metrics.last >= METRICS_EVERY_S:
                try:
                    self.metrics.publish(self.engine)
                except Exception as err:  # noqa: BLE001  metrics must never stop decoding
                    pb_utils.Logger.log_warn(f"torch_engine: metrics not published: {client_message(err)}")

    def _admit(self, block: bool):
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._start(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _start(self, parsed, sender):
        if isinstance(parsed, str):  # refused by _parse
            self._send_error(Stream(sender, False), parsed)
            return
        state = Stream(sender, parsed["stream"], parsed["stream_interval_ms"] / 1000, stream_id=parsed["stream_id"])
        # Those that will still wait once the next step fills the free slots (a burst arrives before any step).
        waiting = len(self.engine.waiting) - len(self.engine.free_slots)
        slots = self.engine.config.max_batch_size
        if self.max_queue_size and queue_is_full(waiting, self.max_queue_size, slots, parsed["resumed"]):
            # Refused before it queues: a client told "busy" now can retry or go elsewhere (a load balancer,
            # another replica); one left waiting minutes behind the queue hears nothing until then. Through the
            # ensemble the gate refuses first (serving_gate.Busy); this check covers direct callers and races.
            self._send_error(state, busy_message(waiting, slots, self.max_queue_size), busy=True)
            self._count_finish("rejected")
            return
        try:
            stops = tuple(dict.fromkeys(([parsed["end_id"]] if parsed["end_id"] >= 0 else []) + parsed["stop_ids"]))
            params = SamplingParams(max_tokens=parsed["max_tokens"], temperature=parsed["temperature"],
                                    top_p=parsed["top_p"], top_k=parsed["top_k"],
                                    seed=parsed["seed"] if parsed["temperature"] > 0 else None,
                                    stop_token_ids=stops, stop=parsed["stop_strings"],
                                    repetition_penalty=parsed["repetition_penalty"],
                                    presence_penalty=parsed["presence_penalty"],
                                    frequency_penalty=parsed["frequency_penalty"], logprobs=parsed["logprobs"],
                                    guide=parsed["guide"], min_tokens=parsed["min_tokens"],
                                    ignore_eos=parsed["ignore_eos"], logit_bias=parsed["logit_bias"],
                                    prompt_logprobs=parsed["prompt_logprobs"])
            req = self.engine.add_request(parsed["prompt_ids"], params, speculation=parsed["speculation"],
                                          on_tokens=self._on_tokens, num_draft_tokens=parsed["num_draft_tokens"],
                                          group=parsed["request_group"], guide=parsed["compiled_guide"],
                                          resume=parsed["resume_ids"], ahead=parsed["resumed"])
        except Exception as err:  # noqa: BLE001  a request the engine refuses fails alone
            self._send_error(state, client_message(err, "torch_engine"))
        else:
            # A resumed answer's start is what its client already has: sent, and resent only as the prefix its
            # first new text is decoded after.
            state.sent = req.num_resumed
            self.streams[req] = state

    def _on_tokens(self, req, tokens):
        state = self.streams.get(req)
        if state is not None:
            state.new.extend(tokens)

    def _cancel_abandoned(self):
        marked = cancel_marks.take_all("engine-")
        now = time.monotonic()
        for req, state in list(self.streams.items()):
            if state.stream_id and state.stream_id in marked:
                cancelled = True
            elif now - state.polled_at >= CANCEL_POLL_S:
                state.polled_at, cancelled = now, state.sender.is_cancelled()
            else:
                continue
            if cancelled:
                self.engine.cancel(req)
                state.sender.send(flags=FINAL)
                del self.streams[req]
                self._count_finish("cancelled")

    def _send(self):
        for req, state in list(self.streams.items()):
            if req.finished and req.error is not None:  # the engine ended this request alone
                self._send_error(state, f"request failed in the engine: {req.error}")
                del self.streams[req]
                self._count_finish("error")
            elif req.finished:
                self._respond(req, state, final=True)
                del self.streams[req]
                self._count_finish(req.finish_reason.value if req.finish_reason else "stop")
            elif state.stream and state.new and time.monotonic() - state.last_sent >= state.interval_s:
                self._respond(req, state, final=False)
            elif state.stream and req.status is RequestStatus.WAITING:
                self._keepalive(req, state)

    def _respond(self, req, state: Stream, final: bool):
        # Streaming: the new tokens after up to PREFIX_TOKENS already sent. Not streaming: the whole answer (after a
        # resumed answer's start, as a stream's first response).
        start = self._prefix_start(req.output_ids, state.sent)
        end = len(req.output_ids) if final else self._safe_end(req)
        # A stream's final response goes out even with no new tokens: it carries the FINAL flag, the last counts
        # and a stop string's cut (its ids are the resent prefix, which postprocessing turns into no text).
        if start == end and final and req.params.prompt_logprobs is not None and state.sent == 0:
            # No token, but the prompt's log probs to give (and the end token's): the prompt's last token as the
            # prefix carries them (as a keepalive does), and postprocessing writes no text for it.
            stop = [] if req.stop_logprob is None else [_entry(*req.stop_logprob)]
            state.sender.send(_generation_response(req.prompt_ids[-1:], 1, 0, 0, 0, top=stop,
                                                   prompt=_prompt_entries(req)), flags=FINAL)
        elif start == end and final:
            # No token at all (the first one was a stop token): Triton's ensemble takes a [1, 0] output_ids for a
            # missing input and fails the request, so the answer ends with a bare final flag instead.
            state.sender.send(flags=FINAL)
        elif not state.stream or end > state.sent or final:
            skipped = _since(req.skip_reasons, state.skipped)
            sent = state.sent  # a whole answer's is 0, or a resumed one's start, until this, its only response
            logprobs = top = None
            if req.params.logprobs is not None:  # a resumed start's tokens have none: in the prefix, dropped there
                logprobs = [0.0 if lp is None else lp.logprob for lp in req.logprobs[start:end]]
                top = [_entry(tok, lp) for tok, lp in zip(req.output_ids[sent:end], req.logprobs[sent:end])]
                if final and req.stop_logprob is not None:  # a scored prompt's end token (Request.stop_logprob)
                    top.append(_entry(*req.stop_logprob))
            # The prompt's log probs, once: in the response that carries the first token.
            prompt = _prompt_entries(req) if sent == 0 and req.params.prompt_logprobs is not None else None
            limit = -1
            if final and req.stop_text_len is not None:  # cut just before the stop string, past what was sent
                limit = max(0, req.stop_text_len - len(self._visible(req.output_ids[:sent])))
            response = _generation_response(req.output_ids[start:end], sent - start,
                                            req.num_accepted - state.accepted, req.num_drafted - state.drafted,
                                            req.num_verify_steps - state.verify_steps, skipped,
                                            _since(req.accepted_per_step, state.histogram), logprobs, top, limit,
                                            req.num_cached_tokens, prompt)
            state.skipped, state.histogram = dict(req.skip_reasons), dict(req.accepted_per_step)
            state.sender.send(response, flags=FINAL if final else 0)
            state.last_sent = time.monotonic()
        state.sent, state.new = max(state.sent, end), []
        state.accepted, state.drafted, state.verify_steps = req.num_accepted, req.num_drafted, req.num_verify_steps

    def _visible(self, ids) -> str:
        """The text postprocessing has written for `ids`."""
        return visible_text(self.decode(ids))

    def _safe_end(self, req) -> int:
        """Output tokens a stream may send now: with stop strings, not those whose text a stop string could still
        start in, since the answer may yet be cut there (pipeline.triton.stop_text)."""
        return sendable(req.output_ids, req.params.stop or (), self.decode)

    def _keepalive(self, req, state: Stream):
        """An empty response for a stream waiting in the queue, so a client that left is noticed (KEEPALIVE_S).
        Its one id is the prompt's last token given as the prefix: postprocessing answers with no text."""
        now = time.monotonic()
        if now - state.probed_at < KEEPALIVE_S:
            return
        state.sender.send(_generation_response(req.prompt_ids[-1:], 1, 0, 0, 0))
        state.probed_at = now

    def _count_finish(self, reason: str):
        if self.metrics is not None:
            try:
                self.metrics.finish(reason)
            except Exception:  # noqa: BLE001  metrics must never stop decoding
                pass

    def _prefix_start(self, ids, sent: int) -> int:
        start, text_tokens = sent, 0
        while start > 0 and text_tokens < PREFIX_TOKENS:
            start -= 1
            text_tokens += 0 <= ids[start] < self.text_vocab and ids[start] not in self.special_ids
        return start

    @staticmethod
    def _send_error(state: Stream, message: str, busy: bool = False):
        # busy: gRPC UNAVAILABLE, which clients retry. TritonError exists only once the stub has started.
        error = (pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE) if busy
                 else pb_utils.TritonError(message))
        state.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
