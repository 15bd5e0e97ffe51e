"""Calling a served repository in tests: the ensemble's inputs, a streamed call, the expected text, metrics."""

from __future__ import annotations

import contextlib
import queue
import re
import urllib.request
from pathlib import Path

import numpy as np

from pipeline.engine import load_engine
from pipeline.triton.ports import free_ports

MAX_TOKENS = 60  # past the gate's min tokens (50), so speculation really runs


def soak_script():
    """scripts/soak.py as a module: its request mix (BAD_REQUESTS among it) is what the serving tests send too."""
    import importlib.util
    import sys

    if "soak" not in sys.modules:
        scripts = str(Path(__file__).parent.parent / "scripts")
        if scripts not in sys.path:  # the script imports its sibling scripts, as when it runs as one
            sys.path.insert(0, scripts)
        spec = importlib.util.spec_from_file_location("soak", Path(__file__).parent.parent / "scripts" / "soak.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["soak"]


def expected_text(engine_dir: Path, prompt: str, max_tokens: int) -> str:
    """What the in-process engine answers (greedy), decoded as `pipeline generate` decodes it."""
    return expected_texts(engine_dir, [prompt], max_tokens)[0]


def expected_texts(engine_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """expected_text for each prompt, alone (speculation off: greedy output is the target's either way)."""
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import answer_text, encode_prompt, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(engine_dir / "target")
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(engine_dir / "target").eos_token_ids)
    engine = load_engine(engine_dir)
    texts = []
    for prompt in prompts:
        [req] = engine.generate([encode_prompt(tokenizer, prompt, raw=False)],
                                SamplingParams(max_tokens=max_tokens, stop_token_ids=stops), speculation="off")
        texts.append(answer_text(tokenizer, req.output_ids))
    return texts


def tensor(name: str, value: np.ndarray, dtype: str):
    """A tritonclient gRPC input holding `value`."""
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def inputs(prompt: str, max_tokens: int, stream: bool, speculation: str = "auto"):
    return [tensor("text_input", np.array([[prompt.encode()]], np.object_), "BYTES"),
            tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
            tensor("stream", np.array([[stream]]), "BOOL"),
            tensor("speculation", np.array([[speculation.encode()]], np.object_), "BYTES")]


def responses(client, prompt: str, max_tokens: int, stream: bool = True, speculation: str = "auto", extra=(),
              raw_inputs=None, leave_after: int | None = None, timeout: float = 60) -> list[tuple[str, int, int]]:
    """(text, accepted, drafted) per response. The ensemble has a decoupled step, so Triton serves it
    only over the streaming RPC (unary ModelInfer refuses decoupled models); stream=False asks for one
    response holding the whole answer. An error response raises. leave_after: cancel the request
    after that many responses, as a client walking away."""
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", raw_inputs or inputs(prompt, max_tokens, stream, speculation) + list(extra),
                                  enable_empty_final_response=True)
        chunks = []
        while True:
            result, error = got.get(timeout=timeout)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                chunks.append((result.as_numpy("text_output")[0, 0].decode(),
                               int(result.as_numpy("num_accepted_tokens")[0, 0]),
                               int(result.as_numpy("num_drafted_tokens")[0, 0])))
            if leave_after is not None and len(chunks) >= leave_after:
                client.stop_stream(cancel_requests=True)
                return chunks
            if response.parameters["triton_final_response"].bool_param:
                return chunks
    finally:
        client.stop_stream()




def ensemble_results(client, prompt: str, max_tokens: int, stream: bool, **values) -> list:
    """Every response (an InferResult) to one ensemble request with extra inputs by name; an error raises."""
    from tritonclient.utils import np_to_triton_dtype

    extra = [tensor(name, v, np_to_triton_dtype(v.dtype)) for name, v in values.items()]
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs(prompt, max_tokens, stream) + extra,
                                  enable_empty_final_response=True)
        results = []
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                raise error
            if result.get_response().outputs:
                results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        client.stop_stream()


TRANSPORTS = ("grpc stream", "grpc whole", "http generate", "http generate_stream")
REQUIRED = ("text_input", "max_tokens")  # upstream's ensemble requires these two; a client must send both


def missing_input_answers(server, name: str) -> dict[str, str]:
    """transport -> what the ensemble answers to a request without the required input `name`: the error's one
    line, or "" where it answers without one. The request still carries two inputs (the other required one and
    stream): tritonserver 2.51 counts a request's inputs, so two was enough to pass its check before."""
    import json
    import urllib.error

    answers = {}
    for transport in TRANSPORTS:
        stream = transport in ("grpc stream", "http generate_stream")
        values = {"text_input": "hi", "max_tokens": 8, "stream": stream}
        del values[name]
        if transport.startswith("grpc"):
            import tritonclient.grpc as grpcclient

            kinds = {"text_input": (np.object_, "BYTES"), "max_tokens": (np.int32, "INT32"), "stream": (bool, "BOOL")}
            tensors = [tensor(k, np.array([[v.encode() if isinstance(v, str) else v]], kinds[k][0]), kinds[k][1])
                       for k, v in values.items()]
            client = grpcclient.InferenceServerClient(server.endpoints.grpc)
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            try:
                client.async_stream_infer("ensemble", tensors, enable_empty_final_response=True)
                while True:
                    result, error = got.get(timeout=60)
                    if error is not None:
                        answers[transport] = str(error)
                        break
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        answers[transport] = ""
                        break
            finally:
                client.stop_stream()
                client.close()
        else:
            url = f"{server.endpoints.http}/v2/models/ensemble/{transport.split()[1]}"
            request = urllib.request.Request(url, json.dumps(values).encode(), {"Content-Type": "application/json"})
            try:  # 2.51 answered these 200, with no text (generate_stream) or a complaint about the response count
                with urllib.request.urlopen(request, timeout=60):
                    answers[transport] = ""
            except urllib.error.HTTPError as err:
                body = err.read().decode().strip()
                body = body[len("data: "):] if body.startswith("data: ") else body  # generate_stream: one event
                answers[transport] = json.loads(body)["error"] if err.code == 400 else f"HTTP {err.code}: {body}"
    return answers


def assert_missing_inputs_refused(server) -> None:
    """Each required input left out, on each transport: an error naming it and the fix, in one line."""
    for name in REQUIRED:
        message = f"{name} is required; send text_input and max_tokens"
        answers = missing_input_answers(server, name)
        assert {t: message in a and "\n" not in a for t, a in answers.items()} == dict.fromkeys(TRANSPORTS, True), \
            answers


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for our own families (pipeline_*)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(pipeline_\w+(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def ngram_engine(target: Path, folder: Path, slots: int, max_seq_len: int = 256) -> Path:
    """The served tests' portable engine folder: the target with n-gram drafts (K=3), `slots` requests at once,
    max_seq_len tokens each, the engine's gate ceiling at its slots. Not calibrated: the draft planner reads the
    rule-of-thumb cost model, so whether a row drafts never depends on how busy the machine was at build time (in
    a full suite run a served test once saw nothing drafted, which it always does alone)."""
    from pipeline.compiler import CompileOptions, compile_model

    out = folder / "tiny"
    compile_model(CompileOptions("torch", target, out, draft="ngram", num_draft_tokens=3, max_batch_size=slots,
                                 max_seq_len=max_seq_len, gate_batch_size=slots, calibrate=False))
    return out


@contextlib.contextmanager
def served_engine(engine_dir: Path, folder: Path, **assemble_options):
    """Assemble a repository for a portable engine folder under `folder` and serve it on free ports;
    yields the TritonServer."""

    from pipeline.triton.assemble import AssembleOptions, assemble
    from pipeline.triton.server import ServeOptions, TritonServer, find_tritonserver

    binary = find_tritonserver()
    repo = Path(assemble(AssembleOptions(engine=engine_dir, repo=folder / "repo", **assemble_options)).repo)
    grpc, http, metrics_port = free_ports()
    with TritonServer(ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics_port),
                      binary) as server:
        yield server
