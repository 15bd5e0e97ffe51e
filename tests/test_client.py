"""`pipeline generate --url` and pipeline/client/ensemble.py against a real tritonserver (the CPU one in
nvidia-pytriton) serving a tiny portable engine: one server for the whole file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_checks import assert_one_line_error
from pipeline.cli import main
from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions, grpc_target, run_request
from pipeline.engine import load_engine
from pipeline.errors import RequestError, ServeError
from pipeline.triton.ports import free_ports
from serving_checks import ngram_engine, served_engine

import tritonclient.grpc  # noqa: E402,F401  (required by pyproject: a missing one fails, never skips)

MAX_TOKENS = 60  # past the gate's min tokens (50), so speculation really runs
PROMPTS = ["abcabcabc hello", "one two one two one", "x"]


@pytest.fixture(scope="module")
def engine_dir(tiny_target, tmp_path_factory) -> Path:
    return ngram_engine(tiny_target, tmp_path_factory.mktemp("engines"), slots=4)


@pytest.fixture(scope="module")
def expected(engine_dir) -> dict[str, tuple[str, int]]:
    """prompt -> (text, new tokens) from the in-process engine (greedy), decoded as the server decodes it."""
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import answer_text, encode_prompt, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(engine_dir / "target")
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(engine_dir / "target").eos_token_ids)
    reqs = load_engine(engine_dir).generate([encode_prompt(tokenizer, p, raw=False) for p in PROMPTS],
                                            SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=stops))
    out = {}
    for prompt, req in zip(PROMPTS, reqs):
        out[prompt] = (answer_text(tokenizer, req.output_ids), len(req.output_ids))
    return out


@pytest.fixture(scope="module")
def url(engine_dir, tmp_path_factory) -> str:
    with served_engine(engine_dir, tmp_path_factory.mktemp("served")) as srv:
        yield srv.endpoints.grpc


def test_streamed_cli_output_equals_the_in_process_greedy_text(url, expected):
    prompt = PROMPTS[0]
    result = CliRunner().invoke(main, ["generate", prompt, "--url", url, "-n", str(MAX_TOKENS)])
    assert result.exit_code == 0, result.output
    text, tokens = expected[prompt]
    assert result.stdout == text + "\n"
    [stats] = result.stderr.splitlines()
    assert f"{tokens} tokens" in stats and "tok/s" in stats and "TTFT" in stats and "acceptance" in stats


def test_stream_arrives_in_chunks_whose_counts_add_up_to_the_engine_tokens(url, expected):
    text, tokens = expected[PROMPTS[0]]
    seen = []
    result = run_request(ClientOptions(url), PROMPTS[0], RequestOptions(max_tokens=MAX_TOKENS, speculation="on"),
                      on_chunk=seen.append)
    assert result.text == text and seen == result.chunks and len(seen) > 1
    assert result.tokens == tokens and 0 < result.accepted <= result.drafted
    assert [c.t_s for c in seen] == sorted(c.t_s for c in seen) and 0 < result.ttft_s <= result.total_s


def test_json_gives_each_concurrent_prompt_its_own_answer_and_stats(url, expected, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS[1:]) + "\n")
    runner = CliRunner()
    on = runner.invoke(main, ["generate", PROMPTS[0], "--prompts-file", str(prompts_file), "--url", url, "-n", str(MAX_TOKENS),
                              "--speculation", "on", "-k", "2", "--json"])
    assert on.exit_code == 0, on.output
    report = json.loads(on.stdout)
    assert [o["prompt"] for o in report["outputs"]] == PROMPTS
    assert [o["text"] for o in report["outputs"]] == [expected[p][0] for p in PROMPTS]
    assert [o["stats"]["tokens"] for o in report["outputs"]] == [expected[p][1] for p in PROMPTS]
    for out in report["outputs"]:
        s = out["stats"]
        assert 0 < s["ttft_s"] <= s["total_s"] and s["responses"] > 1 and s["tokens_per_s"] > 0
        assert s["drafted_tokens"] > 0 and 0 <= s["acceptance_rate"] <= 1
    totals = report["stats"]
    assert totals["requests"] == 3 and totals["concurrency"] == 3
    assert totals["tokens"] == sum(expected[p][1] for p in PROMPTS)
    assert report["config"] == {**report["config"], "url": url, "speculation": "on", "num_draft_tokens": 2}

    off = runner.invoke(main, ["generate", PROMPTS[0], "--url", url, "-n", str(MAX_TOKENS), "--speculation", "off",
                               "--no-stream", "--json"])
    assert off.exit_code == 0, off.output
    [out] = json.loads(off.stdout)["outputs"]
    assert out["text"] == expected[PROMPTS[0]][0]
    assert out["stats"]["responses"] == 1 and out["stats"]["drafted_tokens"] == 0
    assert out["stats"]["tokens"] == expected[PROMPTS[0]][1]  # exact unstreamed too: num_output_tokens


def test_refused_requests_are_one_line_errors_and_the_server_keeps_serving(url, expected):
    runner = CliRunner()
    assert_one_line_error(runner.invoke(main, ["generate", "hi", "--url", url, "-n", "0"]), "max_tokens must be >= 1")
    # Refused by the server (preprocessing), not the client: the engine's max_seq_len is 256.
    assert_one_line_error(runner.invoke(main, ["generate", "hi", "--url", url, "-n", "10000"]),
                          "server refused the request", "beyond the engine's max_seq_len")
    with pytest.raises(RequestError, match="text_input is empty"):
        run_request(ClientOptions(url), "   ", RequestOptions(max_tokens=4))
    after = run_request(ClientOptions(url), PROMPTS[0], RequestOptions(max_tokens=MAX_TOKENS))
    assert after.text == expected[PROMPTS[0]][0]
    # A model's error ends the request, not the stream: the next request goes out on the same one (cancelling
    # a stream whose request has ended costs tritonserver 2.51 memory it never frees, docs/reliability.md).
    with Connection(ClientOptions(url)) as conn:
        with pytest.raises(RequestError, match="text_input is empty"):
            conn.generate("   ", RequestOptions(max_tokens=4))
        assert conn._streaming
        assert conn.generate(PROMPTS[0], RequestOptions(max_tokens=MAX_TOKENS)).text == expected[PROMPTS[0]][0]


def test_closing_a_stream_early_stops_it_without_a_cancel_and_the_connection_serves_the_next_request(url, expected):
    """A stream left early has its request stopped through the stop_request model and is read to the gate's final
    response, on the same stream, which then serves the next request: nothing cancels a gRPC stream, which the
    bundled tritonserver 2.51 can die of (docs/reliability.md)."""
    with Connection(ClientOptions(url)) as conn:
        first = next(conn.stream(PROMPTS[1], RequestOptions(max_tokens=MAX_TOKENS)))
        assert expected[PROMPTS[1]][0].startswith(first.text)  # the generator is dropped here: it is stopped
        stream = conn.stream("walk away", RequestOptions(max_tokens=200))
        next(stream)
        stream.close()  # what Ctrl-C does to the CLI's loop
        again = conn.generate(PROMPTS[2], RequestOptions(max_tokens=MAX_TOKENS))
        assert conn.stream_ends == {"read": 1, "stopped": 2, "cancelled": 0}
    assert again.text == expected[PROMPTS[2]][0]


def test_an_unreachable_server_or_a_missing_model_is_a_one_line_error(url):
    [port] = free_ports(1)
    result = CliRunner().invoke(main, ["generate", "hi", "--url", f"127.0.0.1:{port}"])
    assert_one_line_error(result, f"cannot reach tritonserver at 127.0.0.1:{port}", "pipeline serve")
    t0 = time.monotonic()  # --wait keeps retrying a server that may still be starting, then gives the same error
    waited = CliRunner().invoke(main, ["generate", "hi", "--url", f"127.0.0.1:{port}", "--wait", "1.5"])
    assert_one_line_error(waited, "cannot reach tritonserver")
    assert time.monotonic() - t0 >= 1.5
    with pytest.raises(ServeError, match="model 'nope' is not ready"):
        run_request(ClientOptions(url, model="nope"), "hi", RequestOptions(max_tokens=4))


def test_url_refuses_in_process_options_and_url_options_need_a_url():
    runner = CliRunner()
    both = runner.invoke(main, ["generate", "hi", "--url", "h:1", "--draft", "ngram", "--dtype", "fp32"])
    assert_one_line_error(both, "--draft, --dtype", "pipeline compile")
    assert_one_line_error(runner.invoke(main, ["generate", "hi", "--speculation", "off"]), "--speculation", "--url")
    assert_one_line_error(runner.invoke(main, ["generate", "hi", "--url", "http://h:8000"]), "gRPC endpoint")
    assert grpc_target("grpc://localhost:8001/") == "localhost:8001"
    for bad in ("localhost", ":8001", "h:port", "h:70000"):
        with pytest.raises(RequestError, match="HOST:PORT"):
            grpc_target(bad)


def test_stream_failures_are_serve_errors_and_model_errors_are_request_errors():
    from tritonclient.utils import InferenceServerException

    with Connection(ClientOptions("127.0.0.1:1")) as conn:  # never used: nothing connects
        lost = conn._error(InferenceServerException("Socket closed", status="StatusCode.UNAVAILABLE"))
        refused = conn._error(InferenceServerException("in ensemble 'ensemble', text_input is empty; send a prompt"))
    assert isinstance(lost, ServeError) and "lost tritonserver at 127.0.0.1:1" in str(lost)
    assert isinstance(refused, RequestError) and str(refused) == ("the server refused the request: text_input is "
                                                                  "empty; send a prompt")


def test_stops_are_marked_by_a_digest_of_the_id_swept_when_stale_and_bounded(tmp_path, monkeypatch):
    """What a stop_request leaves: a mark named by a digest (no id names a path), swept after STOP_MARK_TTL_S, and no
    more than MAX_STOP_MARKS pending, so no client grows the marks folder (it is on /dev/shm: memory)."""
    import os

    from pipeline.triton import cancel_marks

    monkeypatch.setattr(cancel_marks, "marks_dir", lambda server_pid=None: tmp_path / "marks")
    monkeypatch.setattr(cancel_marks, "MAX_STOP_MARKS", 3)
    assert cancel_marks.mark_stop("../../etc/passwd")
    key = cancel_marks.stop_key("../../etc/passwd")
    assert os.listdir(tmp_path / "marks") == [key] and "/" not in key and key.startswith(cancel_marks.STOP_PREFIX)
    assert cancel_marks.mark_stop("b") and cancel_marks.mark_stop("c")
    assert not cancel_marks.mark_stop("d")  # three pending: refused
    old = time.time() - cancel_marks.STOP_MARK_TTL_S - 1
    os.utime(tmp_path / "marks" / key, (old, old))  # a stop for a request that had already ended
    assert cancel_marks.mark_stop("d")  # the stale one swept, room for this one
    assert sorted(os.listdir(tmp_path / "marks")) == sorted(cancel_marks.stop_key(i) for i in "bcd")
    assert cancel_marks.take(cancel_marks.stop_key("b")) and not cancel_marks.take(cancel_marks.stop_key("b"))
