"""Client cancellations, carried from `postprocessing` back to `speculation_gate`.

Triton's ensemble scheduler checks a cancelled client request only between steps: it cancels the
NEXT step's request, never a step already running. The gate's request is one long decoupled stream,
so it never learns that its client left, and the engine would decode to max_tokens for nobody.
Postprocessing does see it: every response the gate streams after the cancel reaches postprocessing
as a cancelled request. So postprocessing drops a mark named for the stream's id, and the gate checks
for its own mark before relaying each response, then cancels the engine request, freeing the slot.

The gate passes the cancel on to the portable engine the same way (key "engine-<id>"): the BLS
response iterator of Triton 2.51's python backend has no cancel() (python_backend added it in 2025),
so the engine model can't see that its caller stopped listening.

A client that stops a request without cancelling its stream (the bundled tritonserver 2.51 can die of a stream
cancelled as its last response goes out) asks the `stop_request` model, which marks the request's id (key
"client-<digest of the id>", `stop_key`); the gate stops that request as for a cancel and ends its stream with its
final response, which the client reads. Those marks are bounded: stale ones (STOP_MARK_TTL_S) are swept at each
stop, and past MAX_STOP_MARKS a stop is refused.

Marks are empty files in a folder per tritonserver process (every model's stub is its child), on
/dev/shm where it exists: a stat per response costs microseconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

STOP_PREFIX = "client-"
# `pipeline serve` (or a preStop hook) marks a server it is stopping: its gates refuse new requests
# (pipeline.triton.drain).
DRAINING = "draining"
STOP_MARK_TTL_S = 60.0  # a stop for a request that already ended (or never ran) is swept after this
MAX_STOP_MARKS = 4096  # stops pending at once: no client can grow the folder past this


def marks_dir(server_pid: int | None = None) -> Path:
    """The folder of one tritonserver's marks: from a model's stub, its parent's; from `pipeline serve`, the
    pid of the server it started."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"pipeline-cancel-{os.getppid() if server_pid is None else server_pid}"


def mark(key: str) -> None:
    folder = marks_dir()
    folder.mkdir(exist_ok=True)
    (folder / key).touch()


def take(key: str) -> bool:
    """Whether `key` was marked; removes the mark."""
    try:
        (marks_dir() / key).unlink()
        return True
    except FileNotFoundError:
        return False


def take_all(prefix: str) -> set[str]:
    """Every marked key starting with `prefix` (without it), removing them: one listdir per call."""
    try:
        names = [n for n in os.listdir(marks_dir()) if n.startswith(prefix)]
    except FileNotFoundError:
        return set()
    for name in names:
        take(name)
    return {name[len(prefix):] for name in names}


def stop_key(request_id: str) -> str:
    """The mark a stop of the client's request `request_id` leaves: a digest, so no id names a path."""
    return STOP_PREFIX + hashlib.sha256(request_id.encode()).hexdigest()[:32]


def mark_stop(request_id: str) -> bool:
    """Mark the client's request `request_id` to be stopped, after sweeping stale stops; False (nothing marked) when
    MAX_STOP_MARKS are pending."""
    folder = marks_dir()
    folder.mkdir(exist_ok=True)
    now, pending = time.time(), 0
    for entry in os.scandir(folder):
        if entry.name.startswith(STOP_PREFIX):
            try:
                if now - entry.stat().st_mtime > STOP_MARK_TTL_S:
                    os.unlink(entry.path)
                else:
                    pending += 1
            except FileNotFoundError:  # taken meanwhile
                pass
    if pending >= MAX_STOP_MARKS:
        return False
    (folder / stop_key(request_id)).touch()
    return True


def mark_draining(server_pid: int) -> None:
    folder = marks_dir(server_pid)
    folder.mkdir(exist_ok=True)
    (folder / DRAINING).touch()


def draining() -> bool:
    """Whether this model's server is being stopped (from a model's stub): a stat."""
    return (marks_dir() / DRAINING).exists()


def clear(server_pid: int | None = None) -> None:
    shutil.rmtree(marks_dir(server_pid), ignore_errors=True)
