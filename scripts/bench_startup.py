"""How long `pipeline serve --openai-port` takes to be ready, and what each of its processes holds then.

Starts the server --runs times on the repository as assembled (its tokenizing models load the tokenizer class
assemble recorded, `RepoSpec.tokenizer_class`) and as many times on a copy with that record removed (AutoTokenizer
in every process, which imports torch: the baseline, in the same run). Prints one table: seconds to tritonserver's
readiness and to the OpenAI API's, median over the runs, and each process's RSS once ready, in MiB.

    python scripts/bench_startup.py --repo triton_repo            # pipeline build's default repository
    python scripts/bench_startup.py --repo REPO --runs 5 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_serving import fmt, print_markdown  # noqa: E402  (scripts/ is on sys.path when this runs)
from pipeline.triton.ports import free_ports  # noqa: E402

TOKENIZING = ("preprocessing", "postprocessing", "torch_engine")
READY_WITHIN_S = 300.0


def without_record(repo: Path, into: Path) -> Path:
    """A copy of the repository whose models don't name the tokenizer class: they load it with AutoTokenizer."""
    from pipeline.triton.config import read_config, write_config

    copy = Path(shutil.copytree(repo, into / repo.name, symlinks=True))
    for name in TOKENIZING:
        if (copy / name / "config.pbtxt").is_file():
            config = read_config(copy / name)
            if "tokenizer_class" in config.parameters:
                del config.parameters["tokenizer_class"]
            write_config(copy / name, config)
    return copy


def wait(url: str, since: float) -> float:
    while time.monotonic() - since < READY_WITHIN_S:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return time.monotonic() - since
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"bench_startup.py: {url} did not answer within {READY_WITHIN_S:g} s")


def processes(root: int) -> dict[str, float]:
    """RSS in MiB of serve (root) and everything under it, by name: tritonserver, each python model, the frontend."""
    rows = [line.split(None, 3) for line in subprocess.run(["ps", "-eo", "pid,ppid,rss,args"], capture_output=True,
                                                           text=True).stdout.splitlines()[1:]]
    children: dict[int, list[int]] = {}
    for pid, ppid, _, _ in rows:
        children.setdefault(int(ppid), []).append(int(pid))
    info = {int(pid): (int(rss), args) for pid, _, rss, args in rows}
    out: dict[str, float] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        if pid not in info:
            continue
        rss, args = info[pid]
        if "triton_python_backend_stub" in args:
            name = Path(args.split()[1]).parts[-3]
        elif "bin/tritonserver" in args:
            name = "tritonserver"
        elif "pipeline.openai_api" in args:
            name = "OpenAI frontend"
        elif pid == root:
            name = "pipeline serve"
        else:
            continue
        while name in out:  # a second instance (preprocessing runs two)
            name += "'"
        out[name] = round(rss / 1024, 1)
    return out


def start_once(repo: Path) -> tuple[float, float, dict[str, float]]:
    grpc, http, metrics, openai = free_ports(4)
    t0 = time.monotonic()
    serve = subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--repo",
                              str(repo), "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port",
                              str(metrics), "--openai-port", str(openai)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        triton = wait(f"http://127.0.0.1:{http}/v2/health/ready", t0)
        frontend = wait(f"http://127.0.0.1:{openai}/health", t0)
        time.sleep(1.0)  # the stubs settle
        return triton, frontend, processes(serve.pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=Path("triton_repo"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", dest="json_", action="store_true")
    args = ap.parse_args(argv)
    if not (args.repo / "preprocessing" / "config.pbtxt").is_file():
        raise SystemExit(f"bench_startup.py: {args.repo} is no repository with a preprocessing model; run "
                         f"`pipeline build` (or pass --repo)")
    with tempfile.TemporaryDirectory() as scratch:
        repos = {"recorded class": args.repo, "AutoTokenizer (baseline)": without_record(args.repo, Path(scratch))}
        results = {}
        for name, repo in repos.items():
            runs = [start_once(repo) for _ in range(args.runs)]
            results[name] = {"triton_ready_s": statistics.median(r[0] for r in runs),
                             "openai_ready_s": statistics.median(r[1] for r in runs), "rss_mib": runs[-1][2]}
    names = sorted({p for r in results.values() for p in r["rss_mib"]})
    base = results["AutoTokenizer (baseline)"]
    rows = [(label, *(fmt(r[key], ".2f") for key in ("triton_ready_s", "openai_ready_s")),
             fmt(sum(r["rss_mib"].values()), ".0f"), *(fmt(r["rss_mib"].get(p), ".0f") for p in names))
            for label, r in results.items()]
    rows.append(("recorded / baseline", *(f"{results['recorded class'][k] / base[k]:.2f}x"
                                          for k in ("triton_ready_s", "openai_ready_s")),
                 f"{sum(results['recorded class']['rss_mib'].values()) / sum(base['rss_mib'].values()):.2f}x",
                 *("" for _ in names)))
    print_markdown(("tokenizer", "triton ready s", "OpenAI ready s", "RSS MiB, all", *names), rows)
    print(f"\n{args.repo}: median of {args.runs} starts each; RSS once ready, of the last start.")
    if args.json_:
        print(json.dumps({"repo": str(args.repo), "runs": args.runs, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
