"""scripts/soak.py, the 30-second version: a tiny portable engine served by the script's own tritonserver,
16 streams with bursts every 12 s, the full mix (greedy, sampled, bad, cancelled), and 4 clients on the OpenAI
frontend beside them."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from serving_checks import soak_script

from pipeline.compiler import CompileOptions, compile_model

import tritonclient.grpc  # noqa: E402,F401  (required by pyproject: a missing one fails, never skips)

soak = soak_script()


def test_the_mix_has_every_kind_and_is_the_same_for_the_same_seed():
    options = soak.SoakOptions()
    rng_a, rng_b = random.Random("0-w1"), random.Random("0-w1")
    a = [soak.draw(rng_a, options) for _ in range(2000)]
    assert a == [soak.draw(rng_b, options) for _ in range(2000)]
    kinds = {k: sum(r.kind is k for r in a) / len(a) for k in soak.Kind}
    assert 0.08 < kinds[soak.Kind.BAD] < 0.12 and 0.08 < kinds[soak.Kind.CANCEL] < 0.12
    assert 0.2 < kinds[soak.Kind.SAMPLED] < 0.28  # 0.3 of the 80% neither bad nor cancelled
    assert {r.bad for r in a if r.bad} == set(soak.BAD_REQUESTS)
    assert {r.leave_after for r in a if r.kind is soak.Kind.CANCEL} == {1, 2, 3}


def test_openai_clients_send_greedy_and_sampled_chats_streamed_or_whole_counted_apart():
    options = soak.SoakOptions(chaos=True)
    rng = random.Random("0-o1")
    drawn = [soak.draw_openai(rng, options) for _ in range(2000)]
    assert {r.kind for r in drawn} == {soak.Kind.GREEDY, soak.Kind.SAMPLED} and all(r.openai for r in drawn)
    assert {r.stream for r in drawn} == {True, False}
    assert {r.seed for r in drawn if r.kind is soak.Kind.SAMPLED} == set(range(soak.CHAOS_SEEDS))
    tally = soak.Tally()
    for request in (drawn[0], soak.Request(drawn[0].kind, 0, 8)):
        tally.add(request, soak.Reply(text="x"), soak.Outcome.COMPLETED, None)
    assert tally.sent == {f"openai {drawn[0].kind.value}": 1, drawn[0].kind.value: 1}


def test_judge_counts_a_wrong_refusal_a_served_bad_request_and_a_wrong_greedy_text_as_failures():
    refs = ["ref"] * len(soak.PROMPTS)
    bad = soak.Request(soak.Kind.BAD, 0, 8, bad="top_p 0")
    greedy = soak.Request(soak.Kind.GREEDY, 0, 8)
    O = soak.Outcome
    assert soak.judge(bad, soak.Reply(error="top_p must be in (0, 1] (got 0)"), refs)[0] is O.ERRORED_EXPECTED
    assert soak.judge(bad, soak.Reply(error="something else"), refs)[0] is O.ERRORED_UNEXPECTED
    assert soak.judge(bad, soak.Reply(text="served anyway"), refs)[0] is O.ERRORED_UNEXPECTED
    assert soak.judge(greedy, soak.Reply(text="ref"), refs)[0] is O.COMPLETED
    assert soak.judge(greedy, soak.Reply(text="rEf"), refs)[0] is O.MISMATCHED
    assert soak.judge(greedy, soak.Reply(hung=True), refs)[0] is O.HUNG
    busy = ("in ensemble 'ensemble', server busy: 64 requests are already waiting for the engine's 8 slots "
            "(max_queue_size 64); retry in a moment, or serve a repository assembled with a larger --max-queue-size")
    assert soak.judge(greedy, soak.Reply(error=busy), refs) == (O.BUSY, None)  # load shed as designed: no failure
    cancel = soak.Request(soak.Kind.CANCEL, 0, 8, leave_after=2)
    assert soak.judge(cancel, soak.Reply(text="r", responses=2, left=True), refs)[0] is O.CANCELLED
    assert soak.judge(cancel, soak.Reply(text="wrong", responses=1), refs)[0] is O.MISMATCHED  # ended first


def test_only_grpc_failures_while_the_server_was_down_are_lost_to_its_restart():
    """A request in flight when the server died gets a gRPC error at once: lost to the restart, not an unexpected
    error, inside the restart's window only. A model's error response is never moved, and a restart counts as a
    failure unless the known upstream crash caused it and the server came back."""
    O, tally = soak.Outcome, soak.Tally()
    greedy = soak.Request(soak.Kind.GREEDY, 0, 8)
    for ended_at, transport in ((10.0, True), (20.0, True), (20.5, False), (40.0, True)):
        reply = soak.Reply(error="Socket closed" if transport else "model said no", transport=transport,
                           ended_at=ended_at)
        tally.add(greedy, reply, *soak.judge(greedy, reply, ["ref"] * len(soak.PROMPTS)))
    known = soak.Restart("tritonserver exited with code -11: race", "log", died_at=19.5, ready_at=25.0, known="race")
    tally.settle([known.window])
    counts = tally.snapshot()
    assert (counts[O.ERRORED_UNEXPECTED.value], counts[O.LOST_TO_RESTART.value]) == (3, 1)
    assert sorted(line.split(": ")[-1] for line in tally.problems) == ["Socket closed", "Socket closed", "model said no"]
    assert known.failure() is None
    assert "its log ends:" in soak.Restart("tritonserver exited with code -6", "abort", 1.0, 5.0, None).failure()
    gone = soak.Restart("tritonserver did not start", "log", 1.0, None, "race")
    assert "did not come back" in gone.failure() and gone.window[1] == float("inf")


def test_a_kill_stalls_an_answer_from_the_servers_return_to_its_next_response():
    """--chaos's target: per kill and resumed answer in flight at it, the time from the server being ready again
    to that answer's next response (its end, for one with no response after it); answers no kill touched don't
    count, nor kills outside an answer's time."""
    tally = soak.Tally()
    kill = soak.Restart("killed", "log", died_at=10.0, ready_at=15.0, known="killed")
    later = soak.Restart("killed", "log", died_at=50.0, ready_at=55.0, known="killed")
    greedy, chat = soak.Request(soak.Kind.GREEDY, 0, 8), soak.Request(soak.Kind.GREEDY, 0, 8, openai=True)
    for request, reply in ((greedy, soak.Reply(text="ref", sent_at=8.0, ended_at=20.0, resumed=1,
                                               times=[9.0, 9.5, 16.5, 20.0])),  # streamed: 1.5 s past the return
                           (replace(chat, stream=False),  # a whole answer: its one response, at its end
                            soak.Reply(text="ref", sent_at=9.0, ended_at=18.0, resumed=1, times=[18.0])),
                           (greedy, soak.Reply(text="ref", sent_at=1.0, ended_at=4.0, times=[2.0, 4.0]))):  # untouched
        tally.add(request, reply, soak.Outcome.COMPLETED, None)
    assert tally.stalled_by_kills([kill, later]) == [1.5, 3.0]
    assert tally.stalled_by_kills([kill, later], openai=True) == [3.0]
    assert tally.stalled_by_kills([kill, later], stream=True) == [1.5]


@pytest.mark.slow  # a 30-second soak, plus compiling and starting the server
def test_thirty_second_soak_has_no_hung_unexpected_or_mismatched_request(tiny_target, tmp_path, capsys):
    from pipeline.triton.assemble import AssembleOptions, assemble
    from pipeline.triton.server import find_tritonserver

    find_tritonserver()
    engine = tmp_path / "engine"
    compile_model(CompileOptions("torch", tiny_target, engine, draft="ngram", num_draft_tokens=3, max_batch_size=8,
                                 max_seq_len=256, gate_batch_size=8))
    repo = assemble(AssembleOptions(engine=engine, repo=tmp_path / "repo", gate_batch_size=8,
                                    min_spec_tokens=20)).repo
    code = soak.main(["--repo", repo, "--streams", "16", "--minutes", "0.5", "--burst-every-s", "12",
                      "--max-tokens", "32", "--hang-s", "30", "--openai-streams", "4", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n{") + 1:])
    counts = report["counts"]
    # The server runs under pipeline serve's supervisor. It may die only of the known upstream crash (tritonserver
    # 2.51's gRPC cancellation race), and must come back; only the requests in flight then may be lost.
    # The whole log tail of each restart in the message: pytest cuts a long repr, and a crash's stack is the evidence.
    assert all(r["known"] and r["down_s"] is not None for r in report["restarts"]), "\n\n".join(
        f"{r['died']} (known: {r['known']}, down {r['down_s']} s); its log ends:\n{r['log_tail']}"
        for r in report["restarts"])
    assert (counts["hung"], counts["errored_unexpected"], counts["mismatched"]) == (0, 0, 0), report["problems"]
    assert bool(counts["lost_to_restart"]) <= bool(report["restarts"]), counts
    assert counts["completed"] > 100 and counts["errored_expected"] > 5 and counts["cancelled"] > 5, counts
    openai = {kind: n for kind, n in report["sent_by_kind"].items() if kind.startswith("openai ")}
    assert openai.get("openai greedy", 0) > 10 and openai.get("openai sampled", 0) > 2, report["sent_by_kind"]
    assert report["bursts"] == 2 and set(report["gauges_after"].values()) == {0}
    assert {r["process"] for r in report["rss"]} >= {"tritonserver", "torch_engine", "speculation_gate"}
    assert code == 0, report["failures"]
