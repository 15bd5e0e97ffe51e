"""`pipeline assemble` and the python models it writes, served by a real tritonserver (the CPU one in
nvidia-pytriton) on a tiny portable engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.triton.assemble import PYTHON_MODELS, AssembleOptions, assemble
from pipeline.triton.config import read_config
from serving_checks import MAX_TOKENS, expected_text, inputs, ngram_engine, responses, served_engine  # noqa: E402

import tritonclient.grpc  # noqa: E402,F401  (required by pyproject: a missing one fails, never skips)

@pytest.fixture(scope="module")
def engine_dir(tiny_target, tmp_path_factory) -> Path:
    return ngram_engine(tiny_target, tmp_path_factory.mktemp("engines"), slots=4)


def test_assemble_writes_every_model_with_its_config_and_source(engine_dir, tmp_path):
    result = assemble(AssembleOptions(engine=engine_dir, repo=tmp_path / "repo", gate_batch_size=8, min_spec_tokens=20))
    repo = Path(result.repo)
    assert result.models == sorted(["ensemble", "preprocessing", "postprocessing", "speculation_gate", "torch_engine",
                                    "stop_request"])
    for name in result.models:
        assert read_config(repo / name).name == name and (repo / name / "1").is_dir()
    for name, source in PYTHON_MODELS.items():
        if name not in result.models:
            continue
        assert (repo / name / "1" / "model.py").read_text() == (Path(__file__).parent.parent / "pipeline" / "triton"
                                                               / "models" / source).read_text()
    gate = read_config(repo / "speculation_gate").parameters
    assert (gate["gate_max_batch_size"].string_value, gate["gate_min_tokens"].string_value) == ("8", "20")
    assert "acceptance_floor" not in gate  # acceptance is judged per request, in the engine
    engine = read_config(repo / "torch_engine").parameters
    assert engine["engine_dir"].string_value == str(engine_dir.absolute())
    assert engine["max_seq_len"].string_value == "256"
    for name in ("preprocessing", "postprocessing", "torch_engine"):  # AutoTokenizer's pick, loaded without it
        tokenizer_class = read_config(repo / name).parameters["tokenizer_class"].string_value
        assert tokenizer_class == "transformers.tokenization_utils_tokenizers:TokenizersBackend", name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    assert json.loads((repo / "launch.json").read_text())["mode"] == "plain"  # the CPU server, no MPI


def test_assemble_refuses_an_existing_repo_unless_forced(engine_dir, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "old").write_text("x")
    with pytest.raises(ConfigError, match="--force"):
        assemble(AssembleOptions(engine=engine_dir, repo=repo))
    assert (repo / "old").is_file()
    assemble(AssembleOptions(engine=engine_dir, repo=repo, force=True))
    assert not (repo / "old").exists() and (repo / "ensemble" / "config.pbtxt").is_file()


def test_assemble_cli_prints_the_repo_and_refuses_a_folder_without_an_engine(engine_dir, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["assemble", "--engine", str(engine_dir), "--repo", str(tmp_path / "r"), "--json"])
    assert ok.exit_code == 0, ok.output
    assert "torch_engine" in json.loads(ok.output)["models"]
    bad = runner.invoke(main, ["assemble", "--engine", str(tmp_path), "--repo", str(tmp_path / "r2")])
    assert bad.exit_code != 0 and "engine.json" in bad.output
    again = runner.invoke(main, ["assemble", "--engine", str(engine_dir), "--repo", str(tmp_path / "r")])
    assert again.exit_code != 0 and "--force" in again.output


def test_assemble_writes_the_device_the_served_engine_loads_on(engine_dir, tmp_path):
    """No GPU check here: the repository may be served on another machine; the model picks auto as it loads."""
    default = assemble(AssembleOptions(engine=engine_dir, repo=tmp_path / "a"))
    assert default.device == "auto"
    assert read_config(Path(default.repo) / "torch_engine").parameters["device"].string_value == "auto"
    runner = CliRunner()
    ok = runner.invoke(main, ["assemble", "--engine", str(engine_dir), "--repo", str(tmp_path / "g"),
                              "--device", "cuda", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["device"] == "cuda:0"
    assert read_config(tmp_path / "g" / "torch_engine").parameters["device"].string_value == "cuda:0"


# ---- served by a real tritonserver ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    # No acceptance floor: n-gram drafts on a random tiny model accept little, and these tests need
    # "auto" to speculate (the floor has its own tests).
    with served_engine(engine_dir, tmp_path_factory.mktemp("served")) as srv:
        yield srv


def test_only_the_engine_loads_torch_among_the_python_models(server):
    """The tokenizing models and the gate never import torch: each would add about 3 s to a start (5 stubs on 2
    cores) and 200 MB, for a library they don't use."""
    import os

    from pipeline.triton.supervise import python_stubs

    stubs = python_stubs(os.getpgid(server.process.pid))
    with_torch = {s.model for s in stubs if "libtorch" in Path(f"/proc/{s.pid}/maps").read_text()}
    assert {s.model for s in stubs} >= {"preprocessing", "postprocessing", "speculation_gate", "torch_engine"}
    assert with_torch == {"torch_engine"}


def test_served_answer_equals_the_in_process_engine_streaming_or_not(server, engine_dir):
    import tritonclient.grpc as grpcclient

    prompt = "abcabcabc hello"
    expected = expected_text(engine_dir, prompt, MAX_TOKENS)
    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    try:
        [(text, accepted, drafted)] = responses(client, prompt, MAX_TOKENS, stream=False)
        assert text == expected and 0 <= accepted <= drafted
        for speculation in ("on", "off", "auto"):
            chunks = responses(client, prompt, MAX_TOKENS, speculation=speculation)
            assert "".join(text for text, _, _ in chunks) == expected
            assert len(chunks) > 1
            drafted = sum(d for _, _, d in chunks)
            assert (drafted == 0) == (speculation == "off")
            assert 0 <= sum(a for _, a, _ in chunks) <= drafted
    finally:
        client.close()


@pytest.mark.parametrize("max_tokens, message", [(0, "max_tokens must be >= 1"),
                                                 (10_000, "beyond the engine's max_seq_len")])
def test_bad_request_gets_an_error_and_the_next_request_still_works(server, engine_dir, max_tokens, message):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    try:
        with pytest.raises(InferenceServerException, match=message):
            responses(client, "hi", max_tokens, stream=False)
        with pytest.raises(InferenceServerException, match="text_input is empty"):
            responses(client, "  ", 4, stream=False)
        [(text, _, _)] = responses(client, "hi", 8, stream=False)
        assert text == expected_text(engine_dir, "hi", 8)
    finally:
        client.close()


def test_concurrent_streams_past_the_batch_size_each_get_their_own_answer_beside_a_cancelled_one(server, engine_dir):
    import threading
    import time

    import tritonclient.grpc as grpcclient

    # More streams than the engine's 4 slots: the rest wait in its queue, then join the batch.
    prompts = [f"prompt {i} {'xy' * i}" for i in range(6)]
    got: dict[int, str] = {}

    def run(i):
        client = grpcclient.InferenceServerClient(server.endpoints.grpc)
        try:
            got[i] = "".join(text for text, _, _ in responses(client, prompts[i], MAX_TOKENS))
        finally:
            client.close()

    # A client that walks away mid-stream: its request is cancelled in the engine.
    leaver = grpcclient.InferenceServerClient(server.endpoints.grpc)
    leaver.start_stream(callback=lambda result, error: None)
    leaver.async_stream_infer("ensemble", inputs("walk away", 200, True), enable_empty_final_response=True)
    time.sleep(0.2)
    leaver.stop_stream(cancel_requests=True)
    leaver.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {i: expected_text(engine_dir, p, MAX_TOKENS) for i, p in enumerate(prompts)}


def test_bench_startups_baseline_is_the_repository_without_the_tokenizer_record(engine_dir, tmp_path):
    """scripts/bench_startup.py times a start against the same repository loading AutoTokenizer everywhere."""
    import importlib.util
    import sys

    scripts = Path(__file__).parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("bench_startup", scripts / "bench_startup.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(scripts))
    repo = Path(assemble(AssembleOptions(engine=engine_dir, repo=tmp_path / "repo")).repo)
    (tmp_path / "copy").mkdir()
    baseline = bench.without_record(repo, tmp_path / "copy")
    for name in ("preprocessing", "postprocessing", "torch_engine"):
        kept, dropped = read_config(repo / name), read_config(baseline / name)
        assert "tokenizer_class" in kept.parameters and "tokenizer_class" not in dropped.parameters
        del kept.parameters["tokenizer_class"]
        assert kept == dropped, name
    assert read_config(baseline / "ensemble") == read_config(repo / "ensemble")
