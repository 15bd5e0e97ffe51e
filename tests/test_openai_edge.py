"""The OpenAI frontend's edge, on its own process with no tritonserver behind it: everything here is refused or
answered before the ensemble is called. Its repository takes prompts of up to 3 MB (max_input_bytes), so large
requests reach the tokenizer, and its body limit is 4 MiB (--max-body-bytes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

MAX_INPUT_BYTES = 3_000_000
BODY_LIMIT = 4 << 20
MODEL = "tiny"


class Frontend:
    def __init__(self, process: subprocess.Popen, port: int, log: Path):
        self.process, self.url, self.port, self.log = process, f"http://127.0.0.1:{port}", port, log

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def post(self, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, str, dict]:
        """(status, Content-Type, JSON body) of one POST."""
        request = urllib.request.Request(self.url + path, body, {"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, answer.headers["content-type"], json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, err.headers["content-type"], json.loads(err.read())


def completion(prompt: str, **fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields}).encode()


@pytest.fixture(scope="module")
def repo(tiny_target, tmp_path_factory):
    from serving_checks import ngram_engine

    from pipeline.triton.assemble import AssembleOptions, assemble

    folder = tmp_path_factory.mktemp("edge")
    engine = ngram_engine(tiny_target, folder, slots=2)
    return assemble(AssembleOptions(engine=engine, repo=folder / "repo", max_input_bytes=MAX_INPUT_BYTES)).repo


def start_frontend(repo: Path, log: Path, *flags: str) -> Frontend:
    from pipeline.triton.ports import free_ports

    port, nobody = free_ports(2)  # nothing listens on the gRPC port: no request here may get that far
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "pipeline.openai_api", "--repo", str(repo), "--grpc-url",
                                    f"127.0.0.1:{nobody}", "--port", str(port), "--served-model-name", MODEL,
                                    "--max-body-bytes", str(BODY_LIMIT), *flags], stdout=out,
                                   stderr=subprocess.STDOUT)
    edge = Frontend(process, port, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(edge.url + "/v1/models", timeout=1).read()
            return edge
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


@pytest.fixture(scope="module")
def frontend(repo, tmp_path_factory):
    edge = start_frontend(repo, tmp_path_factory.mktemp("edge-log") / "openai.log")
    yield edge
    edge.process.terminate()
    edge.process.wait(10)


@pytest.fixture(scope="module")
def strict(repo, tmp_path_factory):
    """The same frontend with the edge's limits small enough to reach in a test."""
    edge = start_frontend(repo, tmp_path_factory.mktemp("strict-log") / "openai.log", "--head-timeout", "1",
                          "--body-timeout", "1", "--max-connections", "64")
    yield edge
    edge.process.terminate()
    edge.process.wait(10)


def raw_exchange(port: int, head: str, body_parts: list[bytes]) -> bytes:
    """Send a request head and body parts on a socket of our own; return what the server answers, without
    ever finishing a chunked body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed: what we want
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) == 0:
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        return answer


def test_a_body_over_the_limit_is_refused_while_it_streams_in(frontend):
    """A declared length over the limit is refused before any of the body is read; a chunked body, which declares
    none, as soon as the bytes read pass the limit: the rest is never sent, and the 413 still comes."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {20 << 20}\r\n\r\n")
    answer = raw_exchange(frontend.port, head, [])  # not one byte of the 20 MB body
    assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer

    chunk = b"x" * 65536
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (BODY_LIMIT // len(chunk) + 1)  # one chunk past the limit
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    answer = raw_exchange(frontend.port, head, parts)  # ...and no terminating chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"over this server's limit of 4194304" in answer
    status, _, body = frontend.post("/v1/completions", completion("hi", max_tokens=10**6))
    assert status == 400 and body["error"]["param"] == "max_tokens"  # and it serves on


def test_headers_over_the_limit_are_a_431_whether_they_arrive_whole_or_in_pieces(frontend):
    """uvicorn's h11 refuses a head still arriving past 16 KiB, but took a 200 KB one that came in one read."""
    big = "x" * 100_000
    request = urllib.request.Request(frontend.url + "/v1/models", headers={"X-Big": big})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 431 and json.loads(err.value.read())["error"]["code"] == "request_header_fields_too_large"
    many = {f"X-{i}": "y" * 100 for i in range(300)}  # 30 KB in many headers
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(frontend.url + "/v1/models", headers=many), timeout=30)
    assert err.value.code == 431
    urllib.request.urlopen(frontend.url + "/v1/models", timeout=30).read()  # and it serves on


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_that_is_not_json_is_a_415(frontend, content_type):
    """text/plain and form bodies are what a web page may POST cross-site without asking: never served."""
    status, kind, body = frontend.post("/v1/completions", completion("hi"), content_type)
    assert status == 415 and kind == "application/json" and body["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("raw, said", [
    (b'{"model": "tiny", "prompt": "a \\ud800 b"}', "hex escape"),  # a lone surrogate
    (b'{"model": "tiny", "prompt": ' + b"[" * 60_000 + b"]" * 60_000 + b"}", "recursion limit"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "expected value"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "number out of range"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', "invalid unicode"),  # Latin-1, not UTF-8
    (b"[1, 2]", "must be a JSON object"),
])
def test_json_that_pythons_parser_takes_or_chokes_on_is_a_400(frontend, raw, said):
    status, _, body = frontend.post("/v1/completions", raw)
    assert status == 400 and said in body["error"]["message"], body
    assert len(body["error"]["message"]) < 400  # the request's own text is never echoed whole


def test_routing_errors_are_in_openais_shape(frontend):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        request = urllib.request.Request(frontend.url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == status
        assert set(json.loads(err.value.read())["error"]) == {"message", "type", "param", "code"}


def test_a_huge_prompt_is_tokenized_off_the_event_loop_and_its_memory_goes_back(frontend):
    """A 2 MB prompt (2 M tokens for the byte tokenizer: seconds to tokenize, then refused for the 256-token
    context) holds up no other request, and the frontend's RSS comes back to near where it was: glibc kept
    about 550 MB of what tokenizing freed until the frontend trimmed its heap."""
    frontend.post("/v1/completions", completion("warm up " * 1000))
    before = frontend.rss_mb()
    big = completion("word " * 400_000)
    outcome: dict = {}

    def send():
        start = time.monotonic()
        outcome["answer"] = frontend.post("/v1/completions", big)
        outcome["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        # tokenized too, then refused: 255 new tokens after the prompt's are over the 256-token context
        assert frontend.post("/v1/completions", completion("hi", max_tokens=255))[0] == 400
        waits.append(time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    status, _, body = outcome["answer"]
    assert status == 400 and "the model's whole 256-token context" in body["error"]["message"]
    assert len(waits) >= 3 and max(waits) < outcome["seconds"] / 3, (waits, outcome["seconds"])
    for _ in range(3):
        frontend.post("/v1/completions", big)
    # The heap is trimmed once the answer is out (edge.Guard): give it a moment.
    deadline = time.monotonic() + 10
    while frontend.rss_mb() - before >= 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert frontend.rss_mb() - before < 200


def test_prompts_over_the_repositorys_bytes_are_refused_before_tokenizing(frontend):
    start = time.monotonic()
    status, _, body = frontend.post("/v1/completions", completion("x" * (MAX_INPUT_BYTES + 1)))
    assert status == 400 and f"prompt is {MAX_INPUT_BYTES + 1} bytes" in body["error"]["message"]
    assert time.monotonic() - start < 2  # tokenizing it would take seconds
    messages = [{"role": "user", "content": "x" * (MAX_INPUT_BYTES // 2 + 1)}] * 2
    status, _, body = frontend.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}).encode())
    assert status == 400 and body["error"]["param"] == "messages" and "bytes of text" in body["error"]["message"]


def test_no_refusal_leaves_a_traceback_or_the_requests_text_in_the_log(frontend):
    marker = "SECRET-PROMPT-TEXT"
    for raw in (b'{"model": "tiny", "prompt": "' + marker.encode() + b' \\ud800"}',
                b'{"model": "tiny", "prompt": "' + marker.encode() + b'", "max_tokens": "8"}',
                b'{"model": "tiny", "prompt": ' + b"[" * 60_000 + marker.encode() + b"}"):
        assert frontend.post("/v1/completions", raw)[0] == 400
    log = frontend.log.read_text()
    assert "Traceback" not in log and marker not in log


# ---- connections that never complete (issue 52) ---------------------------------------------------------------


def answer_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    sock.settimeout(seconds)
    start, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pass
    return got, time.monotonic() - start


@pytest.mark.parametrize("sent, status", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"408"),  # a head that never ends
    (b"", b"408"),  # nothing at all
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
     b'{"model": "tiny"', b"408"),  # a body shorter than its Content-Length
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\nabc", b"408"),  # a chunk that never ends
])
def test_a_request_that_never_completes_gets_a_408_and_the_close_at_its_deadline(strict, sent, status):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(sent)
        answer, seconds = answer_within(sock, 10)
    assert answer.startswith(b"HTTP/1.1 " + status) and b'"request_timeout"' in answer, answer[:300]
    assert 0.8 < seconds < 3, seconds
    urllib.request.urlopen(strict.url + "/v1/models", timeout=10).read()


def test_a_slow_head_sent_a_byte_at_a_time_is_cut_at_its_deadline(strict):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        start = time.monotonic()
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer, _ = answer_within(sock, 5)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 3


def test_half_open_connections_past_the_cap_never_keep_a_normal_request_out(strict):
    """Ten times the cap of connections that send half a head: the oldest make room for the newest, a normal
    request still answers at once, and the log grows by a few lines, not one per connection."""
    before = strict.log.stat().st_size
    socks = []
    try:
        for _ in range(640):
            sock = socket.create_connection(("127.0.0.1", strict.port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        start = time.monotonic()
        urllib.request.urlopen(strict.url + "/v1/models", timeout=10).read()
        assert time.monotonic() - start < 2
        closed = 0
        for sock in socks[:576]:  # all but the newest 64 were closed to make room (an RST, or a plain close)
            sock.settimeout(5)
            try:
                closed += sock.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
        assert closed >= 570
    finally:
        for sock in socks:
            sock.close()
    assert strict.log.stat().st_size - before < 4096, strict.log.read_text()[-2000:]


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_a_503(repo, tmp_path):
    """Connections whose requests are in progress (bodies still arriving) are never closed to make room: the newest
    connection is refused instead, with a 503 in OpenAI's shape."""
    edge = start_frontend(repo, tmp_path / "openai.log", "--max-connections", "16", "--body-timeout", "30")
    socks = []
    try:
        for _ in range(16):  # the one urlopen in start_frontend has closed
            sock = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            socks.append(sock)
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
            answer, _ = answer_within(sock, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer, answer[:200]
    finally:
        for sock in socks:
            sock.close()
        time.sleep(0.5)
        urllib.request.urlopen(edge.url + "/v1/models", timeout=10).read()  # room again once they closed
        edge.process.terminate()
        edge.process.wait(10)


def test_the_rate_limited_log_lets_one_line_a_window_through_and_counts_the_rest():
    import logging

    from pipeline.openai_api.connections import RateLimitedLog

    now = [0.0]
    limiter = RateLimitedLog(window_s=10, clock=lambda: now[0])

    def record(msg):
        return logging.LogRecord("x", logging.WARNING, __file__, 1, msg, (), None)

    passed = [limiter.filter(record("refused: %d open")) for _ in range(1000)]
    assert passed.count(True) == 1
    assert limiter.filter(record("another message"))
    now[0] = 10.5
    late = record("refused: %d open")
    assert limiter.filter(late) and "999 more like it" in late.msg


def test_the_connection_cap_stays_below_the_file_limit():
    from pipeline.openai_api.connections import max_connections_for

    assert max_connections_for(20_000) == 8192 and max_connections_for(1024) == 256
    assert max_connections_for(4096) == 1792 and max_connections_for(64) == 16


def test_pipelined_requests_on_one_connection_each_get_their_answer(strict):
    """Two POSTs sent back to back before either is answered (HTTP/1.1 pipelining): the connection edge closes a
    connection answered before its body ended, never one whose next request is already on its way."""
    body = completion("hi", max_tokens=10**6)  # refused at once: no tritonserver needed
    def one(last: bool) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: "
                b"%d\r\n\r\n%s" % (b"Connection: close\r\n" if last else b"", len(body), body))

    second = one(True)
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(one(False) + second[:-len(body)])  # the second's body still on its way as the first is answered
        time.sleep(0.3)
        sock.sendall(body)
        answer, seconds = answer_within(sock, 5)
    assert answer.count(b"HTTP/1.1 400") == 2 and seconds < 2, (answer[:500], seconds)
