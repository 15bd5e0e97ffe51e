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

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from pipeline.engine.guide import GuideSpec
from pipeline.errors import RequestError
from pipeline.openai_api import tools
from pipeline.policy.sampling_limits import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_STOP_CHARS,
                                             MAX_STOP_STRINGS, check_num_draft_tokens, check_penalty_values,
                                             check_sampling_values, check_stop_strings, check_top_k)
from pipeline.triton.validate import logit_bias_pairs

SPECULATION = ("auto", "on", "off")
API_KEY_ENV = "PIPELINE_OPENAI_API_KEY"  # the key the API asks for, when set
# Fields that change nothing here but are stored by the caller's side: OpenAI's own bounds for metadata (16
# pairs, keys of 64 characters, values of 512), and the same 512 for `user` and a message's `name`.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_NAME = 16, 64, 512, 512
UNION_TAGS = {"str", "int", "float", "bool"}
SHOWN = 40  # characters of a refused value or name an error message quotes: an error never grows with the request


@dataclass(frozen=True)
class Limits:
    """What the served engine can do, read from its repository. Every count, length and number a request
    sends is checked against these before anything is built from it, and refused (never clamped) above them:
    an unbounded `num_draft_tokens` once sized a 10^9-entry histogram and took the machine's memory."""

    max_seq_len: int  # prompt + answer, in tokens
    num_draft_tokens: int  # the repository's k: a request may ask for fewer drafts, never more
    vocab_size: int  # top_k's ceiling
    max_input_bytes: int  # a prompt's (or a whole conversation's) UTF-8 bytes, checked before any tokenizing
    # The engine's KV pool in tokens: every choice of a request holds its prompt and answer there at once. None: the
    # repository doesn't say (the TensorRT-LLM routes), and max_seq_len bounds each choice alone.
    kv_pool_tokens: int | None = None

    def check_budget(self, n: int, prompt_tokens: int, max_tokens: int, logprobs: int | None) -> None:
        """A request's memory, bounded before anything runs: its choices' tokens fit the KV pool together (past it
        they would preempt each other and hold their partial answers while they wait), and its answer, with its log
        probs, fits the frontend's buffers (MAX_ANSWER_ENTRIES). Refused with the budget named, never cut."""
        if self.kv_pool_tokens is not None and n * (prompt_tokens + max_tokens) > self.kv_pool_tokens:
            field = "n" if n > 1 else "max_tokens"
            raise ProtocolError(f"n {n} x (prompt {prompt_tokens} + max_tokens {max_tokens}) = "
                                f"{n * (prompt_tokens + max_tokens)} tokens is over this server's per-request budget of "
                                f"{self.kv_pool_tokens} (its engine's KV cache); lower n or max_tokens", field)
        per_token = 1 if logprobs is None else 1 + logprobs  # the token, and its alternatives
        if n * max_tokens * per_token > MAX_ANSWER_ENTRIES:
            asked = "" if logprobs is None else f" x (1 + {logprobs} alternatives)"
            raise ProtocolError(f"n {n} x max_tokens {max_tokens}{asked} = {n * max_tokens * per_token} answer "
                                f"entries is over this server's per-request budget of {MAX_ANSWER_ENTRIES}; lower n, "
                                "max_tokens or the log probs asked for",
                                "n" if n > 1 else "max_tokens")


def shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut to SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


def shown_name(name: str) -> str:
    """A field's name as an error message quotes it: as it is, unless it is long or unprintable."""
    return name if len(name) <= SHOWN and name.isprintable() else shown(name)


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
    "best_of": (_absent_or(1), "best_of isn't supported; send 1 or leave it out"),
    "service_tier": (_absent_or("auto", "default"), "service tiers aren't served here; leave service_tier out"),
    "store": (_absent_or(False), "completions aren't stored here; send store false or leave it out"),
}
CHAT_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "functions": (_empty, "function calling isn't supported; leave functions out"),
    "function_call": (_absent_or("none"), "function calling isn't supported; leave function_call out"),
    "modalities": (lambda v: v is None or v == ["text"], "text is the only modality; send [\"text\"] or leave it out"),
    "audio": (lambda v: v is None, "audio output isn't supported; leave audio out"),
    "prediction": (lambda v: v is None, "predicted outputs aren't supported; leave prediction out"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort isn't supported; leave it out"),
    "web_search_options": (lambda v: v is None, "web search isn't supported; leave web_search_options out"),
    "verbosity": (lambda v: v is None, "verbosity isn't supported; leave it out"),
}
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) isn't supported; leave it out"),
}

# OpenAI's own types are strict: "8" is not a number, 1 is not a boolean, 8.0 is not an integer. Floats
# are finite (a JSON body can't say NaN, but 1e999 parses as infinity).
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Published:
    """How /openapi.json publishes a field where pydantic's schema of its type can't say what is checked: this
    server's bounds (Limits) or the served model's name. Annotated metadata on the field (pydantic keeps it and
    ignores it), read by request_schemas, so the published schema is declared once, beside the field it describes.
    `write`: (pydantic's schema of the field, the limits, the served name) -> the published schema."""

    write: Callable[[dict, Limits, str], dict]


def bounded(**keywords: Callable[[Limits], int]) -> Published:
    """Published with JSON-schema keywords whose values are this server's (each a function of its Limits)."""
    def write(schema: dict, limits: Limits, _: str) -> dict:
        _bound(schema, **{keyword: value(limits) for keyword, value in keywords.items()})
        return schema
    return Published(write)


def _bound(schema: dict, **keywords) -> None:
    """Write JSON-schema keywords into a field's schema, or into each non-null branch of its anyOf."""
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type")
        if kind == "null":
            continue
        for keyword, value in keywords.items():
            if keyword.endswith("Length") and kind != "string" or keyword.endswith("Items") and kind != "array":
                continue
            branch[keyword] = value


BELOW_CONTEXT = bounded(maximum=lambda limits: limits.max_seq_len - 1)  # and checked: check_limits
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}  # as check_stop_strings checks each


def _logit_bias_schema(_: dict, limits: Limits, __: str) -> dict:
    """Token ids (as many digits as the vocabulary's), OpenAI's range of biases."""
    return {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": f"^[0-9]{{1,{len(str(limits.vocab_size - 1))}}}$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                      {"type": "null"}], "default": None, "title": "Logit Bias"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid", populate_by_name=True)
    name: str = Field(max_length=MAX_NAME)
    description: str | None = None
    # "schema" is a BaseModel attribute's name: the field is schema_ in Python, "schema" on the wire.
    schema_: dict | None = Field(default=None, alias="schema")
    # Kept to OpenAI's word: the output always matches the schema here, strict or not.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or a JSON schema (the openai SDK's parse() and
    LangChain's with_structured_output send json_schema)."""

    model_config = ConfigDict(STRICT, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


MAX_CHOICES = 16  # n: each choice is a request of its own in the engine's batch
# Tokens, and alternatives with their log probs, a whole answer holds in the frontend until it is sent (about 200
# bytes each as Python objects): 16 choices of 16k tokens, or of 780 tokens with 20 alternatives each.
MAX_ANSWER_ENTRIES = 1 << 18
MAX_TOOLS = 64  # tools a request lists, and calls a turn holds

# vLLM's guided-decoding extensions, and the guide type each becomes (pipeline.engine.guide).
VLLM_GUIDES = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf_grammar",
               "guided_choice": "regex"}


class SamplingFields(BaseModel):
    """What chat and completions share: the fields this server honours."""

    # The extras are checked by _check_extra, so each gets its own message; published as none, since what it
    # accepts are OpenAI's neutral values, or refused.
    model_config = ConfigDict(STRICT, extra="allow", json_schema_extra={"additionalProperties": False})

    model: Annotated[str, Published(lambda _, __, name: {"type": "string", "enum": [name], "title": "Model"})] = \
        Field(max_length=256)
    max_tokens: Annotated[int | None, BELOW_CONTEXT] = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM's: -1 or 0 means off; at most the vocabulary
    top_k: Annotated[int | None, bounded(maximum=lambda limits: limits.vocab_size)] = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Annotated[str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None,
                    WithJsonSchema({"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP_STRINGS},
                                              {"type": "null"}]})] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_NAME)  # an end-user id for the caller's records
    metadata: dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                   Annotated[str, Field(max_length=MAX_METADATA_VALUE)]] | None = Field(
        default=None, max_length=MAX_METADATA_PAIRS)  # the same
    speculation: Literal["auto", "on", "off"] = "auto"  # ours: as the ensemble's speculation input
    # ours: k for this request, at most the repository's
    num_draft_tokens: Annotated[int | None, bounded(maximum=lambda limits: limits.num_draft_tokens)] = \
        Field(default=None, ge=1)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM's extension
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it on completions too
    # vLLM's guided decoding (one guide a request; response_format is OpenAI's way to say the same). Bounded like
    # any text a request carries: pipeline.engine.guide.MAX_GUIDE_BYTES.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=256, fail_fast=True)] | None = None
    # OpenAI's: token id (as a string) -> bias in [-100, 100], at most 300.
    logit_bias: Annotated[dict[Annotated[str, Field(max_length=12)], float] | None,
                          Published(_logit_bias_schema)] = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # Choices per request, each its own engine request (seed + i where a seed is sent); they share the prompt's
    # cached blocks. Bounded: each holds a batch slot while it runs.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's: no stop before this many tokens
    ignore_eos: bool | None = None  # vLLM's: the model's end token doesn't end the answer (load tools send it)

    def bias(self, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
        try:
            return logit_bias_pairs(self.logit_bias or {}, vocab_size)
        except RequestError as err:
            raise ProtocolError(str(err), "logit_bias") from None

    def guide_field(self) -> str | None:
        """The field that carries the request's guide, for an error about it; None for none."""
        asked = self._guide_fields()
        return asked[0] if asked else None

    def _guide_fields(self) -> list[str]:
        return [name for name in (*VLLM_GUIDES, "response_format") if getattr(self, name) is not None
                and not (name == "response_format" and self.response_format.type == "text")]

    def guide(self) -> GuideSpec | None:
        """The one guide the request asks for (response_format or a vLLM guided_* field), checked; None for none."""
        asked = self._guide_fields()
        if len(asked) > 1:
            raise ProtocolError(f"{' and '.join(asked)} each ask for a guide; send one", asked[1])
        if not asked:
            return None
        name = asked[0]
        try:
            if name == "response_format":
                rf = self.response_format
                if rf.type == "json_object":
                    return GuideSpec("json_schema", json.dumps({"type": "object"}))
                if rf.json_schema is None:
                    raise ProtocolError("response_format json_schema needs its json_schema {name, schema}",
                                        "response_format")
                return GuideSpec("json_schema", json.dumps(rf.json_schema.schema_ or {"type": "object"}))
            value = getattr(self, name)
            if name == "guided_choice":
                return GuideSpec("regex", "|".join(re.escape(c) for c in value))
            if name == "guided_json" and not isinstance(value, str):
                value = json.dumps(value)
            return GuideSpec(VLLM_GUIDES[name], value)
        except RequestError as err:
            raise ProtocolError(f"{name}: {err}", name) from None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def check_limits(self, limits: Limits) -> None:
        """The engine's own bounds, each refused with the value sent (the model's constraints are the rest)."""
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name, None)
            if value is not None and value >= limits.max_seq_len:
                raise ProtocolError(f"{name} {value} is beyond the model's {limits.max_seq_len}-token context; send "
                                    f"at most {limits.max_seq_len - 1}", name)
        # The engine's own rules (pipeline.policy.sampling_limits), each named by its field.
        checks = []
        if self.num_draft_tokens is not None:
            checks.append(("num_draft_tokens", check_num_draft_tokens, self.num_draft_tokens, limits.num_draft_tokens))
        if self.top_k is not None:  # vLLM's -1 is the engine's 0: off
            checks.append(("top_k", check_top_k, max(self.top_k, 0), limits.vocab_size))
        # The engine's lower bounds, on the values as sent: once in float32 (every route's type) a temperature of
        # 1e-300 is 0, greedy, and a top_p of 1e-300 is refused quoting 0.0 with no field named.
        if self.temperature is not None:
            checks.append(("temperature", check_sampling_values, self.temperature, 1.0, 0))
        if self.top_p is not None:
            checks.append(("top_p", check_sampling_values, 0.0, self.top_p, 0))
        if self.repetition_penalty is not None:
            checks.append(("repetition_penalty", check_penalty_values, self.repetition_penalty, 0.0, 0.0))
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true; send stream true, or leave "
                                "stream_options out", "stream_options")
        checks.append(("stop", check_stop_strings, self.stop_strings()))
        self.guide()  # the guide's own checks (one guide, its type, its size): a 400 before anything is sent
        self.bias(limits.vocab_size)
        if self.min_tokens and self.min_tokens > self.new_tokens(limits.max_seq_len - 1):
            raise ProtocolError(f"min_tokens {self.min_tokens} is over max_tokens {self.new_tokens(0)}; send at most "
                                "max_tokens", "min_tokens")
        for param, check, *values in checks:
            try:
                check(*values)
            except RequestError as err:
                raise ProtocolError(str(err), param) from None


class ContentPart(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    name: str = Field(max_length=MAX_NAME)
    arguments: str  # a JSON object, as text (OpenAI's)


class ToolCall(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    id: str = Field(max_length=MAX_NAME)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, as OpenAI requires it, except on an assistant turn with tool calls: a null or missing content was
    # once served as an empty turn.
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    name: str | None = Field(default=None, max_length=MAX_NAME)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_call_id: str | None = Field(default=None, max_length=MAX_NAME)  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _turn_shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant turn has tool_calls")
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise ValueError("a tool turn needs tool_call_id and content")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (only an assistant turn with tool_calls may leave it out)")
        for call in self.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {call.id[:SHOWN]!r}: arguments must be a JSON object, as text")
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> dict:
        """A turn's shapes as _turn_shape checks them: a role's turn with content; an assistant's calls, whose
        arguments are a JSON object as text; a tool's result, naming the call it answers. A JSON schema can't say
        "a string holding a JSON object", so the published arguments are the one such string a generator can't get
        wrong, "{}": documented stricter than served, never looser."""
        fields = handler.resolve_ref_schema(handler(core_schema))["properties"]
        content = fields["content"]["anyOf"][:2]  # text, or text parts
        base = {"type": "object", "additionalProperties": False, "properties": {"name": fields["name"]}}
        name = {"type": "string", "maxLength": 64}
        call = {"type": "object", "additionalProperties": False, "required": ["id", "function"], "properties": {
            "id": name, "type": {"const": "function"},
            "function": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": name, "arguments": {"const": "{}"}}}}}
        return {"title": "Message", "anyOf": [
            {**base, "required": ["role", "content"], "properties": {
                **base["properties"], "role": {"enum": ["system", "developer", "user", "assistant"]},
                "content": {"anyOf": content}}},
            {**base, "required": ["role", "tool_calls"], "properties": {
                **base["properties"], "role": {"const": "assistant"},
                "content": {"anyOf": [*content, {"type": "null"}]},
                "tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_TOOLS}}},
            {**base, "required": ["role", "content", "tool_call_id"], "properties": {
                **base["properties"], "role": {"const": "tool"}, "content": {"anyOf": content},
                "tool_call_id": name}}]}

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")  # OpenAI's rule for a function's name
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict | None = None  # a JSON schema of an object: a call's arguments are one
    strict: bool | None = None  # kept to OpenAI's word: a forced call always matches its parameters here

    @model_validator(mode="after")
    def _object_schema(self) -> FunctionDef:
        # OpenAI's rule: arguments are a JSON object, so the schema is one of an object ({} for no arguments). An
        # array schema was once accepted and its forced call came back as content.
        if self.parameters and self.parameters.get("type") != "object":
            raise ValueError(f"parameters of {self.name!r} must be a JSON Schema of type \"object\" (got type "
                             f"{shown(self.parameters.get('type'))}); a call's arguments are a JSON object")
        return self


class Tool(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(STRICT, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    # fail_fast: the first bad turn is the answer; collecting an error for each of 10^5 bad turns took 0.4 s
    # of the event loop's time (and parse_chat bounds their number before any is validated).
    # Every turn renders to a token at least: parse_chat counts them before any is validated.
    messages: Annotated[list[Message], bounded(maxItems=lambda limits: limits.max_seq_len)] = \
        Field(min_length=1, fail_fast=True)
    max_completion_tokens: Annotated[int | None, BELOW_CONTEXT] = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tool calls, for every chat template (pipeline.openai_api.tools).
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted: a forced call is one call, and an answer makes as many as its template's markup holds.
    parallel_tool_calls: bool | None = None

    def tool_defs(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice none), "auto", "required", or the name of the tool the answer must call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def num_logprobs(self) -> int | None:
        """None: no log probs; N: each token's, and its N most likely alternatives."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ProtocolError("top_logprobs needs logprobs true; send both", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def conversation(self, family: str | None = None) -> tuple[list[dict], list[dict] | None]:
        """The messages as the chat template takes them, and the tools for a template that renders them itself;
        "developer" is OpenAI's newer name for "system". family: the template's tool markup
        (pipeline.openai_api.tools.template_family); None: the fallback, for a template without tools."""
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                  "tool_call_id": m.tool_call_id,
                  "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                 for c in m.tool_calls or []]} for m in self.messages]
        if not self.tools and not any(t["tool_calls"] or t["role"] == "tool" for t in turns):
            return [{"role": t["role"], "content": t["content"]} for t in turns], None
        offered = self.tool_defs() if self.tool_mode() is not None else []
        if family is not None:
            return tools.native(turns, offered)
        return tools.render(turns, offered, describe_tools=bool(offered)), None

    def guide_field(self) -> str | None:
        return super().guide_field() if self.tool_mode() in (None, "auto") else "tools"

    def guide(self) -> GuideSpec | None:
        mode = self.tool_mode()
        if mode in (None, "auto"):
            return super().guide()
        if super().guide() is not None:
            raise ProtocolError(f"tool_choice {mode} holds the answer to a call, and another guide was sent; send "
                                "one", "tool_choice")
        try:
            return tools.guide_for(self.tool_defs(), mode)
        except RequestError as err:  # the call's schema is a guide like any other: bounded in size
            raise ProtocolError(f"tools: the schema of the call tool_choice {shown(mode)} forces is too large "
                                f"({err}); send fewer or smaller parameters", "tools") from None

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def check_limits(self, limits: Limits) -> None:
        if self.tool_choice is not None and not self.tools:
            raise ProtocolError("tool_choice needs tools; send the tools it chooses from, or leave it out",
                                "tool_choice")
        mode = self.tool_mode()
        if mode not in (None, "auto", "required") and mode not in {t.function.name for t in self.tools}:
            raise ProtocolError(f"tool_choice names {shown(mode)}, which tools doesn't list", "tool_choice")
        super().check_limits(limits)
        # A bound on what rendering and tokenizing will cost, known before either runs: the rendered text holds
        # every turn's.
        size = sum(len(m.text().encode("utf-8")) for m in self.messages)
        if size > limits.max_input_bytes:
            raise ProtocolError(f"the messages are {size} bytes of text, over this server's {limits.max_input_bytes} "
                                "(what the model's context can hold); shorten them", "messages")


TokenIds = Annotated[list[int], Field(min_length=1, fail_fast=True)]


def _prompt_schema(_: dict, limits: Limits, __: str) -> dict:
    """One prompt, not only white space, or its token ids, each bounded as check_limits bounds it."""
    text = {"type": "string", "minLength": 1, "maxLength": limits.max_input_bytes, "pattern": r"\S"}
    ids = {"type": "array", "minItems": 1, "maxItems": limits.max_seq_len - 1,
           "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}
    return {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}, ids,
                      {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}], "title": "Prompt"}


class CompletionRequest(SamplingFields):
    # One prompt: text, or token ids (OpenAI's array of integers, what lm-evaluation-harness sends), alone or as a
    # list of one.
    prompt: Annotated[str | Annotated[list[str], Field(fail_fast=True)] | TokenIds
                      | Annotated[list[TokenIds], Field(fail_fast=True)], Published(_prompt_schema)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # OpenAI allows up to 5, vLLM 20
    # OpenAI's: the answer starts with the prompt; with logprobs, the prompt's tokens come with theirs too (the
    # first has none), which evaluators score continuations with.
    echo: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def one_prompt(self) -> str | tuple[int, ...]:
        """The prompt, as text or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return tuple(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ProtocolError(f"prompt holds {len(prompt)} prompts; send one per request", "prompt")
            return prompt[0] if isinstance(prompt[0], str) else tuple(prompt[0])
        return prompt

    def new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    def check_limits(self, limits: Limits) -> None:
        super().check_limits(limits)
        if self.echo and self.stream:
            raise ProtocolError("echo is served on whole answers only here; send stream false, or leave echo out",
                                "echo")
        prompt = self.one_prompt()
        if isinstance(prompt, tuple):
            if len(prompt) >= limits.max_seq_len:
                raise ProtocolError(f"prompt holds {len(prompt)} token ids, the model's whole {limits.max_seq_len}-"
                                    "token context or more; shorten it", "prompt")
            if (bad := next((t for t in prompt if not 0 <= t < limits.vocab_size), None)) is not None:
                raise ProtocolError(f"prompt holds token id {shown(bad)}, outside the vocabulary [0, "
                                    f"{limits.vocab_size})", "prompt")
            return
        size = len(prompt.encode("utf-8"))
        if size > limits.max_input_bytes:
            raise ProtocolError(f"prompt is {size} bytes, over this server's {limits.max_input_bytes} (what the "
                                "model's context can hold); shorten it", "prompt")


def _check_extra(request: SamplingFields, unsupported: dict[str, tuple[Any, str]]) -> None:
    for name, value in (request.model_extra or {}).items():
        if name not in unsupported:
            raise ProtocolError(f"Unrecognized request argument supplied: {shown_name(name)}", shown_name(name))
        passes, message = unsupported[name]
        if isinstance(value, float) and not math.isfinite(value) or not passes(value):
            raise ProtocolError(f"{name} {shown(value)}: {message}", name)


def _parse(model: type[SamplingFields], body: Any, unsupported: dict, limits: Limits) -> SamplingFields:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object (got {type(body).__name__})")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        # Of a union's errors, the one from the member whose type matched (a list too long, not "not a string").
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        # pydantic names the member of a union it tried ("content.str"): the client's field is the rest.
        where = ".".join(shown_name(p) if isinstance(p, str) else str(p) for p in first["loc"]
                         if not (isinstance(p, str) and (p in UNION_TAGS or "[" in p)))
        if first["type"] == "extra_forbidden":
            raise ProtocolError(f"Unrecognized request argument supplied: {where}", where) from None
        got = "" if first["type"] == "missing" else f" (got {shown(first['input'])})"
        raise ProtocolError(f"{where}: {first['msg']}{got}", where.split(".")[0] or None) from None
    _check_extra(request, {**COMMON_UNSUPPORTED, **unsupported})
    request.check_limits(limits)
    return request


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    turns = body.get("messages") if isinstance(body, dict) else None
    if isinstance(turns, list) and len(turns) > limits.max_seq_len:  # every turn renders to a token at least
        raise ProtocolError(f"messages holds {len(turns)} turns; the model's {limits.max_seq_len}-token context "
                            "can't hold them; send fewer", "messages")
    request = _parse(ChatRequest, body, CHAT_UNSUPPORTED, limits)
    if request.messages[-1].role == "assistant" and len(request.messages) == 1:
        raise ProtocolError("messages holds only an assistant turn; start with a user (or system) turn", "messages")
    _check_tool_turns(request.messages)
    return request


def _check_tool_turns(messages: list[Message]) -> None:
    """A tool turn answers a call of the assistant turn just before it (other tool turns between), as OpenAI
    requires: a result with no call would be rendered as an answer to nothing."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool" and m.tool_call_id not in calls:
            raise ProtocolError(f"messages.{i}: a tool turn answers a call of the assistant turn before it, and "
                                f"tool_call_id {shown(m.tool_call_id)} names none; send the assistant turn with "
                                "its tool_calls first", "messages")
        if m.role != "tool":
            calls = {c.id for c in m.tool_calls or []}


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    request = _parse(CompletionRequest, body, COMPLETION_UNSUPPORTED, limits)
    prompt = request.one_prompt()
    if isinstance(prompt, str) and not prompt.strip():
        raise ProtocolError("prompt is empty; send a prompt", "prompt")
    return request


def request_schemas(limits: Limits, model_name: str) -> dict[str, dict]:
    """The request bodies as /openapi.json publishes them (components/schemas by name), with this server's
    bounds written in (each field's Published): what a client, or a fuzzer driven by the document, may send."""
    schemas: dict[str, dict] = {}
    for model in (ChatRequest, CompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        fields = schema["properties"]
        for name, info in model.model_fields.items():
            for published in (m for m in info.metadata if isinstance(m, Published)):
                fields[name] = published.write(fields[name], limits, model_name)
        schemas[model.__name__] = schema
    return schemas


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every refusal and failure is one."""

    error: ErrorObject


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
    content: str | None
    tool_calls: list[ToolCall] | None = None


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
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: ResponseMetrics | None = None


class DeltaToolCall(BaseModel):
    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
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
