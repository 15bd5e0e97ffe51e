"""The OpenAI-compatible frontend: its request rules on their own, then the real thing driven by the official
`openai` SDK against a real tritonserver serving a tiny seeded Llama with n-gram drafts."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.engine.guide import GuideSpec
from pipeline.openai_api.protocol import Limits, ProtocolError
from pipeline.openai_api.protocol import parse_chat as parse_chat_within
from pipeline.openai_api.protocol import parse_completion as parse_completion_within
from pipeline.openai_api.stops import StopMatcher

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LIMITS = Limits(max_seq_len=256, num_draft_tokens=3, vocab_size=1000, max_input_bytes=8192)


def parse_chat(body):
    return parse_chat_within(body, LIMITS)


def parse_completion(body):
    return parse_completion_within(body, LIMITS)


# ---- the request rules -----------------------------------------------------------------------------


def test_openai_clients_neutral_defaults_pass():
    request = parse_chat({**CHAT, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False,
                          "stream": True, "stream_options": {"include_usage": True}, "user": "u1", "response_format": {"type": "text"},
                          "stop": ["a", "b"], "speculation": "off", "num_draft_tokens": 2})
    assert request.stop_strings() == ("a", "b") and request.speculation == "off"


@pytest.mark.parametrize("field, value", [
    ("n", 17), ("n", 0), ("n", True), ("top_logprobs", 30), ("frequency_penalty", 2.5),
    ("tools", [{"type": "function"}]),
    ("response_format", {"type": "xml"}), ("response_format", {"type": "json_schema"}),
    ("guided_regex", "(ab" * 30_000), ("logit_bias", {"1": 500}), ("logit_bias", {"x": 1}),
    ("min_tokens", -1), ("presence_penalty", float("nan")),
])
def test_an_unsupported_field_is_a_400_naming_it(field, value):
    with pytest.raises(ProtocolError) as err:
        parse_chat({**CHAT, field: value})
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


def test_response_format_and_vllms_guided_fields_become_one_guide():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    assert parse_chat({**CHAT, "response_format": rf}).guide() == GuideSpec("json_schema", json.dumps(schema))
    assert parse_chat({**CHAT, "response_format": {"type": "json_object"}}).guide().type == "json_schema"
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).guide() is None
    assert parse_chat({**CHAT, "guided_json": schema}).guide() == GuideSpec("json_schema", json.dumps(schema))
    assert parse_chat({**CHAT, "guided_regex": "[0-9]+"}).guide() == GuideSpec("regex", "[0-9]+")
    assert parse_chat({**CHAT, "guided_choice": ["a.b", "c"]}).guide() == GuideSpec("regex", r"a\.b|c")
    assert parse_chat({**CHAT, "guided_grammar": 'root ::= "x"'}).guide().type == "ebnf_grammar"
    with pytest.raises(ProtocolError, match="guided_regex and response_format each ask for a guide; send one"):
        parse_chat({**CHAT, "guided_regex": "x", "response_format": {"type": "json_object"}})


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "frobnicate": 1}, "frobnicate"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "stop": ["ok", ""]}, "stop"),
    ({**CHAT, "speculation": "maybe"}, "speculation"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
])
def test_a_bad_chat_request_is_a_400_naming_the_field(body, param):
    with pytest.raises(ProtocolError) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_a_completion_takes_one_prompt_as_text_or_token_ids():
    assert parse_completion({"model": "m", "prompt": ["one"]}).one_prompt() == "one"
    assert parse_completion({"model": "m", "prompt": [5, 6, 7]}).one_prompt() == (5, 6, 7)
    assert parse_completion({"model": "m", "prompt": [[5, 6, 7]], "echo": True}).one_prompt() == (5, 6, 7)
    for body, param in (({"model": "m", "prompt": ["a", "b"]}, "prompt"), ({"model": "m", "prompt": [[1], [2]]},
                                                                            "prompt"),
                        ({"model": "m", "prompt": [5, 1000]}, "prompt"), ({"model": "m", "prompt": [1] * 256},
                                                                          "prompt"),
                        ({"model": "m", "prompt": "x", "echo": True, "stream": True}, "echo"),
                        ({"model": "m", "prompt": []}, "prompt")):
        with pytest.raises(ProtocolError) as err:
            parse_completion(body).one_prompt()
        assert err.value.param == param, err.value.message


def test_a_stop_string_split_across_chunks_ends_the_answer_before_it():
    stops = StopMatcher(("glad to", "END"))
    out = [stops.feed(piece) for piece in ("I am gl", "ad", " to help", "more")]
    assert "".join(out) == "I am " and stops.stopped


def test_text_that_only_looked_like_a_stop_string_is_released():
    stops = StopMatcher(("glad to",))
    out = [stops.feed("I am gl"), stops.feed("ee, happy"), stops.flush()]
    assert out == ["I am ", "glee, happy", ""] and not stops.stopped


def test_a_rendered_conversation_is_not_templated_again(tiny_target):
    from pipeline.models.tokenizer import encode_prompt, is_rendered, load_tokenizer, render_chat

    tokenizer = load_tokenizer(tiny_target)
    rendered = render_chat(tokenizer, [{"role": "user", "content": "hello"}])
    assert is_rendered(tokenizer, rendered) and not is_rendered(tokenizer, "hello")
    # The ids the ensemble makes of the rendered text are the ones it makes of the plain prompt.
    assert encode_prompt(tokenizer, rendered, raw=False) == encode_prompt(tokenizer, "hello", raw=False)
    # An assistant turn last is continued (prefill), not closed.
    prefill = render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}])
    assert prefill.endswith("Sure, ")


# ---- the served frontend -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    """A tritonserver on the tiny n-gram engine, and the frontend in front of it, as `pipeline serve` starts it."""
    from serving_checks import ngram_engine, served_engine

    from pipeline.openai_api.process import FrontendOptions, FrontendProcess
    from pipeline.triton.ports import free_ports

    # 1024 tokens: a byte-level tokenizer spends a token a character, and tool descriptions are long.
    engine = ngram_engine(tiny_target, tmp_path_factory.mktemp("engines"), slots=8, max_seq_len=1024)
    # Room for the 64-stream test: 8 slots and 64 waiting, so no request is refused as busy.
    with served_engine(engine, tmp_path_factory.mktemp("served"), min_spec_tokens=20, max_queue_size=64) as server:
        [port] = free_ports(1)
        frontend = FrontendProcess(FrontendOptions(port=port, model_name="tiny"), server.options.repo,
                                   f"127.0.0.1:{server.options.grpc_port}", server.endpoints.metrics,
                                   tmp_path_factory.mktemp("frontend") / "openai.log")
        frontend.start().wait_ready()
        try:
            yield server, frontend, engine
        finally:
            frontend.stop()


@pytest.fixture()
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_text(server, prompt: str, max_tokens: int) -> str:
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request

    return run_request(ClientOptions(url=f"127.0.0.1:{server.options.grpc_port}"), prompt,
                       RequestOptions(max_tokens=max_tokens, speculation="off")).text


def test_greedy_chat_is_the_grpc_routes_text_for_the_same_prompt(served, client):
    prompt = "Write a function that reverses a list."
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=40, temperature=0, extra_body={"speculation": "on"})
    assert answer.choices[0].message.content == grpc_text(served[0], prompt, 40)
    assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
    assert answer.usage.completion_tokens <= 40
    assert answer.choices[0].finish_reason == ("length" if answer.usage.completion_tokens == 40 else "stop")


def test_a_stream_says_what_the_whole_answer_says_and_ends_with_usage(client):
    messages = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another one?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert whole.usage.prompt_tokens > 20  # the system prompt and both turns are in it
    # the same conversation again: its whole blocks come from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_a_stop_string_cuts_the_answer_where_it_starts(client):
    prompt = "Count to twenty."
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    stop = full[10:13]
    assert len(full) > 20 and stop.strip(), full
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never seen"], stream=True))
            reason = None
        else:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                               stop=stop)
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
            assert answer.usage.completion_tokens < 40
        assert text == full[:full.index(stop)]
        assert reason in (None, "stop")


def frontend_stream_ends(served) -> dict[str, float]:
    """How the frontend's gRPC streams ended: read, stopped or cancelled (its own lines on /metrics)."""
    with urllib.request.urlopen(f"{served[1].url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {end: float(v) for end, v in re.findall(r'^pipeline_frontend_grpc_streams_total\{end="(\w+)"\} (\S+)$', text,
                                                   re.MULTILINE)}


def test_the_frontend_never_cancels_a_grpc_stream_it_reads_or_stops(served, client):
    """Cancelling a gRPC stream as its last response goes out is what the bundled tritonserver 2.51 can die of
    (docs/reliability.md). An answer read to its end, or cut at a stop string (the server ends it there), ends its
    stream read; a client that leaves mid-answer has its request stopped through the stop_request model and the
    stream read to the gate's final response: no stream is cancelled."""
    import time

    prompt = "Count to twenty."
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0).choices[0].text
    stop = full[6:9]
    assert stop.strip() and len(full) > 30, full
    before = frontend_stream_ends(served)
    for stream in (False, True) * 2:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                           stream=stream)
        text = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
        assert text == full[:full.index(stop)]
    for _ in range(3):
        left = client.completions.create(model="tiny", prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(left))
        left.close()  # the client leaves mid-answer
    deadline = time.monotonic() + 15
    while sum(frontend_stream_ends(served).values()) < sum(before.values()) + 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = frontend_stream_ends(served)
    assert {end: after[end] - before[end] for end in after} == {"read": 4, "stopped": 3, "cancelled": 0}
    while engine_counts(served)[0] and time.monotonic() < deadline:  # the stopped requests leave the engine
        time.sleep(0.05)
    assert engine_counts(served)[0] == 0


@pytest.mark.parametrize("extra, param", [
    ({"n": 17}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
])
def test_unsupported_fields_get_openais_400_and_the_server_serves_on(client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       **extra)
    assert err.value.body["param"] == param and param in err.value.body["message"]
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert ok.choices[0].finish_reason in ("stop", "length")


PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "age", "name"],
              "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
                             "name": {"type": "string", "maxLength": 6}}}


def test_a_guided_answer_is_the_same_speculated_or_not_over_grpc_and_the_openai_api(served, client):
    """The guide holds the answer to its schema, and speculation changes no token of it: gRPC (upstream's
    guided_decoding_* inputs) and the OpenAI API (response_format json_schema), each with drafts forced on and off."""
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request
    from pipeline.engine.guide import GuideSpec

    server = served[0]
    prompt = "Describe a pet as JSON: its kind, its age and its name, then repeat it: kind, age, name."
    guide = GuideSpec("json_schema", json.dumps(PET_SCHEMA))
    grpc = {spec: run_request(ClientOptions(url=f"127.0.0.1:{server.options.grpc_port}"), prompt,
                              RequestOptions(max_tokens=80, speculation=spec, guide=guide))
            for spec in ("on", "off")}
    assert grpc["on"].text == grpc["off"].text
    pet = json.loads(grpc["on"].text)
    assert set(pet) == {"kind", "age", "name"} and pet["kind"] in ("cat", "dog") and 0 <= pet["age"] <= 30
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
    api = {spec: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=80, temperature=0, response_format=rf,
                                                extra_body={"speculation": spec})
           for spec in ("on", "off")}
    assert api["on"].choices[0].message.content == api["off"].choices[0].message.content == grpc["on"].text
    assert api["on"].choices[0].finish_reason == "stop"


def test_the_sdks_parse_and_vllms_guided_fields_get_answers_that_match(client):
    """The openai SDK's chat.completions.parse with a pydantic model (it sends a strict json_schema and reads the
    answer back into the model), vLLM's guided_choice and guided_regex; a guide that doesn't compile is a 400
    naming why, and the server answers the next request."""
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)
        name: str = Field(max_length=6)

    messages = [{"role": "user", "content": "Describe a pet."}]
    parsed = client.chat.completions.parse(model="tiny", messages=messages, response_format=Pet, max_tokens=80,
                                           temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    choice = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    year = client.completions.create(model="tiny", prompt="The year after 2024 is", max_tokens=8, temperature=0,
                                     extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", year.choices[0].text)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       extra_body={"guided_regex": "(ab"})
    said = err.value.body["message"]
    assert "the regex guide doesn't compile" in said and "unclosed group" in said
    ok = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_load_tools_fixed_length_request_and_a_logit_bias_are_honoured(client):
    """vLLM's `bench serve` payload (ignore_eos: every answer exactly max_tokens long), min_tokens, and a logit
    bias that forces a token."""
    messages = [{"role": "user", "content": "hi"}]
    fixed = client.completions.create(model="tiny", prompt="hi", max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True, "speculation": "on"})
    assert fixed.usage.completion_tokens == 48 and fixed.choices[0].finish_reason == "length"
    eos = {"256": 100}  # the tiny tokenizer's <|endoftext|>, all but forced: the answer ends at once...
    ended = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                           logit_bias=eos)
    assert ended.usage.completion_tokens == 0 and ended.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                          logit_bias=eos, extra_body={"min_tokens": 7})
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"  # ...or after 7 tokens
    from tiny_models import byte_tokenizer

    [a] = byte_tokenizer().encode("a", add_special_tokens=False)
    forced = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            logit_bias={str(a): 100})
    assert forced.choices[0].message.content == "a" * 8


def test_n_choices_each_their_own_and_the_prompt_read_once(client):
    """n sampled choices with a seed: n answers, reproducible, not all alike; the later choices read the prompt's
    blocks from the prefix cache; usage counts the prompt once and every choice's tokens."""
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm at sea, " * 3}]
    # ignore_eos: every choice makes its 12 tokens, whatever its seed draws (usage is counted below)
    kwargs = dict(model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    first, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.message.content for c in again.choices] == texts  # seed + i per choice: reproducible
    assert first.usage.completion_tokens == 36 and first.usage.total_tokens == first.usage.prompt_tokens + 36
    assert first.usage.prompt_tokens_details.cached_tokens > 0
    greedy = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    # Streamed: each choice's chunks carry its index, and put together say what the whole answers said.
    streamed, finishes, usage = ["", "", ""], {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert streamed == texts and finishes == {i: first.choices[i].finish_reason for i in range(3)}
    assert usage.completion_tokens == 36 and usage.prompt_tokens == first.usage.prompt_tokens
    pieces = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert pieces == [greedy.choices[0].text] * 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "maxLength": 12},
                                                                          "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_a_tool_call_round_trip_forced_on_a_template_without_tools(client):
    """SmolLM2's template (and the tiny one) knows no tools: the call is forced by a guide (tool_choice named or
    required), comes back as tool_calls with finish_reason tool_calls, streamed as a delta too, and the tool's
    result goes back in a tool turn for the final answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=150, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and args["unit"] in ("c", "f")
    required = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=150, temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                            max_tokens=150, temperature=0, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and deltas[0].function.arguments == call.function.arguments
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=20,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    import openai

    for bad, param in ((dict(tool_choice="required"), "tool_choice"),
                       (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                        "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, **bad)
        assert err.value.body["param"] == param


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchains_structured_output_gets_its_pydantic_model(served, method):
    """LangChain's ChatOpenAI, as an agent framework sends it: with_structured_output by a strict json_schema
    response_format (its default) and by a forced tool call."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        """A pet."""

        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)

    llm = ChatOpenAI(base_url=f"{served[1].url}/v1", api_key="unused", model="tiny", temperature=0, max_tokens=80,
                     max_retries=0, timeout=60)
    pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_langchains_bound_tools_make_a_call_and_take_its_result_back(served):
    """bind_tools with a named tool_choice: a call LangChain parses into tool_calls, then its ToolMessage back."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=12)  # the random tiny model would otherwise write one string to max_tokens

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 C in {city}"

    llm = ChatOpenAI(base_url=f"{served[1].url}/v1", api_key="unused", model="tiny", temperature=0, max_tokens=150,
                     max_retries=0, timeout=60)
    messages = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert asked.response_metadata["finish_reason"] == "tool_calls" and not asked.content
    [call] = asked.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    messages += [asked, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_a_call_is_an_answer_that_is_exactly_one_call_of_a_listed_tool():
    from pipeline.openai_api import tools

    listed = [WEATHER["function"], TIME["function"]]
    assert tools.parse_calls('{"name": "get_time", "arguments": {"zone": "UTC"}}', listed, None) == tools.Parsed(
        [("get_time", '{"zone": "UTC"}')], None)
    for text in ('{"name": "nope", "arguments": {}}', "It is sunny.", '{"name": "get_time"}',
                 '{"name": "get_time", "arguments": "UTC"}', '[{"name": "get_time", "arguments": {}}]',
                 '{"name": "get_time", "arguments": {}, "extra": 1}'):
        assert tools.parse_calls(text, listed, None) is None, text
    turns = tools.render([{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": "call_1", "name": "get_time", "arguments": '{"zone": "CET"}'}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], listed, True)
    assert turns[0]["role"] == "system" and "get_weather" in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '{"name": "get_time", "arguments": {"zone": "CET"}}'}
    assert turns[3] == {"role": "user", "content": "Result of get_time: 12:00"}


# A template in the Hermes family's markup (NousResearch's Hermes 2 Pro format, which Qwen2.5's follows): it lists the
# tools, writes calls as <tool_call> blocks and results as <tool_response>; written here, as no template is on disk.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You may call these functions:
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'assistant' and m.tool_calls %}\
<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_knows_tools_renders_them_and_its_markup_is_parsed():
    """With a template of the Hermes family the tools, the call and its result go through the template itself, and
    an answer's <tool_call> blocks are its calls, the text beside them content. Llama 3.1's bare JSON calls (with
    "parameters") are read too; a template without tools gets the fallback."""
    from tiny_models import byte_tokenizer

    from pipeline.models.tokenizer import render_chat
    from pipeline.openai_api import tools
    from pipeline.openai_api.protocol import ChatRequest

    assert tools.template_family(HERMES_TEMPLATE) == "hermes"
    assert tools.template_family("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert tools.template_family("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    req = ChatRequest.model_validate({"model": "tiny", "tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]})
    text = render_chat(tokenizer, *req.conversation("hermes"))
    assert text.startswith("<|im_start|>system\nBe brief.\nYou may call these functions:\n<tools>")
    assert '"name": "get_weather"' in text and "Result of" not in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in text
    assert text.endswith("<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    listed = [WEATHER["function"], TIME["function"]]
    two = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    assert tools.parse_calls(two, listed, "hermes") == tools.Parsed(
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "unit": "c"}')], "Checking.")
    assert tools.parse_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', listed, "hermes") is None
    assert tools.parse_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', listed, "llama3_json") == \
        tools.Parsed([("get_time", '{"zone": "UTC"}')], None)
    assert tools.parse_calls("It is noon.", listed, "hermes") is None


def test_penalties_reach_the_engine_and_a_resent_prompt_is_served_from_the_prefix_cache(client):
    messages = [{"role": "user", "content": "Say something repetitive about the sea, the sea and the sea. " * 3}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    penalised = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                               frequency_penalty=1.5, presence_penalty=0.5,
                                               extra_body={"repetition_penalty": 1.3})
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    # The second time the prompt was sent, its whole blocks were found cached (the last token is always computed).
    cached = penalised.usage.prompt_tokens_details.cached_tokens
    assert cached == (penalised.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_log_probs_in_openais_shapes_streamed_or_not(client):
    from pipeline.models.tokenizer import visible_text

    messages = [{"role": "user", "content": "List some numbers."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    # Each token's own text; the answer drops a character max_tokens cut in two (visible_text).
    assert visible_text("".join(t.token for t in content)) == whole.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
    streamed = [c for c in client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                         temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for c in streamed for t in c.choices[0].logprobs.content] == content
    completion = client.completions.create(model="tiny", prompt="Count: 1, 2,", max_tokens=10, temperature=0,
                                           logprobs=2)
    lp = completion.choices[0].logprobs
    assert visible_text("".join(lp.tokens)) == completion.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    pieces = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt="Count: 1, 2,", max_tokens=10, temperature=0, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens  # the offsets run on across the pieces
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    assert [x for p in pieces for x in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_an_unknown_model_is_a_404_naming_the_served_one(client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "tiny" in err.value.body["message"]
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_each_answer_carries_its_speculation_in_vllms_shape(client):
    answer = client.completions.create(model="tiny", prompt="one two three one two three one two", max_tokens=60,
                                       temperature=0, extra_body={"speculation": "on"})
    spec = answer.model_extra["metrics"]["speculative_decoding"]
    histogram = spec["acceptance_histogram"]
    assert spec["num_spec_steps"] > 0 and sum(histogram) == spec["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(histogram)) == spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert len(histogram) == spec["num_spec_tokens"] + 1
    off = client.completions.create(model="tiny", prompt="one two three", max_tokens=30, temperature=0,
                                    extra_body={"speculation": "off"})
    assert off.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] == 0


def test_health_and_metrics_pass_through(served):
    frontend = served[1]
    with urllib.request.urlopen(f"{frontend.url}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"{frontend.url}/metrics", timeout=5) as response:
        assert "pipeline_gate_in_flight" in response.read().decode()


def total(samples: dict[str, float], name: str) -> float:
    """A family's value summed over its label sets (serving_checks.metrics keys carry the labels)."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def test_the_serving_metrics_count_what_the_answers_said(served, client):
    """The latency histograms observe each streamed answer once (and its later responses), and the token
    counters add up to the answers' own usage, exactly."""
    import time

    from serving_checks import metrics

    names = {"ttft": "pipeline_time_to_first_token_seconds_count", "itl": "pipeline_inter_token_latency_seconds_count",
             "e2e": "pipeline_e2e_request_latency_seconds_count", "prompt": "pipeline_prompt_tokens_total",
             "generated": "pipeline_generation_tokens_total"}
    # The token counters are published every 0.1 s: wait until an earlier test's last answer is in them.
    before, previous = metrics(served[0].endpoints.metrics), None
    deadline = time.monotonic() + 10
    while before != previous and time.monotonic() < deadline:
        time.sleep(0.3)
        previous, before = before, metrics(served[0].endpoints.metrics)
    usages = []
    for i in range(3):
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=30, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
    want = {"ttft": 3, "e2e": 3, "prompt": sum(u.prompt_tokens for u in usages),
            "generated": sum(u.completion_tokens for u in usages)}

    def added() -> dict[str, float]:  # the token counters are published every 0.1 s
        now = metrics(served[0].endpoints.metrics)
        return {key: total(now, name) - total(before, name) for key, name in names.items()}
    deadline = time.monotonic() + 10
    got = added()
    while {k: got[k] for k in want} != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = added()
    assert {k: got[k] for k in want} == want
    # The first token leaves alone, so each answer of more than one token sends at least one more response.
    assert got["itl"] >= sum(u.completion_tokens > 1 for u in usages)
    after = metrics(served[0].endpoints.metrics)
    ttft_s, e2e_s = (total(after, n) - total(before, n) for n in ("pipeline_time_to_first_token_seconds_sum",
                                                                  "pipeline_e2e_request_latency_seconds_sum"))
    assert 0 < ttft_s < e2e_s


def test_every_metric_the_dashboard_plots_is_one_the_server_exports(served):
    import re

    from pipeline.deploy.dashboard import metric_names

    with urllib.request.urlopen(served[0].endpoints.metrics, timeout=5) as response:
        exported = set(re.findall(r"^(\w+)[{ ]", response.read().decode(), re.M))
    assert metric_names() - exported == set()


def test_kv_cache_usage_rises_while_answers_run_and_falls_to_zero(served, client):
    import time

    from serving_checks import metrics

    name = "pipeline_engine_kv_cache_usage_ratio"
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(total(metrics(served[0].endpoints.metrics), name))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        streams = [threading.Thread(target=lambda i=i: list(client.completions.create(
            model="tiny", prompt=f"Once upon a time {i}", max_tokens=200, temperature=0, stream=True,
            extra_body={"speculation": "off"}))) for i in range(4)]
        for t in streams:
            t.start()
        for t in streams:
            t.join(60)
    finally:
        done.set()
        watcher.join()
    assert 0 < max(seen) <= 1
    deadline = time.monotonic() + 10
    while total(metrics(served[0].endpoints.metrics), name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert total(metrics(served[0].endpoints.metrics), name) == 0


def test_64_streams_with_50_clients_leaving_mid_stream_leave_nothing_in_flight(served, client):
    import re
    import time

    errors, finished = [], []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"story {i}"}],
                                                    max_tokens=120, temperature=0.8, seed=i, stream=True)
            for n, chunk in enumerate(stream):
                if i < 50 and n == 1:
                    stream.close()  # the client walks away
                    return
            finished.append(i)
        except Exception as err:  # noqa: BLE001  collected: any error fails the test below
            errors.append(f"{i}: {err}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and sorted(finished) == list(range(50, 64)), errors[:3]

    def in_flight() -> float:
        with urllib.request.urlopen(served[0].endpoints.metrics, timeout=5) as response:
            return sum(float(v) for v in re.findall(r"^pipeline_gate_in_flight\{[^}]*\} (\S+)$",
                                                     response.read().decode(), re.M))
    deadline = time.monotonic() + 30
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert in_flight() == 0


def test_an_api_key_is_asked_when_set(served, tmp_path):
    import openai

    from pipeline.openai_api.process import FrontendOptions, FrontendProcess
    from pipeline.triton.ports import free_ports

    server = served[0]
    [port] = free_ports(1)
    keyed = FrontendProcess(FrontendOptions(port=port, api_key="s3cret-key", model_name="tiny"), server.options.repo,
                            f"127.0.0.1:{server.options.grpc_port}", None, tmp_path / "openai.log").start()
    try:
        keyed.wait_ready()
        assert "s3cret-key" not in " ".join(keyed.argv)  # never on the command line, which `ps` shows
        good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="s3cret-key", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        keyed.stop()


def test_a_dead_frontend_is_noticed(served, tmp_path):
    from pipeline.openai_api.process import FrontendOptions, FrontendProcess
    from pipeline.triton.ports import free_ports

    [port] = free_ports(1)
    frontend = FrontendProcess(FrontendOptions(port=port), served[0].options.repo,
                               f"127.0.0.1:{served[0].options.grpc_port}", None, tmp_path / "openai.log").start()
    frontend.wait_ready()
    assert frontend.died() is None
    frontend.process.kill()
    frontend.process.wait()
    assert "exited" in frontend.died()
    frontend.start().wait_ready()  # what supervise does
    assert frontend.died() is None
    frontend.stop()


def test_the_ensemble_takes_a_prompt_as_it_is_when_asked(served):
    """apply_chat_template false (what /v1/completions sends): the raw prompt's ids, not the templated ones."""
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request

    url = ClientOptions(url=f"127.0.0.1:{served[0].options.grpc_port}")
    templated = run_request(url, "hello", RequestOptions(max_tokens=20, speculation="off")).text
    raw = run_request(url, "hello", RequestOptions(max_tokens=20, speculation="off", apply_chat_template=False)).text
    assert templated != raw



def test_tritons_own_openai_frontend_can_sit_in_front_of_the_ensemble(served, client):
    """What Triton's OpenAI frontend sends (pipeline.trtllm.upstream.TRITON_OPENAI_INPUTS): a conversation it
    rendered with the model's template, and its sampling fields at OpenAI's neutral values. The ensemble doesn't
    template it twice: the answer is the one our own frontend gives for the same messages."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from serving_checks import responses, tensor

    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.triton.config import PREPROCESSING, read_config
    from pipeline.trtllm.upstream import TRITON_OPENAI_INPUTS

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    params = read_config(served[0].options.repo / PREPROCESSING / "config.pbtxt").parameters
    tokenizer = load_tokenizer(params["tokenizer_dir"].string_value)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # TritonLLMEngine.chat
    # A one-token stop word (the ensemble refuses longer ones in a line; our frontend matches text instead).
    stop = next(w for w in (" zebra", "zebra", " banana", "~") if len(tokenizer(w, add_special_tokens=False)
                                                                           .input_ids) == 1)
    sent = {"text_input": np.array([[rendered.encode()]], np.object_), "stream": np.array([[True]]),
            "max_tokens": np.array([[30]], np.int32), "stop_words": np.array([[stop.encode()]], np.object_),
            "top_p": np.array([[1.0]], np.float32), "frequency_penalty": np.array([[0.0]], np.float32),
            "presence_penalty": np.array([[0.0]], np.float32), "seed": np.array([[7]], np.uint64),
            "temperature": np.array([[0.0]], np.float32)}
    assert [name for name, _ in TRITON_OPENAI_INPUTS] == list(sent)
    dtypes = dict(TRITON_OPENAI_INPUTS)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{served[0].options.grpc_port}")
    try:
        chunks = responses(grpc, "", 0, raw_inputs=[tensor(n, v, dtypes[n]) for n, v in sent.items()])
    finally:
        grpc.close()
    ours = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                          stop=[stop])
    assert "".join(text for text, _, _ in chunks) == ours.choices[0].message.content


# ---- bounds and strict types (issue 39) ----------------------------------------------------------------


@pytest.mark.parametrize("body, param, said", [
    ({**CHAT, "max_tokens": "8"}, "max_tokens", "valid integer (got '8')"),
    ({**CHAT, "max_tokens": True}, "max_tokens", "valid integer (got True)"),
    ({**CHAT, "max_tokens": 8.0}, "max_tokens", "valid integer (got 8.0)"),
    ({**CHAT, "stream": "yes"}, "stream", "valid boolean (got 'yes')"),
    ({**CHAT, "stream": 1}, "stream", "valid boolean (got 1)"),
    ({**CHAT, "temperature": "0.5"}, "temperature", "valid number (got '0.5')"),
    ({**CHAT, "temperature": float("inf")}, "temperature", "finite number"),
    ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages", "messages.0: Value error, content "
     "is required"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages", "messages.0: Value error, content is required"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages", "a tool turn needs tool_call_id"),
    ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages", "arguments must be a JSON object"),
    ({**CHAT, "top_k": 10**12}, "top_k", "top_k 1000000000000 is over the vocabulary's 1000"),
    ({**CHAT, "num_draft_tokens": 10**9}, "num_draft_tokens", "num_draft_tokens 1000000000 is more than the 3"),
    ({**CHAT, "max_tokens": 256}, "max_tokens", "max_tokens 256 is beyond the model's 256-token context"),
    ({**CHAT, "max_completion_tokens": 10**30}, "max_completion_tokens", f"max_completion_tokens {10**30} is beyond"),
    ({**CHAT, "seed": 2**64}, "seed", "less than 18446744073709551616"),
    ({**CHAT, "stop": ["x" * 300]}, "stop", "send at most 256"),
    ({**CHAT, "stop": [str(i) for i in range(17)]}, "stop", "at most 16 items"),
    ({**CHAT, "repetition_penalty": 1e6}, "repetition_penalty", "less than or equal to 10000"),
    ({**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({**CHAT, "user": "u" * 513}, "user", "at most 512 characters"),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 9000}]}, "messages", "9000 bytes of text"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}] * 257}, "messages", "257 turns"),
    # issue 52: checked as sent, before float32 rounds them, with the engine's lower bounds
    ({**CHAT, "temperature": 1e-300}, "temperature", "temperature 1e-300 is too small to sample with"),
    ({**CHAT, "top_p": 1e-300}, "top_p", "top_p 1e-300 is under 1e-30"),
    ({**CHAT, "repetition_penalty": 1e-38}, "repetition_penalty", "repetition_penalty 1e-38 is under 0.0001"),
    # OpenAI's own shape where it is strict
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", 'of type "object" (got type '
     "'array')"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4",
                                                                    "tool_call_id": "c1"}]},
     "messages", "messages.1: a tool turn answers a call of the assistant turn before it"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c2"}]}, "messages", "tool_call_id 'c2' names none"),
])
def test_every_number_count_and_length_is_bounded_strictly_typed_and_named_with_the_value_sent(body, param, said):
    with pytest.raises(ProtocolError) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == param and said in err.value.message, err.value.message


def test_a_tool_turn_answering_the_call_before_it_passes():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
                                           {"role": "tool", "content": "1", "tool_call_id": "c2"},
                                           {"role": "tool", "content": "2", "tool_call_id": "c1"}]})


def test_a_forced_call_whose_schema_is_over_the_guide_limit_is_a_400_naming_tools():
    """One tool of 1,700 properties (about 75 KB of schema) with tool_choice required was a 500 (the guide's own
    size check, raised past the request check); as response_format the same schema was a 400."""
    parameters = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "some text"}
                                                   for i in range(1700)}}
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}
    with pytest.raises(ProtocolError) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == "tools" and "the most is 65536" in err.value.message


def test_a_completion_prompt_is_bounded_in_bytes_before_it_is_tokenized():
    assert parse_completion({"model": "m", "prompt": "é" * 4096}).one_prompt()  # 8192 bytes: at the limit
    with pytest.raises(ProtocolError, match="prompt is 8194 bytes, over this server's 8192"):
        parse_completion({"model": "m", "prompt": "é" * 4097})


def test_an_error_message_never_grows_with_the_request():
    for body in ({**CHAT, "x" * 100_000: 1}, {**CHAT, "n": "y" * 100_000}, {**CHAT, "max_tokens": "z" * 100_000},
                 {**CHAT, "metadata": {"k" * 100_000: "v"}}):
        with pytest.raises(ProtocolError) as err:
            parse_chat(body)
        assert len(err.value.message) < 300 and len(err.value.param or "") < 60, err.value.message


def test_the_published_schema_holds_the_bounds_the_parser_enforces():
    """/openapi.json tells a client (and the fuzzer) this server's limits; each is the parser's: the bound
    passes, one past it is refused."""
    from pipeline.openai_api.protocol import request_schemas

    schemas = request_schemas(LIMITS, "m")
    fields = schemas["ChatRequest"]["properties"]

    def maximum(name):
        [branch] = [b for b in fields[name]["anyOf"] if b["type"] == "integer"]
        return branch["maximum"]

    assert (maximum("num_draft_tokens"), maximum("top_k"), maximum("max_tokens")) == (3, 1000, 255)
    for name in ("num_draft_tokens", "top_k", "max_tokens", "max_completion_tokens"):
        parse_chat({**CHAT, name: maximum(name)})
        with pytest.raises(ProtocolError) as err:
            parse_chat({**CHAT, name: maximum(name) + 1})
        assert err.value.param == name
    assert fields["messages"]["maxItems"] == LIMITS.max_seq_len and fields["model"]["enum"] == ["m"]
    assert schemas["ChatRequest"]["additionalProperties"] is False
    # logit_bias keys: token ids with as many digits as the vocabulary's (SmolLM2's 49151 has five)
    from dataclasses import replace

    wide = request_schemas(replace(LIMITS, vocab_size=49152), "m")["ChatRequest"]["properties"]["logit_bias"]
    assert wide["anyOf"][0]["propertyNames"]["pattern"] == "^[0-9]{1,5}$"
    parse_chat_within({**CHAT, "logit_bias": {"49151": 5}}, replace(LIMITS, vocab_size=49152))


# The issue's hostile requests, against the real stack: each a 4xx in OpenAI's shape, the next request served.
HOSTILE = [
    ("application/json", b'{"model": "tiny", "prompt": "hi", "num_draft_tokens": 1000000000}', 400, "num_draft_tokens"),
    ("application/json", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "stop": ["\\udfff"], "stream": true}', 400, None),
    ("application/json", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("application/json", b'{"model": "tiny", "prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),
    ("text/plain", b'{"model": "tiny", "prompt": "hi"}', 415, None),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": "8"}', 400, "max_tokens"),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": true}', 400, "max_tokens"),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("application/json", b'{"model": "tiny", "messages": [{"role": "user", "content": null}]}', 400, "messages"),
    ("application/json", b'{"model": "tiny", "messages": [{"role": "user"}]}', 400, "messages"),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "top_k": 1000000000000}', 400, "top_k"),
    ("application/json", b'{"model": "gpt-4o", "prompt": "hi"}', 404, "model"),
]


@pytest.mark.parametrize("content_type, raw, status, param", HOSTILE)
def test_a_hostile_request_gets_a_typed_4xx_and_the_next_one_its_usual_answer(served, client, content_type, raw,
                                                                               status, param):
    url = f"{served[1].url}/v1/completions" if b"prompt" in raw else f"{served[1].url}/v1/chat/completions"
    if len(raw) > 1 << 20:
        # Refused on its declared length, before the body is read: a client still writing the rest would meet a
        # closed socket (EPIPE) instead of the answer, so only the body's first 64 KiB is sent.
        import http.client
        from urllib.parse import urlsplit

        where = urlsplit(url)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        conn.putrequest("POST", where.path)
        conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw[:1 << 16])
        answer = conn.getresponse()
        code, headers, body = answer.status, answer.headers, answer.read()
        conn.close()
    else:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, raw, {"Content-Type": content_type}), timeout=60)
        code, headers, body = err.value.code, err.value.headers, err.value.read()
    assert code == status and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["param"] == param and error["message"] and len(error["message"]) < 400
    usual = client.completions.create(model="tiny", prompt="Count: 1, 2,", max_tokens=8, temperature=0)
    assert usual.choices[0].text == grpc_text_raw(served[0], "Count: 1, 2,", 8)


def grpc_text_raw(server, prompt: str, max_tokens: int) -> str:
    """The ensemble's greedy answer to a prompt taken as it is (what /v1/completions sends)."""
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request

    return run_request(ClientOptions(url=f"127.0.0.1:{server.options.grpc_port}"), prompt,
                       RequestOptions(max_tokens=max_tokens, speculation="off", apply_chat_template=False)).text


def test_schemathesis_fuzzing_the_published_api_finds_no_5xx_no_reset_and_no_lasting_harm(served, tmp_path):
    """Schemathesis (positive and negative cases from /openapi.json, its coverage and fuzzing phases) against
    the served frontend: every answer is documented, in its documented type and schema, never a 5xx or a
    dropped connection, and after each request the engine ran (and every 6th refused one) a normal request still
    gets its usual text (fuzz_hooks.serves_on)."""
    import os
    import shutil
    import subprocess
    import sys

    prompt = "one two three"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "FUZZ_MODEL": "tiny", "FUZZ_PROMPT": prompt,
           "FUZZ_EXPECTED_TEXT": grpc_text_raw(served[0], prompt, 8),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    run = subprocess.run([st, "run", f"{served[1].url}/openapi.json", "--checks",
                          "not_a_server_error,status_code_conformance,content_type_conformance,"
                          "response_schema_conformance,serves_on", "--max-examples", "30", "--seed", "39",
                          "--workers", "2", "--request-retries", "0", "--request-timeout", "60", "--no-color",
                          "--generation-database", "none", "--report-dir", str(tmp_path)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "serves_on" not in run.stdout and "No issues found" in run.stdout, run.stdout[-2000:]


def test_an_answer_cut_inside_a_character_ends_before_it(served, client):
    """The tiny model writes bytes, so max_tokens can cut a character in two: the answer ends before it, on the
    OpenAI API and over gRPC alike, never in the U+FFFD a lossy decode writes for the missing bytes."""
    from pipeline.engine import load_engine
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    engine_dir = served[2]
    tokenizer, engine = load_tokenizer(engine_dir / "target"), load_engine(engine_dir)
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(engine_dir / "target").eos_token_ids)
    cuts = []
    for prompt in (f"Dites quelque chose, {i}" for i in range(30)):
        [req] = engine.generate([encode_prompt(tokenizer, prompt, raw=True)],
                                SamplingParams(max_tokens=40, stop_token_ids=stops), speculation="off")
        cuts += [(prompt, n, req.output_ids[:n]) for n in range(1, len(req.output_ids) + 1)
                 if tokenizer.decode(req.output_ids[:n], skip_special_tokens=True).endswith("\ufffd")]
        if cuts:
            break
    prompt, n, ids = cuts[0]
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
    text = answer.choices[0].text
    assert text == tokenizer.decode(ids, skip_special_tokens=True)[:-1] and not text.endswith("\ufffd")
    assert answer.usage.completion_tokens == n and answer.choices[0].finish_reason == "length"
    assert grpc_text_raw(served[0], prompt, n) == text


# ---- the front door, round two (issue 52) ----------------------------------------------------------------------


def engine_counts(served) -> tuple[float, float]:
    """(requests running or waiting in the engine, requests it has finished as cancelled)."""
    from serving_checks import metrics

    samples = metrics(served[0].endpoints.metrics)
    busy = total(samples, "pipeline_engine_requests_running") + total(samples, "pipeline_engine_requests_waiting")
    cancelled = sum(v for k, v in samples.items()
                    if k.startswith("pipeline_engine_requests_finished_total") and 'reason="cancelled"' in k)
    return busy, cancelled


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_request_in_the_engine_within_a_second(served, client, stream):
    """A whole answer writes nothing until it is done, so a client that gave up was noticed by nobody: its n x
    max_tokens were decoded for nobody while normal requests waited. Streamed or not, closing the connection now
    cancels every choice in the engine within a second."""
    import socket
    import time

    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "n": 4, "temperature": 1,
                       "seed": 5, "ignore_eos": True, "stream": stream}).encode()
    _, cancelled_before = engine_counts(served)
    sock = socket.create_connection(("127.0.0.1", int(served[1].url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while engine_counts(served)[0] < 4:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    sock.close()  # the client gives up
    left = time.monotonic()
    while engine_counts(served)[0] and time.monotonic() - left < 10:
        time.sleep(0.05)
    stopped = time.monotonic() - left
    busy, cancelled = engine_counts(served)
    assert busy == 0 and cancelled - cancelled_before == 4, (busy, cancelled - cancelled_before)
    assert stopped < 1.5, stopped  # 1 s, and the metrics' own 0.1 s cadence and this loop's polling
    usual = client.completions.create(model="tiny", prompt="Count: 1, 2,", max_tokens=8, temperature=0)
    assert usual.choices[0].text == grpc_text_raw(served[0], "Count: 1, 2,", 8)


def test_a_normal_request_beside_sixteen_choices_starts_at_once(served, client):
    """16 choices of 480 tokens on 8 slots held every slot while a normal request waited: it got one only after 9
    choices had finished (seconds here, minutes on a real model). The choices share one request_group now, and the
    normal request takes a slot at the engine's next step: it is answered before any choice ends."""
    import socket
    import time

    from serving_checks import metrics

    def finished() -> float:  # engine requests ended other than by a cancel
        return sum(v for k, v in metrics(served[0].endpoints.metrics).items()
                   if k.startswith("pipeline_engine_requests_finished_total") and 'reason="cancelled"' not in k)

    # Not speculated: each choice takes its 480 steps (the KV budget holds n x max_tokens under the pool's 8192).
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "n": 16,
                       "temperature": 1, "seed": 5, "ignore_eos": True, "speculation": "off"}).encode()
    sock = socket.create_connection(("127.0.0.1", int(served[1].url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        deadline = time.monotonic() + 30
        while engine_counts(served)[0] + finished() < 16:  # the first choice may have ended already (below)
            assert time.monotonic() < deadline, "the choices never reached the engine"
            time.sleep(0.05)
        before = finished()
        answer = client.completions.create(model="tiny", prompt="Count: 1, 2,", max_tokens=8, temperature=0)
        time.sleep(0.3)  # the metrics' cadence (0.1 s)
        ended = finished() - before
    finally:
        sock.close()  # the client leaves: the choices are cancelled
    assert answer.choices[0].text == grpc_text_raw(served[0], "Count: 1, 2,", 8)
    # The normal request, and at most the first choice: it runs alone while the frontend sends the other 15 after
    # its first piece (their prompt then cached), 0.3-0.5 s here, so it may end in the window. Waiting for a slot as
    # before, the normal request would have come after 9 choices.
    assert ended in (1, 2), ended
    deadline = time.monotonic() + 10
    while engine_counts(served)[0]:
        assert time.monotonic() < deadline, "the choices were not cancelled"
        time.sleep(0.05)


def test_ignore_eos_ignores_the_end_of_turn_token_too(client):
    """vLLM's ignore_eos: no end token ends the answer, the chat template's end of turn (<|im_end|>, 258 here)
    included, so a benchmark's fixed-length request gets its length. It once stopped at the first <|im_end|>."""
    ends = {"256": 100, "258": 100}  # the model all but forced to end at once
    said = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=64, temperature=0, logit_bias=ends,
                                          extra_body={"ignore_eos": True})
    assert said.usage.completion_tokens == 64 and said.choices[0].finish_reason == "length"
    ended = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=64, temperature=0, logit_bias=ends)
    assert ended.usage.completion_tokens <= 1 and ended.choices[0].finish_reason == "stop"


BIG_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    f"field_{i}": {"type": "string", "description": "some text"} for i in range(1700)}}}}
SAY_HI = [{"role": "user", "content": "Say hi."}]
# The issue's cases that were a 500, a wrong 200 or a silent rounding: each a 400 naming its field, served.
REFUSED = [
    ({"messages": SAY_HI, "tools": [BIG_TOOL], "tool_choice": "required"}, "tools"),
    ({"messages": SAY_HI, "guided_regex": "a+[^\\s\\S]"}, "guided_regex"),
    ({"messages": SAY_HI, "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "response_format"),
    ({"messages": SAY_HI, "guided_grammar": 'root ::= "x" root'}, "guided_grammar"),
    ({"messages": SAY_HI, "repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 1e-45, "temperature": 1}, "repetition_penalty"),
    ({"prompt": "hi", "temperature": 1e-300}, "temperature"),
    ({"messages": SAY_HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"messages": SAY_HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [*SAY_HI, {"role": "tool", "content": "4", "tool_call_id": "c1"}]}, "messages"),
]


@pytest.mark.parametrize("fields, param", REFUSED)
def test_what_was_a_500_or_a_wrong_answer_is_a_400_and_the_server_serves_on(served, client, fields, param):
    import time

    url = f"{served[1].url}/v1/{'chat/completions' if 'messages' in fields else 'completions'}"
    raw = json.dumps({"model": "tiny", "max_tokens": 16, **fields}).encode()
    start = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(url, raw, {"Content-Type": "application/json"}), timeout=60)
    assert time.monotonic() - start < 1
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["param"] == param and len(error["message"]) < 400, error
    usual = client.completions.create(model="tiny", prompt="Count: 1, 2,", max_tokens=8, temperature=0)
    assert usual.choices[0].text == grpc_text_raw(served[0], "Count: 1, 2,", 8)


def test_a_requests_memory_is_bounded_up_front_by_its_budget():
    """n choices hold their prompts and answers in the KV pool together, and a whole answer's tokens and log probs
    in the frontend: past either budget, a 400 naming it, before anything is sent."""
    from dataclasses import replace

    from pipeline.openai_api.protocol import MAX_ANSWER_ENTRIES

    limits = replace(LIMITS, kv_pool_tokens=4096)
    limits.check_budget(16, 56, 200, None)  # 16 x 256 = 4096: at the budget
    with pytest.raises(ProtocolError) as err:
        limits.check_budget(16, 57, 200, None)
    assert err.value.param == "n" and "4112 tokens is over this server's per-request budget of 4096" in \
        err.value.message
    with pytest.raises(ProtocolError) as err:
        limits.check_budget(1, 4000, 200, None)
    assert err.value.param == "max_tokens"
    LIMITS.check_budget(16, 10, MAX_ANSWER_ENTRIES // 16, None)  # no pool known: the frontend's budget only
    with pytest.raises(ProtocolError, match=r"x \(1 \+ 20 alternatives\) = .* answer entries is over"):
        LIMITS.check_budget(16, 10, 1000, 20)


def test_the_issues_request_past_the_kv_budget_is_a_400_before_any_token(served, client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", n=16, max_tokens=1000, temperature=1,
                                  logit_bias={"256": -100, "258": -100})
    assert err.value.body["param"] == "n" and "budget of 8192" in err.value.body["message"]


def test_echo_with_logprobs_gives_the_prompts_own_log_probs_as_the_engine_computes_them(served, client):
    """OpenAI's completions `echo` with `logprobs` (what lm-evaluation-harness's loglikelihood tasks send, the prompt
    as token ids): the answer starts with the prompt, and its tokens come with their log probs under the target,
    the first with none; each is the in-process engine's prompt_logprobs."""
    from pipeline.engine import load_engine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer

    engine_dir = served[2]
    tokenizer = load_tokenizer(engine_dir / "target")
    prompt = "The capital of France is Paris"
    ids = encode_prompt(tokenizer, prompt, raw=True)
    [ref] = load_engine(engine_dir).generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2, logprobs=2))
    for sent in (prompt, [ids]):
        answer = client.completions.create(model="tiny", prompt=sent, max_tokens=1, temperature=0, logprobs=2,
                                           echo=True)
        choice = answer.choices[0]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        lps = choice.logprobs
        assert len(lps.tokens) == len(ids) + 1 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        assert lps.token_logprobs[1:len(ids)] == [lp.logprob for lp in ref.prompt_logprobs]
        assert all(len(top) <= 2 for top in lps.top_logprobs[1:])
        assert lps.token_logprobs[-1] == ref.logprobs[0].logprob  # then the answer's token, as before
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    # Over gRPC: prompt_log_probs only where prompt_logprobs was asked for.
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request

    url = ClientOptions(url=f"127.0.0.1:{served[0].options.grpc_port}")
    asked = run_request(url, prompt, RequestOptions(max_tokens=3, prompt_logprobs=0, apply_chat_template=False))
    unasked = run_request(url, prompt, RequestOptions(max_tokens=3, apply_chat_template=False))
    assert [len(c.prompt_logprobs) for c in asked.chunks if c.prompt_logprobs] == [len(ids)]
    assert all(c.prompt_logprobs == [] for c in unasked.chunks)


# A multiple-choice task of lm-evaluation-harness's own format, on local files (no hub): each continuation's log
# likelihood comes from the endpoint's echoed prompt log probs.
EVAL_DOCS = [{"question": q, "choices": c, "answer": a} for q, c, a in (
    ("The sky is", ["blue", "green", "loud"], 0), ("Two plus two is", ["four", "five"], 0),
    ("Cats like to", ["sleep", "fly", "swim"], 0), ("Water is", ["wet", "dry"], 0),
    ("The sun rises in the", ["east", "west"], 0), ("Fire is", ["hot", "cold", "blue"], 0),
    ("A week has seven", ["days", "years"], 0), ("Ice is", ["cold", "warm"], 0))]


def test_lm_evaluation_harness_scores_the_served_model_as_the_in_process_engine_does(served, tmp_path):
    """lm-evaluation-harness (`local-completions`, loglikelihood: echo with logprobs, the prompt as token ids)
    against the served frontend: every continuation's log likelihood, and so the accuracy, is what the in-process
    engine computes for the same token ids."""
    import os
    import shutil
    import subprocess
    import sys

    from pipeline.engine import load_engine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import load_tokenizer

    engine_dir = served[2]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in EVAL_DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    lm_eval = shutil.which("lm_eval", path=str(Path(sys.executable).parent)) or "lm_eval"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([lm_eval, "--model", "local-completions", "--model_args",
                          f"model=tiny,base_url={served[1].url}/v1/completions,tokenizer={engine_dir / 'target'},"
                          "tokenizer_backend=huggingface,max_retries=1,num_concurrent=1",
                          "--tasks", "tiny_choice", "--include_path", str(tmp_path / "tasks"), "--limit", "8",
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = list((tmp_path / "out").rglob("results_*.json"))
    [samples] = list((tmp_path / "out").rglob("samples_tiny_choice_*.jsonl"))
    served_acc = json.loads(results.read_text())["results"]["tiny_choice"]["acc,none"]
    logged = {json.loads(line)["doc"]["question"]: [float(r[0][0]) for r in json.loads(line)["resps"]]
              for line in samples.read_text().splitlines()}

    # The same pairs in process: lm-eval's own encoding (context alone, then the whole; trailing spaces moved).
    tokenizer, engine = load_tokenizer(engine_dir / "target"), load_engine(engine_dir)
    correct = 0
    for doc in EVAL_DOCS:
        scores = []
        for choice in doc["choices"]:
            context = tokenizer(doc["question"], add_special_tokens=False).input_ids
            whole = tokenizer(doc["question"] + " " + choice, add_special_tokens=False).input_ids
            [req] = engine.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=1))
            scores.append(sum(lp.logprob for lp in req.prompt_logprobs[len(context) - 1:]))
        assert scores == logged[doc["question"]]
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert served_acc == correct / len(EVAL_DOCS)


def test_a_refusal_to_retry_elsewhere_is_a_503_and_a_request_the_engine_refused_a_400():
    """A busy engine and a server being stopped (the drain's refusal) are the client's to retry: 503, each with its
    own type; the engine's refusal of the request itself is a 400, a lost server a 502."""
    from pipeline.client.ensemble_aio import EnsembleError
    from pipeline.openai_api.app import error_of
    from pipeline.openai_api.protocol import parse_completion
    from pipeline.policy.serving_gate import STOPPING_MESSAGE, busy_message

    req = parse_completion({"model": "m", "prompt": "hi"}, LIMITS)
    cases = [(EnsembleError(STOPPING_MESSAGE, refused=True), 503, "server_stopping"),
             (EnsembleError(busy_message(8, 4, 8), refused=True), 503, "server_busy"),
             (EnsembleError("top_k 5 is over the vocabulary's 3 tokens", refused=True), 400, "invalid_request_error"),
             (EnsembleError("Socket closed", refused=False), 502, "upstream_error")]
    for err, status, kind in cases:
        answer = error_of(err, req)
        assert (answer.status, answer.type) == (status, kind), err.message
