"""Triton python model `speculation_gate` (decoupled): decides speculation per request, runs the engine.

The admission policy (load with hysteresis, min tokens, per-request override) is
`pipeline.policy.serving_gate.ServingGate`; how many tokens a request drafts at each step, from its own
acceptance, is the planner's (policy/draft_plan.py, docs/gate.md). Per backend:
- torch: the portable engine model (decoupled, BLS) gets the decision in its `speculation` tensor:
  "auto" when the gate lets it speculate (the engine's planner decides each step), "off" when not, "on"
  only when the client forced it. Each response is relayed, its skipped steps relabelled with the gate's
  own reason where the gate turned the request off.
- trtllm: `pipeline.triton.draft_target` runs the draft -> target loop for speculating requests
  (the draft proposes up to K tokens, the target verifies them through draft_input_ids) and calls the
  target alone otherwise.

Each stream is driven by its own worker thread (a BLS response iterator blocks), but every response
and every metric update goes out from ONE sender thread: a decoupled model sending from many threads
at once crashed the python backend at 40 streams.

Metrics (Prometheus, on Triton's metrics port), named after vLLM's and TensorRT-LLM's:
  pipeline_requests_total{mode=speculative|standard, reason=...}
  pipeline_spec_decode_num_draft_tokens_total, pipeline_spec_decode_num_accepted_tokens_total,
  pipeline_spec_decode_num_drafts_total (verification steps),
  pipeline_spec_decode_skipped_steps_total{reason=...} (decode steps that drafted nothing, and why),
  pipeline_spec_decode_acceptance_rate, pipeline_spec_decode_mean_acceptance_length (rolling window),
  pipeline_gate_speculating (1/0), pipeline_gate_threshold, pipeline_gate_in_flight,
  pipeline_gate_flips_total, pipeline_gate_rejected_total (refused as busy, before the engine),
  pipeline_prompt_tokens_total, pipeline_generation_tokens_total (tokens sent on to postprocessing),
  pipeline_time_to_first_token_seconds, pipeline_inter_token_latency_seconds,
  pipeline_e2e_request_latency_seconds (histograms; which requests each observes: pipeline.triton.latency).
The engine exports its own (torch_engine: running and waiting requests, KV-cache usage).
"""

import itertools
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.errors import PipelineError
from pipeline.heap import release_memory
from pipeline.policy.draft_plan import read_counts
from pipeline.policy.gate_policy import GatePolicy
from pipeline.policy.serving_gate import OVERRIDE, Busy, Decision, ServingGate
from pipeline.routes import PORTABLE, route_named
from pipeline.triton import cancel_marks
from pipeline.triton.bls_streams import ENDED
from pipeline.triton.client_errors import client_message, stopping_refusal
from pipeline.triton.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, RequestClock
from pipeline.triton.stub_exit import exit_without_teardown

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# What the engine returns; the gate adds stream_id.
ENGINE_OUTPUTS = ["output_ids", "prefix_length", "accepted_tokens", "drafted_tokens", "verify_steps", "skipped_steps",
                  "acceptance_histogram", "output_log_probs", "top_log_probs", "text_limit", "cached_tokens",
                  "prompt_log_probs"]
GENERATION_OUTPUTS = ENGINE_OUTPUTS + ["stream_id"]
METRICS_EVERY_S = 0.1  # metric updates are IPC round trips: batch them rather than send one per token


def _defaults(outputs: dict) -> dict:
    """The generation tensors an engine left out (the TensorRT-LLM loop sends log probs only where they were asked
    for, and no stop-string cut or prefix-cache count), at their neutral values: postprocessing always gets every
    input."""
    return {"output_log_probs": np.zeros(outputs["output_ids"].shape, np.float32),
            "top_log_probs": np.array([[b"[]"]], np.object_), "text_limit": np.array([[-1]], np.int32),
            "cached_tokens": np.array([[0]], np.int32), "prompt_log_probs": np.array([[b"[]"]], np.object_),
            **outputs}


def _trtllm_refusal(request, guided: bool) -> str | None:
    """What the TensorRT-LLM route can't serve, in one line: penalties, each token's log prob and a guide go to the
    tensorrt_llm model as its own inputs (draft_target), but it has no top-N alternatives to give, and no guided
    decoding where compile wrote no tokenizer file for it (guided: the repository's target has one)."""
    guide = pb_utils.get_input_tensor_by_name(request, "guided_decoding_guide_type")
    if not guided and guide is not None and guide.as_numpy().size and guide.as_numpy().reshape(-1)[0]:
        return ("this repository's tensorrt_llm model has guided decoding off (its engine folder has no "
                "xgrammar_tokenizer_info.json); rerun `pipeline compile` and `pipeline assemble`, or leave "
                "guided_decoding_guide_type out")
    for name, neutral in (("min_tokens", (0, 1)), ("ignore_eos", (False,)), ("logit_bias", ("{}",)),
                          ("prompt_logprobs", (-1,)), ("resume_length", (0,))):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None and tensor.as_numpy().size and _scalar(request, name) not in neutral:
            sent = "resume_token_ids" if name == "resume_length" else name  # the ensemble input it came from
            return (f"{sent} isn't passed to the TensorRT-LLM route's tensorrt_llm models yet; serve the portable "
                    "engine (pipeline build --backend torch) for it, or leave it out")
    n = int(_scalar(request, "num_logprobs"))
    if n:
        return (f"num_logprobs {n} isn't served on the TensorRT-LLM route (its tensorrt_llm model returns each "
                f"token's own log prob, no alternatives); send 0 or leave it out")
    return None


def _scalar(request, name):
    value = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else value


def _resumed(request) -> bool:
    """Whether the request is a retry of one a lost server held (preprocessing's resumed)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "resumed")
    return tensor is not None and tensor.as_numpy().size > 0 and bool(tensor.as_numpy().reshape(-1)[0])


class EngineError(PipelineError):
    """The engine model answered with an error response; `code` is its TritonError code, passed on so a
    busy engine's UNAVAILABLE reaches the client as a retryable status."""

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code


def _skipped(outputs: dict, decision: Decision) -> dict[str, int]:
    """A response's steps without drafts, by reason. The engine counts a request the gate sent as "off" under
    "override"; the gate's own reason (load, short) replaces that unless the client really asked for off."""
    raw = outputs.get("skipped_steps")
    skipped = read_counts(raw.reshape(-1)[0]) if raw is not None and raw.size else {}
    if not decision.speculate and decision.reason != OVERRIDE and OVERRIDE in skipped:
        skipped[decision.reason] = skipped.get(decision.reason, 0) + skipped.pop(OVERRIDE)
    return skipped


def _trtllm_plain_reason(request) -> str | None:
    from pipeline.triton.draft_target import TritonRequest

    return TritonRequest.from_tensors({t.name(): t.as_numpy() for t in request.inputs()}).plain_reason


class Metrics:
    """The gate's Prometheus families. Touched only by the sender thread."""

    def __init__(self, model: str):
        # Every sample carries the model's name, as Triton's own metrics do (and a family's samples
        # with no labels at all did not show on the metrics port).
        self.labels = {"model": model}
        F = pb_utils.MetricFamily
        # Each Metric needs its family kept referenced, or every update fails with
        # "the corresponding 'MetricFamily' has been deleted".
        self.families = []

        def keep(family):
            self.families.append(family)
            return family

        def family(name, kind, description):
            return keep(F(name=name, description=description, kind=kind))

        self.requests = family("pipeline_requests_total", F.COUNTER, "Requests by decoding mode and the gate's reason")
        self.drafted = family("pipeline_spec_decode_num_draft_tokens_total", F.COUNTER,
                              "Draft tokens proposed").Metric(labels=self.labels)
        self.accepted = family("pipeline_spec_decode_num_accepted_tokens_total", F.COUNTER,
                               "Draft tokens accepted by the target").Metric(labels=self.labels)
        self.drafts = family("pipeline_spec_decode_num_drafts_total", F.COUNTER,
                             "Target verification steps that checked drafts").Metric(labels=self.labels)
        self.rate = family("pipeline_spec_decode_acceptance_rate", F.GAUGE,
                           "Accepted / drafted over the gate's rolling window").Metric(labels=self.labels)
        self.length = family("pipeline_spec_decode_mean_acceptance_length", F.GAUGE,
                             "Tokens per verification step over the rolling window").Metric(labels=self.labels)
        self.speculating = family("pipeline_gate_speculating", F.GAUGE,
                                  "1 while auto requests speculate, 0 while the gate holds them off").Metric(labels=self.labels)
        self.threshold = family("pipeline_gate_threshold", F.GAUGE,
                                "Requests in flight above which speculation turns off").Metric(labels=self.labels)
        self.in_flight = family("pipeline_gate_in_flight", F.GAUGE, "Requests in flight").Metric(labels=self.labels)
        self.flips = family("pipeline_gate_flips_total", F.COUNTER, "Times the load gate changed state").Metric(labels=self.labels)
        self.rejected = family("pipeline_gate_rejected_total", F.COUNTER,
                               "Requests refused as busy before reaching the engine (its slots and queue full)"
                               ).Metric(labels=self.labels)
        self.skipped = family("pipeline_spec_decode_skipped_steps_total", F.COUNTER,
                              "Decode steps of speculating-capable requests that drafted nothing, by reason")
        self.prompt_tokens = family("pipeline_prompt_tokens_total", F.COUNTER,
                                    "Prompt tokens of requests the gate admitted").Metric(labels=self.labels)
        self.generation_tokens = family("pipeline_generation_tokens_total", F.COUNTER,
                                        "Generated tokens sent on to the client").Metric(labels=self.labels)

        def histogram(name, description, buckets):
            return family(name, F.HISTOGRAM, description).Metric(labels=self.labels, buckets=list(buckets))

        self.ttft = histogram("pipeline_time_to_first_token_seconds",
                              "Time to the first token of streamed requests", TTFT_BUCKETS)
        self.itl = histogram("pipeline_inter_token_latency_seconds",
                             "Time per output token after the first, of streamed requests (one observation "
                             "a response)", ITL_BUCKETS)
        self.e2e = histogram("pipeline_e2e_request_latency_seconds",
                             "Time from the gate's receipt to the last token, of requests that ended without "
                             "an error", E2E_BUCKETS)
        self._by_mode: dict = {}
        self._by_skip: dict = {}
        self._flips_sent = 0
        self._rejected_sent = 0
        self.pending_tokens = [0, 0]  # prompt, generation: published with the rest, not one IPC a response

    def count_request(self, speculate: bool, reason: str):
        key = ("speculative" if speculate else "standard", reason)
        if key not in self._by_mode:
            self._by_mode[key] = self.requests.Metric(labels={**self.labels, "mode": key[0], "reason": key[1]})
        self._by_mode[key].increment(1)

    def count_skipped(self, skipped: dict[str, int]):
        for reason, n in skipped.items():
            if reason not in self._by_skip:
                self._by_skip[reason] = self.skipped.Metric(labels={**self.labels, "reason": reason})
            self._by_skip[reason].increment(n)

    def observe(self, ttft: float | None = None, itl: float | None = None, e2e: float | None = None):
        for metric, value in ((self.ttft, ttft), (self.itl, itl), (self.e2e, e2e)):
            if value is not None:
                metric.observe(value)

    def publish(self, gate: ServingGate, drafted: int, accepted: int, steps: int):
        for metric, n in zip((self.prompt_tokens, self.generation_tokens), self.pending_tokens):
            if n:
                metric.increment(n)
        self.pending_tokens = [0, 0]
        if drafted:
            self.drafted.increment(drafted)
            self.accepted.increment(accepted)
        if steps:
            self.drafts.increment(steps)
        self.rate.set(gate.acceptance_rate)
        self.length.set(gate.mean_acceptance_length)
        self.speculating.set(1.0 if gate.speculating else 0.0)
        self.threshold.set(gate.policy.max_batch_size)
        self.in_flight.set(gate.in_flight)
        if gate.flips > self._flips_sent:
            self.flips.increment(gate.flips - self._flips_sent)
            self._flips_sent = gate.flips
        if gate.rejected > self._rejected_sent:
            self.rejected.increment(gate.rejected - self._rejected_sent)
            self._rejected_sent = gate.rejected


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        # The engine route's repository: the gate runs the draft-target loop over upstream's tensorrt_llm models
        self.drives_engines = route_named(params.get("backend", PORTABLE.repo_backend)).upstream_engine_models
        self.engine_model = params["engine_model"]
        self.draft_model = params.get("draft_model", "")
        self.is_text = None
        if self.drives_engines:  # which ids are text, for the streamed prefix resend
            from pipeline.triton.draft_target import text_token_filter
            self.is_text = text_token_filter(params["tokenizer_dir"])
        self.num_draft_tokens = int(params.get("num_draft_tokens", "4"))
        self.guided = params.get("guided_decoding", "off") == "on"  # trtllm: the target takes guides
        self.gate = ServingGate(
            GatePolicy(max_batch_size=int(params["gate_max_batch_size"]),
                       hysteresis=int(params["gate_hysteresis"]), min_tokens=int(params["gate_min_tokens"])),
            slots=int(params.get("engine_slots", "0")), max_queue_size=int(params.get("engine_max_queue_size", "0")))
        self.metrics = Metrics(json.loads(args["model_config"])["name"]) if hasattr(pb_utils, "MetricFamily") else None
        self._pending = [0, 0, 0]  # drafted, accepted, steps not yet published; sender thread only
        self._stream_ids = itertools.count(1)
        cancel_marks.clear()
        # Callables run by the sender thread, in order; None ends it.
        self.outbox: queue.Queue = queue.Queue()
        self.sender_thread = threading.Thread(target=self._send_loop, name="gate-sender", daemon=True)
        self.sender_thread.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            arrival = time.monotonic()
            if (refusal := stopping_refusal()) is not None:  # the server is stopping: retried elsewhere
                self._send(sender, refusal, FINAL)
                continue
            refusal = _trtllm_refusal(request, self.guided) if self.drives_engines else None
            if refusal is not None:
                self._send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)), FINAL)
                continue
            try:
                decision = self.gate.admit(str(_scalar(request, "speculation")),
                                           int(_scalar(request, "request_output_len")), resumed=_resumed(request))
            except Busy as err:  # UNAVAILABLE, as the engine's own refusal: clients retry it (counted by publish)
                self._send(sender, pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(err), pb_utils.TritonError.UNAVAILABLE)), FINAL)
                continue
            except Exception as err:  # noqa: BLE001  a malformed request fails alone
                self._send(sender, pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(client_message(err, "speculation_gate"))), FINAL)
                continue
            if self.drives_engines and decision.speculate and not self.draft_model:
                decision = Decision(False, "no_draft")  # a repository serving the target engine alone
            elif self.drives_engines and decision.speculate and (reason := _trtllm_plain_reason(request)):
                # The TensorRT-LLM loop speculates for greedy requests without a guide, penalties or log probs only
                # (draft_target): guided, sampled, penalties, log_probs.
                decision = Decision(False, reason)
            self.outbox.put(lambda d=decision, n=int(_scalar(request, "input_lengths")): self._count_request(d, n))
            clock = RequestClock(arrival, streamed=bool(_scalar(request, "stream")))
            threading.Thread(target=self._run, args=(request, sender, decision, next(self._stream_ids), clock),
                             daemon=True).start()
        return None

    def _count_request(self, decision: Decision, prompt_tokens: int):  # on the sender thread
        if self.metrics is not None:
            self.metrics.count_request(decision.speculate, decision.reason)
            self.metrics.pending_tokens[0] += prompt_tokens

    def finalize(self):
        self.outbox.put(None)
        self.sender_thread.join(timeout=10)
        cancel_marks.clear()

    # ---- one request, on its worker thread -------------------------------------------------------

    def _run(self, request, sender, decision, stream_id: int, clock: RequestClock):
        # The client's cancel reaches us through postprocessing (cancel_marks); is_cancelled covers a
        # client calling this model directly. A client's stop (the stop_request model, by the id the client gave the
        # request, which Triton hands every step of the ensemble) ends it the same way, and the final response
        # below then ends the stream the client still reads.
        stop = cancel_marks.stop_key(request.request_id()) if request.request_id() else None

        def cancelled() -> bool:  # asked by this worker only (bls_streams)
            return (ENDED.is_cancelled(sender) or cancel_marks.take(f"stream-{stream_id}")
                    or (stop is not None and cancel_marks.take(stop)))

        def forward(outputs: dict):
            self._forward(sender, {**_defaults(outputs), "stream_id": np.array([[stream_id]], np.uint64)}, decision,
                          clock)

        try:
            if self.drives_engines:
                from pipeline.triton.draft_target import serve_request

                tensors = {t.name(): t.as_numpy() for t in request.inputs()}
                k = int(tensors.get("num_draft_tokens", np.array([[self.num_draft_tokens]])).reshape(-1)[0])
                k = min(k, self.num_draft_tokens)  # the target engine's max_draft_len; TensorRT-LLM refuses more
                serve_request(tensors, speculate=decision.speculate, num_draft_tokens=k, target_model=self.engine_model,
                         draft_model=self.draft_model, send=forward, cancelled=cancelled, is_text=self.is_text,
                         reason=decision.reason, forced=decision.speculate and decision.reason == OVERRIDE)
            else:
                self._relay_engine(request, decision, stream_id, forward, cancelled)
            cancelled()  # ended streams wait for an answer asked after them (bls_streams): this one's own
        except Exception as err:  # noqa: BLE001  one failed stream must not take the model down
            error = client_message(err, "speculation_gate")  # an EngineError: the engine's own line, as it is
            code = err.code if isinstance(err, EngineError) else None
        else:
            error = code = None
        self.gate.leave()
        if self.gate.in_flight == 0:  # the burst is over: what its threads' arenas hold goes back (pipeline.heap)
            self.outbox.put(release_memory)
        # An error goes out as the stream's final response: an error followed by a separate empty final left
        # the ensemble holding this model until Triton's 30 s exit timeout at unload.
        if error is None:
            e2e = clock.end(time.monotonic())
            self._send(sender, None, FINAL, observe=lambda m: m.observe(e2e=e2e))
        else:
            triton_error = pb_utils.TritonError(error) if code is None else pb_utils.TritonError(error, code)
            self._send(sender, pb_utils.InferenceResponse(error=triton_error), FINAL)

    def _relay_engine(self, request, decision, stream_id: int, forward, cancelled):
        requested = str(_scalar(request, "speculation"))
        speculation = requested if decision.reason == "override" else ("auto" if decision.speculate else "off")
        inputs = [t for t in request.inputs() if t.name() != "speculation"]
        inputs.append(pb_utils.Tensor("speculation", np.array([[speculation.encode()]], np.object_)))
        inputs.append(pb_utils.Tensor("stream_id", np.array([[stream_id]], np.uint64)))
        responses = pb_utils.InferenceRequest(
            model_name=self.engine_model, inputs=inputs,
            requested_output_names=ENGINE_OUTPUTS).exec(decoupled=True)
        try:
            for response in responses:
                if cancelled():
                    # Tell the engine, which frees the slot: by mark (any Triton), and by cancel() where
                    # the python backend has it (2025 and later).
                    cancel_marks.mark(f"engine-{stream_id}")
                    if hasattr(responses, "cancel"):
                        responses.cancel()
                    break
                if response.has_error():
                    error = response.error()
                    raise EngineError(error.message(), error.code() if hasattr(error, "code") else None)
                tensors = response.output_tensors()
                if tensors:
                    # Copied out of the python backend's shared memory, which then frees at once: a view would
                    # hold it until the sender thread got to this response, and the region grows, never shrinks.
                    forward({t.name(): np.array(t.as_numpy()) for t in tensors})
                del response, tensors
        finally:
            ENDED.end(responses)  # read to its end, and held until the stub lets go of it first (bls_streams)

    def _forward(self, sender, outputs: dict, decision: Decision, clock: RequestClock):
        """Queue one generation response (GENERATION_OUTPUTS as numpy arrays) and count its drafts, the
        steps that drafted nothing, its tokens and its latency."""
        counts = [int(outputs[name].reshape(-1)[0]) if name in outputs else 0
                  for name in ("drafted_tokens", "accepted_tokens", "verify_steps")]
        self.gate.record(*counts)
        skipped = _skipped(outputs, decision)
        outputs["skipped_steps"] = np.array([[json.dumps(skipped).encode()]], np.object_)
        new_tokens = outputs["output_ids"].size - int(outputs["prefix_length"].reshape(-1)[0])
        ttft, itl = clock.response(new_tokens, time.monotonic())

        def observe(metrics: Metrics):
            metrics.pending_tokens[1] += max(new_tokens, 0)
            metrics.observe(ttft=ttft, itl=itl)
        self._send(sender, pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(outputs[name])) for name in GENERATION_OUTPUTS
                            if name in outputs]), 0, counts, skipped, observe)

    def _send(self, sender, response, flags=0, counts=(0, 0, 0), skipped=None, observe=None):
        def send():
            for i, v in enumerate(counts):
                self._pending[i] += v
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            finally:  # counted even where a cancelled client's sender refused the send
                if self.metrics is not None:
                    try:
                        if skipped:
                            self.metrics.count_skipped(skipped)
                        if observe is not None:
                            observe(self.metrics)
                    except Exception as err:  # noqa: BLE001  metrics must never stop responses
                        pb_utils.Logger.log_warn(f"speculation_gate: metrics not updated: {client_message(err)}")
        self.outbox.put(send)

    # ---- the sender thread -----------------------------------------------------------------------

    def _send_loop(self):
        last_publish, dirty = 0.0, True
        while True:
            try:
                job = self.outbox.get(timeout=METRICS_EVERY_S)
            except queue.Empty:
                job = ()
            if job is None:
                return
            if job:
                dirty = True
                try:
                    job()
                except Exception:  # noqa: BLE001  a cancelled client's sender refuses sends; others go on
                    pass
            if self.metrics is not None and dirty and time.monotonic() - last_publish >= METRICS_EVERY_S:
                last_publish, dirty = time.monotonic(), False
                try:
                    self.metrics.publish(self.gate, *self._pending)
                except Exception as err:  # noqa: BLE001  metrics must never stop responses
                    pb_utils.Logger.log_warn(f"speculation_gate: metrics not published: {client_message(err)}")
                self._pending = [0, 0, 0]
