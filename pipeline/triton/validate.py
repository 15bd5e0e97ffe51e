"""Requests read and checked at each model's edge. A client request is read the same way by the models
that take the ensemble's inputs (preprocessing, and the LLM-API route's frontend); the internal models
(torch_engine, postprocessing) check their own inputs too, since a client can call them directly.
Pure: the request's tensors come through `get(name) -> array | None`, and each refusal is a
RequestError with the one line the client sees.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.engine.guide import GuideSpec
from pipeline.errors import RequestError
from pipeline.policy.sampling_limits import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, check_logit_bias, check_logprobs,
                                             check_min_tokens, check_num_draft_tokens, check_penalty_values,
                                             check_sampling_values, check_stop_strings)
from pipeline.triton.interface import (IGNORED_INPUTS, MAX_STREAM_INTERVAL_MS, REQUIRED_INPUTS, STREAM_INTERVAL_MS,
                                       UNSUPPORTED_INPUTS)

Get = Callable[[str], "np.ndarray | None"]
SPECULATION = ("auto", "on", "off")


def check_required(get: Get) -> None:
    """The inputs every request needs, by name: the configs declare them optional (interface.REQUIRED_INPUTS says
    why), so this is the only check that a request without one gets."""
    missing = [name for name in REQUIRED_INPUTS if get(name) is None]
    if missing:
        raise RequestError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required; send "
                           f"{' and '.join(REQUIRED_INPUTS)}")


def check_unsupported(get: Get) -> None:
    """Upstream ensemble inputs this pipeline doesn't implement: fine at their neutral value, refused otherwise."""
    for name, (neutral, message) in UNSUPPORTED_INPUTS.items():
        value = get(name)
        if value is None or not value.size:
            continue
        values = value.reshape(-1).tolist()
        if neutral is None:
            if any(v not in (b"", "") for v in values):
                raise RequestError(message)
        elif not all(v == neutral for v in values):
            raise RequestError(f"{name} {values[0]!r}: {message}")
    for name in IGNORED_INPUTS:  # accepted, but still checked for sanity
        value = get(name)
        if value is not None and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise RequestError(f"{name} must be a finite number")


def check_speculation(speculation: str, num_draft_tokens: int, max_draft_tokens: int) -> None:
    """`max_draft_tokens`: the repository's k, what its engine was built to draft and verify per step."""
    if speculation not in SPECULATION:
        raise RequestError(f"speculation must be auto, on or off (got {speculation[:40]!r})")
    if num_draft_tokens < 1:
        raise RequestError(f"num_draft_tokens must be >= 1 (got {num_draft_tokens}); send speculation=off instead")
    check_num_draft_tokens(num_draft_tokens, max_draft_tokens)


def check_max_tokens(max_tokens: int, max_seq_len: int) -> None:
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1 (got {max_tokens})")
    if max_tokens >= max_seq_len:
        raise RequestError(f"max_tokens {max_tokens} is beyond the engine's max_seq_len {max_seq_len}")


def check_length(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    if prompt_tokens + max_tokens > max_seq_len:
        raise RequestError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) is over the engine's "
                           f"max_seq_len {max_seq_len}; shorten the prompt or lower max_tokens")


def text_of(value, name: str, byte_limit: int | None = None) -> str:
    """One BYTES element as text: its size checked before anything reads it, and strict UTF-8 (a replacement
    character would silently change the prompt)."""
    raw = value if isinstance(value, bytes) else str(value).encode()
    if byte_limit is not None and len(raw) > byte_limit:
        raise RequestError(f"{name} is {len(raw)} bytes, over this server's limit of {byte_limit}; shorten it "
                           f"(the limit is the repository's max_input_bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"{name} is not valid UTF-8 (byte {err.start}); send UTF-8 text") from None


@dataclass(frozen=True)
class ClientRequest:
    """The ensemble inputs every route reads, checked; defaults filled where the client left one out."""

    text: str
    max_tokens: int
    speculation: str  # auto | on | off
    num_draft_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stream: bool
    end_id: int | None  # None: not sent
    stop_words: tuple[str, ...]
    apply_chat_template: bool | None = None  # None: not sent (the repository's setting)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_log_probs: bool = False
    num_logprobs: int = 0  # top-N alternatives per token, with return_log_probs
    guide: GuideSpec | None = None  # guided_decoding_guide_type and guided_decoding_guide, checked
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int = -1  # -1: none; N: the prompt's log probs and N alternatives each
    prompt_ids: tuple[int, ...] | None = None  # prompt_token_ids, checked against the vocabulary; None: tokenize
    stream_interval_ms: int = STREAM_INTERVAL_MS
    request_group: int = 0  # 0: a group of its own
    resume_ids: tuple[int, ...] = ()  # resume_token_ids, checked: the answer's start the client already has
    resumed: bool = False  # a retry of a request a lost server held: sent, or resume_ids

    def raw(self, repository_raw: bool) -> bool:
        """Whether text_input is taken as it is: the request's apply_chat_template, else the repository's."""
        return repository_raw if self.apply_chat_template is None else not self.apply_chat_template


def read_request(get: Get, *, max_seq_len: int, max_input_bytes: int, num_draft_tokens: int,
                 vocab_size: int) -> ClientRequest:
    """Every check that needs no tokenizing, in the order a client meets them: required inputs, text_input's
    size and encoding before anything else reads it, upstream inputs we don't implement, then each value."""
    def scalar(name, default):
        value = get(name)
        if value is None:
            return default
        if value.shape[0] != 1:
            raise RequestError(f"send one request per call (got a batch of {value.shape[0]} in {name})")
        return value.reshape(-1)[0]

    check_required(get)
    text = text_of(scalar("text_input", b""), "text_input", max_input_bytes)
    check_unsupported(get)
    if not text.strip():
        raise RequestError("text_input is empty; send a prompt")
    max_tokens = int(scalar("max_tokens", 0))
    check_max_tokens(max_tokens, max_seq_len)
    speculation = text_of(scalar("speculation", b"auto"), "speculation", max_input_bytes)
    num_draft = int(scalar("num_draft_tokens", num_draft_tokens))
    check_speculation(speculation, num_draft, num_draft_tokens)
    temperature, top_p, top_k = float(scalar("temperature", 0.0)), float(scalar("top_p", 1.0)), int(scalar("top_k", 0))
    check_sampling_values(temperature, top_p, top_k, vocab_size)
    end_id = scalar("end_id", None)
    words = get("stop_words")
    # Upstream clients pad the list with empty words; the rest are counted before any is decoded.
    words = [w for w in ([] if words is None else words.reshape(-1)) if len(w)]
    if len(words) > MAX_STOP_STRINGS:
        raise RequestError(f"{len(words)} stop words; send at most {MAX_STOP_STRINGS}")
    stop_words = tuple(text_of(w, "stop_words", max_input_bytes) for w in words)
    check_stop_strings(stop_words)
    penalties = (float(scalar("repetition_penalty", 1.0)), float(scalar("presence_penalty", 0.0)),
                 float(scalar("frequency_penalty", 0.0)))
    check_penalty_values(*penalties)
    logprobs, num_logprobs = bool(scalar("return_log_probs", False)), int(scalar("num_logprobs", 0))
    check_logprobs(num_logprobs)
    if num_logprobs and not logprobs:
        raise RequestError(f"num_logprobs {num_logprobs} needs return_log_probs true; send both")
    template = scalar("apply_chat_template", None)
    guide = read_guide(scalar, max_input_bytes)
    min_tokens = int(scalar("min_tokens", 0))
    check_min_tokens(min_tokens, max_tokens)
    bias = read_logit_bias(text_of(scalar("logit_bias", b"{}"), "logit_bias", max_input_bytes), vocab_size)
    prompt_logprobs = int(scalar("prompt_logprobs", -1))
    _prompt_logprobs(prompt_logprobs)  # checked; the tensor keeps -1 for none
    resume_ids = read_resume_ids(get("resume_token_ids"), max_tokens)
    return ClientRequest(text, max_tokens, speculation, num_draft, temperature, top_p, top_k,
                         int(scalar("seed", 0)), bool(scalar("stream", False)),
                         None if end_id is None else int(end_id), stop_words,
                         None if template is None else bool(template), *penalties, logprobs, num_logprobs, guide,
                         min_tokens, bool(scalar("ignore_eos", False)), bias, prompt_logprobs,
                         read_prompt_ids(get("prompt_token_ids"), max_seq_len, vocab_size),
                         check_stream_interval(int(scalar("stream_interval_ms", STREAM_INTERVAL_MS))),
                         int(scalar("request_group", 0)), resume_ids,
                         bool(scalar("resumed", False)) or bool(resume_ids))


def check_stream_interval(ms: int) -> int:
    """stream_interval_ms within its bounds: no shorter than the default, since every response costs each process
    on its way to the client (and a backlog of them, memory), and at most a second, so a client that left is noticed
    within one."""
    if not STREAM_INTERVAL_MS <= ms <= MAX_STREAM_INTERVAL_MS:
        raise RequestError(f"stream_interval_ms {ms} is outside {STREAM_INTERVAL_MS}..{MAX_STREAM_INTERVAL_MS}; "
                           f"send a value in that range, or leave it out for {STREAM_INTERVAL_MS}")
    return ms


def read_prompt_ids(value: np.ndarray | None, max_seq_len: int, vocab_size: int) -> tuple[int, ...] | None:
    """prompt_token_ids: one row of ids, each a token of the vocabulary, fewer than max_seq_len; None when absent."""
    if value is None:
        return None
    if value.ndim > 2 or (value.ndim == 2 and value.shape[0] != 1):
        raise RequestError(f"prompt_token_ids must be one row of token ids (got shape {list(value.shape)})")
    ids = value.reshape(-1)
    if not 0 < ids.size < max_seq_len:
        raise RequestError(f"prompt_token_ids holds {ids.size} ids; send 1 to {max_seq_len - 1} (the model's "
                           "context holds the answer too)")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise RequestError(f"prompt_token_ids has ids outside the vocabulary [0, {vocab_size}); check the tokenizer")
    return tuple(int(t) for t in ids)


def read_resume_ids(value: np.ndarray | None, max_tokens: int) -> tuple[int, ...]:
    """resume_token_ids: one row of token ids, fewer than max_tokens (what is left is what gets made);
    () when absent or empty. Whether they can be the answer's start (no stop token, a guide's) is the engine's check."""
    if value is None or not value.size:
        return ()
    if value.ndim > 2 or (value.ndim == 2 and value.shape[0] != 1):
        raise RequestError(f"resume_token_ids must be one row of token ids (got shape {list(value.shape)})")
    ids = value.reshape(-1)
    if ids.size >= max_tokens:
        raise RequestError(f"resume_token_ids holds {ids.size} ids and max_tokens is {max_tokens}: nothing is left to "
                           "make; send the first request's max_tokens, and don't resume an answer that ended")
    # The model's own ids may lie past the tokenizer's (a padded embedding): the engine checks the upper bound.
    if ids.min() < 0:
        raise RequestError("resume_token_ids holds negative ids; send the answer's own output_token_ids")
    return tuple(int(t) for t in ids)


def read_logit_bias(text: str, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """The logit_bias input, a JSON object {"token id": bias}, as (id, bias) pairs, checked."""
    try:
        raw = json.loads(text or "{}")
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        raise RequestError('logit_bias must be a JSON object {"token id": bias}')
    return logit_bias_pairs(raw, vocab_size)


def logit_bias_pairs(raw: dict, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} (OpenAI's logit_bias) as (id, bias) pairs, checked."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(raw)} entries; send at most {MAX_LOGIT_BIAS}")
    pairs = []
    for key, value in raw.items():
        if not str(key).isdigit():
            raise RequestError(f"logit_bias key {str(key)[:20]!r} is not a token id")
        pairs.append((int(key), value))
    bias = tuple(pairs)
    check_logit_bias(bias, vocab_size)
    return tuple((t, float(b)) for t, b in bias)


def read_guide(scalar, byte_limit: int | None = None) -> GuideSpec | None:
    """guided_decoding_guide_type and guided_decoding_guide (upstream's inputs) as a GuideSpec: None for no
    type or an empty one; a guide without its type is refused, never dropped."""
    kind = text_of(scalar("guided_decoding_guide_type", b""), "guided_decoding_guide_type", byte_limit)
    text = text_of(scalar("guided_decoding_guide", b""), "guided_decoding_guide", byte_limit)
    if not kind:
        if text:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type (json, json_schema, regex or "
                               "ebnf_grammar); send both")
        return None
    return GuideSpec(kind, text)


def _required(get: Get, name: str) -> np.ndarray:
    value = get(name)
    if value is None or not value.size:
        raise RequestError(f"{name} is required")
    return value


def read_engine_request(get: Get) -> dict:
    """The engine model's inputs (pipeline.triton.interface REQUEST_TENSORS) as add_request arguments.
    Sampling values, speculation and token ids are checked again by the engine itself."""
    def scalar(name):
        return _required(get, name).reshape(-1)[0]

    def optional(name, default):
        value = get(name)
        return default if value is None or not value.size else value.reshape(-1)[0]

    ids = _required(get, "input_ids")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise RequestError(f"input_ids must be [1, N] (got shape {list(ids.shape)}); send one request per call")
    length = int(scalar("input_lengths"))
    if not 1 <= length <= ids.shape[1]:
        raise RequestError(f"input_lengths {length} is outside 1..{ids.shape[1]} (the ids sent)")
    max_tokens = int(scalar("request_output_len"))
    if max_tokens < 1:
        raise RequestError(f"request_output_len must be >= 1 (got {max_tokens})")
    resumed = int(optional("resume_length", 0))
    if not 0 <= resumed < length:
        raise RequestError(f"resume_length {resumed} is outside 0..{length - 1} (the ids sent, less a prompt token)")
    temperature, top_p = float(scalar("temperature")), float(scalar("top_p"))
    stop_words = _required(get, "stop_words_list")  # [1, 2, N]: Triton checks the shape
    stream_id = get("stream_id")
    return {
        "stream_id": "" if stream_id is None or not stream_id.size else str(int(stream_id.reshape(-1)[0])),
        "prompt_ids": [int(t) for t in ids[0, :length - resumed]],
        "resume_ids": [int(t) for t in ids[0, length - resumed:length]],
        "max_tokens": max_tokens,
        "end_id": int(scalar("end_id")),
        "temperature": temperature,
        "top_k": int(scalar("top_k")),
        "top_p": top_p,
        "seed": int(scalar("seed")),
        "stream": bool(scalar("stream")),
        # Single-token stop words as token ids; longer ones are matched on text (stop_strings).
        "stop_ids": [w[0] for w in stop_word_ids(stop_words) if len(w) == 1],
        "speculation": text_of(scalar("speculation"), "speculation"),
        "num_draft_tokens": int(scalar("num_draft_tokens")),
        "repetition_penalty": float(scalar("repetition_penalty")),
        "presence_penalty": float(scalar("presence_penalty")),
        "frequency_penalty": float(scalar("frequency_penalty")),
        "logprobs": int(scalar("num_logprobs")) if bool(scalar("return_log_probs")) else None,
        "stop_strings": tuple(json.loads(text_of(scalar("stop_strings"), "stop_strings"))),
        "guide": read_guide(optional),
        "min_tokens": int(optional("min_tokens", 0)),
        "ignore_eos": bool(optional("ignore_eos", False)),
        "logit_bias": read_logit_bias(text_of(optional("logit_bias", b"{}"), "logit_bias")),
        "prompt_logprobs": _prompt_logprobs(int(optional("prompt_logprobs", -1))),
        "stream_interval_ms": check_stream_interval(int(optional("stream_interval_ms", STREAM_INTERVAL_MS))),
        "request_group": int(optional("request_group", 0)) or None,
        "resumed": bool(optional("resumed", False)) or resumed > 0,
    }


def _prompt_logprobs(n: int) -> int | None:
    """The prompt_logprobs input as the engine takes it: -1 is none, else 0..MAX_LOGPROBS, checked."""
    if n == -1:
        return None
    check_logprobs(n)
    return n


def stop_word_ids(flat: np.ndarray) -> list[tuple[int, ...]]:
    """tensorrtllm's [2, W] layout (row 0 the ids, row 1 each word's end offset, -1 padded) -> words."""
    ids, ends = flat.reshape(2, -1)
    words, start = [], 0
    for end in ends:
        if end < 0:
            break
        words.append(tuple(int(t) for t in ids[start:end]))
        start = int(end)
    return [w for w in words if w]


def read_generation_output(get: Get) -> tuple[list[int], int]:
    """postprocessing's inputs: (output_ids, prefix_length), with the prefix inside the ids."""
    ids = _required(get, "output_ids")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise RequestError(f"output_ids must be [1, N] (got shape {list(ids.shape)}); send one response per call")
    tokens = [int(t) for t in ids[0]]
    if any(t < 0 for t in tokens):
        raise RequestError("output_ids holds negative token ids; send the engine's output as it is")
    start = int(_required(get, "prefix_length").reshape(-1)[0])
    if not 0 <= start <= len(tokens):
        raise RequestError(f"prefix_length {start} is outside 0..{len(tokens)} (the ids sent)")
    return tokens, start
