"""`pipeline serve`'s run of a tritonserver (`serve`: start, wait until ready, watch, stop) and its watch over it:
a dead server, or a dead python backend stub, brings the whole server back.

Each python model instance runs in its own stub process. When one dies (OOM killer, a segfault in a
native library, kill -9), tritonserver 2.51 doesn't notice: readiness stays 200, the dead instance's
in-flight requests hang, and every new one fails with "Stub process is not healthy". The server is
restarted instead: killing it ends every client's stream with an error at once, and the repository is
ready again after a normal start. Restarts are rationed, so a model that dies at every start ends
`pipeline serve` with its reason rather than looping.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.errors import ServeError
from pipeline.triton.backtrace import crash_site, named_frames
from pipeline.triton.server import (STUB_NAME, ServeOptions, ServerBinary, TritonServer, failure_from_log,
                                    group_members)

POLL_S = 0.5
# tritonserver 2.51's gRPC frontend (the bundled CPU server's) can free a stream's state when a client cancels while
# the request's last response is on its way, and the response-complete callback then locks a freed mutex: SIGSEGV in
# the frontend, reached from a python model's send. Fixed upstream in 2.53 (triton-inference-server/server #7880)
# and 2.57 (#8078); nvidia-pytriton 0.7.0, the newest, still bundles 2.51. Seen about once in 500 cancelled streams.
CANCEL_RACE = "tritonserver 2.51's gRPC cancellation race (fixed in 2.53 and 2.57; NVIDIA's containers have it)"
CANCEL_RACE_LINES = ("Signal (11) received.", "pthread_mutex_lock", "TRITONBACKEND_Response")
# The same family in a second place, seen in this project's CI soak (a clean clone, 2026-12-07): the segfault
# inside the gRPC stream handler's Process, on its completion-queue thread, as clients cancel streams. Server PR
# #7840 ("gRPC segfault due to Low Request Cancellation Timeout", in 2.53 as #7880) fixes Process's corner cases
# under cancellation. Its frames are in the tritonserver binary, which the log doesn't name: backtrace.named_frames.
STREAM_HANDLER_PROCESS = "23ModelStreamInferHandler7Process"  # triton::server::grpc::ModelStreamInferHandler::Process
MAX_RESTARTS = 5  # within RESTART_WINDOW_S; then serve stops with the reason
RESTART_WINDOW_S = 600.0


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str


def python_stubs(pgid: int) -> list[Stub]:
    """The python backend stubs in a server's process group, with the model each one runs (its first
    argument is the model's `<repo>/<model>/<version>/model.py`)."""
    stubs = []
    for pid in group_members(pgid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode(errors="replace")).name == STUB_NAME and len(argv) > 1:
            parts = Path(argv[1].decode(errors="replace")).parts
            stubs.append(Stub(pid, parts[-3] if len(parts) >= 3 else "a python model"))
    return stubs


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for tritonserver to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def what_died(server: TritonServer, stubs: list[Stub]) -> str | None:
    """One line naming the dead processes, or None while the server and every stub it started are up.

    Both are named when both are gone: a killed stub can take tritonserver down within one poll, and a dead
    server takes its stubs, so which went first can't be told from here."""
    parts = []
    dead = [s for s in stubs if not _alive(s.pid)]
    if dead:
        parts.append("the python stub of " + ", ".join(f"{s.model} (pid {s.pid})" for s in dead) + " died")
    code = server.process.poll()
    if code is not None:
        log = server.log()
        if code < 0 and (site := crash_site(log)):  # its own handler printed a stack: say where
            parts.append(f"tritonserver died of {site}")
        else:
            reason = failure_from_log(log)
            parts.append(f"tritonserver exited with code {code}" + (f" ({reason})" if reason else ""))
    return "; ".join(parts) or None


def known_crash(log: str) -> str | None:
    """CANCEL_RACE when the last crash in a server's log is that upstream bug's: each of CANCEL_RACE_LINES in the
    stack it printed, or its first frame past the signal in the gRPC stream handler's Process; else None."""
    crash = log[log.rfind(CANCEL_RACE_LINES[0]):] if CANCEL_RACE_LINES[0] in log else ""
    if not crash:
        return None
    if all(line in crash for line in CANCEL_RACE_LINES):
        return CANCEL_RACE
    own = named_frames(crash)  # [0] is the signal handler; [1] its first own frame past the signal
    return CANCEL_RACE if len(own) > 1 and STREAM_HANDLER_PROCESS in own[1] else None


@dataclass
class RestartBudget:
    """At most `limit` restarts within `window_s`."""

    limit: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    times: deque = field(default_factory=deque)

    def take(self, now: float) -> bool:
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def supervise(server: TritonServer, say: Callable[[str], None], ready_timeout: float,
              budget: RestartBudget | None = None, poll_s: float = POLL_S, frontend=None,
              stop: threading.Event | None = None,
              on_restart: Callable[[str, str, float, float], None] | None = None) -> None:
    """Watch a ready server until interrupted (or `stop` is set); restart it when it or a stub dies, and the OpenAI
    frontend (a pipeline.openai_api.process.FrontendProcess, or None) when it dies. Raises ServeError when the
    restarts run out or a restarted server doesn't come back.
    on_restart(what died, the server's log as it died, when it was seen dead, when it was ready again): once per
    server restart, for a caller that accounts for them (scripts/soak.py)."""
    budget = budget or RestartBudget()
    stop = stop or threading.Event()
    stubs = python_stubs(server.process.pid)
    while not stop.wait(poll_s):
        if frontend is not None and (gone := frontend.died()):
            if not budget.take(time.monotonic()):
                raise ServeError(f"{gone}, after {budget.limit} restarts in {budget.window_s / 60:g} min; not "
                                 f"restarting again: read its log ({frontend.log_path})")
            say(f"{gone}; restarting it")
            frontend.start().wait_ready()
            say("the OpenAI frontend is back")
        died = what_died(server, stubs)
        if died is None:
            continue
        if server.process.poll() == -signal.SIGSEGV and (known := known_crash(server.log())):
            died += f": {known}"
        if not budget.take(time.monotonic()):
            raise ServeError(f"{died}, after {budget.limit} restarts in {budget.window_s / 60:g} min; not restarting "
                             f"again: read the log ({server.log_path})")
        say(f"{died}; restarting tritonserver (clients in flight get an error)")
        start, log = time.monotonic(), server.log()
        server.restart()
        server.wait_ready(ready_timeout)
        say(f"ready again after {time.monotonic() - start:.1f} s")
        if on_restart is not None:
            on_restart(died, log, start, time.monotonic())
        stubs = python_stubs(server.process.pid)


READY_TIMEOUT_S = 120.0
MPI_READY_TIMEOUT_S = 1800.0  # TensorRT-LLM engines of a 70B model take minutes to load


def serve(options: ServeOptions, timeout: float | None = None, on_ready: Callable[[TritonServer], None] | None = None,
          binary: ServerBinary | None = None, on_start: Callable[[TritonServer], None] | None = None,
          say: Callable[[str], None] = print, frontend: Callable[[TritonServer], object] | None = None) -> None:
    """Start, wait until every model is ready, start the frontend `frontend(server)` makes (the OpenAI API:
    pipeline.openai_api.process.FrontendProcess, which this layer doesn't import), call on_ready, then supervise
    until Ctrl-C or SIGTERM: a dead server, python stub or frontend is restarted (supervise, above), each
    time said in one line. SIGTERM drains first (pipeline.triton.drain, for at most options.drain_timeout_s): the
    requests in flight finish, new ones are refused; Ctrl-C, or a second SIGTERM, stops at once. Always stops both.
    on_start runs as soon as the process is started (a 70B model takes minutes to become ready)."""
    server = TritonServer(options, binary)
    previous = _raise_on_sigterm()
    try:
        try:
            server.start()
            if server.device_line:
                say(server.device_line)
            if on_start is not None:
                on_start(server)
            ready_timeout = timeout or (MPI_READY_TIMEOUT_S if server.launch.mpi else READY_TIMEOUT_S)
            server.wait_ready(ready_timeout)
            if frontend is not None:
                server.frontend = frontend(server)
                server.frontend.start().wait_ready()
            if on_ready is not None:
                on_ready(server)
            supervise(server, say, ready_timeout, frontend=server.frontend)
        except StopRequested:
            _drain(server, options.drain_timeout_s, say)
    except (KeyboardInterrupt, StopRequested):
        pass
    finally:
        if server.frontend is not None:
            server.frontend.stop()
        server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class StopRequested(BaseException):
    """SIGTERM: a BaseException, as KeyboardInterrupt is, so no `except Exception` on the way swallows it."""


def _drain(server: TritonServer, timeout_s: float, say: Callable[[str], None]) -> None:
    """The OpenAI frontend asked to stop first (it closes its port and finishes the requests it holds, which the
    server still serves), the server's gates told to refuse new requests; then wait for both."""
    from pipeline.triton.drain import drain

    if server.process is None or server.process.poll() is not None or timeout_s <= 0:
        return
    process = server.frontend.process if server.frontend is not None else None
    if process is not None and process.poll() is None:
        process.terminate()
    result = drain([server.process.pid], server.endpoints.metrics, timeout_s,
                   others_done=lambda: process is None or process.poll() is not None, say=say)
    say(result.line())


def _raise_on_sigterm():
    """SIGTERM raises StopRequested, the first time (serve drains), then KeyboardInterrupt (stop now); either way the
    finally that stops the server runs."""
    received = []

    def interrupt(signum, frame):
        received.append(signum)
        raise StopRequested if len(received) == 1 else KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        return signal.signal(signal.SIGTERM, interrupt)
    return None
