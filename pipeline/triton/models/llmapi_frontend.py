"""Triton python model `llmapi_frontend` (decoupled): the LLM-API route's ensemble step.

TensorRT-LLM's llmapi model (behind it as `tensorrt_llm`, loaded by models/llmapi.py) takes text and
answers with the text so far in every streamed response (CompletionOutput.text, not its diff), with no
token ids. This model gives clients the interface the other routes have (pipeline.triton.interface):
it validates the request as preprocessing does, renders the chat template, maps our inputs onto the
llmapi model's sampling_param_* inputs (pipeline.trtllm.upstream.LLMAPI_INPUTS), always streams from it,
and answers with deltas: text_output the new text, num_output_tokens its tokens. The llmapi model has
no token ids to give, so the count is the target tokenizer's count of the text so far, differenced: it
can be off by one where a token decodes to nothing (special tokens) or re-encodes differently.

What the LLM API can't take per request is refused in one line, never ignored: speculation "on"/"off"
(TensorRT-LLM decides per batch, speculative_config.max_concurrency), a num_draft_tokens other than
the compiled one, end_id (its llmapi model reads none), penalties and log probs (_sampling_refusal). Stop words
go as sampling_param_stop, text the LLM API matches itself. Drafted/accepted counts are 0: its only
source, return_perf_metrics, returns strings in 1.2 (tensors built with text_output's dtype).

Each request runs on its own worker thread (a BLS response iterator blocks); every response goes out
from ONE sender thread, as in speculation_gate: a decoupled model sending from many threads at once
crashed the python backend at 40 streams.
"""

import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.errors import PipelineError, RequestError
from pipeline.models.tokenizer import load_tokenizer, prompt_text, template_opening
from pipeline.triton.bls_streams import ENDED
from pipeline.triton.client_errors import client_message, stopping_refusal
from pipeline.triton.stub_exit import exit_without_teardown
from pipeline.triton.validate import check_length, read_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _sampling_refusal(r) -> str | None:
    """The penalties and log probs the LLM-API route can't pass on, in one line naming the input. TensorRT-LLM's
    llmapi model reads no repetition penalty and returns no per-token log probs (LLMAPI_HELPERS
    get_sampling_params_from_request; only a cumulative one); it does read sampling_param_presence_penalty and
    sampling_param_frequency_penalty, which pipeline.trtllm.upstream.LLMAPI_INPUTS doesn't record yet, so this
    route sends them nowhere."""
    if r.repetition_penalty != 1.0:
        return (f"repetition_penalty {r.repetition_penalty:g} isn't served on the LLM-API route (TensorRT-LLM's "
                f"llmapi model takes none); send 1 or leave it out")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name) != 0.0:
            return (f"{name} {getattr(r, name):g} isn't passed to the LLM-API route's llmapi model yet; send 0 or "
                    f"leave it out")
    if r.return_log_probs:
        return ("return_log_probs isn't served on the LLM-API route (TensorRT-LLM's llmapi model returns no "
                "per-token log probs); send false or leave it out")
    for name, neutral in (("min_tokens", (0, 1)), ("ignore_eos", (False,)), ("logit_bias", ((),)),
                          ("prompt_logprobs", (-1,)), ("prompt_ids", (None,))):
        if getattr(r, name) not in neutral:
            return f"{name} isn't passed to the LLM-API route's llmapi model yet; leave it out"
    if r.resume_ids:
        return ("resume_token_ids isn't served on the LLM-API route (its llmapi model returns text, no token ids to "
                "resume from); leave it out")
    if r.guide is not None:  # LLMAPI_HELPERS get_sampling_params_from_request reads no guided-decoding input
        return ("guided_decoding_guide_type isn't served by the LLM-API route's Triton model (TensorRT-LLM's llmapi "
                "model reads no guide); send response_format to compile's trtllm-serve (serve.sh), serve the "
                "engine route or the portable engine, or leave it out")
    return None


class TritonPythonModel:
    def initialize(self, args):
        exit_without_teardown()
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.raw = params["apply_chat_template"] != "true"
        self.opening = template_opening(self.tokenizer)  # an already rendered conversation isn't templated again
        self.max_seq_len = int(params["max_seq_len"])
        self.num_draft_tokens = int(params["num_draft_tokens"])
        self.max_input_bytes = int(params["max_input_bytes"])
        self.llmapi_model = params["llmapi_model"]
        self.outbox: queue.Queue = queue.Queue()
        self.sender = threading.Thread(target=self._send_loop, name="llmapi-sender", daemon=True)
        self.sender.start()
        # The same gauge as speculation_gate's, so one autoscaling rule (pipeline deploy kubernetes) reads every
        # route: TensorRT-LLM gates inside its executor, and this is where its requests are counted.
        self._family = pb_utils.MetricFamily(name="pipeline_gate_in_flight", description="Requests in flight",
                                             kind=pb_utils.MetricFamily.GAUGE)  # kept: a Metric needs its family
        self.in_flight_gauge = self._family.Metric(labels={"model": args["model_name"]})
        self.in_flight = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if (refusal := stopping_refusal()) is not None:  # the server is stopping: retried elsewhere
                self._send(sender, refusal, FINAL)
                continue
            threading.Thread(target=self._run, args=(request, sender), daemon=True).start()
        return None

    def finalize(self):
        self.outbox.put(None)
        self.sender.join(timeout=10)

    # ---- one request, on its worker thread ------------------------------------------------------------

    def _count(self, delta: int):
        with self.lock:
            self.in_flight += delta
            self.in_flight_gauge.set(self.in_flight)

    def _run(self, request, sender):
        self._count(+1)
        try:
            inputs, stream = self._inputs(request)
            self._relay(inputs, stream, sender)
        except Exception as err:  # noqa: BLE001  one failed request must not take the model down
            error = client_message(err, "llmapi_frontend")
        else:
            error = None
        finally:
            self._count(-1)
        # An error is the stream's final response: an error then a separate empty final left Triton 2.51's
        # ensemble holding the request until its 30 s exit timeout at unload (as in speculation_gate).
        if error is None:
            self._send(sender, None, FINAL)
        else:
            self._send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(error)), FINAL)

    def _inputs(self, request) -> tuple[list, bool]:
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        r = read_request(get, max_seq_len=self.max_seq_len, max_input_bytes=self.max_input_bytes,
                         num_draft_tokens=self.num_draft_tokens, vocab_size=len(self.tokenizer))
        if r.speculation != "auto":
            raise RequestError(f"speculation {r.speculation!r} can't be set per request on the LLM-API route: "
                               f"TensorRT-LLM decides per batch (speculative_config.max_concurrency); send auto")
        if r.num_draft_tokens != self.num_draft_tokens:
            raise RequestError(f"num_draft_tokens {r.num_draft_tokens} can't be set per request on the LLM-API route "
                               f"(it is {self.num_draft_tokens}, compiled in); leave it out")
        if (refusal := _sampling_refusal(r)) is not None:
            raise RequestError(refusal)
        if r.end_id is not None:
            raise RequestError("end_id isn't supported on the LLM-API route (TensorRT-LLM's llmapi model stops at "
                               "the tokenizer's end of text); leave it out, or send stop_words")
        prompt = prompt_text(self.tokenizer, r.text, r.raw(self.raw), self.opening)
        check_length(len(self.tokenizer(prompt).input_ids), r.max_tokens, self.max_seq_len)

        def t(name, value, dtype):
            return pb_utils.Tensor(name, np.array(value, dtype))

        inputs = [t("text_input", [prompt.encode()], np.object_), t("streaming", [True], np.bool_),
                  t("sampling_param_max_tokens", [r.max_tokens], np.int32),
                  t("sampling_param_exclude_input_from_output", [True], np.bool_)]
        if r.temperature == 0.0 or r.top_k == 1:  # greedy, as the other routes read temperature 0
            inputs.append(t("sampling_param_top_k", [1], np.int32))
        else:
            inputs += [t("sampling_param_temperature", [r.temperature], np.float32),
                       t("sampling_param_top_p", [r.top_p], np.float32),
                       t("sampling_param_seed", [r.seed], np.uint64)]
            if r.top_k > 0:
                inputs.append(t("sampling_param_top_k", [r.top_k], np.int32))
        if r.stop_words:
            inputs.append(t("sampling_param_stop", [w.encode() for w in r.stop_words], np.object_))
        return inputs, r.stream

    def _relay(self, inputs, stream: bool, sender):
        responses = pb_utils.InferenceRequest(model_name=self.llmapi_model, inputs=inputs,
                                              requested_output_names=["text_output"]).exec(decoupled=True)
        sent_text, sent_tokens, text = "", 0, ""
        try:
            for response in responses:
                if ENDED.is_cancelled(sender):  # this request's worker is the only one to ask (bls_streams)
                    if hasattr(responses, "cancel"):  # python backend >= 24.04: TensorRT-LLM aborts the request
                        responses.cancel()
                    return
                if response.has_error():
                    raise PipelineError(response.error().message())
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if "text_output" not in outputs:
                    continue
                item = outputs["text_output"].reshape(-1)[0]
                text = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
                if stream:
                    sent_text, sent_tokens = self._answer(sender, text, sent_text, sent_tokens)
        finally:
            ENDED.end(responses)  # read to its end, and held until the stub lets go of it first (bls_streams)
        ENDED.is_cancelled(sender)  # ended streams wait for an answer asked after them: this one's own
        if not stream or text != sent_text:
            self._answer(sender, text, sent_text, sent_tokens)

    def _answer(self, sender, text: str, sent_text: str, sent_tokens: int) -> tuple[str, int]:
        """Send what `text` adds to what was sent; returns the new (sent text, sent token count)."""
        delta = text[len(sent_text):] if text.startswith(sent_text) else text
        tokens = len(self.tokenizer(text, add_special_tokens=False).input_ids)

        def count(n):
            return np.array([[n]], np.int32)

        self._send(sender, pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[delta.encode()]], np.object_)),
            pb_utils.Tensor("num_accepted_tokens", count(0)), pb_utils.Tensor("num_drafted_tokens", count(0)),
            pb_utils.Tensor("num_output_tokens", count(max(0, tokens - sent_tokens))),
            # TensorRT-LLM's own gate decides inside its executor; it reports no per-step reasons.
            pb_utils.Tensor("num_draft_steps", count(0)),
            pb_utils.Tensor("skipped_steps", np.array([[b"{}"]], np.object_)),
            pb_utils.Tensor("acceptance_histogram", np.array([[b"{}"]], np.object_)),
            pb_utils.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)),
            pb_utils.Tensor("output_log_probs", np.zeros((1, 1, 0), np.float32)),
            pb_utils.Tensor("top_log_probs", np.array([[b"[]"]], np.object_)),
            pb_utils.Tensor("prefix_cache_hit_tokens", count(0)),
            pb_utils.Tensor("prompt_log_probs", np.array([[b"[]"]], np.object_)),
            pb_utils.Tensor("output_token_ids", np.zeros((1, 0), np.int32))]))  # text only comes back
        return text, tokens

    # ---- the sender thread ------------------------------------------------------------------------------

    def _send(self, sender, response, flags=0):
        self.outbox.put((sender, response, flags))

    def _send_loop(self):
        while (job := self.outbox.get()) is not None:
            sender, response, flags = job
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001  a cancelled client's sender refuses sends; others go on
                pass
