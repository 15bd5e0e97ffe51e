"""Graceful stop: the requests in flight finish, new ones go elsewhere.

SIGTERM is how a process is asked to stop (Kubernetes, systemd, a rolling update), and tritonserver 2.51 takes it
badly for our ensembles: it refuses new requests at once, and to the ensemble scheduler the steps after the gate
(postprocessing, per streamed response) are new requests, so every stream in flight stalls and the server waits out
its exit timeout (measured: no response for 30 s, the process not gone after 60). So the drain happens before
tritonserver hears of it:

1. the server's gate models see a drain mark (cancel_marks.DRAINING) and refuse each new request with UNAVAILABLE,
   the status a client or a load balancer retries on another replica;
2. the OpenAI frontend is asked to stop (SIGTERM: uvicorn closes its port and finishes the requests it holds);
3. we wait until the gates have nothing in flight (their `pipeline_gate_in_flight` gauge, read twice, one
   publishing period apart, so a final response still queued behind the gauge goes out) or the drain timeout
   passes; only then is tritonserver stopped. What is still running at the timeout gets an error.

`pipeline serve` drains on SIGTERM (supervise.serve); a second SIGTERM or Ctrl-C stops at once. Where tritonserver
is the container's own process (the TensorRT-LLM routes on Kubernetes), the pod's preStop hook runs this module:
`python3 -m pipeline.triton.drain --metrics-url URL --timeout S` marks every tritonserver in the container.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.polling import wait_until
from pipeline.triton import cancel_marks

DEFAULT_DRAIN_TIMEOUT_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
IN_FLIGHT_METRIC = "pipeline_gate_in_flight"
# Twice the gates' publishing period (METRICS_EVERY_S, 0.1 s): a gauge read at 0 is read again this much later.
SETTLE_S = 0.25
_SAMPLE = re.compile(rf"^{IN_FLIGHT_METRIC}(?:{{[^}}]*}})?\s+(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Drained:
    """How a drain ended: in_flight is what was still running when it stopped waiting (0: everything finished);
    None where the metrics never answered."""

    in_flight: int | None
    waited_s: float
    timeout_s: float

    def line(self) -> str:
        if self.in_flight == 0:
            return f"drained: every request in flight finished ({self.waited_s:.1f} s)"
        left = "requests in flight unknown (no metrics)" if self.in_flight is None else \
            f"{self.in_flight} request{'s' if self.in_flight != 1 else ''} still in flight get an error"
        return f"drain timed out after {self.timeout_s:g} s: {left}"


def in_flight(metrics_url: str, timeout_s: float = 2.0) -> int | None:
    """Requests the server's gates hold (the sum over gate models); None where the metrics don't answer or the
    repository has no gate (nothing to wait for that we can see)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    samples = _SAMPLE.findall(text)
    return round(sum(float(v) for v in samples)) if samples else None


def drain(server_pids: list[int], metrics_url: str | None, timeout_s: float,
          others_done: Callable[[], bool] = lambda: True, say: Callable[[str], None] = print) -> Drained:
    """Mark each server as draining, then wait (at most timeout_s) until its gates hold no request and
    others_done() (the OpenAI frontend has finished its own)."""
    for pid in server_pids:
        cancel_marks.mark_draining(pid)
    start = time.monotonic()
    held = in_flight(metrics_url) if metrics_url else None
    seen = [held is not None]  # a gate answered once: a later unanswered read is a busy server, not "no gate"
    say(f"draining: new requests are refused (UNAVAILABLE); waiting up to {timeout_s:g} s for "
        f"{'the requests' if held is None else held} in flight")

    def idle() -> bool | None:
        if not others_done():
            return None
        held = in_flight(metrics_url) if metrics_url else None
        if held is None:
            return None if seen[0] else True  # no gate or no metrics at all: nothing more we can see
        seen[0] = True
        if held == 0:
            time.sleep(SETTLE_S)
            if in_flight(metrics_url) == 0:
                return True
        return None

    done = wait_until(idle, timeout_s, 0.1)
    left = 0 if done else (in_flight(metrics_url) if metrics_url else None)
    return Drained(left, time.monotonic() - start, timeout_s)


def tritonserver_pids() -> list[int]:
    """Every tritonserver process this one can see: in a container, the server beside the hook."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "tritonserver":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.triton.drain",
                                     description="Drain the tritonserver beside this process (a preStop hook).")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S)
    parser.add_argument("--server-pid", type=int, action="append", help="[default: every tritonserver seen]")
    args = parser.parse_args(argv)
    pids = args.server_pid or tritonserver_pids()
    if not pids:
        print("drain: no tritonserver process here; nothing to drain")
        return 0
    print(drain(pids, args.metrics_url, args.timeout).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
