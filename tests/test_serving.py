"""The served repository under load: the gate's switch and its metrics, client disconnects, bad inputs.

A real tritonserver (the CPU one in nvidia-pytriton) serves a tiny portable engine with 8 KV-cache
slots; the gate's threshold is 12 requests in flight with a hysteresis of 4.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.compiler import CompileOptions, compile_model
from serving_checks import (assert_missing_inputs_refused, ensemble_results, expected_text,  # noqa: E402
                            expected_texts, inputs, metrics, ngram_engine, responses, served_engine, soak_script,
                            tensor)

import tritonclient.grpc  # noqa: E402,F401  (required by pyproject: a missing one fails, never skips)

THRESHOLD, HYSTERESIS = 12, 4
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def engine_dir(tiny_target, tmp_path_factory) -> Path:
    return ngram_engine(tiny_target, tmp_path_factory.mktemp("engines"), slots=8)


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    # No acceptance floor: n-gram drafts on a random tiny model accept little, and the load switch is
    # what these tests watch (the floor has its own tests in test_serving_gate.py).
    with served_engine(engine_dir, tmp_path_factory.mktemp("served"), gate_batch_size=THRESHOLD,
                       gate_hysteresis=HYSTERESIS, min_spec_tokens=20) as srv:
        pid = srv.process.pid
        yield srv
    # The disconnect test leaves cancel marks; stopping the server takes their folder with it.
    from pipeline.triton.cancel_marks import marks_dir

    assert not marks_dir(pid).exists()


def value(snapshot: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in snapshot.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def finished(server, reason: str) -> float:
    """The engine's finished requests with this reason, from the server's metrics port."""
    return value(metrics(server.endpoints.metrics), "pipeline_engine_requests_finished_total", reason=reason)


def wait_for(predicate, timeout: float = 15.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def client(server):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(server.endpoints.grpc)


def test_forty_concurrent_streams_get_target_greedy_while_the_gate_switches_off_and_back(server, engine_dir):
    prompts = [f"request {i}: {'ab' * (i % 5)} count {i}" for i in range(40)]
    expected = expected_texts(engine_dir, prompts, MAX_TOKENS)
    before = metrics(server.endpoints.metrics)
    got: dict[int, str] = {}
    errors: list[Exception] = []

    def run(i):
        c = client(server)
        try:
            got[i] = "".join(text for text, _, _ in responses(c, prompts[i], MAX_TOKENS))
        except Exception as err:  # noqa: BLE001  reported below
            errors.append(err)
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    seen_off, most_in_flight = False, 0.0
    while any(t.is_alive() for t in threads):
        snap = metrics(server.endpoints.metrics)
        seen_off |= value(snap, "pipeline_gate_speculating") == 0.0
        most_in_flight = max(most_in_flight, value(snap, "pipeline_gate_in_flight"))
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert got == dict(enumerate(expected))

    assert seen_off and most_in_flight > THRESHOLD
    # Published every 0.1 s: wait for the last requests' numbers.
    assert wait_for(lambda: value(metrics(server.endpoints.metrics), "pipeline_gate_in_flight") == 0.0)
    after = metrics(server.endpoints.metrics)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("pipeline_requests_total") == 40
    assert delta("pipeline_requests_total", mode="standard", reason="load") >= 1
    assert delta("pipeline_requests_total", mode="speculative", reason="open") >= THRESHOLD
    assert delta("pipeline_gate_flips_total") >= 2  # off above the threshold, on again as the load drained
    assert value(after, "pipeline_gate_speculating") == 1.0 and value(after, "pipeline_gate_threshold") == THRESHOLD
    drafted, accepted = delta("pipeline_spec_decode_num_draft_tokens_total"), delta(
        "pipeline_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert value(after, "pipeline_spec_decode_mean_acceptance_length") >= 1.0
    assert delta("pipeline_engine_requests_finished_total") == 40


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, engine_dir):
    import queue

    c = client(server)
    before = metrics(server.endpoints.metrics)
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    # "hi" runs the whole 220 tokens on this tiny model (no stop token), far longer than the cancel takes.
    c.async_stream_infer("ensemble", inputs("hi", 220, True, speculation="off"),
                         enable_empty_final_response=True)
    result, error = got.get(timeout=30)  # the first chunk: the request holds a slot now
    assert error is None
    c.stop_stream(cancel_requests=True)
    c.close()

    def freed():
        snap = metrics(server.endpoints.metrics)
        return (value(snap, "pipeline_engine_requests_finished_total", reason="cancelled")
                > value(before, "pipeline_engine_requests_finished_total", reason="cancelled")
                and value(snap, "pipeline_engine_requests_running") == 0
                and value(snap, "pipeline_gate_in_flight") == 0)

    assert wait_for(freed)
    c = client(server)
    try:
        [(text, _, _)] = responses(c, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


def test_bad_inputs_get_error_responses_and_the_server_keeps_serving(server, engine_dir):
    from tritonclient.utils import InferenceServerException

    c = client(server)
    try:
        wrong_dtype = tensor("max_tokens", np.array([[8.0]], np.float32), "FP32")
        text = tensor("text_input", np.array([[b"hi"]], np.object_), "BYTES")
        with pytest.raises(InferenceServerException, match="max_tokens.*(FP32|INT32)"):
            responses(c, "", 0, raw_inputs=[text, wrong_dtype])  # refused before any model runs
        with pytest.raises(InferenceServerException, match="over the engine's max_seq_len 256"):
            responses(c, "word " * 300, 8, stream=False)
        with pytest.raises(InferenceServerException, match="max_tokens must be >= 1"):
            responses(c, "hi", -3, stream=True)
        with pytest.raises(InferenceServerException, match="text_input is empty"):
            responses(c, "", 8)
        with pytest.raises(InferenceServerException, match="speculation must be auto, on or off"):
            responses(c, "hi", 8, speculation="sometimes")
        [(result, _, _)] = responses(c, "hi", 8, stream=False)
        assert result == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


def engine_inputs(**overrides):
    """The engine model's inputs for a two-token prompt, as the gate sends them; overrides by name."""
    values = dict(input_ids=np.array([[1, 2]], np.int32), input_lengths=np.array([[2]], np.int32),
                  request_output_len=np.array([[8]], np.int32), end_id=np.array([[-1]], np.int32),
                  temperature=np.array([[0.0]], np.float32), top_k=np.array([[0]], np.int32),
                  top_p=np.array([[1.0]], np.float32), seed=np.array([[0]], np.uint64),
                  stream=np.array([[True]]), stop_words_list=np.array([[[-1], [-1]]], np.int32),
                  speculation=np.array([[b"auto"]], np.object_), num_draft_tokens=np.array([[3]], np.int32),
                  repetition_penalty=np.array([[1.0]], np.float32), presence_penalty=np.array([[0.0]], np.float32),
                  frequency_penalty=np.array([[0.0]], np.float32), return_log_probs=np.array([[False]]),
                  num_logprobs=np.array([[0]], np.int32), stop_strings=np.array([[b"[]"]], np.object_))
    values.update(overrides)
    from tritonclient.utils import np_to_triton_dtype

    return [tensor(name, v, np_to_triton_dtype(v.dtype)) for name, v in values.items()]


def stream_error(c, model: str, tensors) -> str:
    """The error a decoupled model answers to one request (fails the test if it answers without one)."""
    import queue

    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer(model, tensors, enable_empty_final_response=True)
        result, error = got.get(timeout=30)
        assert error is not None, f"{model} answered without an error"
        return str(error)
    finally:
        c.stop_stream()


def test_an_engine_error_reaches_the_client_through_the_gate_as_the_engines_own_line(server, engine_dir):
    """Called directly with token ids past the vocabulary (preprocessing never sends those), the engine
    refuses the request; the gate relays its message, and serves the next request."""
    c = client(server)
    try:
        error = stream_error(c, "speculation_gate", engine_inputs(input_ids=np.array([[1, 99_999]], np.int32)))
        assert "outside the vocabulary" in error and "speculation_gate:" not in error
        [(text, _, _)] = responses(c, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


def test_each_answer_and_the_metrics_say_why_its_steps_did_or_did_not_draft(server):
    """The response counters (num_draft_steps, skipped_steps) and pipeline_spec_decode_skipped_steps_total:
    a short request's steps are all "short", a forced-off one's all "override", and an auto one's steps
    are each counted once, drafted or under a reason. The repository's min tokens (20) is the only one: the
    engine folder's own (compile's default, 50) doesn't call a 30-token request short a second time."""
    from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions
    from pipeline.policy.draft_plan import SKIP_REASONS

    before = metrics(server.endpoints.metrics)
    with Connection(ClientOptions(server.endpoints.grpc)) as conn:
        short = conn.generate("why not a short one", RequestOptions(max_tokens=10))  # under min_spec_tokens (20)
        off = conn.generate("why not, said the client", RequestOptions(max_tokens=30, speculation="off"))
        auto = conn.generate("ab ab ab ab ab ab ab ab", RequestOptions(max_tokens=60, stream=False))
        mid = conn.generate("ab ab ab ab ab ab ab ab", RequestOptions(max_tokens=30, stream=False))
    for result, reason in ((short, "short"), (off, "override")):
        assert result.draft_steps == 0 and set(result.skipped_steps) == {reason}
        assert result.skipped_steps[reason] in (result.tokens - 1, result.tokens)  # the first token is the prefill's
    assert set(auto.skipped_steps) <= set(SKIP_REASONS)
    steps = auto.draft_steps + sum(auto.skipped_steps.values())  # a drafting step emits 1..K+1 tokens
    assert auto.draft_steps > 0 and (auto.tokens - 1) / 4 <= steps <= auto.tokens
    assert mid.draft_steps > 0 and "short" not in mid.skipped_steps, mid.skipped_steps
    assert wait_for(lambda: value(metrics(server.endpoints.metrics), "pipeline_gate_in_flight") == 0.0)
    time.sleep(0.3)  # the gate publishes every 0.1 s
    after = metrics(server.endpoints.metrics)
    for reason in ("short", "override"):
        name = "pipeline_spec_decode_skipped_steps_total"
        want = sum(r.skipped_steps.get(reason, 0) for r in (short, off, auto, mid))
        assert value(after, name, reason=reason) - value(before, name, reason=reason) == want


def test_internal_models_called_directly_refuse_bad_inputs_in_one_line(server, engine_dir):
    """torch_engine and postprocessing check their own inputs: no dropped token, no negative count, and
    never a traceback or a path on the server's machine."""
    from tritonclient.utils import InferenceServerException

    def postprocess(ids, prefix):
        return [tensor("output_ids", np.array([ids], np.int32), "INT32"),
                tensor("prefix_length", np.array([[prefix]], np.int32), "INT32"),
                tensor("accepted_tokens", np.array([[0]], np.int32), "INT32"),
                tensor("drafted_tokens", np.array([[0]], np.int32), "INT32"),
                tensor("verify_steps", np.array([[0]], np.int32), "INT32"),
                tensor("skipped_steps", np.array([[b"{}"]], np.object_), "BYTES"),
                tensor("acceptance_histogram", np.array([[b"{}"]], np.object_), "BYTES"),
                tensor("stream_id", np.array([[0]], np.uint64), "UINT64")]

    c = client(server)
    try:
        errors = [stream_error(c, "torch_engine", engine_inputs(input_lengths=np.array([[-1]], np.int32))),
                  stream_error(c, "torch_engine", engine_inputs(input_lengths=np.array([[3]], np.int32))),
                  stream_error(c, "torch_engine", engine_inputs(temperature=np.array([[np.nan]], np.float32)))]
        assert "input_lengths -1 is outside 1..2" in errors[0] and "input_lengths 3 is outside 1..2" in errors[1]
        assert "temperature must be a finite number" in errors[2]
        for ids, prefix, message in (([65, -7], 0, "negative token ids"), ([65, 66], 99, "prefix_length 99 is outside 0..2")):
            with pytest.raises(InferenceServerException, match=re.escape(message)) as err:
                c.infer("postprocessing", postprocess(ids, prefix))
            errors.append(str(err.value))
        for error in errors:
            assert "Traceback" not in error and "/" not in error.split(":", 1)[-1] and "\n" not in error
        result = c.infer("postprocessing", postprocess([71, 72], 0))  # the byte tokenizer: "h", "i"
        assert result.as_numpy("text_output")[0, 0].decode() == "hi"
        [(text, _, _)] = responses(c, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


BAD_REQUESTS = soak_script().BAD_REQUESTS  # what a hostile or careless client sends -> the one line it gets


def test_a_bad_request_never_fails_or_hangs_the_others(server, engine_dir):
    """Each bad request is refused at the edge in one line while six good streams run beside it; they all
    finish with the target's greedy answer and the gate's in-flight count returns to zero."""
    from tritonclient.utils import InferenceServerException

    dtypes = {"FP32": np.float32, "INT32": np.int32}
    prompts = [f"steady {i}" for i in range(6)]
    good: dict[int, str] = {}

    def run(i):
        c = client(server)
        try:
            good[i] = "".join(t for t, _, _ in responses(c, prompts[i], 40))
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    c = client(server)
    try:
        for label, (extra, message) in BAD_REQUESTS.items():
            tensors = [tensor(name, np.array([[value]], dtypes[dtype]), dtype) for name, (dtype, value) in extra.items()]
            with pytest.raises(InferenceServerException, match=re.escape(message)):
                responses(c, "hi", 8, extra=tensors)
    finally:
        c.close()
    for t in threads:
        t.join(timeout=120)
    assert good == {i: expected_text(engine_dir, p, 40) for i, p in enumerate(prompts)}
    assert wait_for(lambda: value(metrics(server.endpoints.metrics), "pipeline_gate_in_flight") == 0)


def test_invalid_utf8_and_oversized_prompts_are_refused_before_tokenizing(server, engine_dir):
    from tritonclient.utils import InferenceServerException

    c = client(server)
    try:
        with pytest.raises(InferenceServerException, match=r"text_input is not valid UTF-8 \(byte 2\)"):
            responses(c, "", 8, raw_inputs=[tensor("text_input", np.array([[b"hi\xff"]], np.object_), "BYTES"),
                                            tensor("max_tokens", np.array([[8]], np.int32), "INT32")])
        huge = "word " * 2_000_000  # 10 MB; the limit is max_seq_len 256 x 32 bytes
        start = time.monotonic()
        with pytest.raises(InferenceServerException, match=r"text_input is 10000000 bytes, over this server's "
                                                           r"limit of 8192"):
            responses(c, huge, 8)
        assert time.monotonic() - start < 10  # refused without tokenizing (that took 20 s at 20 MB)
        [(text, _, _)] = responses(c, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


def test_preprocessing_called_without_max_tokens_is_an_error_not_an_empty_answer(server):
    from tritonclient.utils import InferenceServerException

    c = client(server)
    try:
        with pytest.raises(InferenceServerException, match="max_tokens"):
            c.infer("preprocessing", [tensor("text_input", np.array([[b"hi"]], np.object_), "BYTES")])
    finally:
        c.close()


def test_a_request_without_a_required_input_is_refused_naming_it_on_every_transport(server, engine_dir):
    """Through the ensemble, as clients call it: 2.51 let such a request through and ended it with an empty final
    response, no error (docs/reliability.md). A request with no input at all is refused by the python backend
    before preprocessing runs: an error too, if not ours."""
    import urllib.error

    assert_missing_inputs_refused(server)
    with pytest.raises(urllib.error.HTTPError) as err:
        http_generate(server, {}, False)
    assert err.value.code == 400 and "request has 0 inputs" in json.loads(err.value.read())["error"]
    [answer] = http_generate(server, {"text_input": "hi", "max_tokens": 8}, False)
    assert answer["text_output"] == expected_text(engine_dir, "hi", 8)


def test_http_generate_bounds_every_number_by_the_engine(server, engine_dir):
    """The bounds the gRPC route checks hold on Triton's HTTP generate too: k above the engine's is refused in one
    line naming the value (never clamped), and the next request gets its usual answer."""
    import urllib.error

    for body, message in (({"num_draft_tokens": 10**6}, "num_draft_tokens 1000000 is more than the 3 drafts"),
                          ({"top_k": 10**6}, "top_k 1000000 is over the vocabulary"),
                          ({"stop_words": [f"w{i}" for i in range(17)]}, "17 stop words; send at most 16")):
        with pytest.raises(urllib.error.HTTPError) as err:
            http_generate(server, {"text_input": "hi", "max_tokens": 8, **body}, False)
        assert err.value.code == 400 and message in json.loads(err.value.read())["error"]
    [answer] = http_generate(server, {"text_input": "hi", "max_tokens": 8, "num_draft_tokens": 3}, False)
    assert answer["text_output"] == expected_text(engine_dir, "hi", 8)


LONG_STREAM = 900  # tokens a stream asks for while its engine is killed: it must still be running then
# Answers resumed by `pipeline`'s client across the kill, greedy and seeded (a temperature exact in float32, as the
# ensemble carries it), each the whole LONG_STREAM (end tokens ignored), so it is mid-answer at the kill.
RESUMED = (("resume me after a kill", {"ignore_eos": True}),
           ("and me, sampled", {"temperature": 0.5, "seed": 5, "ignore_eos": True}))


def engine_text(engine_dir: Path, prompt: str, max_tokens: int, **sampling) -> str:
    """The in-process engine's uninterrupted answer, decoded as the client joins it."""
    from pipeline.models.tokenizer import answer_text

    if sampling.get("ignore_eos"):  # as preprocessing sends it: no stop token at all
        sampling = {**sampling, "stop_token_ids": ()}
    req, tokenizer = engine_answer(engine_dir, prompt, max_tokens, **sampling)
    return answer_text(tokenizer, req.output_ids)


@pytest.mark.slow
def test_a_killed_engine_process_errors_its_clients_and_serve_brings_it_back(tiny_target, tmp_path):
    """kill -9 of the torch_engine stub mid-load, under `pipeline serve`: every client in flight gets an error
    within 10 s, readiness drops, serve says why in one line, and a new request succeeds within 60 s. `pipeline`'s
    own client and the OpenAI frontend resume instead (issue 55): the greedy and seeded answers they had in flight
    at the kill end, after the restart, exactly as uninterrupted ones, streamed or whole."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from pipeline.triton.ports import free_ports

    from pipeline.triton.assemble import AssembleOptions, assemble
    from pipeline.triton.supervise import python_stubs

    # Answers of up to 900 tokens, not the module engine's 256: 200-token streams all finished between the check
    # that three were running and the kill, once verify steps got faster.
    engine_dir = ngram_engine(tiny_target, tmp_path / "engine", slots=8, max_seq_len=1024)
    repo = assemble(AssembleOptions(engine=engine_dir, repo=tmp_path / "repo")).repo
    grpc, http, metrics_port, openai_port = free_ports(4)
    cli = subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--repo", str(repo),
                            "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics_port),
                            "--openai-port", str(openai_port), "--served-model-name", "tiny"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(cli.stdout.readline, "")), daemon=True)
    reader.start()

    from types import SimpleNamespace

    served = SimpleNamespace(endpoints=SimpleNamespace(grpc=f"127.0.0.1:{grpc}"))  # what client() needs

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    resuming: set[str] = set()
    resumed: dict[str, object] = {}

    def resume(url: str, prompt: str, sampling: dict):
        from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions

        try:
            with Connection(ClientOptions(url, resume_s=90)) as conn:
                resumed[prompt] = conn.generate(prompt, RequestOptions(max_tokens=LONG_STREAM, **sampling),
                                                on_chunk=lambda chunk: chunk.tokens and resuming.add(prompt))
        except Exception as err:  # noqa: BLE001  checked by the test
            resumed[prompt] = err

    def api():
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(key: str, stream: bool, **sampling):
        """Through the OpenAI frontend, which resumes too: (text, completion tokens), or the error."""
        try:
            kwargs = dict(model="tiny", messages=[{"role": "user", "content": key}], max_tokens=LONG_STREAM,
                          extra_body={"ignore_eos": True}, **sampling)
            if not stream:
                answer = api().chat.completions.create(**kwargs)
                resumed[key] = (answer.choices[0].message.content, answer.usage.completion_tokens)
                return
            text, usage = [], None
            for chunk in api().chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    resuming.add(key)
                usage = chunk.usage or usage
            resumed[key] = ("".join(text), usage.completion_tokens)
        except Exception as err:  # noqa: BLE001  checked by the test
            resumed[key] = err

    try:
        assert wait_for(lambda: any(line.strip().startswith("admin") for line in lines), timeout=120), lines
        outcome: dict[int, tuple[str, float]] = {}

        def stream(i):
            c = client(served)
            try:
                responses(c, f"in flight {i}", LONG_STREAM, timeout=30)
                outcome[i] = ("finished", time.monotonic())
            except Exception as err:  # noqa: BLE001  the error is what this test wants
                outcome[i] = (f"error: {err}", time.monotonic())
            finally:
                c.close()

        # The stub to kill, found before the streams start: the search through the process table took long enough
        # for every stream to finish before the kill.
        [server_pid] = [int(p) for p in subprocess.run(["pgrep", "-f", f"tritonserver.*grpc-port={grpc}"],
                                                       capture_output=True, text=True).stdout.split()]
        [engine] = [s for s in python_stubs(os.getpgid(server_pid)) if s.model == "torch_engine"]
        resumers = [threading.Thread(target=resume, args=(served.endpoints.grpc, prompt, sampling))
                    for prompt, sampling in RESUMED]
        chats = {"a seeded chat, streamed": dict(temperature=0.7, seed=3), "a greedy chat, whole": dict(temperature=0)}
        resumers += [threading.Thread(target=chat, args=(key, "streamed" in key), kwargs=sampling)
                     for key, sampling in chats.items()]
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in resumers:
            t.start()
        # Frozen at the first answer's first tokens, so nothing in flight can end before the kill (a 900-token
        # answer took 0.8 s in a CI run): what was sent waits for the engine, and so does what is sent now.
        assert wait_for(lambda: bool(resuming), timeout=30, step=0.001)
        os.kill(engine.pid, signal.SIGSTOP)
        for t in threads:
            t.start()
        time.sleep(2)  # every request reaches the server (the chats through the frontend)
        os.kill(engine.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: not ready(), timeout=10)
        for t in threads:
            t.join(timeout=30)
        assert sorted(outcome) == list(range(8))
        # Every stream gets an error, fast.
        errors = [at - killed for what, at in outcome.values() if what.startswith("error")]
        assert len(errors) == 8 and max(errors) < 10, outcome
        c = client(served)
        deadline = killed + 60
        while True:
            try:
                [(text, _, _)] = responses(c, "hi", 8, stream=False)
                break
            except Exception:  # noqa: BLE001  still restarting
                assert time.monotonic() < deadline, "no answer within 60 s of the kill"
                time.sleep(1)
        c.close()
        assert text == expected_text(engine_dir, "hi", 8)
        for t in resumers:
            t.join(timeout=120)
        for prompt, sampling in RESUMED:  # one answer each, as the uninterrupted engine gives it
            got = resumed[prompt]
            assert not isinstance(got, Exception), got
            assert got.resumed >= 1 and got.text == engine_text(engine_dir, prompt, LONG_STREAM, **sampling), prompt
        for key, sampling in chats.items():  # the frontend's answers, as the restarted server gives them whole
            assert not isinstance(resumed[key], Exception), resumed[key]
            again = api().chat.completions.create(model="tiny", messages=[{"role": "user", "content": key}],
                                                  max_tokens=LONG_STREAM, extra_body={"ignore_eos": True}, **sampling)
            assert resumed[key] == (again.choices[0].message.content, LONG_STREAM), key
        frontend = metrics(f"http://127.0.0.1:{openai_port}/metrics")
        assert value(frontend, "pipeline_frontend_resumed_total") >= 2  # the streamed chat's, and the whole one's
        died = [line for line in lines if "died" in line]
        assert len(died) == 1 and f"the python stub of torch_engine (pid {engine.pid}) died" in died[0]
        assert any(line.startswith("ready again after") for line in lines)
    finally:
        cli.send_signal(signal.SIGTERM)
        cli.wait(60)


@pytest.mark.slow
def test_sixty_four_abandoned_streams_free_every_slot_and_decode_little_for_nobody(tiny_target, tmp_path):
    """64 streams of up to 900 tokens at once, each left by its client after 2 responses: none decodes to
    max_tokens for nobody, every slot comes back, and few tokens are made in all. Postprocessing passes each
    cancel straight to the engine as well as to the gate, and the engine streams at most 20 responses a second
    per stream, so postprocessing keeps up and sees a cancel soon after the client leaves."""
    long_tokens = 900
    engine_dir = tmp_path / "long"
    compile_model(CompileOptions("torch", tiny_target, engine_dir, draft="ngram", num_draft_tokens=3,
                                 max_batch_size=64, max_seq_len=1024, gate_batch_size=64))
    with served_engine(engine_dir, tmp_path, gate_batch_size=THRESHOLD, gate_hysteresis=HYSTERESIS,
                       min_spec_tokens=20) as srv:
        def leave(i):
            c = client(srv)
            try:
                assert len(responses(c, f"abandoned {i}", long_tokens, leave_after=2)) == 2
            finally:
                c.close()

        threads = [threading.Thread(target=leave, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)

        assert wait_for(lambda: sum(finished(srv, r) for r in ("cancelled", "length", "stop")) == 64, timeout=60)
        assert wait_for(lambda: value(metrics(srv.endpoints.metrics), "pipeline_engine_requests_running") == 0)
        after = metrics(srv.endpoints.metrics)
        # Some answers of this random model end at an end-of-text token within their first tokens.
        assert finished(srv, "length") == 0 and finished(srv, "cancelled") >= 48, \
            (finished(srv, "cancelled"), finished(srv, "stop"))
        assert wait_for(lambda: value(metrics(srv.endpoints.metrics), "pipeline_gate_in_flight") == 0)
        made = value(after, "pipeline_engine_generation_tokens_total")
        assert made < 64 * long_tokens / 10, made  # the 64 answers in full: 57,600 tokens


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_that_stops_at_its_first_token_is_an_empty_answer_not_an_error(server, engine_dir, stream):
    """end_id set to the token the model says first: zero tokens out, streamed or not."""
    from pipeline.engine import load_engine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer

    tokenizer, engine = load_tokenizer(engine_dir / "target"), load_engine(engine_dir)
    [req] = engine.generate([encode_prompt(tokenizer, "hi", raw=False)], SamplingParams(max_tokens=1))
    first = tensor("end_id", np.array([[req.output_ids[0]]], np.int32), "INT32")
    c = client(server)
    try:
        assert "".join(t for t, _, _ in responses(c, "hi", 8, stream=stream, extra=[first])) == ""
    finally:
        c.close()


# With the chat template the prompt is 34 tokens; max_seq_len is 8192. 2000 tokens took 0.5 s in-process on an AMD
# EPYC, so the blocker freed its slot before the queue test's five requests were in.
LONG_TOKENS = 8000
# (980 of 1024 could run out on a quiet machine before the queued clients had left, and one of them decoded)


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory) -> tuple[Path, str]:
    """A portable engine with one KV-cache slot, and a prompt whose answer holds it for LONG_TOKENS tokens."""
    from pipeline.engine import load_engine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tiny import make_tiny_llama
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer

    target = make_tiny_llama(tmp_path_factory.mktemp("long-target"), seed=0, layers=3, max_positions=8192)
    engine_dir = tmp_path_factory.mktemp("one-slot") / "engine"
    compile_model(CompileOptions("torch", target, engine_dir, draft="ngram", num_draft_tokens=3,
                                 max_batch_size=1, max_seq_len=8192, gate_batch_size=1))
    tokenizer, engine = load_tokenizer(engine_dir / "target"), load_engine(engine_dir)
    for prompt in (f"hold the slot {i}" for i in range(6)):  # one at a time: the first that holds it will do
        [req] = engine.generate([encode_prompt(tokenizer, prompt, raw=False)],
                                SamplingParams(max_tokens=LONG_TOKENS, stop_token_ids=(tokenizer.eos_token_id,)),
                                speculation="off")
        if req.finish_reason.value == "length":
            return engine_dir, prompt
    raise AssertionError("no candidate prompt holds the slot for LONG_TOKENS tokens")


def hold_the_slot(srv, blocker: str):
    """A client whose stream holds the one slot (its first response has come); stop_stream frees it."""
    import queue

    held = client(srv)
    got: queue.Queue = queue.Queue()
    held.start_stream(callback=lambda result, error: got.put(error))
    held.async_stream_infer("ensemble", inputs(blocker, LONG_TOKENS, stream=True, speculation="off"),
                            enable_empty_final_response=True)
    first = got.get(timeout=30)
    assert first is None, (first.message(), first.status(), first.debug_details())
    return held


@pytest.mark.slow
def test_requests_abandoned_in_the_queue_are_cancelled_not_decoded_for_nobody(one_slot, tmp_path):
    """One slot, held by a long answer; eight streamed requests queue behind it and each client leaves after
    its first keepalive. All eight end as cancelled while still queued, with no token decoded for them."""
    import queue

    engine_dir, blocker = one_slot
    with served_engine(engine_dir, tmp_path, gate_batch_size=1, min_spec_tokens=20,
                       max_queue_size=8) as srv:  # all eight must queue (the default is 4 per slot)
        held = hold_the_slot(srv, blocker)
        seen: dict[int, list[str]] = {}

        def leave(i):
            c = client(srv)
            chunks: queue.Queue = queue.Queue()
            c.start_stream(callback=lambda result, error: chunks.put(
                "error" if error else result.as_numpy("text_output")[0, 0].decode() if result.get_response().outputs
                else "final"))
            c.async_stream_infer("ensemble", inputs(f"queued {i}", 50, stream=True), enable_empty_final_response=True)
            seen[i] = [chunks.get(timeout=10)]  # a keepalive, about a second after it queued
            c.stop_stream(cancel_requests=True)
            c.close()

        threads = [threading.Thread(target=leave, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert seen == {i: [""] for i in range(8)}

        assert wait_for(lambda: finished(srv, "cancelled") == 8, timeout=10)
        # Nothing but the blocker decoded: it may have run out its LONG_TOKENS by now on a fast machine.
        snapshot = metrics(srv.endpoints.metrics)
        assert finished(srv, "stop") == 0 and finished(srv, "length") <= 1
        assert value(snapshot, "pipeline_engine_generation_tokens_total") <= LONG_TOKENS
        held.stop_stream(cancel_requests=True)
        held.close()
        assert wait_for(lambda: value(metrics(srv.endpoints.metrics), "pipeline_engine_requests_running") == 0)



@pytest.mark.slow
def test_past_max_queue_size_a_request_is_refused_at_once_as_busy_and_the_queued_ones_are_served(one_slot, tmp_path):
    """One slot held, max_queue_size 2: of five more requests two queue and three are refused within a
    second or two, in one line that says why; once the slot frees, the queued two finish. (The refusal
    is a TritonError UNAVAILABLE, but Triton's streaming RPC carries only an error's message.)"""
    engine_dir, blocker = one_slot
    with served_engine(engine_dir, tmp_path, gate_batch_size=1, min_spec_tokens=20,
                       max_queue_size=2) as srv:
        held = hold_the_slot(srv, blocker)
        outcomes: dict[int, tuple[str, float, str]] = {}  # i -> (served or the error, seconds, text)

        def send(i, extra=()):
            c = client(srv)
            start = time.monotonic()
            try:
                text = "".join(t for t, _, _ in responses(c, f"queued {i}", 8, stream=False, speculation="off",
                                                          extra=extra))
                outcomes[i] = ("served", time.monotonic() - start, text)
            except Exception as err:  # noqa: BLE001  the refusal is what this test looks at
                outcomes[i] = (str(err), time.monotonic() - start, "")
            finally:
                c.close()

        threads = []
        for i in range(5):
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            time.sleep(0.3)  # in order: the first two find room in the queue
        assert wait_for(lambda: len(outcomes) == 3, timeout=10), outcomes
        refused = dict(outcomes)  # now: the two queued ones still wait behind the held slot
        assert sorted(refused) == [2, 3, 4]
        for message, seconds, _ in refused.values():
            assert "server busy: 2 requests are already waiting for the engine's 1 slots (max_queue_size 2)" in message
            assert "Traceback" not in message and "\n" not in message
            assert seconds < 5
        # A client's retry of a request a lost server held (`resumed`) queues past the bound (serving_gate.
        # queue_is_full), in the gate and in the engine.
        threads.append(threading.Thread(target=send, args=(5, [tensor("resumed", np.array([[True]]), "BOOL")])))
        threads[-1].start()
        time.sleep(1.0)
        assert 5 not in outcomes, outcomes.get(5)
        held.stop_stream(cancel_requests=True)
        held.close()
        for t in threads:
            t.join(timeout=60)
        assert [outcomes[i][0] for i in (0, 1, 5)] == ["served", "served", "served"]
        assert [outcomes[i][2] for i in (0, 1, 5)] == expected_texts(engine_dir, ["queued 0", "queued 1", "queued 5"], 8)
        # Refused by the gate, before the engine (serving_gate.Busy): a refusal sent back through BLS costs
        # tritonserver memory it never frees. The gate publishes its counters at most every METRICS_EVERY_S,
        # so the third refusal may reach /metrics a moment after its client saw it.
        assert wait_for(lambda: value(metrics(srv.endpoints.metrics), "pipeline_gate_rejected_total") == 3,
                        timeout=5), metrics(srv.endpoints.metrics)
        assert finished(srv, "rejected") == 0


# ---- stop strings, log probs and penalties through the ensemble (issue 29) ----------------------------------

def engine_answer(engine_dir: Path, prompt: str, max_tokens: int, **params):
    """The in-process engine's request for a prompt, as the repository's preprocessing would send it."""
    from pipeline.engine import load_engine
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(engine_dir / "target")
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(engine_dir / "target").eos_token_ids)
    engine = load_engine(engine_dir)
    engine.detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    [req] = engine.generate([encode_prompt(tokenizer, prompt, raw=False)],
                            SamplingParams(**{"max_tokens": max_tokens, "stop_token_ids": stops, **params}),
                            speculation="off")
    return req, tokenizer


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_word_of_several_tokens_cuts_the_text_just_before_it(server, engine_dir, stream):
    prompt = "tell me about stop words"
    whole = expected_text(engine_dir, prompt, 40)
    _, tokenizer = engine_answer(engine_dir, prompt, 1)
    stop = next(whole[i:i + 6] for i in range(8, len(whole) - 6)
                if len(tokenizer(whole[i:i + 6], add_special_tokens=False).input_ids) > 1)
    c = client(server)
    try:
        results = ensemble_results(c, prompt, 40, stream,
                                   stop_words=np.array([[stop.encode()]], np.object_))
        text = "".join(r.as_numpy("text_output")[0, 0].decode() for r in results)
        assert text == whole[:whole.find(stop)]
        # and the server serves the next request as before
        [(again, _, _)] = responses(c, prompt, 40, stream=False)
        assert again == whole
    finally:
        c.close()


def http_generate(server, body: dict, stream: bool) -> list[dict]:
    """Triton's HTTP generate (one JSON answer) or generate_stream (server-sent events, one per response)."""
    import urllib.request

    url = f"{server.endpoints.http}/v2/models/ensemble/generate{'_stream' if stream else ''}"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read().decode()
    if not stream:
        return [json.loads(text)]
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_word_over_http_generate_and_generate_stream(server, engine_dir, stream):
    prompt = "tell me about stop words"
    whole = expected_text(engine_dir, prompt, 40)
    stop = whole[12:19]
    events = http_generate(server, {"text_input": prompt, "max_tokens": 40, "stop_words": [stop], "stream": stream},
                           stream)
    assert len(events) > 1 if stream else len(events) == 1
    assert "".join(e["text_output"] for e in events) == whole[:whole.find(stop)]


@pytest.mark.parametrize("body, message", [
    ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0 (got -1.0); use 1 for none"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2] (got 2.5); use 0 for none"),
    ({"num_logprobs": 3}, "num_logprobs 3 needs return_log_probs true; send both"),
    ({"stop_words": ["x" * 300]}, "is 300 characters; send at most 256"),
])
def test_a_bad_value_over_http_is_a_one_line_400_and_the_server_serves_the_next(server, engine_dir, body, message):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        http_generate(server, {"text_input": "hi", "max_tokens": 8, **body}, False)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and message in error and "\n" not in error
    [answer] = http_generate(server, {"text_input": "hi", "max_tokens": 8}, False)
    assert answer["text_output"] == expected_text(engine_dir, "hi", 8)


def test_log_probs_and_penalties_are_the_engines_own(server, engine_dir):
    from pipeline.models.tokenizer import answer_text

    prompt = "count the words in this sentence please"
    req, tokenizer = engine_answer(engine_dir, prompt, 24, repetition_penalty=1.2, logprobs=2)
    plain, _ = engine_answer(engine_dir, prompt, 24)
    assert req.output_ids != plain.output_ids  # the penalty changed the answer
    c = client(server)
    try:
        for stream in (False, True):
            results = ensemble_results(c, prompt, 24, stream, repetition_penalty=np.array([[1.2]], np.float32),
                                       return_log_probs=np.array([[True]]), num_logprobs=np.array([[2]], np.int32))
            logprobs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in results])
            assert logprobs.tolist() == pytest.approx([lp.logprob for lp in req.logprobs], abs=1e-5)
            assert sum(float(r.as_numpy("cum_log_probs").reshape(-1)[0]) for r in results) == \
                pytest.approx(sum(lp.logprob for lp in req.logprobs), abs=1e-3)
            top = [t for r in results for t in json.loads(r.as_numpy("top_log_probs")[0, 0])]
            assert [t[0] for t in top] == req.output_ids
            assert [[tuple(p) for p in t[2]] for t in top] == [list(lp.top) for lp in req.logprobs]
        [(text, _, _)] = responses(c, prompt, 24, stream=False,
                                   extra=[tensor("repetition_penalty", np.array([[1.2]], np.float32), "FP32")])
        assert text == answer_text(tokenizer, req.output_ids)
    finally:
        c.close()


def test_a_longer_stream_interval_sends_fewer_responses_with_the_same_text(server, engine_dir):
    """stream_interval_ms spaces a stream's responses (what the OpenAI frontend asks for a whole answer, so that a
    burst of them leaves no backlog of responses in tritonserver and the gate): at 1 s, a stream decoding for T
    seconds gets at most T + 2 responses (its first at once, then one a second, then the final), with the text and
    token count of the default cadence."""
    from pipeline.models.tokenizer import answer_text

    prompt, tokens = "count the words in this sentence please", 180  # about 0.2 s here: several 50 ms intervals
    req, tokenizer = engine_answer(engine_dir, prompt, tokens, stop_token_ids=(), ignore_eos=True)
    c = client(server)
    try:
        got = {}
        for interval in (50, 1000):
            start = time.monotonic()
            results = ensemble_results(c, prompt, tokens, True, ignore_eos=np.array([[True]]),
                                       stream_interval_ms=np.array([[interval]], np.int32))
            got[interval] = (results, time.monotonic() - start)
            text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in results)
            assert text == answer_text(tokenizer, req.output_ids)
            assert sum(int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in results) == tokens
        (spaced, seconds) = got[1000]
        assert len(spaced) <= seconds + 2
        assert len(got[50][0]) > len(spaced)  # the default cadence does send more (the check above can fail)
    finally:
        c.close()


def test_each_python_models_shared_memory_region_is_made_at_its_full_size_and_does_not_grow(server, engine_dir):
    """The python backend takes serve's region size (launch.PYTHON_SHM_BYTES, 16 MiB; its own default is 1 MB, grown
    1 MB at a time, each growth mapped again in two processes): after a burst of streams every region is that size."""
    from pipeline.triton.launch import PYTHON_SHM_BYTES

    answered = []

    def stream(i: int) -> None:
        c = client(server)  # a client holds one stream
        try:
            answered.append(len(ensemble_results(c, f"burst {i}", MAX_TOKENS, True)))
        finally:
            c.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answered) == 8 and min(answered) > 0
    regions = list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
    assert len(regions) >= 4  # preprocessing, the gate, the engine, postprocessing
    assert {r.stat().st_size for r in regions} == {PYTHON_SHM_BYTES}


@pytest.mark.parametrize("name, value, message", [
    ("repetition_penalty", np.array([[0.0]], np.float32), "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", np.array([[3.0]], np.float32), r"presence_penalty must be in \[-2, 2\]"),
    ("num_logprobs", np.array([[30]], np.int32), r"logprobs must be an integer in \[0, 20\]"),
    ("stream_interval_ms", np.array([[10]], np.int32), r"stream_interval_ms 10 is outside 50\.\.1000"),
    ("stream_interval_ms", np.array([[5000]], np.int32), r"stream_interval_ms 5000 is outside 50\.\.1000"),
])
def test_bad_sampling_extras_are_refused_in_one_line_and_the_server_goes_on(server, engine_dir, name, value, message):
    from tritonclient.utils import InferenceServerException

    c = client(server)
    try:
        with pytest.raises(InferenceServerException, match=message):
            ensemble_results(c, "hi", 8, True, return_log_probs=np.array([[True]]), **{name: value})
        [(text, _, _)] = responses(c, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        c.close()


# ---- resuming an answer a restart cut off (issue 55) ---------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_a_resumed_answer_sends_only_what_follows_its_start_and_ends_as_the_uninterrupted_one(server, engine_dir,
                                                                                               stream):
    """resume_token_ids, greedy and seeded sampled: the responses hold the answer's tokens after the start the client
    sent (output_token_ids), their text is the rest of the uninterrupted answer's text, and their counts are theirs."""
    from pipeline.models.tokenizer import load_tokenizer, visible_text

    tokenizer = load_tokenizer(engine_dir / "target")
    prompt = "tell me about resuming"
    c = client(server)

    def answer(params: dict, **extra) -> tuple[list[int], str, int]:
        results = ensemble_results(c, prompt, 40, stream, **params, **extra)
        return ([int(t) for r in results for t in r.as_numpy("output_token_ids").reshape(-1)],
                "".join(r.as_numpy("text_output")[0, 0].decode() for r in results),
                sum(int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in results))

    try:
        for params in ({}, {"temperature": np.array([[0.9]], np.float32), "seed": np.array([[7]], np.uint64)}):
            ids, text, counted = answer(params)
            assert len(ids) == counted > 12 and text
            for cut in (1, 11):
                rest, rest_text, rest_counted = answer(params, resume_token_ids=np.array([ids[:cut]], np.int32))
                assert rest == ids[cut:] and rest_counted == len(ids) - cut, (params, cut)
                start = visible_text(tokenizer.decode(ids[:cut], skip_special_tokens=True))
                assert start + rest_text == text, (params, cut)
        for bad, message in (([ids[:1] * 40], "resume_token_ids holds 40 ids and max_tokens is 40"),
                             ([[10 ** 6]], r"resume has token ids outside the vocabulary \[0, "),
                             ([[-3]], "resume_token_ids holds negative ids")):
            with pytest.raises(Exception, match=message):
                ensemble_results(c, prompt, 40, stream, resume_token_ids=np.array(bad, np.int32))
        assert answer(params)[0] == ids  # and the server serves on as before
    finally:
        c.close()
