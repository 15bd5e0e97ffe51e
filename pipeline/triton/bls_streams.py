"""Reading a BLS stream (`InferenceRequest.exec(decoupled=True)`) to its end, and letting it go safely.

The python backend keeps a second reference to each stream's response iterator in the stub (its
`response_iterator_map_`). Reading the final response queues a cleanup message, and the stub's stub-to-parent
thread drops that reference when it gets to the message (`Stub::SendCleanupId`). That thread never holds the
GIL. Where the model's own reference went first, the iterator dies on that thread, with every response it kept,
each holding numpy arrays: Python objects freed without the GIL. That corrupts the heap: the speculation_gate
stub died of `malloc(): unaligned fastbin chunk detected` or a segfault in the interpreter under load (gdb on
the stub: 6 of 129 iterators died on that thread in two rounds of 64 streams; tritonserver 2.51's python backend,
and upstream's is the same). docs/reliability.md tells the story.

So a finished stream is held here until that thread has passed its cleanup. The thread serves its queue first in,
first out, and a sender's `is_cancelled()` that answers False went through it (True may be a cached answer): such
an answer, asked after a stream was held, proves the stream's cleanup is done, and our reference is then the last
one, dropped with the GIL. Every stream of ours asks `is_cancelled()` as its responses come, so what is held goes
at the next response of any stream; at most the streams that ended since the last such answer are held.
"""

from __future__ import annotations

import threading


def drain(responses) -> None:
    """Read a BLS stream to its final response. One left unread (after an error, a cancel, an early stop)
    keeps the calling model alive in Triton, which then waits out its 30 s exit timeout at unload. The
    engine ends that request at once (it has the same stop rules, sent the error, or was cancelled), so
    this is its last response or two, and the request stays counted in flight while the engine works on it."""
    for _ in responses:
        pass


class EndedStreams:
    """Streams read to their end, held until the stub's own reference to each is gone (see the module)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[tuple[int, object]] = []
        self._ended = 0  # streams handed to end(), ever

    def end(self, responses) -> None:
        """Read `responses` to its final response (which queues the stub's cleanup) and hold it."""
        drain(responses)
        with self._lock:
            self._ended += 1
            self._held.append((self._ended, responses))

    def is_cancelled(self, sender) -> bool:
        """`sender.is_cancelled()`; an answer of False lets go of every stream held before the question. Only
        one thread may ask about a given sender (ours: its stream's worker): a False that merely waited for
        another thread's question, queued before ours, would prove nothing."""
        with self._lock:
            asked_after = self._ended
        cancelled = sender.is_cancelled()
        if not cancelled and asked_after:
            with self._lock:
                done = [r for n, r in self._held if n <= asked_after]
                self._held = [(n, r) for n, r in self._held if n > asked_after]
            del done  # the last references, dropped here with the GIL: the iterators and their responses go
        return cancelled

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


# One per stub process: a stub runs one model instance, and every stream of it shares the stub's thread.
ENDED = EndedStreams()
