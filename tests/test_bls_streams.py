"""Ended BLS streams are let go only after an is_cancelled() answer asked after them (pipeline/triton/bls_streams.py).

The python backend drops its own reference to a stream on a thread without the GIL; ours must be the last, so
it goes only once a round trip through that thread's queue, started after the stream ended, came back False.
"""

import gc
import weakref

from pipeline.triton.bls_streams import EndedStreams


class Stream:
    """A response iterator: three responses, then the end (which is when the real one queues its cleanup)."""

    def __init__(self):
        self.left = 3

    def __iter__(self):
        return self

    def __next__(self):
        if not self.left:
            raise StopIteration
        self.left -= 1
        return object()


class Sender:
    def __init__(self, answer: bool, during=None):
        self.answer, self.during = answer, during

    def is_cancelled(self) -> bool:
        if self.during is not None:  # another stream ends while this question is in flight
            self.during()
        return self.answer


def ended(streams: EndedStreams) -> weakref.ref:
    stream = Stream()
    streams.end(stream)
    assert stream.left == 0  # read to its final response
    return weakref.ref(stream)


def test_an_ended_stream_is_held_until_a_false_answer_asked_after_it():
    streams = EndedStreams()
    first = ended(streams)
    gc.collect()
    assert first() is not None and len(streams) == 1  # nobody asked yet: the stub may still hold it too

    assert streams.is_cancelled(Sender(True)) is True  # True may be cached: no round trip, no proof
    gc.collect()
    assert first() is not None

    assert streams.is_cancelled(Sender(False)) is False
    gc.collect()
    assert first() is None and len(streams) == 0


def test_a_stream_that_ends_while_the_question_is_in_flight_waits_for_the_next():
    streams = EndedStreams()
    first = ended(streams)
    late = []
    streams.is_cancelled(Sender(False, during=lambda: late.append(ended(streams))))
    gc.collect()
    assert first() is None  # ended before the question: its cleanup was queued ahead of it
    assert late[0]() is not None and len(streams) == 1  # its cleanup may be queued behind the question

    streams.is_cancelled(Sender(False))
    gc.collect()
    assert late[0]() is None and len(streams) == 0
