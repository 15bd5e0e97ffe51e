"""Draft -> target speculation over TensorRT-LLM's Triton models, run by the speculation gate per request.

TensorRT-LLM's own tensorrt_llm_bls runs this loop too (tensorrtllm_backend
all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py, `_spec_generate`), but refuses
streaming and batch > 1. Here each request runs on its own gate worker thread, any number at once,
and streams: every response goes out through `send`, the gate's one sender thread.

One iteration, as upstream's (triton_decoder.py `_get_llm_tensors_from_request`):
  propose: the draft model, greedy, request_output_len = n <= K, input_ids = prompt + generated
  verify:  the target, input_ids = the same, draft_input_ids = the n drafts, request_output_len = n + 1;
           it answers with the drafts it accepted + its own next token.
Both tensorrt_llm models are decoupled and run with exclude_input_in_output=true (our config.pbtxt),
so each response's output_ids [1, beam=1, len] hold generated tokens only, sequence_length [1, 1] how
many are valid; a streaming response holds just the tokens new since the last one.

Sampling: speculation runs for greedy requests only; sampled ones decode on the target alone. The
target accepts by token match unless it gets draft_logits (externalDraftTokensLayer), and logits need
the draft engine built with --gather_generation_logits plus a [n, vocab] FP32 tensor through BLS per
step; `pipeline compile` doesn't build that, and upstream's BLS leaves use_draft_logits off too.

Penalties and log probs go to the target as TensorRT-LLM's own inputs (repetition_penalty,
presence_penalty, frequency_penalty, return_log_probs -> output_log_probs), and such a request decodes on
the target alone, as one TensorRT-LLM request: each verify step here is a new request whose prompt holds
the answer so far, which would move the tokens the penalties count from output to prompt, and TensorRT-LLM
returns no log probs for accepted draft tokens. The answer is then TensorRT-LLM's own, penalised its way.

A guide (upstream's guided_decoding_guide_type / guided_decoding_guide) goes to the target the same way, and such a
request decodes on the target alone too: TensorRT-LLM's C++ guided decoder masks one position per step and starts its
grammar at a request's first context step (pipeline.trtllm.upstream.GUIDED_DECODER_REF), so it would neither mask the
draft positions of a verify nor carry its grammar from one verify request to the next.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.errors import PipelineError
from pipeline.policy.cost_model import CostModel, default_cost_model
from pipeline.policy.draft_plan import EMPTY, AcceptanceEstimate, Row, plan_drafts
from pipeline.triton.bls_streams import ENDED

# Text-bearing tokens resent before each streamed chunk so postprocessing can rebuild a character split
# across chunks (as models/torch_engine.py). Special tokens and ids past the tokenizer's vocabulary
# decode to nothing, so they don't count: a run of them would push the split bytes out of the prefix.
PREFIX_TOKENS = 6
TRTLLM_OUTPUTS = ["output_ids", "sequence_length"]
LOG_PROBS_OUTPUT = "output_log_probs"  # [1, beam=1, len]: every generated token's so far, also when streaming
# Every input TritonEngines may send the tensorrt_llm models, with its dtype (tritonclient's names):
# assemble checks each against the model config it writes (pipeline.triton.trtllm_template.check_config).
SENT_INPUTS = {"input_ids": "INT32", "input_lengths": "INT32", "request_output_len": "INT32", "streaming": "BOOL",
               "end_id": "INT32", "pad_id": "INT32", "stop_words_list": "INT32", "runtime_top_k": "INT32",
               "temperature": "FP32", "runtime_top_p": "FP32", "seed": "UINT64", "draft_input_ids": "INT32",
               "repetition_penalty": "FP32", "presence_penalty": "FP32", "frequency_penalty": "FP32",
               "return_log_probs": "BOOL", "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES"}
PENALTIES = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))  # name, neutral

Send = Callable[[dict], None]
Step = tuple[list[int], "list[float] | None"]  # new tokens, and their log probs where they were asked for


class EngineCallError(PipelineError):
    """A tensorrt_llm model answered a request with an error."""


@dataclass(frozen=True)
class TritonRequest:
    """REQUEST_TENSORS of one request, as plain values."""

    prompt: tuple[int, ...]
    max_tokens: int
    end_id: int  # -1: none
    stop_words: tuple[tuple[int, ...], ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stream: bool
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_log_probs: bool = False
    num_logprobs: int = 0  # top-N alternatives: the tensorrt_llm model has none to give (the gate refuses N > 0)
    guide_type: str = ""  # guided_decoding_guide_type, checked by preprocessing (validate.read_guide); "": none
    guide: str = ""

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray]) -> TritonRequest:
        def scalar(name, default=None):
            return tensors[name].reshape(-1)[0] if name in tensors or default is None else default

        def text(name) -> str:
            value = tensors[name].reshape(-1)[0] if name in tensors and tensors[name].size else b""
            return value.decode() if isinstance(value, bytes) else str(value)

        length = int(scalar("input_lengths"))
        return cls(prompt=tuple(int(t) for t in tensors["input_ids"].reshape(-1)[:length]),
                   max_tokens=int(scalar("request_output_len")), end_id=int(scalar("end_id")),
                   stop_words=parse_stop_words(tensors["stop_words_list"]),
                   temperature=float(scalar("temperature")), top_k=int(scalar("top_k")),
                   top_p=float(scalar("top_p")), seed=int(scalar("seed")), stream=bool(scalar("stream")),
                   **{name: float(scalar(name, neutral)) for name, neutral in PENALTIES},
                   return_log_probs=bool(scalar("return_log_probs", False)),
                   num_logprobs=int(scalar("num_logprobs", 0)),
                   guide_type=text("guided_decoding_guide_type"), guide=text("guided_decoding_guide"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_reason(self) -> str | None:
        """Why this request decodes on the target alone whatever the gate says (module docstring), as the reason
        its steps are counted under; None: it may speculate."""
        if self.guide_type:
            return "guided"
        if not self.greedy:
            return "sampled"
        if any(getattr(self, name) != neutral for name, neutral in PENALTIES):
            return "penalties"
        if self.return_log_probs:
            return "log_probs"
        return None


def parse_stop_words(flat: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """tensorrtllm's [2, W] layout -> words (pipeline.triton.validate.stop_word_ids)."""
    from pipeline.triton.validate import stop_word_ids

    return tuple(stop_word_ids(flat))


def stop_words_tensor(words: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """words -> [1, 2, W] int32 in tensorrtllm's layout."""
    flat = [t for w in words for t in w]
    out = np.full((1, 2, len(flat)), -1, np.int32)
    out[0, 0] = flat
    out[0, 1, :len(words)] = np.cumsum([len(w) for w in words])
    return out


def stop_at(before: list[int], new: list[int], request: TritonRequest) -> int | None:
    """How many of `new` to keep, up to and including the first end_id or stop word (a word may start
    in `before`, the tokens already generated); None when nothing in `new` ends the answer."""
    seq = before + new
    for i in range(len(before), len(seq)):
        if seq[i] == request.end_id:
            return i + 1 - len(before)
        for word in request.stop_words:
            if i + 1 >= len(word) and tuple(seq[i + 1 - len(word):i + 1]) == word:
                return i + 1 - len(before)
    return None


def accepted_count(drafts: list[int], verified: list[int]) -> tuple[int, bool]:
    """(drafts accepted, whether the target stopped) from the target's answer to n drafts.

    Greedy verification (the target's rule, so the answer is target-only greedy whatever the draft):
      accept d_i while d_i == argmax p_target(. | x, d_<i), for i = 0, 1, ...
      at the first mismatch (or after all n) emit the target's own argmax instead.
    So the answer is the accepted drafts + 1 token; anything after that is the target's too and kept.
    An answer that is all drafts and shorter than n + 1 means it stopped (end_id, which TensorRT-LLM
    may leave out of the output) before its own token.
    """
    n = 0
    while n < len(drafts) and n < len(verified) and verified[n] == drafts[n]:
        n += 1
    return n, n == len(verified) and len(verified) < len(drafts) + 1


class Engines(Protocol):
    """The two models as the loop sees them; `TritonEngines` is the real one, tests pass fakes."""

    def propose(self, ids: list[int], n: int) -> list[int]: ...

    def verify(self, ids: list[int], drafts: list[int]) -> list[int]: ...

    def decode(self, ids: list[int], n: int, request: TritonRequest) -> Iterator[Step]:
        """The target alone: (new tokens, their log probs or None) per response."""
        ...


def text_token_filter(tokenizer_dir: str) -> Callable[[int], bool]:
    """Whether a token id decodes to text with this tokenizer (for the prefix count)."""
    from pipeline.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    special = frozenset(tokenizer.all_special_ids) | frozenset(
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return lambda t: 0 <= t < vocab and t not in special


class Emitter:
    """Builds GENERATION_TENSORS responses: deltas of the counts, and the prefix resend when streaming."""

    def __init__(self, request: TritonRequest, send: Send, is_text: Callable[[int], bool] | None = None):
        self.request, self.send = request, send
        self.is_text = is_text or (lambda t: t != request.end_id)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # one per token, with return_log_probs
        self.sent = 0
        self.counts = [0, 0, 0]  # accepted, drafted, verify_steps not yet sent
        self.skipped: dict[str, int] = {}  # steps without drafts not yet sent, by reason
        self.histogram: dict[str, int] = {}  # verification steps not yet sent, by drafts accepted

    def add(self, tokens: list[int], accepted: int = 0, drafted: int = 0, steps: int = 0,
            skipped: str | None = None, skipped_steps: int = 1, logprobs: list[float] | None = None) -> None:
        """skipped: the reason this step (or these `skipped_steps` steps) drafted nothing; logprobs: the tokens'
        own, where the request asked for them."""
        if self.request.return_log_probs:
            if logprobs is None or len(logprobs) != len(tokens):
                raise EngineCallError(f"the target returned {0 if logprobs is None else len(logprobs)} log probs "
                                      f"for {len(tokens)} tokens")
            self.logprobs += logprobs
        self.tokens += tokens
        self.counts = [self.counts[0] + accepted, self.counts[1] + drafted, self.counts[2] + steps]
        if steps:  # one verification step (the loop verifies one draft run per call)
            self.histogram[str(accepted)] = self.histogram.get(str(accepted), 0) + steps
        if skipped is not None and skipped_steps > 0:
            self.skipped[skipped] = self.skipped.get(skipped, 0) + skipped_steps
        if self.request.stream:
            self.flush()

    def flush(self) -> None:
        """Send what is new: a stream's new tokens, or the whole answer once."""
        end = len(self.tokens)
        if self.request.stream and end == self.sent:
            return
        start = self._prefix_start() if self.request.stream else 0
        row = np.array([self.tokens[start:end]], np.int32).reshape(1, -1)
        extras = {}
        if self.request.return_log_probs:  # GENERATION_TENSORS' log probs; the gate fills neutral ones otherwise
            new = range(self.sent if self.request.stream else 0, end)
            extras = {"output_log_probs": np.array([self.logprobs[start:end]], np.float32).reshape(1, -1),
                      "top_log_probs": np.array([[json.dumps([[self.tokens[i], self.logprobs[i], []]
                                                              for i in new]).encode()]], np.object_)}
        self.send({**extras, "output_ids": row,
                   "prefix_length": np.array([[self.sent - start if self.request.stream else 0]], np.int32),
                   "accepted_tokens": np.array([[self.counts[0]]], np.int32),
                   "drafted_tokens": np.array([[self.counts[1]]], np.int32),
                   "verify_steps": np.array([[self.counts[2]]], np.int32),
                   "skipped_steps": np.array([[json.dumps(self.skipped).encode()]], np.object_),
                   "acceptance_histogram": np.array([[json.dumps(self.histogram).encode()]], np.object_)})
        self.sent, self.counts, self.skipped, self.histogram = end, [0, 0, 0], {}, {}

    def _prefix_start(self) -> int:
        start, text = self.sent, 0
        while start > 0 and text < PREFIX_TOKENS:
            start -= 1
            text += self.is_text(self.tokens[start])
        return start


def speculate_loop(request: TritonRequest, engines: Engines, k: int, emit: Emitter, cancelled: Callable[[], bool],
                   cost: CostModel | None = None, forced: bool = False) -> None:
    """Draft proposes, target verifies, until max_tokens, end_id or a stop word; checks cancel each step.

    Each step the draft length comes from the planner (policy/draft_plan.py) for this request alone: its
    own acceptance, under `cost` (default: the rule of thumb for a draft model). A request whose drafts
    keep failing calls the target alone, probing now and then; no other request is affected. forced: the
    client asked for speculation on, so it drafts its full length every step."""
    cost = cost or default_cost_model(k, 1, "draft")
    estimate = AcceptanceEstimate()
    out: list[int] = []
    while len(out) < request.max_tokens and not cancelled():
        ids = list(request.prompt) + out
        # Room for the target's own token after the drafts: n + 1 <= what is left.
        room = min(k, request.max_tokens - len(out) - 1)
        plan = plan_drafts([Row(cap=room, acceptance=estimate.first,
                                continuation=estimate.continuation, hit=estimate.hit_rate,
                                mode="on" if forced else "auto", probe=estimate.probe_due)], cost)
        n, reason = plan.ks[0], plan.reasons[0]
        if reason is not None:
            estimate.skipped_for(reason)
        drafts = engines.propose(ids, n)[:n] if n > 0 else []
        if n > 0:
            estimate.proposed(bool(drafts))
            reason = reason if drafts else EMPTY
        verified = engines.verify(ids, drafts)
        if not verified:
            return
        accepted, stopped = accepted_count(drafts, verified)
        estimate.update(len(drafts), accepted)
        new = verified[:request.max_tokens - len(out)]
        end = stop_at(out, new, request)
        new = new[:end] if end is not None else new
        out += new
        emit.add(new, accepted=accepted, drafted=len(drafts), steps=1 if drafts else 0,
                 skipped=None if drafts else reason)
        if end is not None or stopped:
            return


def plain_loop(request: TritonRequest, engines: Engines, emit: Emitter, cancelled: Callable[[], bool],
               reason: str | None = None) -> None:
    """The target alone (streaming when the request streams): relay its tokens up to a stop. reason: why
    it doesn't speculate, counted once per token (one decode step each)."""
    out: list[int] = []
    for tokens, logprobs in engines.decode(list(request.prompt), request.max_tokens, request):
        new = tokens[:request.max_tokens - len(out)]
        end = stop_at(out, new, request)
        new = new[:end] if end is not None else new
        out += new
        emit.add(new, skipped=reason, skipped_steps=len(new),
                 logprobs=None if logprobs is None else logprobs[:len(new)])
        if end is not None or len(out) >= request.max_tokens or cancelled():
            return


class TritonEngines:
    """The tensorrt_llm target and draft through BLS, both decoupled (exec(decoupled=True))."""

    def __init__(self, target_model: str, draft_model: str, request: TritonRequest, cancelled: Callable[[], bool]):
        self.target_model, self.draft_model = target_model, draft_model
        self.request, self.cancelled = request, cancelled

    def _inputs(self, ids: list[int], n: int, *, greedy: bool, streaming: bool) -> dict[str, np.ndarray]:
        r = self.request
        tensors = {
            "input_ids": np.array([ids], np.int32),
            "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[n]], np.int32),
            "streaming": np.array([[streaming]], bool),
        }
        if r.end_id >= 0:
            tensors["end_id"] = tensors["pad_id"] = np.array([[r.end_id]], np.int32)
        if r.stop_words:
            tensors["stop_words_list"] = stop_words_tensor(r.stop_words)
        if greedy:
            tensors["runtime_top_k"] = np.array([[1]], np.int32)
        else:
            tensors.update(temperature=np.array([[r.temperature]], np.float32),
                           runtime_top_k=np.array([[r.top_k]], np.int32),
                           runtime_top_p=np.array([[r.top_p]], np.float32),
                           seed=np.array([[r.seed]], np.uint64))
        return tensors

    def _call(self, model: str, tensors: dict[str, np.ndarray]) -> Iterator[Step]:
        import triton_python_backend_utils as pb_utils

        log_probs = bool(tensors.get("return_log_probs", np.zeros(1, bool)).reshape(-1)[0])
        responses = pb_utils.InferenceRequest(
            model_name=model, inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()],
            requested_output_names=TRTLLM_OUTPUTS + [LOG_PROBS_OUTPUT] * log_probs).exec(decoupled=True)
        try:
            for response in responses:
                if response.has_error():
                    raise EngineCallError(f"{model}: {' '.join(response.error().message().split())}")
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if "output_ids" in outputs:
                    ids = outputs["output_ids"].reshape(-1)  # [1, beam=1, len]
                    length = int(outputs["sequence_length"].reshape(-1)[0]) if "sequence_length" in outputs \
                        else ids.size
                    yield [int(t) for t in ids[:length]], _new_log_probs(outputs, length) if log_probs else None
                if self.cancelled():
                    if hasattr(responses, "cancel"):  # python backend >= 24.04: tells the model to stop
                        responses.cancel()
                    return
        finally:  # also when the caller stopped early: the token budget, a stop word, a cancel
            ENDED.end(responses)  # read to its end, and held until the stub lets go of it first (bls_streams)

    def propose(self, ids: list[int], n: int) -> list[int]:
        return [t for tokens, _ in self._call(self.draft_model, self._inputs(ids, n, greedy=True, streaming=False))
                for t in tokens]

    def verify(self, ids: list[int], drafts: list[int]) -> list[int]:
        tensors = self._inputs(ids, len(drafts) + 1, greedy=True, streaming=False)
        if drafts:
            tensors["draft_input_ids"] = np.array([drafts], np.int32)
        return [t for tokens, _ in self._call(self.target_model, tensors) for t in tokens]

    def decode(self, ids: list[int], n: int, request: TritonRequest) -> Iterator[Step]:
        return self._call(self.target_model, self._decode_inputs(ids, n))

    def _decode_inputs(self, ids: list[int], n: int) -> dict[str, np.ndarray]:
        """The target alone, with TensorRT-LLM's own penalties, log probs and guide where the request has them (such a
        request never speculates: module docstring)."""
        r = self.request
        tensors = self._inputs(ids, n, greedy=r.greedy, streaming=r.stream)
        for name, neutral in PENALTIES:
            if getattr(r, name) != neutral:
                tensors[name] = np.array([[getattr(r, name)]], np.float32)
        if r.return_log_probs:
            tensors["return_log_probs"] = np.array([[True]], bool)
        if r.guide_type:  # "json" takes no guide text (GuidedDecodingParams::GuideType::kJSON)
            tensors["guided_decoding_guide_type"] = np.array([[r.guide_type.encode()]], np.object_)
            if r.guide:
                tensors["guided_decoding_guide"] = np.array([[r.guide.encode()]], np.object_)
        return tensors


def _new_log_probs(outputs: dict[str, np.ndarray], new: int) -> list[float]:
    """The log probs of a response's `new` tokens. TensorRT-LLM's output_log_probs hold every generated token's so
    far, streaming or not (LlmRequest::createResult slices the ids to the new ones, not the log probs): the last."""
    if LOG_PROBS_OUTPUT not in outputs:
        raise EngineCallError("the target returned no output_log_probs though return_log_probs was sent")
    values = outputs[LOG_PROBS_OUTPUT].reshape(-1)  # [1, beam=1, len]
    if values.size < new:
        raise EngineCallError(f"the target returned {values.size} log probs for {new} tokens")
    return [float(v) for v in values[values.size - new:]]


def serve_request(tensors: dict[str, np.ndarray], *, speculate: bool, num_draft_tokens: int, target_model: str,
             draft_model: str, send: Send, cancelled: Callable[[], bool], engines: Engines | None = None,
             is_text: Callable[[int], bool] | None = None, reason: str = "override", forced: bool = False) -> None:
    """Answer one request (REQUEST_TENSORS as numpy arrays) with GENERATION_TENSORS responses via `send`.

    reason: the gate's, when it doesn't let the request speculate (counted per step in skipped_steps);
    forced: the client asked for speculation on.

    Streaming: one response per iteration with new tokens; otherwise one response with the whole
    answer. The caller sends Triton's FINAL flag after the last one. Raises
    EngineCallError (one line) if a model fails.
    is_text: `text_token_filter(tokenizer_dir)`; without it every token but end_id counts as text.
    """
    request = TritonRequest.from_tensors(tensors)
    engines = engines or TritonEngines(target_model, draft_model, request, cancelled)
    emit = Emitter(request, send, is_text)
    if speculate and request.plain_reason is None and num_draft_tokens > 0:
        speculate_loop(request, engines, num_draft_tokens, emit, cancelled, forced=forced)
    else:
        plain_loop(request, engines, emit, cancelled, reason=request.plain_reason or reason)
    if not cancelled():
        emit.flush()
