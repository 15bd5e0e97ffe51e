"""The OpenAI endpoint under load from NVIDIA's AIPerf, against llama.cpp's own OpenAI server, in one run.

For each server in turn (the other one stopped, so they never share the cores), AIPerf (`aiperf profile`, chat
endpoint, streaming) runs a closed loop at each concurrency C: N requests (default max(8, 2C)), C in flight.
The prompts are bench_cpu's eight code completions (answers that copy from the prompt, where n-gram drafts pay),
greedy, at most --max-tokens new tokens each. Servers:

- pipeline: `pipeline serve --openai-port` on a repository (default: the embedded SmolLM2 build, n-gram drafts,
  the gate on), so the figures go through the frontend, tritonserver and the ensemble;
- llamacpp: `python -m llama_cpp.server` (llama-cpp-python's server, the optional extra `.[llamacpp]`) on the
  embedded Q4_1 GGUF, 1 thread (its best beside AIPerf on 2 cores), one sequence at a time (requests queue:
  its default of interrupting the running one is turned off).

Reported per server and level, from AIPerf's own export: output tokens/s, requests/s, time to first token,
inter-token latency and request latency (p50), and, for the pipeline, AIPerf's reading of the responses'
`metrics.speculative_decoding` (mean acceptance length, draft acceptance rate); then pipeline / llamacpp output
tokens/s per level. AIPerf runs on the same 2 cores as the server, at nice 19, for both servers alike.

AIPerf pins its own packages: install it in a venv of its own and pass its binary.

    python3 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf
    python scripts/bench_openai.py --aiperf /tmp/aiperf/bin/aiperf                 # C = 1 8 32, 128 tokens
    python scripts/bench_openai.py --aiperf /tmp/aiperf/bin/aiperf --concurrency 1 --servers pipeline --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_cpu import PROMPTS  # noqa: E402  (scripts/ is on sys.path when this runs as a script)
from pipeline.triton.ports import free_ports

MODEL_NAME = "smollm2-135m"  # what both servers are asked to call the model
INSTRUCTION = "Complete this Python function. Reply with the code only.\n\n"
SERVERS = ("pipeline", "llamacpp")


def start_server(name: str, args, port: int, log) -> subprocess.Popen:
    if name == "pipeline":
        argv = ["pipeline", "serve", "--repo", args.repo, "--openai-port", str(port), "--served-model-name", MODEL_NAME]
        ports = free_ports(3)
        argv += ["--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--metrics-port", str(ports[2])]
    else:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", args.gguf, "--host", "127.0.0.1", "--port",
                str(port), "--n_ctx", "2048", "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--model_alias", MODEL_NAME,
                # Its default lets each new request cut off the one streaming: queue them instead, as a server must.
                "--interrupt_requests", "False"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until one real chat request is answered (a /health that says ok isn't a warm server)."""
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}) before it was ready; see its log")
        try:
            request = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_aiperf(args, server: str, url: str, concurrency: int, prompts: Path, out: Path) -> dict:
    requests = args.requests or max(8, 2 * concurrency)
    # At nice 19: AIPerf's timing manager spins a core while it waits, and a server's threads that meet a busy
    # core (llama.cpp's spin-waiting ones most) slow down many times over; niced, it yields to the server.
    argv = ["nice", "-n", "19", args.aiperf, "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(args.tokenizer), "--input-file", str(prompts), "--custom-dataset-type", "single_turn",
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--prompt-output-tokens-mean", str(args.max_tokens), "--extra-inputs", "temperature:0",
            # llama-cpp-python's server reads max_tokens, not max_completion_tokens (it would run to n_ctx)
            "--use-legacy-max-tokens", "--random-seed", "0", "--output-artifact-dir", str(out), "--ui-type", "none"]
    if server == "pipeline":
        # Its usage chunk carries metrics.speculative_decoding. llama-cpp-python sends no usage when streaming,
        # so AIPerf counts its tokens with the same tokenizer instead.
        argv.append("--use-server-token-count")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"aiperf at concurrency {concurrency} failed ({done.returncode}): {tail}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def row(server: str, concurrency: int, export: dict) -> dict:
    def stat(key: str, field: str = "avg"):
        value = export.get(key, {}).get(field)
        return None if value is None else round(value, 4)

    return {"server": server, "concurrency": concurrency, "requests": stat("request_count"),
            "errors_pct": stat("request_error_rate"), "output_tok_s": stat("output_token_throughput"),
            "requests_s": stat("request_throughput"), "ttft_ms_p50": stat("time_to_first_token", "p50"),
            "itl_ms_p50": stat("inter_token_latency", "p50"), "latency_ms_p50": stat("request_latency", "p50"),
            "output_tokens_mean": stat("output_sequence_length"),
            "acceptance_length": stat("spec_decode_token_weighted_acceptance_length"),
            "draft_acceptance_pct": stat("spec_decode_overall_draft_acceptance_rate")}


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["server"], r["concurrency"]): r for r in rows}
    out = []
    for (server, c), r in sorted(by.items()):
        base = by.get(("llamacpp", c))
        if server == "pipeline" and base and base["output_tok_s"] and r["output_tok_s"]:
            out.append({"concurrency": c, "pipeline_over_llamacpp": round(r["output_tok_s"] / base["output_tok_s"], 2)})
    return out


def print_table(rows: list[dict], versus: list[dict], meta: dict) -> None:
    print(f"AIPerf {meta['aiperf']} | chat, streaming, greedy, {meta['max_tokens']} tokens max | {meta['cpus']} CPUs, "
          f"load {meta['load']:.1f} at start")
    head = ("server", "C", "req", "err %", "out tok/s", "req/s", "TTFT p50 ms", "ITL p50 ms", "latency p50 ms",
            "out tokens", "accept len", "draft accept %")
    keys = ("server", "concurrency", "requests", "errors_pct", "output_tok_s", "requests_s", "ttft_ms_p50",
            "itl_ms_p50", "latency_ms_p50", "output_tokens_mean", "acceptance_length", "draft_acceptance_pct")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r[k] for k in keys]
        print("| " + " | ".join("n/a" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
                                for v in cells) + " |")
    for v in versus:
        print(f"C={v['concurrency']}: pipeline / llama.cpp output tokens/s = {v['pipeline_over_llamacpp']}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf binary [default: on PATH]")
    ap.add_argument("--repo", default="triton_repo", help="a `pipeline build` repository [default: triton_repo]")
    ap.add_argument("--gguf", help="llama.cpp's model [default: the embedded SmolLM2 Q4_1 GGUF]")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: " + ", ".join(SERVERS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, help="requests per level [default: max(8, 2C)]")
    ap.add_argument("--max-tokens", type=int, default=128)
    # 1: with AIPerf busy on the other core, llama.cpp's 2 spin-waiting threads (prefill's too) fell to 2-14 tok/s
    # and 5 s to a first token here; 1 thread decodes at its ~70 tok/s.
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads, decode and prefill [default: 1]")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.aiperf or not Path(args.aiperf).exists():
        raise SystemExit("no aiperf: python3 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf, then pass "
                         "--aiperf /tmp/aiperf/bin/aiperf")
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        raise SystemExit(f"unknown --servers {sorted(unknown)}; pick from {', '.join(SERVERS)}")
    if "llamacpp" in servers:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
            raise SystemExit("llama.cpp's server isn't installed: pip install '.[llamacpp]' (it builds from source), "
                             "or pass --servers pipeline")
    if args.gguf is None:
        from pipeline.models.resolve import embedded_gguf

        args.gguf = str(embedded_gguf())
    from pipeline.openai_api.__main__ import settings_from_repo

    args.tokenizer = settings_from_repo(Path(args.repo), "unused:0", None, None).tokenizer_dir
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    meta = {"aiperf": version, "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "load": os.getloadavg()[0]}

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": INSTRUCTION + p}) + "\n" for p in PROMPTS))
        for server in servers:
            [port] = free_ports(1)
            url = f"http://127.0.0.1:{port}"
            with open(Path(tmp) / f"{server}.log", "w") as log:
                process = start_server(server, args, port, log)
                try:
                    wait_ready(url, process)
                    for c in args.concurrency:
                        export = run_aiperf(args, server, url, c, prompts, Path(tmp) / f"{server}-{c}")
                        rows.append(row(server, c, export))
                        print(f"{server} C={c}: {rows[-1]['output_tok_s']} output tok/s", file=sys.stderr)
                finally:
                    stop_server(process)
    versus = ratios(rows)
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows, "ratios": versus}, indent=2))
    else:
        print_table(rows, versus, meta)


if __name__ == "__main__":
    main()
