"""The frontend as `pipeline serve` runs it: its own process beside tritonserver, started once the ensemble is
ready, watched, and brought back when it dies (pipeline.triton.supervise), as the python stubs are.

Its own process, not a thread of `serve`: uvicorn's event loop and the tokenizer's work then never hold up
the supervisor, and a crash in it takes only it down.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ServeError
from pipeline.openai_api.protocol import API_KEY_ENV
from pipeline.polling import wait_until
from pipeline.triton.drain import DEFAULT_DRAIN_TIMEOUT_S
from pipeline.triton.server import terminate_with_parent


@dataclass(frozen=True)
class FrontendOptions:
    port: int
    host: str = "127.0.0.1"
    api_key: str | None = None  # None: $PIPELINE_OPENAI_API_KEY, else no key
    model_name: str | None = None  # None: the tokenizer folder's name
    max_body_bytes: int | None = None  # None: the frontend's default, from the repository's max_input_bytes
    # On SIGTERM: how long the requests it holds may take to finish (serve's --drain-timeout: pipeline.triton.drain)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None


def frontend_argv(options: FrontendOptions, repo: Path, grpc_url: str, metrics_url: str | None) -> list[str]:
    """The frontend's command line. Pure. The key is never on it (argv is readable by every user)."""
    argv = [sys.executable, "-m", "pipeline.openai_api", "--repo", str(Path(repo).resolve()), "--grpc-url", grpc_url,
            "--host", options.host, "--port", str(options.port)]
    if metrics_url:
        argv += ["--metrics-url", metrics_url]
    if options.model_name:
        argv += ["--served-model-name", options.model_name]
    if options.max_body_bytes:
        argv += ["--max-body-bytes", str(options.max_body_bytes)]
    if options.drain_timeout_s != DEFAULT_DRAIN_TIMEOUT_S:
        argv += ["--drain-timeout", f"{options.drain_timeout_s:g}"]
    return argv


class FrontendProcess:
    def __init__(self, options: FrontendOptions, repo: Path, grpc_url: str, metrics_url: str | None, log_path: Path):
        self.options, self.log_path = options, log_path
        self.argv = frontend_argv(options, repo, grpc_url, metrics_url)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"http://{host}:{self.options.port}"

    def start(self) -> FrontendProcess:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if key := self.options.key():
            env[API_KEY_ENV] = key
        with open(self.log_path, "ab") as log:
            # Its own session (Ctrl-C reaches serve, which stops it in order), and SIGTERMed if serve dies.
            self.process = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=terminate_with_parent)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until /health answers 200 (the ensemble is ready behind it); a frontend that exits raises."""
        def probe() -> bool | None:
            if self.process.poll() is not None:
                raise ServeError(f"the OpenAI frontend exited with code {self.process.returncode}: "
                                 f"{self._last_line()} (log: {self.log_path})")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return True
            return None

        if wait_until(probe, timeout, 0.2) is None:
            self.stop()
            raise ServeError(f"the OpenAI frontend did not answer on {self.url} in {timeout:g} s "
                             f"(log: {self.log_path})")

    def died(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        return f"the OpenAI frontend exited with code {self.process.returncode} ({self._last_line()})"

    def stop(self, timeout: float = 3.0) -> None:
        """Now (a drain, pipeline.triton.drain, has let it finish its requests first where there was time)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _last_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()[:200]
        return "no output"
