"""wait_until: the one wait-until-ready loop (the server's readiness, the client's, the OpenAI frontend's)."""

from __future__ import annotations

import time

import pytest

from pipeline.polling import wait_until


def test_it_returns_the_first_answer_and_probes_at_least_once():
    answers = iter([None, None, "up"])
    assert wait_until(lambda: next(answers), timeout_s=5, every_s=0.01) == "up"
    assert wait_until(lambda: 0, timeout_s=0, every_s=1) == 0  # a falsy answer is still an answer


def test_it_gives_none_after_its_timeout_and_stops_early_when_the_probe_raises():
    start = time.monotonic()
    assert wait_until(lambda: None, timeout_s=0.2, every_s=0.05) is None
    assert 0.2 <= time.monotonic() - start < 1
    with pytest.raises(RuntimeError, match="exited"):
        wait_until(lambda: (_ for _ in ()).throw(RuntimeError("exited")), timeout_s=5, every_s=0.01)
