"""Soak the OpenAI frontend with clients that leave: does the server survive streams left mid-answer? (issue 55)

Serves a tiny seeded n-gram engine (8 slots, its queue 64) with the OpenAI frontend in front, as `pipeline serve
--openai-port` does, and runs --clients openai-SDK clients back to back for --minutes: each request a streamed
completion of --max-tokens tokens (end tokens ignored), half of them left by their client after 1-3 chunks (a chat
UI's "stop" button). tritonserver 2.51, the bundled one, dies of SIGSEGV about once in 500 gRPC streams cancelled as
their last response goes out; our clients stop a request through the engine instead (the stop_request model) and
read its stream to its end, so a left stream is never a cancel. Prints one table (and --json): answers read,
streams left, failures, how the frontend's gRPC streams ended (read, stopped, cancelled), and whether tritonserver
lived; exit status 1 if it died or a request failed.

    python scripts/frontend_soak.py --clients 32 --minutes 30 --json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the served tests' engine folder and server: the same stack as theirs

from serving_checks import ngram_engine, served_engine  # noqa: E402

from pipeline.models.tiny import make_tiny_llama  # noqa: E402
from pipeline.openai_api.process import FrontendOptions, FrontendProcess  # noqa: E402
from pipeline.triton.ports import free_ports  # noqa: E402


def stream_ends(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {end: int(float(v)) for end, v in
            re.findall(r'^pipeline_frontend_grpc_streams_total\{end="(\w+)"\} (\S+)$', text, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--leave-share", type=float, default=0.5, help="the share of streams left after 1-3 chunks")
    ap.add_argument("--json", dest="json_", action="store_true")
    args = ap.parse_args()

    from openai import OpenAI

    tmp = Path(tempfile.mkdtemp(prefix="frontend-soak-"))
    engine = ngram_engine(make_tiny_llama(tmp / "target", seed=0, layers=3), tmp / "engines", slots=8,
                          max_seq_len=256)
    counts = {"answers": 0, "left": 0, "failed": 0}
    failures: list[str] = []
    lock = threading.Lock()
    with served_engine(engine, tmp / "served", max_queue_size=64) as server:
        [port] = free_ports(1)
        frontend = FrontendProcess(FrontendOptions(port=port, model_name="tiny"), server.options.repo,
                                   f"127.0.0.1:{server.options.grpc_port}", server.endpoints.metrics,
                                   tmp / "openai.log")
        frontend.start().wait_ready()
        start = time.monotonic()
        stop_at = start + args.minutes * 60

        def client(i: int) -> None:
            rng = random.Random(i)
            api = OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=60)
            while time.monotonic() < stop_at:
                try:
                    stream = api.completions.create(model="tiny", prompt=f"Count {i}", max_tokens=args.max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
                    if rng.random() < args.leave_share:
                        chunks = iter(stream)
                        for _ in range(rng.randint(1, 3)):
                            next(chunks)
                        stream.close()
                        key = "left"
                    else:
                        for _ in stream:
                            pass
                        key = "answers"
                except Exception as err:  # noqa: BLE001  counted, the first few kept
                    key = "failed"
                    with lock:
                        failures.append(f"{type(err).__name__}: {str(err)[:200]}")
                    time.sleep(1.0)
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        loaded_s = time.monotonic() - start
        time.sleep(3)  # the last stops read to their ends
        alive = server.process.poll() is None
        ends = stream_ends(frontend.url)
        frontend.stop()
    row = {"clients": args.clients, "minutes": round(loaded_s / 60, 1), **counts,
           **{f"streams {end}": n for end, n in sorted(ends.items())}, "tritonserver": "alive" if alive else "DIED"}
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    for failure in failures[:10]:
        print(f"failed: {failure}")
    if args.json_:
        print(json.dumps({**row, "failures": failures[:10]}))
    return 0 if alive and not counts["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
