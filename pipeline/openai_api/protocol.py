"""OpenAI's chat and completions requests as this server reads them, and the responses it writes.

Every field OpenAI's API defines is either honoured, accepted at its neutral value (what OpenAI's own
clients send by default: `n: 1`, `logit_bias: {}`, ...) or refused with a 400 in
OpenAI's error shape naming the field. A field nobody defines is refused too, as OpenAI refuses it
("Unrecognized request argument supplied"). Nothing is silently ignored.

Our extension, in the body (the openai SDK sends it with `extra_body`): `speculation` ("auto", "on", "off")
and `num_draft_tokens`, as the ensemble's gRPC inputs of the same names. `top_k` and `repetition_penalty` are
vLLM's extensions.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SPECULATION = ("auto", "on", "off")
API_KEY_ENV = "PIPELINE_OPENAI_API_KEY"  # the key the API asks for, when set
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top-N alternatives per token (pipeline.engine.sampling_limits.MAX_LOGPROBS)


class ProtocolError(Exception):
    """A request this server refuses: the HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _absent_or(*neutral):
    """A check for a field we don't implement: passes when left out (null) or sent at a neutral value."""
    def passes(value) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) or any(isinstance(n, bool) for n in neutral):
            return any(value is n for n in neutral)  # True == 1 in Python: booleans match only booleans
        return isinstance(value, (int, float, str)) and value in neutral
    return passes


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


# Fields OpenAI defines that this server doesn't implement: (passes?, what to do instead).
COMMON_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (_absent_or(1), "one choice per request; send n 1 or leave it out"),
    "logit_bias": (_empty, "logit_bias isn't supported; leave it out"),
    "min_tokens": (_absent_or(0, 1), "min_tokens above 1 isn't supported (an answer may end at its first token)"),
    "ignore_eos": (_absent_or(False), "ignore_eos isn't supported; an answer ends at the model's end token"),
    "best_of": (_absent_or(1), "best_of isn't supported; send 1 or leave it out"),
    "service_tier": (_absent_or("auto", "default"), "service tiers aren't served here; leave service_tier out"),
    "store": (_absent_or(False), "completions aren't stored here; send store false or leave it out"),
}
CHAT_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "tools": (_empty, "tool calling isn't supported; leave tools out"),
    "tool_choice": (_absent_or("none"), "tool calling isn't supported; leave tool_choice out"),
    "parallel_tool_calls": (lambda v: v is None, "tool calling isn't supported; leave parallel_tool_calls out"),
    "functions": (_empty, "function calling isn't supported; leave functions out"),
    "function_call": (_absent_or("none"), "function calling isn't supported; leave function_call out"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "structured output isn't supported; send response_format {\"type\": \"text\"} or leave it out"),
    "modalities": (lambda v: v is None or v == ["text"], "text is the only modality; send [\"text\"] or leave it out"),
    "audio": (lambda v: v is None, "audio output isn't supported; leave audio out"),
    "prediction": (lambda v: v is None, "predicted outputs aren't supported; leave prediction out"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort isn't supported; leave it out"),
    "web_search_options": (lambda v: v is None, "web search isn't supported; leave web_search_options out"),
    "verbosity": (lambda v: v is None, "verbosity isn't supported; leave it out"),
}
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "echo": (_absent_or(False), "echo isn't supported (the answer never repeats the prompt); send false or leave it out"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) isn't supported; leave it out"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and completions share: the fields this server honours."""

    model_config = ConfigDict(extra="allow")  # checked by _check_extra, so each gets its own message

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's: -1 or 0 means off
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records; it changes nothing here
    metadata: dict[str, str] | None = None  # the same
    speculation: Literal["auto", "on", "off"] = "auto"  # ours: as the ensemble's speculation input
    num_draft_tokens: int | None = Field(default=None, ge=1)  # ours: k for this request
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's extension

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise ProtocolError(f"stop holds {len(stops)} strings; send at most {MAX_STOP_STRINGS}", "stop")
        if any(s == "" for s in stops):
            raise ProtocolError("stop holds an empty string; remove it", "stop")
        return stops


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        """None: no log probs; N: each token's, and its N most likely alternatives."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ProtocolError("top_logprobs needs logprobs true; send both", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them; "developer" is OpenAI's newer name for "system"."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # OpenAI allows up to 5, vLLM 20

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ProtocolError(f"prompt holds {len(self.prompt)} prompts; send one per request", "prompt")
            return self.prompt[0]
        return self.prompt

    def new_tokens(self, default: int) -> int:
        return self.max_tokens or default


def _check_extra(request: SamplingFields, unsupported: dict[str, tuple[Any, str]]) -> None:
    for name, value in (request.model_extra or {}).items():
        if name not in unsupported:
            raise ProtocolError(f"Unrecognized request argument supplied: {name}", name)
        passes, message = unsupported[name]
        if isinstance(value, float) and not math.isfinite(value) or not passes(value):
            raise ProtocolError(f"{name} {value!r}: {message}", name)


def _parse(model: type[SamplingFields], body: Any, unsupported: dict) -> SamplingFields:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ProtocolError(f"Unrecognized request argument supplied: {where}", where) from None
        raise ProtocolError(f"{where}: {first['msg']}", where.split(".")[0] or None) from None
    _check_extra(request, {**COMMON_UNSUPPORTED, **unsupported})
    request.stop_strings()
    return request


def parse_chat(body: Any) -> ChatRequest:
    request = _parse(ChatRequest, body, CHAT_UNSUPPORTED)
    if request.messages[-1].role == "assistant" and len(request.messages) == 1:
        raise ProtocolError("messages holds only an assistant turn; start with a user (or system) turn", "messages")
    return request


def parse_completion(body: Any) -> CompletionRequest:
    request = _parse(CompletionRequest, body, COMPLETION_UNSUPPORTED)
    if not request.prompt_text().strip():
        raise ProtocolError("prompt is empty; send a prompt", "prompt")
    return request


# ---- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpecDecoding(BaseModel):
    """One request's speculation, in vLLM's per-request shape (`metrics.speculative_decoding`, which NVIDIA's
    AIPerf reads: aiperf/spec_decode/vllm_adapter.py). acceptance_histogram[j] counts the verification steps
    that accepted exactly j drafted tokens."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    acceptance_histogram: list[int]
    mean_acceptance_length: float
    draft_acceptance_rate: float
    num_spec_tokens: int | None = None
    # Ours: decode steps that drafted nothing, by reason (docs/gate.md), as the gRPC route's skipped_steps.
    skipped_steps: dict[str, int] = Field(default_factory=dict)


class ResponseMetrics(BaseModel):
    speculative_decoding: SpecDecoding | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: ResponseMetrics | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A completion, and (object "text_completion" as OpenAI streams it too) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec-pipeline"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
