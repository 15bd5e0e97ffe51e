"""The frontend's connections: a deadline for a request head, and a cap on open connections below the file limit.

uvicorn (0.55, h11) times out only an idle keep-alive connection, after a response. A connection that sends half a
request head and then nothing (slowloris) holds its socket for ever: about 20,000 of them took the frontend to its
open-file limit, a normal request then hung, and asyncio logged about 10,000 EMFILE tracebacks a second. So:

- **A head has HEAD_TIMEOUT_S** from the connection's start, or from its first byte after a keep-alive wait
  (uvicorn's own keep-alive timeout covers a connection that sends nothing there): past it, a 408 and the close.
  A body's deadline is the route's (pipeline.openai_api.edge.read_json): a 408 too, in OpenAI's shape.
- **At most `max_connections` are open**, well below the process's file limit (gRPC, the tokenizer and the logs
  need descriptors too), so accept() never fails for want of one. At the cap, a new connection closes the one that
  has waited longest for its request head (it has asked for nothing yet, so closing it costs nobody an answer, and
  a client that sends its head at once is never the oldest); when every connection has a request in progress, the
  new one gets a 503 and is closed. Under a flood of half-open connections a normal client is then still served.
- Log lines about the same thing are rate-limited (RateLimitedLog): at most one a RATE_WINDOW_S per message, with a
  count of those left out.

nginx does the same with client_header_timeout and worker_connections; uvicorn's limit_concurrency answers 503 only
once a whole head arrived, which a half-open connection never sends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pipeline.openai_api")
HEAD_TIMEOUT_S = 10.0  # a head takes one round trip; nginx's client_header_timeout is 60 s, Apache's 20-40 s
BODY_TIMEOUT_S = 30.0  # the whole body: a 4 MiB prompt at 1 Mbit/s
KEEP_ALIVE_S = 5.0  # uvicorn's default, named
MAX_CONNECTIONS = 8192  # the ceiling whatever the file limit (about 10 KB of state each)
RESERVED_FILES = 256  # descriptors kept for everything else the process opens
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What the protocol bounds per connection (the body's deadline is the route's: FrontendSettings)."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    keep_alive_s: float = KEEP_ALIVE_S
    max_connections: int = 1024


def max_connections_for(open_files: int) -> int:
    """The cap for a process allowed `open_files` descriptors: half of them, less a reserve, within [16, ceiling].
    Pure."""
    return max(16, min(MAX_CONNECTIONS, open_files // 2 - RESERVED_FILES))


def raise_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard one (Linux's soft default is 1024) and return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a container may forbid it: keep the soft limit
            pass
    return soft


def canned(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, written before (or instead of) h11's own state machine."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_busy", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


HEAD_TIMED_OUT = canned(408, "Request Timeout", "the request head did not arrive in time; send the whole head at once",
                        "request_timeout")
FULL = canned(503, "Service Unavailable", "this server holds as many connections as it takes, each with a request "
              "in progress; retry shortly", "too_many_connections")


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline and the connection cap. `limits` is set by protocol_class;
    `waiting` (shared by every connection of the server) holds those waiting for a head, oldest first."""

    limits: ConnectionLimits = ConnectionLimits()
    waiting: OrderedDict  # EdgeProtocol -> None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections and not self._evict_oldest():
            log.warning("connection refused: %d open, each with a request in progress (the cap, "
                        "max_connections)", len(self.connections))
            self.connections.discard(self)
            transport.write(FULL)
            transport.close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.head_timer is None:  # a head's first bytes after a keep-alive wait: its deadline starts
                self._await_head()
        else:
            self._head_done()

    def connection_lost(self, exc) -> None:
        self._head_done()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # Answered before its body ended (a 408, a 413): the rest can't start another request, and uvicorn would hold
        # the connection for its keep-alive timeout waiting for it. (Read before uvicorn moves on to a pipelined
        # request, whose own body may still be on its way.)
        unfinished = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if unfinished:
            self.transport.close()
        elif self.conn.their_state is h11.IDLE:
            self.waiting[self] = None  # idle until its next head (uvicorn's keep-alive timer bounds the wait)

    def _await_head(self) -> None:
        self.waiting[self] = None
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _head_done(self) -> None:
        self.waiting.pop(self, None)
        if getattr(self, "head_timer", None) is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        self.waiting.pop(self, None)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(HEAD_TIMED_OUT)
            self.transport.close()

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest for its head, making room; False where none waits."""
        while self.waiting:
            oldest, _ = self.waiting.popitem(last=False)
            if oldest.transport.is_closing():
                continue
            oldest._head_done()
            oldest.connections.discard(oldest)
            oldest.transport.abort()  # no FIN handshake to wait for: its descriptor is free now
            log.warning("closed the connection that had waited longest for a request head: %d connections open, "
                        "the cap (max_connections)", len(oldest.connections))
            return True
        return False


def protocol_class(limits: ConnectionLimits) -> type[EdgeProtocol]:
    """An EdgeProtocol class for one server (uvicorn takes a protocol class for `http`)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits, "waiting": OrderedDict()})


class RateLimitedLog(logging.Filter):
    """At most one record per RATE_WINDOW_S for each (logger, message template); the next one let through says how
    many were left out. A flood of one failure (bad heads, refused connections, accept errors) then costs a line
    every few seconds, not megabytes."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock=time.monotonic):
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last let through, left out since)

    def filter(self, record: logging.LogRecord) -> bool:
        # The template's first line: asyncio's accept errors go on to name the socket, which differs each time.
        key = (record.name, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        last, dropped = self.seen.get(key, (None, 0))
        if last is not None and now - last < self.window_s:
            self.seen[key] = (last, dropped + 1)
            return False
        if len(self.seen) > 1024:  # message templates are few; never let the table grow with requests
            self.seen.clear()
        self.seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.window_s:g} s not logged)"
        return True
