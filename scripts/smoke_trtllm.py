"""Smoke check for NVIDIA's TensorRT-LLM Triton container: build, serve and call a draft-target pair on one GPU.

Run it first in nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 (TensorRT-LLM 1.2.1), through
scripts/smoke_trtllm.sh, which installs this project into the container's Python if needed. Nothing is
downloaded: the models are a seeded tiny Llama pair written here (or --target/--draft local folders).

1. build: `pipeline build --backend trtllm` quantizes both models (none) into TensorRT-LLM checkpoints,
   runs trtllm-build for each and assembles the Triton repository (skipped with --repo).
2. serve: `pipeline serve` in the background until /v2/health/ready answers; always stopped at the end.
3. checks, over gRPC (pipeline.client.ensemble) and the metrics port:
   greedy_off_on_auto          one greedy request with speculation off, auto and on: the same text
   speculation_drafts          off drafts nothing; auto (idle server) and on draft; on has drafts accepted
   concurrent_auto_equals_off  N requests at once with speculation auto: each text equals its prompt's
                               speculation-off text (run one at a time before)
   gate_flips                  pipeline_gate_flips_total rose by >= 2 during that burst (off above the gate's
                               batch threshold, on again as it drained)
   gate_load_requests          pipeline_requests_total{mode="standard",reason="load"} rose: requests the gate
                               decoded without drafts because of the load

Prints one table (check, result, detail) with the build's and serve's key lines, the launch command and the
timings; --json prints the same as JSON. Exit status 0 when every check passes, 1 when one fails.

    scripts/smoke_trtllm.sh                              # the tiny pair, temp workdir, ports 8001/8000/8002
    scripts/smoke_trtllm.sh --target /models/llama-8b --draft /models/llama-1b --keep --json
    python3 scripts/smoke_trtllm.py --repo WORKDIR/triton_repo   # rerun the checks on a built repository
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import one_line

MODES = ("off", "auto", "on")  # auto runs before on: on an idle server with no acceptance history it must speculate
BUILD_SETTINGS = {"--num-draft-tokens": "4", "--max-batch-size": "64", "--gate-batch-size": "8"}
SMOKE_MAX_SEQ_LEN = 1024  # prompts here are a few dozen tokens; short engines build and load faster
# The pipeline CLI of this interpreter, whether or not a `pipeline` script is on PATH.
PIPELINE = [sys.executable, "-c", "from pipeline.cli import main; main(prog_name='pipeline')"]
# The offline switches of huggingface_hub and transformers: a build or serve that would fetch fails instead.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Every prompt ends in its own letter or digit: the tiny pair's answer follows from the prompt's last token.
SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

FLIPS, REQUESTS, IN_FLIGHT = "pipeline_gate_flips_total", "pipeline_requests_total", "pipeline_gate_in_flight"
THRESHOLD, SPECULATING = "pipeline_gate_threshold", "pipeline_gate_speculating"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


class StepFailed(Exception):
    """A subprocess step (build, serve) failed: one line, and the last lines of its output."""

    def __init__(self, step: str, detail: str, tail: list[str]):
        super().__init__(detail)
        self.step, self.detail, self.tail = step, detail, tail


# ---- the tiny pair -------------------------------------------------------------------------------

EMBED_STD = 2.0  # the token's own embedding dominates the residual stream...
LAYER_SCALE = 0.3  # ...over every layer's attention and MLP output (o_proj, down_proj scaled by this)
# The share of tokens whose successor the draft gets right: with K = 4 about 2/3 of the drafts are accepted,
# enough that every request keeps drafting (docs/gate.md), and a step in three or so still has one rejected.
DRAFT_AGREEMENT = 0.85


def make_tiny_pair(workdir: Path, seed: int = 0) -> tuple[Path, Path]:
    """A seeded random Llama target (4 layers, hidden 256) and a 1-layer draft cut from it, same byte tokenizer.

    Plain random weights (make_tiny_llama's, init_std 0.1) make a poor smoke check in bf16: their top two
    logits are often within bf16 noise. Measured on CPU, 31 of 40 64-token greedy answers changed between
    bf16 decoding with and without a KV cache, so TensorRT-LLM's decode and verify kernels could
    legitimately disagree. Here the lm_head maps each token's embedding to its successor in a fixed cycle
    over SYMBOLS, and the embedding outweighs the layers, so at every step the top logit leads the second
    by more than half its value (none of those 40 answers changed). The draft keeps
    layer 0 and gets the successor right for DRAFT_AGREEMENT of the tokens: drafts are accepted and rejected.
    The tokenizer has no chat template, so each prompt's last character picks its answer.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models.tiny import byte_tokenizer, make_tiny_llama

    target_dir, draft_dir = workdir / "tiny-target", workdir / "tiny-draft"
    scratch = workdir / "base"
    try:
        make_tiny_llama(scratch, seed, layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512)
        model = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    symbols = tokenizer.convert_tokens_to_ids(list(SYMBOLS))  # byte-level: these characters are their own tokens
    g = torch.Generator().manual_seed(seed)
    cycle = [symbols[i] for i in torch.randperm(len(symbols), generator=g).tolist()]
    successor = dict(zip(cycle, cycle[1:] + cycle[:1]))
    draft_successor = {token: cycle[(i + 7) % len(cycle)] if torch.rand((), generator=g).item() > DRAFT_AGREEMENT
                       else successor[token] for i, token in enumerate(cycle)}  # a wrong one is still a symbol
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        embed.mul_(EMBED_STD / embed.std())
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)
        model.lm_head.weight.copy_(_successor_head(embed, successor))
        _save(model, tokenizer, target_dir)
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        model.lm_head.weight.copy_(_successor_head(embed, draft_successor))
        _save(model, tokenizer, draft_dir)
    return target_dir, draft_dir


def _successor_head(embed, successor: dict[int, int]):
    """lm_head rows: row successor[t] is t's unit embedding; the others stay zero, so the specials (EOS
    included) are never generated and every answer runs to max_tokens."""
    import torch

    head = torch.zeros_like(embed)  # [vocab, hidden]
    for token, following in successor.items():
        head[following] = embed[token] / embed[token].norm()
    return head * 4.0  # top logit ~ 4 * sqrt(hidden) = 64: far from bf16's resolution


def _save(model, tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prompts_for(n: int) -> list[str]:
    return [f"Request {i}: write one line about the symbol {SYMBOLS[i % len(SYMBOLS)]}" for i in range(n)]


# ---- build and serve (subprocesses) --------------------------------------------------------------


def max_seq_len_for(target: Path) -> int:
    """SMOKE_MAX_SEQ_LEN, or the target's own limit where that is lower (trtllm-build refuses more)."""
    config = Path(target) / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    return min(SMOKE_MAX_SEQ_LEN, limit or SMOKE_MAX_SEQ_LEN)


def build_args(target: Path, draft: Path, workdir: Path, max_seq_len: int) -> list[str]:
    args = ["build", "--backend", "trtllm", "--target", str(target), "--draft", str(draft),
            "--target-qformat", "none", "--draft-qformat", "none"]
    for flag, value in BUILD_SETTINGS.items():
        args += [flag, value]
    return args + ["--max-seq-len", str(max_seq_len), "--engines-dir", str(workdir / "engines"),
                   "--repo", str(workdir / "triton_repo"), "--force"]


def serve_args(repo: Path, ports: dict[str, int], ready_timeout: float, log_file: Path) -> list[str]:
    return ["serve", "--repo", str(repo), "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
            "--metrics-port", str(ports["metrics"]), "--timeout", f"{ready_timeout:g}", "--log-file", str(log_file)]


def shown(args: list[str]) -> str:
    return shlex.join(["pipeline", *args])


def _env() -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV}


def tail(log: Path, n: int = 15) -> list[str]:
    if not log.is_file():
        return []
    return [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-n:]


def _error_line(lines: list[str]) -> str:
    """click's `Error: ...` line where there is one."""
    return next((line for line in reversed(lines) if line.startswith("Error:")), "")


def run_build(args: list[str], log: Path, cwd: Path) -> list[str]:
    """`pipeline build` to the end, its output in `log`; returns its summary (the lines from `built ...` on)."""
    with open(log, "wb") as out:
        code = subprocess.run([*PIPELINE, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              cwd=cwd, env=_env()).returncode
    lines = tail(log, 10_000)
    if code != 0:
        error = _error_line(lines)
        raise StepFailed("build", f"pipeline build exited with code {code}" + (f": {error}" if error else ""),
                         lines[-15:])
    start = max((i for i, line in enumerate(lines) if line.startswith("built ")), default=max(len(lines) - 8, 0))
    return lines[start:]


class Serve:
    """`pipeline serve` in the background, its output in a log. stop() always ends it: SIGTERM (serve then
    stops tritonserver and reaps its stubs), SIGKILL for what is left after `grace` seconds."""

    def __init__(self, args: list[str], log: Path, cwd: Path):
        self.args, self.log, self.cwd = args, log, cwd
        self.process: subprocess.Popen | None = None

    def start(self) -> Serve:
        with open(self.log, "wb") as out:
            # Its own session: a Ctrl-C here reaches only this script, whose finally stops the server once.
            self.process = subprocess.Popen([*PIPELINE, *self.args], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.cwd, env=_env(),
                                            start_new_session=True)
        return self

    def wait_ready(self, http_url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                lines = tail(self.log)
                error = _error_line(lines)
                raise StepFailed("serve", f"pipeline serve exited with code {code}" + (f": {error}" if error else ""),
                                 lines)
            try:
                with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise StepFailed("serve", f"not ready after {timeout:g} s ({http_url}/v2/health/ready); raise "
                                          "--ready-timeout if the engines are still loading", tail(self.log))
            time.sleep(1.0)

    def key_lines(self) -> list[str]:
        """The launch command and the endpoints, as serve printed them."""
        keep = ("launch:", "Serving ", "gRPC", "HTTP", "metrics", "log ")
        return [line.strip() for line in tail(self.log, 10_000) if line.strip().startswith(keep)]

    def stop(self, grace: float = 60.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


# ---- checks --------------------------------------------------------------------------------------


def compare_texts(name: str, labels: list[str], expected: list[str], got: list) -> Check:
    """Each got[i] (a text, or the exception its request raised) must equal expected[i]."""
    bad = [(label, e, g) for label, e, g in zip(labels, expected, got, strict=True)
           if isinstance(g, BaseException) or g != e]
    if not bad:
        return Check(name, True, f"{len(labels)}/{len(labels)} identical")
    label, e, g = bad[0]
    if isinstance(g, BaseException):
        why = f"failed: {one_line(g)}"
    else:
        at = next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), min(len(e), len(g)))
        why = f"differs at char {at}: expected {e[at:at + 24]!r}, got {g[at:at + 24]!r}"
    return Check(name, False, f"{len(bad)}/{len(labels)} differ; first {label!r} {why}")


def speculation_check(results: dict) -> Check:
    """results: mode -> a client Result (drafted, accepted) for one greedy request."""
    off, auto, on = (results[m] for m in MODES)
    problems = []
    if off.drafted:
        problems.append(f"off drafted {off.drafted} tokens")
    if not auto.drafted:
        problems.append("auto drafted nothing on an idle server (max_tokens below the gate's min tokens?)")
    if not on.drafted:
        problems.append("on drafted nothing")
    elif not on.accepted:
        problems.append(f"on had none of its {on.drafted} drafts accepted")
    counts = f"accepted/drafted: on {on.accepted}/{on.drafted}, auto {auto.accepted}/{auto.drafted}, off 0/{off.drafted}"
    return Check("speculation_drafts", not problems, "; ".join(problems + [counts]))


def gate_checks(before: dict, after: dict, peak_in_flight: float) -> list[Check]:
    """The gate's metrics around the burst: it switched off under the load and on again, and turned requests away."""
    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    if not any(name == FLIPS for name, _ in after):
        missing = f"no {FLIPS} on the metrics port (is this a `pipeline assemble` repository?)"
        return [Check("gate_flips", False, missing), Check("gate_load_requests", False, missing)]
    flips, threshold, speculating = delta(FLIPS), metric(after, THRESHOLD), metric(after, SPECULATING)
    flips_ok = flips >= 2 and speculating == 1
    flips_detail = (f"{flips:g} flips (threshold {threshold:g} in flight, peak seen {peak_in_flight:g}, "
                    f"in flight after {metric(after, IN_FLIGHT):g}); speculating after: {speculating:g}")
    if threshold == 0:
        flips_detail += "; the gate's threshold is 0: speculation is off for good"
    load = delta(REQUESTS, mode="standard", reason="load")
    return [Check("gate_flips", flips_ok, flips_detail),
            Check("gate_load_requests", load > 0,
                  f"{load:g} auto requests decoded without drafts because of the load "
                  f"({delta(REQUESTS, mode='speculative'):g} speculated)")]


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(name, sorted label pairs): value}; comments and timestamps dropped."""
    import re

    sample = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
    label = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out = {}
    for line in text.splitlines():
        m = sample.match(line.strip())
        if not m or line.lstrip().startswith("#"):
            continue
        labels = tuple(sorted((k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
                              for k, v in label.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples carrying these labels (0 when none: a labelled counter appears on first use)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def scrape(metrics_url: str) -> dict:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return parse_metrics(response.read().decode("utf-8", "replace"))


def settled_metrics(metrics_url: str, timeout: float = 10.0) -> dict:
    """The gate publishes every 0.1 s: scrape until two scrapes 0.3 s apart agree on our families."""
    def ours(samples):
        return {k: v for k, v in samples.items() if k[0].startswith("pipeline_")}

    deadline = time.monotonic() + timeout
    last = scrape(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = scrape(metrics_url)
        if ours(now) == ours(last) and metric(now, IN_FLIGHT) == 0:
            return now
        last = now
    return last


def burst(client, prompts: list[str], options, concurrency: int, metrics_url: str) -> tuple[list, float]:
    """Every prompt, `concurrency` at a time, each worker on its own connection. The connections open first
    and the workers start together, so the gate sees them in flight at once; meanwhile the metrics port is
    sampled for the peak of pipeline_gate_in_flight. Returns (text or exception per prompt, peak)."""
    from pipeline.client.ensemble import Connection

    workers = max(1, min(concurrency, len(prompts)))
    connections = [Connection(client) for _ in range(workers)]
    results: list = [None] * len(prompts)
    pending = list(range(len(prompts)))
    lock = threading.Lock()
    start = threading.Barrier(workers + 1, timeout=120)

    def work(conn):
        try:
            start.wait()
        except threading.BrokenBarrierError:
            return
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            try:
                results[i] = conn.generate(prompts[i], options).text
            except Exception as err:  # noqa: BLE001  reported per prompt by compare_texts
                results[i] = err

    peak = 0.0
    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in connections]
    try:
        for conn in connections:
            conn.check_ready()  # opens each channel now rather than inside the burst
        for t in threads:
            t.start()
        start.wait()
        while any(t.is_alive() for t in threads):
            try:
                peak = max(peak, metric(scrape(metrics_url), IN_FLIGHT))
            except OSError:
                pass
            time.sleep(0.05)
    finally:
        start.abort()  # releases the workers if a connection failed before the start
        for t in threads:
            if t.ident is not None:
                t.join()
        for conn in connections:
            conn.close()
    return [r if r is not None else RuntimeError("not run") for r in results], peak


def check_server(grpc_url: str, metrics_url: str, prompts: list[str], max_tokens: int,
                 concurrency: int | None = None, *, timeout_s: float = 600.0) -> list[Check]:
    """The checks against a served repository (see the module docstring). A request that fails ends the run
    with the check it belonged to marked failed."""
    from pipeline.client.ensemble import ClientOptions, Connection, RequestOptions
    from pipeline.errors import PipelineError

    client = ClientOptions(grpc_url, response_timeout_s=timeout_s, wait_s=30.0)
    checks: list[Check] = []
    step = "greedy_off_on_auto"
    try:
        with Connection(client) as conn:
            conn.check_ready()
            single = {mode: conn.generate(prompts[0], RequestOptions(max_tokens=max_tokens, speculation=mode,
                                                                     stream=False)) for mode in MODES}
            checks.append(compare_texts(step, ["auto", "on"], [single["off"].text] * 2,
                                        [single["auto"].text, single["on"].text]))
            checks.append(speculation_check(single))
            step = "concurrent_auto_equals_off"
            # One at a time: never more than one in flight, so the gate stays on until the burst.
            expected = [conn.generate(p, RequestOptions(max_tokens=max_tokens, speculation="off")).text
                        for p in prompts]
        step = "gate_flips"
        before = settled_metrics(metrics_url)
        step = "concurrent_auto_equals_off"
        got, peak = burst(client, prompts, RequestOptions(max_tokens=max_tokens, speculation="auto"),
                          concurrency or len(prompts), metrics_url)
        step = "gate_flips"
        after = settled_metrics(metrics_url)
    except (PipelineError, OSError) as err:
        return checks + [Check(step, False, one_line(err))]
    checks.append(compare_texts("concurrent_auto_equals_off", prompts, expected, got))
    return checks + gate_checks(before, after, peak)


# ---- report --------------------------------------------------------------------------------------


def failed(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if not c.ok]


def exit_status(checks: list[Check]) -> int:
    return 1 if failed(checks) or not checks else 0


def render_report(checks: list[Check], info: dict) -> str:
    bad = failed(checks)
    verdict = f"FAILED: {', '.join(bad)}" if bad else f"passed ({len(checks)} checks)"
    rows = [("check", "result", "detail")] + [(c.name, "ok" if c.ok else "FAIL", c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"TensorRT-LLM smoke check {verdict}", ""]
    for i, (name, result, detail) in enumerate(rows):
        lines.append(f"{name:<{widths[0]}}  {result:<{widths[1]}}  {detail}".rstrip())
        if i == 0:
            lines.append(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 6}")
    for step in ("build", "serve"):
        part = info.get(step)
        if not part:
            continue
        lines += ["", f"{step}: {part['command']}"]
        lines += [f"  {line}" for line in part.get("lines", [])]
        if part.get("tail"):
            lines += [f"  last lines of {part['log']}:"] + [f"    {line}" for line in part["tail"]]
        if part.get("server_tail"):
            lines += ["  last lines of tritonserver's log:"] + [f"    {line}" for line in part["server_tail"]]
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in info.get("timings", {}).items())
    models = f"{info['target']} + {info['draft']}" if info.get("draft") else info.get("target", "?")
    lines += ["", f"models   {models}", f"timings  {timings}", f"workdir  {info.get('workdir', '?')}"]
    return "\n".join(lines)


def report_json(checks: list[Check], info: dict) -> dict:
    timings = {k: round(v, 2) for k, v in info.get("timings", {}).items()}
    return {"ok": exit_status(checks) == 0, "failed": failed(checks), "checks": [asdict(c) for c in checks],
            **info, "timings": timings}


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="smoke_trtllm.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--workdir", type=Path, default=None,
                    help="Where models, engines, the repository and logs go [default: a temp dir, removed after a "
                         "passing run unless --keep; a given --workdir is never removed].")
    ap.add_argument("--target", type=Path, default=None, help="A local Hugging Face folder to build as the target.")
    ap.add_argument("--draft", type=Path, default=None, help="A local Hugging Face folder to build as its draft.")
    ap.add_argument("--repo", type=Path, default=None,
                    help="Serve this already built repository instead of building (skips the build).")
    ap.add_argument("--keep", action="store_true", help="Keep the temp workdir after a passing run.")
    ap.add_argument("--json", dest="json_", action="store_true", help="Print the report as JSON.")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="Tokens per request [default: 64; under the gate's min tokens (50 in a build) auto "
                         "never speculates].")
    ap.add_argument("--requests", type=int, default=40, help="Requests in the concurrent burst [default: 40].")
    ap.add_argument("--ready-timeout", type=float, default=900.0,
                    help="Seconds to wait for the server to load the engines [default: 900].")
    args = ap.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        ap.error("pass --target and --draft together (or neither, for the tiny pair)")
    if args.repo is not None and args.target is not None:
        ap.error("--repo serves a built repository; it takes no --target/--draft")
    if args.max_tokens < 1 or args.requests < 1:
        ap.error("--max-tokens and --requests must be >= 1")
    return args


def run(args: argparse.Namespace, workdir: Path, info: dict) -> list[Check]:
    """Build (unless --repo), serve, check; every step's outcome is a Check, and the server always stops."""
    timings = info["timings"]
    checks: list[Check] = []
    server = None
    step = "models"
    try:
        repo = args.repo
        if repo is None:
            t0 = time.monotonic()
            if args.target is None:
                say("writing the tiny target/draft pair")
                target, draft = make_tiny_pair(workdir / "models")
                timings["models"] = time.monotonic() - t0
            else:
                target, draft = args.target.resolve(), args.draft.resolve()
            info.update(target=str(target), draft=str(draft))
            step = "build"
            build = build_args(target, draft, workdir, max_seq_len_for(target))
            log = workdir / "build.log"
            info["build"] = {"command": shown(build), "log": str(log)}
            say(f"building: {shown(build)} (log: {log})")
            t0 = time.monotonic()
            info["build"]["lines"] = run_build(build, log, workdir)
            timings["build"] = time.monotonic() - t0
            checks.append(Check("build", True, f"engines and repository in {timings['build']:.1f} s"))
            repo = workdir / "triton_repo"
        else:
            info.update(target=f"those of the repository {repo}", draft="")
        step = "serve"
        ports = {"grpc": args.grpc_port, "http": args.http_port, "metrics": args.metrics_port}
        log = workdir / "serve.log"
        serve = serve_args(Path(repo).resolve(), ports, args.ready_timeout, workdir / "tritonserver.log")
        info["serve"] = {"command": shown(serve), "log": str(log)}
        say(f"serving: {shown(serve)} (log: {log})")
        t0 = time.monotonic()
        server = Serve(serve, log, workdir).start()
        server.wait_ready(f"http://127.0.0.1:{ports['http']}", args.ready_timeout)
        timings["ready"] = time.monotonic() - t0
        info["serve"]["lines"] = server.key_lines()
        checks.append(Check("serve", True, f"ready in {timings['ready']:.1f} s"))
        step = "checks"
        say(f"checking: {args.requests} prompts, {args.max_tokens} tokens each")
        t0 = time.monotonic()
        checks += check_server(f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['metrics']}/metrics",
                               prompts_for(args.requests), args.max_tokens, args.requests)
        timings["checks"] = time.monotonic() - t0
        if failed(checks):  # a restart by serve's supervisor, or the server's own error, is in these logs
            info["serve"]["tail"] = tail(log)
            info["serve"]["server_tail"] = tail(workdir / "tritonserver.log")
    except StepFailed as err:
        info[err.step]["tail"] = err.tail
        checks.append(Check(err.step, False, err.detail))
    except KeyboardInterrupt:
        checks.append(Check(step, False, "interrupted"))
    finally:
        if server is not None:
            if "serve" in info and "lines" not in info["serve"]:
                info["serve"]["lines"] = server.key_lines()
            t0 = time.monotonic()
            server.stop()
            timings["stop"] = time.monotonic() - t0
    return checks


def say(message: str) -> None:
    print(f"smoke: {message}", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    temp = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="smoke-trtllm-")) if temp else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    info: dict = {"workdir": str(workdir), "timings": {}}
    t0 = time.monotonic()
    checks = run(args, workdir, info)
    info["timings"]["total"] = time.monotonic() - t0
    status = exit_status(checks)
    if temp and status == 0 and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        info["workdir"] += " (removed; --keep keeps it)"
    print(json.dumps(report_json(checks, info), indent=2) if args.json_ else render_report(checks, info))
    return status


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)  # `docker stop` takes Ctrl-C's path, so the server is stopped
    sys.exit(main())
