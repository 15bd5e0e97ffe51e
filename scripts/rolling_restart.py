"""A rolling restart under load: does SIGTERM, then a start, lose a request? (issue 55's graceful stop)

Starts `pipeline serve --repo R --openai-port P` (default: triton_repo, the embedded SmolLM2 build), takes each
prompt's greedy answer alone as its reference, then runs --streams clients back to back, half over gRPC
(tritonclient, the ensemble's stream) and half over the OpenAI API (the openai SDK, streamed). After --term-after-s
it SIGTERMs serve (which drains: pipeline.triton.drain), and once serve has exited starts it again on the same ports;
the clients run on until --seconds. Each request ends as one of:

- served: its answer equals its prompt's reference;
- refused: turned away by the stopping server (the draining gate's UNAVAILABLE, the OpenAI frontend's 503);
- unreachable: no server to take it (connection refused, or the restarted server's models still loading);
- lost: cut after it started (an error after its first token) or answered differently. The target is 0.
A refused or unreachable request is sent again by its client a second later until it is served: what a client does
with a refusal, its "elsewhere" being the restarted server here (another replica behind a Service). A request cut
by a server death before its first token would count as unreachable; with the drain none should be.

The gRPC half uses tritonclient as it is (what a third-party client gets), or with `--grpc-client pipeline` the
project's own client (pipeline.client.ensemble), which resumes an answer the stop cut off from the tokens it had
once the server is back: with `--drain-timeout 0` what the drain hands back is finished by the restarted server.

Prints one table (and --json); exit status 1 when anything is lost.

    python scripts/rolling_restart.py                          # triton_repo, 8 + 8 streams, SIGTERM at 20 s
    python scripts/rolling_restart.py --repo R --streams 16 --max-tokens 96 --json
    python scripts/rolling_restart.py --drain-timeout 0 --grpc-client pipeline   # the leftovers resumed
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from pipeline.triton.ports import free_ports

PROMPTS = ("Write a haiku about the sea.", "List three uses of a paperclip.", "Explain what a hash map is.",
           "Give me a short story about a robot.", "What is the capital of France? Answer in a sentence.",
           "Count from one to twenty in words.")
REFUSED = ("the server is stopping",)  # the draining gate's line (pipeline.policy.serving_gate.STOPPING_MESSAGE)
UNREACHABLE = ("failed to connect", "onnection refused", "Connection error", "unknown model", "no available versions",
               "no longer in valid state", "Server is stopping", "not ready",
               "cannot reach", "is not live")  # the last two: pipeline's client (--grpc-client pipeline)


class Serve:
    """`pipeline serve` on fixed ports, in its own process group, restartable."""

    def __init__(self, repo: str, workdir: Path, drain_timeout: float):
        self.repo, self.workdir, self.drain_timeout = repo, workdir, drain_timeout
        self.grpc, self.http, self.metrics, self.openai = free_ports(4)
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> float:
        self.starts += 1
        out = open(self.workdir / f"serve-{self.starts}.out", "wb")
        started = time.monotonic()
        self.process = subprocess.Popen(
            ["pipeline", "serve", "--repo", self.repo, "--grpc-port", str(self.grpc), "--http-port", str(self.http),
             "--metrics-port", str(self.metrics), "--openai-port", str(self.openai), "--served-model-name", "m",
             "--drain-timeout", f"{self.drain_timeout:g}"], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.openai}/health", timeout=2).status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            if self.process.poll() is not None:
                raise SystemExit(f"pipeline serve exited: {self.output()[-2000:]}")
            time.sleep(0.5)

    def output(self) -> str:
        return (self.workdir / f"serve-{self.starts}.out").read_text(errors="replace")

    def terminate(self) -> float:
        """SIGTERM serve alone (as the kubelet does a container's first process); seconds until it exited."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(self.drain_timeout + 60)
        return time.monotonic() - start

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(120)


def grpc_answer(serve: Serve, prompt: str, max_tokens: int) -> tuple[str | None, str | None, int]:
    """(text, error, chunks before the error) for one greedy streamed request over the ensemble."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = [tensor("text_input", np.array([[prompt.encode()]], np.object_), "BYTES"),
              tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
              tensor("stream", np.array([[True]]), "BOOL")]
    got: queue.Queue = queue.Queue()
    chunks: list[str] = []
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{serve.grpc}")
    except Exception as err:  # noqa: BLE001  counted by its message
        return None, str(err), 0
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=120)
            if error is not None:
                return None, str(error), len(chunks)
            response = result.get_response()
            if response.outputs:
                chunks.append(result.as_numpy("text_output")[0, 0].decode())
            if response.parameters["triton_final_response"].bool_param:
                return "".join(chunks), None, len(chunks)
    except Exception as err:  # noqa: BLE001  a stream that can't start: counted by its message
        return None, str(err), len(chunks)
    finally:
        try:
            client.stop_stream()
            client.close()
        except Exception:  # noqa: BLE001
            pass


def pipeline_answer(serve: Serve, prompt: str, max_tokens: int) -> tuple[str | None, str | None, int]:
    """As grpc_answer, through pipeline's resuming client; a resumed answer counts its chunks from both runs."""
    from pipeline.client.ensemble import ClientOptions, RequestOptions, run_request

    chunks: list = []
    try:
        result = run_request(ClientOptions(f"127.0.0.1:{serve.grpc}", resume_s=120.0),
                             prompt, RequestOptions(max_tokens=max_tokens), on_chunk=chunks.append)
    except Exception as err:  # noqa: BLE001  counted by its message
        return None, f"{type(err).__name__}: {err}", len(chunks)
    with RESUMED_LOCK:
        RESUMED[0] += result.resumed
    return result.text, None, len(chunks)


RESUMED, RESUMED_LOCK = [0], threading.Lock()  # answers pipeline's client resumed (--grpc-client pipeline)


def openai_answer(serve: Serve, prompt: str, max_tokens: int) -> tuple[str | None, str | None, int]:
    from openai import OpenAI

    api = OpenAI(base_url=f"http://127.0.0.1:{serve.openai}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks: list[str] = []
    try:
        for chunk in api.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=max_tokens, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
        return "".join(chunks), None, len(chunks)
    except Exception as err:  # noqa: BLE001  counted by its message
        return None, f"{type(err).__name__}: {err}", len(chunks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default="triton_repo")
    ap.add_argument("--streams", type=int, default=16, help="clients: half gRPC, half the OpenAI API")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the clients run, restart included")
    ap.add_argument("--term-after-s", type=float, default=20.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--grpc-client", choices=("tritonclient", "pipeline"), default="tritonclient",
                    help="the gRPC half's client: tritonclient as is, or pipeline's, which resumes a cut-off answer")
    ap.add_argument("--json", dest="json_", action="store_true")
    args = ap.parse_args()

    serve = Serve(args.repo, Path(tempfile.mkdtemp(prefix="rolling-")), args.drain_timeout)
    tally: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    try:
        first_start_s = serve.start()
        want = {}
        for prompt in PROMPTS:
            text, error, _ = grpc_answer(serve, prompt, args.max_tokens)
            if error is not None:
                raise SystemExit(f"the reference for {prompt!r} failed: {error}")
            want[prompt] = text
        end = time.monotonic() + args.seconds

        def client(i: int) -> None:
            ask = (pipeline_answer if args.grpc_client == "pipeline" else grpc_answer) if i % 2 == 0 else openai_answer
            kind = "grpc" if i % 2 == 0 else "openai"
            n = i
            while time.monotonic() < end:
                prompt = PROMPTS[n % len(PROMPTS)]
                while True:  # one request, sent again while it is refused or the server unreachable
                    text, error, chunks = ask(serve, prompt, args.max_tokens)
                    turned = next((label for label, signs in (("refused", REFUSED), ("unreachable", UNREACHABLE))
                                   if error is not None and chunks == 0 and any(s in error for s in signs)), None)
                    if turned is None or time.monotonic() > end + 120:
                        break
                    with lock:
                        tally[f"{kind} {turned}"] += 1
                    time.sleep(1.0)
                with lock:
                    if text is not None and text == want[prompt]:
                        tally[f"{kind} served"] += 1
                    else:
                        tally[f"{kind} lost"] += 1
                        problems.append(f"{kind} {prompt!r}: " + (f"error after {chunks} chunks: {error[:200]}"
                                                                  if error else "a different answer"))
                if error is not None:
                    time.sleep(1.0)
                n += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        time.sleep(args.term_after_s)
        stop_s = serve.terminate()
        drained = [line for line in serve.output().splitlines() if line.startswith(("draining", "drain"))]
        restart_s = serve.start()
        for thread in threads:
            thread.join(args.seconds + args.drain_timeout + 300)
    finally:
        serve.kill()
    lost = sum(v for k, v in tally.items() if k.endswith("lost"))
    row = {"streams": args.streams, "max_tokens": args.max_tokens, "first start s": round(first_start_s, 1),
           "SIGTERM to exit s": round(stop_s, 1), "restart s": round(restart_s, 1), **dict(sorted(tally.items())),
           **({"grpc resumed": RESUMED[0]} if args.grpc_client == "pipeline" else {}), "lost": lost}
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    for line in drained:
        print(f"serve: {line}")
    for problem in problems[:20]:
        print(f"lost: {problem}")
    if args.json_:
        print(json.dumps({**row, "drain": drained, "problems": problems[:20]}))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
