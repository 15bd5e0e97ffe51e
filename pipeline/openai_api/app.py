"""The OpenAI-compatible application: FastAPI routes over the ensemble.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events in OpenAI's chunk
shape, or whole), GET /v1/models, /health (200 once the ensemble is ready) and /metrics (tritonserver's
Prometheus text, passed through, so one scrape target has the gate's, the engine's and Triton's own).

A chat request is rendered here with the model's own chat template (system, user and assistant turns; a
final assistant turn is continued, not closed) and sent as text that the ensemble recognises as rendered
(pipeline.models.tokenizer.is_rendered): it is never templated twice. A completion's prompt is sent with
apply_chat_template false: OpenAI's completions take the prompt as it is.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from pipeline.client.ensemble import Chunk, RequestOptions
from pipeline.client.ensemble_aio import Ensemble, EnsembleError
from pipeline.openai_api import edge, tools
from pipeline.openai_api.connections import BODY_TIMEOUT_S
from pipeline.openai_api.protocol import (API_KEY_ENV, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs,
                                          ChatMessage, ChatRequest, ChunkChoice, Completion, CompletionChoice,
                                          CompletionLogprobs, CompletionRequest, Delta, DeltaToolCall, ErrorResponse,
                                          FunctionCall, Limits, ToolCall,
                                          ModelCard, ModelList, PromptTokensDetails, ProtocolError, ResponseMetrics,
                                          SamplingFields, SpecDecoding, TokenLogprob, TopLogprob, Usage, parse_chat,
                                          parse_completion, request_schemas)
from pipeline.openai_api.stops import StopMatcher

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default, as vLLM's where the model ships no generation_config
TOKENIZING_THREADS = 4
# A whole answer is streamed from the ensemble (its first response tells a refusal from a start, and a client that
# left is noticed at each one) but read only at its end: four responses a second, not twenty. At the default
# cadence 16 choices of 300 tokens left tritonserver's RSS 50 MiB and the gate's 34 MiB higher, and took 42 s; at
# 250 ms, 10 and 6 MiB, and 37 s (2 cores: the stack's processes had fallen behind the engine's responses). No
# longer: a client's cancel reaches the engine at a response, twice on its way (0.5 s after the client left, here).
WHOLE_ANSWER_INTERVAL_MS = 250
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
GUIDE_ERROR = re.compile(r"\bthe (?:json |json_schema |regex |ebnf_grammar )?guide\b")  # pipeline.engine.guide's


@dataclass(frozen=True)
class FrontendSettings:
    grpc_url: str  # tritonserver's gRPC endpoint, HOST:PORT
    tokenizer_dir: Path
    model_name: str  # what /v1/models lists and requests must name
    max_seq_len: int  # prompt + answer; an answer without max_tokens may fill the rest
    num_draft_tokens: int  # the repository's k: the histogram's last bucket
    max_input_bytes: int  # the repository's: the most UTF-8 bytes of prompt text it takes
    metrics_url: str | None = None  # tritonserver's /metrics, passed through
    api_key: str | None = None  # None: no key asked
    max_body_bytes: int | None = None  # None: edge.default_max_body_bytes(max_input_bytes)
    body_timeout_s: float = BODY_TIMEOUT_S  # the whole body must arrive within this (a 408 otherwise)
    kv_pool_tokens: int | None = None  # the engine's KV pool: a request's budget (Limits.check_budget)
    tokenizer_class: str = ""  # preprocessing's (RepoSpec.tokenizer_class): loaded without torch

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes or edge.default_max_body_bytes(self.max_input_bytes)


@dataclass
class Outcome:
    """What one request produced, for usage, finish_reason and the speculation figures."""

    prompt_tokens: int
    max_tokens: int
    completion_tokens: int = 0
    stopped_by_string: bool = False
    chunks: list[Chunk] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per token [id, log prob, [[id, log prob], ...]], as they came
    reported: int = 0  # of those, already in a response
    text_offset: int = 0  # characters of the answer already covered by reported tokens
    prompt_logprobs: list = field(default_factory=list)  # echo with logprobs: the prompt's, as the first chunk had them

    def take_logprobs(self) -> list:
        """The log probs not yet reported."""
        new, self.reported = self.logprobs[self.reported:], len(self.logprobs)
        return new

    @property
    def finish_reason(self) -> str:
        # The ensemble ends an answer at an end token or at max_tokens: fewer tokens than asked means it stopped.
        if self.stopped_by_string or self.completion_tokens < self.max_tokens:
            return "stop"
        return "length"

    def usage(self) -> Usage:
        cached = max((c.cached_tokens for c in self.chunks), default=0)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def metrics(self, k: int) -> ResponseMetrics:
        drafted = sum(c.drafted for c in self.chunks)
        accepted = sum(c.accepted for c in self.chunks)
        steps = sum(c.draft_steps for c in self.chunks)
        skipped: dict[str, int] = {}
        for c in self.chunks:
            for reason, n in c.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        if not steps:
            return ResponseMetrics(speculative_decoding=None if not skipped else SpecDecoding(
                num_spec_steps=0, num_draft_tokens=0, num_accepted_draft_tokens=0, acceptance_histogram=[0] * (k + 1),
                mean_acceptance_length=1.0, draft_acceptance_rate=0.0, num_spec_tokens=k, skipped_steps=skipped))
        histogram = [0] * (k + 1)
        for c in self.chunks:
            for j, n in c.acceptance_histogram.items():
                if j >= len(histogram):  # a request's own num_draft_tokens above the repository's
                    histogram += [0] * (j + 1 - len(histogram))
                histogram[j] += n
        return ResponseMetrics(speculative_decoding=SpecDecoding(
            num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_draft_tokens=accepted,
            acceptance_histogram=histogram, mean_acceptance_length=round(1 + accepted / steps, 4),
            draft_acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
            num_spec_tokens=len(histogram) - 1, skipped_steps=skipped))


def body(schema: str) -> dict:
    """A route's request body in /openapi.json: the route reads it itself (edge.read_json), so FastAPI can't."""
    return {"requestBody": {"required": True, "content": {
        edge.JSON_TYPE: {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}}


def answers(model) -> dict:
    """A route's responses in /openapi.json: the answer, whole or as server-sent events, and every refusal."""
    errors = {status: {"model": ErrorResponse, "description": what} for status, what in (
        (400, "a bad request, named in the message"), (401, "no or a wrong API key"), (404, "another model"),
        (408, "the body did not arrive in time"), (413, "a body over the limit"), (415, "a body that is not JSON"),
        (500, "the server failed this request"),
        (502, "tritonserver failed the request"), (503, "the server is busy, or stopping; retry"))}
    return {200: {"model": model, "content": {"text/event-stream": {}}}, **errors}


END = object()  # a streamed choice's last piece came


def echoes_logprobs(req: SamplingFields) -> bool:
    return getattr(req, "echo", False) and req.num_logprobs() is not None


def options_of(options: RequestOptions, i: int) -> RequestOptions:
    """Choice i's options: its own seed (the request's + i, or a fresh one), so sampled choices differ."""
    if i == 0 or options.temperature == 0:
        return options
    seed = secrets.randbelow(2**63) if options.seed is None else (options.seed + i) % 2**64
    return replace(options, seed=seed)


def merged(outcomes: list[Outcome], prompt_tokens: int, max_new: int) -> Outcome:
    """The choices' usage and speculation figures together: the prompt once, every choice's tokens."""
    if len(outcomes) == 1:
        return outcomes[0]
    total = Outcome(prompt_tokens, max_new)
    total.completion_tokens = sum(o.completion_tokens for o in outcomes)
    total.chunks = [c for o in outcomes for c in o.chunks]
    return total


def error_of(err: EnsembleError, req: SamplingFields) -> ProtocolError:
    if err.busy:
        return ProtocolError(err.message, status=503, type="server_busy")
    if err.stopping:  # a rolling update's old server: the next replica (or this one, restarted) takes it
        return ProtocolError(err.message, status=503, type="server_stopping")
    if err.refused:  # the engine's refusal of a guide (it compiles them) names the field that carried it
        return ProtocolError(err.message, req.guide_field() if GUIDE_ERROR.search(err.message) else None)
    return ProtocolError(err.message, status=502, type="upstream_error")


class Frontend:
    """What every request reads (the settings, the tokenizer, the limits, the ensemble's client) and the routes'
    handlers; one per application (create_app)."""

    def __init__(self, settings: FrontendSettings):
        from pipeline.models.tokenizer import load_tokenizer, template_opening

        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer_dir, settings.tokenizer_class)
        self.opening = template_opening(self.tokenizer)
        # The template's own tool markup, or None: tools go through the fallback (pipeline.openai_api.tools).
        self.family = tools.template_family(getattr(self.tokenizer, "chat_template", None))
        self.limits = Limits(max_seq_len=settings.max_seq_len, num_draft_tokens=settings.num_draft_tokens,
                             vocab_size=len(self.tokenizer), max_input_bytes=settings.max_input_bytes,
                             kv_pool_tokens=settings.kv_pool_tokens)
        # Rendering and tokenizing run here, off the event loop: an 8 MB prompt once held every other request for
        # 4 s. Several threads, so one long prompt doesn't queue the short ones behind it (the Rust tokenizer lets
        # go of the GIL). They share the tokenizer safely because no call sets padding or truncation: a call that
        # changed them would fail a concurrent one with "Already borrowed".
        self.tokenizing = ThreadPoolExecutor(max_workers=TOKENIZING_THREADS, thread_name_prefix="tokenize")
        self.ensemble: Ensemble | None = None  # opened by the application's lifespan, on its event loop
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, app):
        self.ensemble = Ensemble(self.settings.grpc_url)
        yield
        await self.ensemble.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- what a request needs read or checked -----------------------------------------------------------------

    async def authorized(self, request: Request) -> None:
        if self.settings.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), self.settings.api_key.encode()):
            raise ProtocolError("Incorrect API key provided; send it as `Authorization: Bearer KEY` (the key "
                                f"`pipeline serve` was given with --api-key or ${API_KEY_ENV})", status=401,
                                code="invalid_api_key")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    async def read_body(self, request: Request):
        return await edge.read_json(request, self.settings.body_limit, self.settings.body_timeout_s)

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ProtocolError(f"The model `{name}` does not exist; this server serves `{self.settings.model_name}`",
                                "model", status=404, code="model_not_found")

    def options_for(self, req: SamplingFields, prompt_tokens: int, max_new: int, stream: bool,
                    template: bool | None, prompt_ids: tuple[int, ...] | None = None) -> RequestOptions:
        max_seq_len = self.settings.max_seq_len
        room = max_seq_len - prompt_tokens
        if room < 1:
            raise ProtocolError(f"the prompt is {prompt_tokens} tokens, the model's whole {max_seq_len}-token "
                                "context; shorten it", "messages" if isinstance(req, ChatRequest) else "prompt")
        if max_new > room:
            raise ProtocolError(f"the prompt is {prompt_tokens} tokens and max_tokens {max_new}; together they are "
                                f"over the model's {max_seq_len}-token context: lower max_tokens to "
                                f"{max(room, 0)} or shorten the prompt", "max_tokens")
        temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        seed = req.seed
        if seed is None and temperature > 0:
            seed = secrets.randbelow(2**63)  # unseeded sampled requests differ, as OpenAI's do
        return RequestOptions(max_tokens=max_new, temperature=temperature, top_p=1.0 if req.top_p is None else
                              req.top_p, top_k=max(req.top_k or 0, 0), seed=seed, speculation=req.speculation,
                              num_draft_tokens=req.num_draft_tokens, stream=stream, apply_chat_template=template,
                              frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
                              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                              # the engine ends the decoding at a stop string; the matcher below cuts the text
                              # on a route that stops on token sequences instead
                              stop=req.stop_strings(), logprobs=req.num_logprobs(), guide=req.guide(),
                              min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos),
                              logit_bias=req.bias(), prompt_ids=prompt_ids,
                              prompt_logprobs=req.num_logprobs() if echoes_logprobs(req) else None)

    def rendered(self, req: ChatRequest) -> str:
        """The conversation as the model's template writes it."""
        from pipeline.models.tokenizer import render_chat

        try:
            text = render_chat(self.tokenizer, *req.conversation(self.family))
        except Exception as err:  # noqa: BLE001  the template's own refusal (e.g. roles out of order)
            raise ProtocolError(f"the model's chat template refused these messages: {edge.shown_error(err)}",
                                "messages") from None
        size = len(text.encode("utf-8"))
        if size > self.settings.max_input_bytes:  # the template's own text came on top of the messages'
            raise ProtocolError(f"the conversation is {size} bytes as the model's template writes it, over this "
                                f"server's {self.settings.max_input_bytes}; shorten the messages", "messages")
        return text

    def prompt_length(self, text: str, raw: bool) -> int:
        """The prompt's tokens as the ensemble will count them (a rendered conversation is never templated again)."""
        from pipeline.models.tokenizer import encode_prompt

        return len(encode_prompt(self.tokenizer, text, raw=raw, opening="" if raw else self.opening))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=True)

    # ---- an answer's parts ----------------------------------------------------------------------------------

    async def pieces(self, text: str, options: RequestOptions, outcome: Outcome,
                     stops: StopMatcher) -> AsyncIterator[str]:
        """The answer's text as it may be sent; fills `outcome`. Leaving early stops the request."""
        stream = self.ensemble.stream(text, options)
        try:
            async for chunk in stream:
                outcome.chunks.append(chunk)
                outcome.logprobs += chunk.logprobs
                outcome.prompt_logprobs = outcome.prompt_logprobs or chunk.prompt_logprobs
                outcome.completion_tokens += chunk.tokens
                out = stops.feed(chunk.text)
                if out:
                    yield out
                if stops.stopped:
                    # The tokens past the stop string were made but aren't the answer: count the kept text's
                    # tokens, plus the one the stop string began in, as vLLM counts up to the stopping token.
                    outcome.stopped_by_string = True
                    kept = await self.off_loop(self.count_tokens, stops.text[:stops.sent]) + 1
                    outcome.completion_tokens = min(outcome.completion_tokens, kept)
                    del outcome.logprobs[outcome.completion_tokens:]  # as many as the tokens counted
                    return
            if out := stops.flush():
                yield out
        finally:
            await stream.aclose()

    def answered(self, req: SamplingFields, answer: str, outcome: Outcome) -> dict:
        """A chat choice's message and finish_reason: the tool calls where the request offered tools and the answer
        calls listed tools, in the template's markup or the fallback's (pipeline.openai_api.tools), the text
        otherwise."""
        mode = req.tool_mode() if isinstance(req, ChatRequest) else None
        parsed = (tools.parse_calls(answer, req.tool_defs(), self.family) if mode and outcome.finish_reason == "stop"
                  else None)
        if parsed is None:
            return {"message": ChatMessage(content=answer), "finish_reason": outcome.finish_reason}
        return {"message": ChatMessage(content=parsed.content, tool_calls=[ToolCall(
            id=tools.call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls]), "finish_reason": "tool_calls"}

    def chat_logprobs(self, entries: list) -> ChatLogprobs:
        def top(token: int, logprob: float) -> TopLogprob:
            t = self.token_text(token)
            return TopLogprob(token=t, logprob=logprob, bytes=list(t.encode()))

        return ChatLogprobs(content=[TokenLogprob(**top(token, logprob).model_dump(),
                                                  top_logprobs=[top(i, lp) for i, lp in alternatives])
                                     for token, logprob, alternatives in entries])

    def completion_logprobs(self, entries: list, outcome: Outcome) -> CompletionLogprobs:
        # An echoed prompt's first token has no log prob (nothing predicts it): None, as OpenAI and vLLM give it.
        tokens = [self.token_text(token) for token, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(outcome.text_offset)
            outcome.text_offset += len(t)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[lp for _, lp, _ in entries],
                                  top_logprobs=[None if alternatives is None else
                                                {self.token_text(i): lp for i, lp in alternatives}
                                                for _, _, alternatives in entries], text_offset=offsets)

    def logprobs_of(self, req: SamplingFields, outcome: Outcome, chat: bool, echo: bool = False):
        """The log probs not yet reported; with echo, the prompt's own first, as its first chunk had them."""
        if req.num_logprobs() is None:
            return None
        entries = outcome.take_logprobs()
        if echo:
            entries = outcome.prompt_logprobs + entries
        return self.chat_logprobs(entries) if chat else self.completion_logprobs(entries, outcome)

    # ---- the routes ----------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request):
        req: ChatRequest = parse_chat(await self.read_body(request), self.limits)
        self.check_model(req.model)
        text = await self.off_loop(self.rendered, req)
        prompt_tokens = await self.off_loop(self.prompt_length, text, False)
        return await Answer.start(self, request, req, text, prompt_tokens, None, chat=True)

    async def completions(self, request: Request):
        req: CompletionRequest = parse_completion(await self.read_body(request), self.limits)
        self.check_model(req.model)
        prompt = req.one_prompt()
        if isinstance(prompt, tuple):  # token ids, taken as they are; the text names them for the ensemble and echo
            text = await self.off_loop(partial(self.tokenizer.decode, list(prompt)))
            return await Answer.start(self, request, req, text, len(prompt), False, chat=False, prompt_ids=prompt)
        prompt_tokens = await self.off_loop(self.prompt_length, prompt, True)
        return await Answer.start(self, request, req, prompt, prompt_tokens, False, chat=False)

    async def models(self):
        return ModelList(data=[ModelCard(id=self.settings.model_name, created=self.created)])

    async def health(self):
        ready = await self.ensemble.ready()
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    async def metrics(self):
        url = self.settings.metrics_url
        if url is None:
            raise ProtocolError("no metrics endpoint was given to this frontend", status=404)

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()
        try:
            text = await asyncio.to_thread(scrape)
        except OSError as err:
            raise ProtocolError(f"tritonserver's metrics at {url} did not answer ({err})",
                                status=502, type="upstream_error") from None
        own = ["# HELP pipeline_frontend_grpc_streams_total Streams to the ensemble this frontend ended: read to their "
               "final response, or cancelled (the client left)",
               "# TYPE pipeline_frontend_grpc_streams_total counter",
               *(f'pipeline_frontend_grpc_streams_total{{end="{end}"}} {count}'
                 for end, count in self.ensemble.stream_ends.items()),
               "# HELP pipeline_frontend_resumed_total Answers a lost server cut off, resumed from the tokens they had "
               "once it was back",
               "# TYPE pipeline_frontend_resumed_total counter",
               f"pipeline_frontend_resumed_total {self.ensemble.resumed}"]
        return PlainTextResponse(text.rstrip("\n") + "\n" + "\n".join(own) + "\n",
                                 media_type="text/plain; version=0.0.4")


class Answer:
    """One request's answer: its n choices streamed from the ensemble, sent whole (whole) or as server-sent events
    (events), in the chat or the completion shape."""

    def __init__(self, frontend: Frontend, request: Request, req: SamplingFields, text: str, prompt_tokens: int,
                 max_new: int, options: RequestOptions, chat: bool):
        self.frontend, self.request, self.req, self.text, self.chat = frontend, request, req, text, chat
        self.prompt_tokens, self.max_new = prompt_tokens, max_new
        self.model = frontend.settings.model_name
        self.outcomes = [Outcome(prompt_tokens, max_new) for _ in range(req.n)]
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.k = req.num_draft_tokens or frontend.settings.num_draft_tokens
        self.streams = [frontend.pieces(text, options_of(options, i), self.outcomes[i], StopMatcher(req.stop_strings()))
                        for i in range(req.n)]
        self.first: str | None = None

    @classmethod
    async def start(cls, frontend: Frontend, request: Request, req: SamplingFields, text: str, prompt_tokens: int,
                    template: bool | None, chat: bool, prompt_ids: tuple[int, ...] | None = None):
        """The answer, whole or as an event stream, once the first choice's first piece came: a refused request is
        still a plain 400 then, and with several choices the first's prompt is prefilled and cached, and the
        others start from the cache."""
        max_new = req.new_tokens(frontend.settings.max_seq_len - prompt_tokens)
        # Streamed from the ensemble even for a whole answer: a stop string then ends the decoding early.
        options = frontend.options_for(req, prompt_tokens, max_new, True, template, prompt_ids)
        if not req.stream:
            options = replace(options, stream_interval_ms=WHOLE_ANSWER_INTERVAL_MS)
        if req.n > 1:  # the choices share the engine's slots with other clients' requests as one (interface.py)
            options = replace(options, request_group=1 + secrets.randbelow(2**63))
        echoed = prompt_tokens if echoes_logprobs(req) else 0  # the prompt's log probs come back too
        frontend.limits.check_budget(req.n, prompt_tokens, max_new + echoed, req.num_logprobs())
        answer = cls(frontend, request, req, text, prompt_tokens, max_new, options, chat)
        try:
            answer.first = await edge.unless_client_leaves(request, anext(answer.streams[0], None))  # queued too
        except (EnsembleError, edge.ClientLeft) as err:
            for a in answer.streams:
                await a.aclose()
            raise error_of(err, req) if isinstance(err, EnsembleError) else err from None
        return await answer.whole() if not req.stream else EventSourceResponse(answer.events())

    async def choice(self, i: int) -> AsyncIterator[str]:
        """Choice i's pieces, the first one's awaited piece included."""
        if i == 0 and self.first is not None:
            yield self.first
        async for piece in self.streams[i]:
            yield piece

    async def close(self, tasks: list[asyncio.Task]) -> None:
        """Cancel what still runs (the client left, or an error ended the answer): its ensemble request with it."""
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for a in self.streams:
            await a.aclose()

    def logprobs(self, i: int, echo: bool = False):
        return self.frontend.logprobs_of(self.req, self.outcomes[i], self.chat, echo)

    # ---- whole -----------------------------------------------------------------------------------------------

    async def whole(self):
        async def text_of(i: int) -> str:
            return "".join([piece async for piece in self.choice(i)])

        req = self.req
        tasks = [asyncio.create_task(text_of(i)) for i in range(req.n)]
        try:
            answers = await edge.unless_client_leaves(self.request, asyncio.gather(*tasks))
        except EnsembleError as err:
            raise error_of(err, req) from None
        finally:
            await self.close(tasks)
        total = merged(self.outcomes, self.prompt_tokens, self.max_new)
        if self.chat:
            return ChatCompletion(id=self.rid, created=self.created, model=self.model, choices=[ChatChoice(
                index=i, **self.frontend.answered(req, answer, o), logprobs=self.logprobs(i))
                for i, (answer, o) in enumerate(zip(answers, self.outcomes))], usage=total.usage(),
                metrics=total.metrics(self.k))
        echo = getattr(req, "echo", False)
        return Completion(id=self.rid, created=self.created, model=self.model, choices=[CompletionChoice(
            index=i, text=self.text + answer if echo else answer, finish_reason=o.finish_reason,
            logprobs=self.logprobs(i, echo)) for i, (answer, o) in enumerate(zip(answers, self.outcomes))],
            usage=total.usage(), metrics=total.metrics(self.k))

    # ---- streamed --------------------------------------------------------------------------------------------

    def chunk(self, i: int = 0, content: str | None = None, finish: str | None = None, role: bool = False,
              choices: bool = True, usage: bool = False) -> str:
        # A piece of choice i's text carries the log probs of every token that came since its last piece; its
        # finish chunk the rest. The usage chunk counts the prompt once and every choice's tokens.
        lps = self.logprobs(i) if content or finish else None
        total = merged(self.outcomes, self.prompt_tokens, self.max_new) if usage else None
        if self.chat:
            body = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[ChunkChoice(
                index=i, delta=Delta(role="assistant" if role else None, content=content), finish_reason=finish,
                logprobs=lps)] if choices else [], usage=total.usage() if usage else None,
                metrics=total.metrics(self.k) if usage else None)
        else:
            body = Completion(id=self.rid, created=self.created, model=self.model, choices=[CompletionChoice(
                index=i, text=content or "", finish_reason=finish, logprobs=lps)] if choices else [],
                usage=total.usage() if usage else None, metrics=total.metrics(self.k) if usage else None)
        return format_sse_event(data_str=body.model_dump_json(exclude_none=False))

    def tool_chunk(self, i: int, call: DeltaToolCall) -> str:
        body = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[ChunkChoice(
            index=i, delta=Delta(tool_calls=[call]), logprobs=self.logprobs(i))])
        return format_sse_event(data_str=body.model_dump_json(exclude_none=False))

    def ending(self, i: int, whole: str):
        """Choice i's last chunks once its whole answer is known, where it may be tool calls: those as deltas
        (one each), or its text, then its finish."""
        said = self.frontend.answered(self.req, whole, self.outcomes[i])
        if said["finish_reason"] == "tool_calls":
            if said["message"].content:
                yield self.chunk(i, said["message"].content)
            for j, call in enumerate(said["message"].tool_calls):
                yield self.tool_chunk(i, DeltaToolCall(index=j, id=call.id, type="function", function=call.function))
        elif whole:
            yield self.chunk(i, whole)
        yield self.chunk(i, finish=said["finish_reason"])

    async def events(self):
        # Each choice's pieces, as they come: (i, text), (i, END) or (i, the exception that ended it).
        queue: asyncio.Queue = asyncio.Queue()
        req, chat = self.req, self.chat

        async def feed(i: int) -> None:
            try:
                async for piece in self.choice(i):
                    await queue.put((i, piece))
                await queue.put((i, END))
            except Exception as err:  # noqa: BLE001  reported to the client by events()
                await queue.put((i, err))

        tasks = [asyncio.create_task(feed(i)) for i in range(req.n)]
        calling = chat and req.tool_mode() is not None  # a call is known only once the whole answer is
        wholes: list[list[str]] = [[] for _ in range(req.n)]
        try:
            if chat:
                for i in range(req.n):
                    yield self.chunk(i, "", role=True)
            running = req.n
            while running:
                i, item = await queue.get()
                if isinstance(item, Exception):  # mid-stream: OpenAI's error object as an event, then the end
                    if isinstance(item, EnsembleError):
                        error = error_of(item, req)
                    else:  # unforeseen: logged in one line, as the edge logs a whole request's
                        edge.log_failure("POST", CHAT_PATH if chat else COMPLETIONS_PATH, item)
                        error = edge.internal_error()
                    yield format_sse_event(data_str=json.dumps(error.body()))
                    yield format_sse_event(data_str="[DONE]")
                    return
                if item is END:
                    running -= 1
                    for event in (self.ending(i, "".join(wholes[i])) if calling else
                                  [self.chunk(i, finish=self.outcomes[i].finish_reason)]):
                        yield event
                elif calling:
                    wholes[i].append(item)
                else:
                    yield self.chunk(i, item)
            if req.stream_options and req.stream_options.include_usage:
                yield self.chunk(choices=False, usage=True)  # OpenAI's last chunk: no choices, the usage (and ours)
            yield format_sse_event(data_str="[DONE]")
        finally:
            await self.close(tasks)


def create_app(settings: FrontendSettings) -> FastAPI:
    frontend = Frontend(settings)
    app = FastAPI(title="specdec-pipeline OpenAI-compatible API", lifespan=frontend.lifespan, docs_url=None,
                  redoc_url=None)
    edge.install(app)
    schemas = request_schemas(frontend.limits, settings.model_name)

    def openapi() -> dict:
        """FastAPI's document, with the request bodies the routes read themselves (and their bounds)."""
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    key = [Depends(frontend.authorized)]
    app.post(CHAT_PATH, dependencies=key, openapi_extra=body("ChatRequest"),
             responses=answers(ChatCompletion))(frontend.chat_completions)
    app.post(COMPLETIONS_PATH, dependencies=key, openapi_extra=body("CompletionRequest"),
             responses=answers(Completion))(frontend.completions)
    app.get("/v1/models", dependencies=key, response_model=ModelList,
            responses={401: {"model": ErrorResponse}})(frontend.models)
    app.get("/health", responses={503: {"description": "the ensemble is not ready yet"}})(frontend.health)
    app.get("/metrics", response_class=PlainTextResponse,
            responses={404: {"model": ErrorResponse}, 502: {"model": ErrorResponse}})(frontend.metrics)
    return app
