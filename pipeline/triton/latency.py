"""One request's serving latency, as the speculation gate observes it into Prometheus histograms.

The figures a serving dashboard plots, named after vLLM's (vllm:time_to_first_token_seconds,
vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds in vllm/v1/metrics/loggers.py) with
our `pipeline_` prefix. The clock starts when the gate receives the request (after tokenizing) and stops
when a response with tokens leaves it for postprocessing.

- Time to first token and inter-token latency are observed for streamed requests only: a request that
  isn't streamed gets one response at the end, so its "first token" would be its last.
- A response carries every token made since the previous one (a verify step that accepted drafts, or the
  engine's 50 ms stream interval), so one inter-token observation is the gap spread over its tokens: with
  speculation a step that emits four tokens is four times cheaper per token, which is the point.
- End-to-end latency is observed for every request that ends without an error.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's buckets, with finer ones at the low end: a CPU decode step of a small model is a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


@dataclass
class RequestClock:
    arrival: float  # time.monotonic() when the gate received the request
    streamed: bool
    last: float | None = None  # when the previous response with tokens left; None before the first

    def response(self, new_tokens: int, now: float) -> tuple[float | None, float | None]:
        """(time to first token, inter-token latency) that a response with `new_tokens` tokens leaving at
        `now` observes; None for a figure it doesn't."""
        if new_tokens <= 0 or not self.streamed:
            return None, None
        first = self.last is None
        gap = now - (self.arrival if first else self.last)
        self.last = now
        return (gap, None) if first else (None, gap / new_tokens)

    def end(self, now: float) -> float:
        """End-to-end latency of a request that ended at `now`."""
        return now - self.arrival
