"""pipeline.triton.draft_target: the draft -> target loop the gate runs over TensorRT-LLM's models.

Pure loop tests use seeded toy "models" (a next-token function); the served tests assemble a trtllm
repository, swap tensorrt_llm and tensorrt_llm_draft for python stand-ins that follow the tensorrtllm
backend's interface (tests/trtllm_standin.py) and serve it with a real tritonserver.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from serving_checks import responses, tensor  # noqa: E402
from pipeline.triton.draft_target import (Emitter, TritonRequest, accepted_count, parse_stop_words,
                                          serve_request, stop_at, stop_words_tensor)

# ---- the loop on toy models ---------------------------------------------------------------------


def toy(seed: int):
    """A deterministic next-token function over a 40-token vocabulary."""
    return lambda ids: (sum(ids) * 31 + len(ids) * seed + seed) % 40


class ToyEngines:
    """propose / verify / decode with TensorRT-LLM's semantics, over two next-token functions."""

    def __init__(self, target, draft, end_id=-1, stream_chunk=1):
        self.target, self.draft, self.end_id, self.chunk = target, draft, end_id, stream_chunk
        self.calls: list[tuple[str, int]] = []

    def _greedy(self, f, ids, n):
        out = []
        while len(out) < n:
            out.append(f(ids + out))
            if out[-1] == self.end_id:
                break
        return out

    def propose(self, ids, n):
        self.calls.append(("draft", n))
        return self._greedy(self.draft, ids, n)

    def verify(self, ids, drafts):
        self.calls.append(("verify", len(drafts)))
        out = []
        for d in drafts:
            t = self.target(ids + out)
            out.append(t)
            if t != d or t == self.end_id:
                return out
        return out + [self.target(ids + out)]

    def decode(self, ids, n, request):
        self.calls.append(("decode", n))
        out = self._greedy(self.target, ids, n)
        # A toy log prob per token, every one so far in each response, as TensorRT-LLM sends them.
        logprobs = [-t / 100 for t in out] if request.return_log_probs else None
        if request.stream:
            for i in range(0, len(out), self.chunk):
                yield out[i:i + self.chunk], logprobs and logprobs[i:i + self.chunk]
        else:
            yield out, logprobs


def request_tensors(prompt, max_tokens, *, stream=False, end_id=-1, stop_words=(), temperature=0.0,
                    repetition_penalty=1.0, presence_penalty=0.0, return_log_probs=False, guide_type="", guide=""):
    # Preprocessing's layout: -1 padded, one column even with no words.
    words = stop_words_tensor(tuple(tuple(w) for w in stop_words)) if stop_words else np.full((1, 2, 1), -1, np.int32)
    return {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32), "end_id": np.array([[end_id]], np.int32),
            "temperature": np.array([[temperature]], np.float32), "top_k": np.array([[0]], np.int32),
            "top_p": np.array([[1.0]], np.float32), "seed": np.array([[0]], np.uint64),
            "stream": np.array([[stream]], bool), "stop_words_list": words,
            "speculation": np.array([[b"auto"]], np.object_), "num_draft_tokens": np.array([[4]], np.int32),
            "repetition_penalty": np.array([[repetition_penalty]], np.float32),
            "presence_penalty": np.array([[presence_penalty]], np.float32),
            "frequency_penalty": np.array([[0.0]], np.float32),
            "return_log_probs": np.array([[return_log_probs]], bool), "num_logprobs": np.array([[0]], np.int32),
            # Preprocessing sends both always, empty for no guide.
            "guided_decoding_guide_type": np.array([[guide_type.encode()]], np.object_),
            "guided_decoding_guide": np.array([[guide.encode()]], np.object_)}


def run(engines, tensors, *, speculate=True, k=4, cancel_after=None):
    sent = []
    cancelled = (lambda: len(sent) >= cancel_after) if cancel_after else (lambda: False)
    serve_request(tensors, speculate=speculate, num_draft_tokens=k, target_model="t", draft_model="d",
             send=sent.append, cancelled=cancelled, engines=engines)
    return sent


def tokens_of(sent):
    """Rebuild the answer from GENERATION_TENSORS responses: each is prefix_length resent + new."""
    out = []
    for r in sent:
        ids = r["output_ids"].reshape(-1).tolist()
        prefix = int(r["prefix_length"][0, 0])
        assert ids[:prefix] == out[len(out) - prefix:] if prefix else True
        out += ids[prefix:]
    return out


def counts(sent):
    return tuple(sum(int(r[name][0, 0]) for r in sent) for name in ("accepted_tokens", "drafted_tokens",
                                                                        "verify_steps"))


PROMPT = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("draft_seed", [7, 8])  # 7: the target itself; 8: a different draft
def test_speculative_answer_equals_target_only_greedy_streamed_or_not(stream, draft_seed):
    target = toy(7)
    engines = ToyEngines(target, toy(draft_seed))
    expected = ToyEngines(target, target)._greedy(target, PROMPT, 30)
    sent = run(engines, request_tensors(PROMPT, 30, stream=stream))
    assert tokens_of(sent) == expected
    assert len(sent) > 1 if stream else len(sent) == 1
    accepted, drafted, steps = counts(sent)
    assert 0 <= accepted <= drafted and steps > 0
    if draft_seed == 7:
        assert accepted == drafted  # a draft equal to the target is always accepted
        assert steps == -(-30 // 5)  # K + 1 tokens per step
    assert all(kind != "decode" for kind, _ in engines.calls)


def test_drafts_shrink_near_max_tokens_so_the_target_token_fits():
    target = toy(7)
    engines = ToyEngines(target, target)
    sent = run(engines, request_tensors(PROMPT, 7))
    assert len(tokens_of(sent)) == 7
    assert engines.calls == [("draft", 4), ("verify", 4), ("draft", 1), ("verify", 1)]


def skipped(sent) -> dict[str, int]:
    import json

    total: dict[str, int] = {}
    for r in sent:
        for reason, n in json.loads(r["skipped_steps"][0, 0]).items():
            total[reason] = total.get(reason, 0) + n
    return total


def test_a_draft_that_keeps_failing_stops_drafting_for_this_request_and_says_why():
    """A draft that never agrees with the target: after a few rejected steps the loop calls the target
    alone, with a short probe every PROBE_EVERY steps; the answer stays the target's, and every step
    without drafts is counted under its reason."""
    from pipeline.policy.draft_plan import PROBE_EVERY

    target = toy(7)
    engines = ToyEngines(target, lambda ids: (target(ids) + 1) % 40)  # always wrong
    sent = run(engines, request_tensors(PROMPT, 60))
    assert tokens_of(sent) == ToyEngines(target, target)._greedy(target, PROMPT, 60)
    drafting = [n for kind, n in engines.calls if kind == "draft"]
    assert len(drafting) <= 12 + 60 // PROBE_EVERY, drafting  # a few tries, then probes only
    reasons = skipped(sent)
    _, _, steps = counts(sent)
    assert reasons["acceptance"] >= 40 and steps + sum(reasons.values()) == len(engines.calls) - len(drafting)


def test_a_forced_request_drafts_every_step_however_bad_its_drafts():
    target = toy(7)
    engines = ToyEngines(target, lambda ids: (target(ids) + 1) % 40)
    sent = []
    serve_request(request_tensors(PROMPT, 30), speculate=True, num_draft_tokens=4, target_model="t", draft_model="d",
             send=sent.append, cancelled=lambda: False, engines=engines, forced=True)
    assert tokens_of(sent) == ToyEngines(target, target)._greedy(target, PROMPT, 30)
    # One token a step (every draft rejected); near max_tokens the drafts shrink so the target's token fits.
    assert [n for kind, n in engines.calls if kind == "draft"] == [4] * 26 + [3, 2, 1]
    assert skipped(sent) == {"end": 1}


def test_speculation_off_and_sampled_requests_call_the_target_alone():
    target = toy(7)
    expected = ToyEngines(target, target)._greedy(target, PROMPT, 20)
    engines = ToyEngines(target, toy(8), stream_chunk=3)
    sent = run(engines, request_tensors(PROMPT, 20, stream=True), speculate=False)
    # 20 tokens in chunks of 3: 7 chunks, and nothing after the last (the gate sends the FINAL flag alone).
    assert tokens_of(sent) == expected and counts(sent) == (0, 0, 0) and len(sent) == 7
    assert engines.calls == [("decode", 20)]
    sampled = ToyEngines(target, toy(8))
    run(sampled, request_tensors(PROMPT, 20, temperature=0.8))
    assert sampled.calls == [("decode", 20)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, reason", [({"repetition_penalty": 1.2}, "penalties"),
                                           ({"presence_penalty": -0.5}, "penalties"),
                                           ({"return_log_probs": True}, "log_probs"),
                                           ({"guide_type": "json"}, "guided")])
def test_penalties_log_probs_and_guides_decode_on_the_target_alone_as_one_request(stream, extra, reason):
    """Each verify step is a new TensorRT-LLM request whose prompt holds the answer so far: penalties would count
    other tokens there, accepted drafts get no log probs, and the C++ guided decoder would start its grammar over
    and leave draft positions unmasked. So the target decodes alone, and says why."""
    target = toy(7)
    engines = ToyEngines(target, target, stream_chunk=3)
    tensors = request_tensors(PROMPT, 20, stream=stream, **extra)
    assert TritonRequest.from_tensors(tensors).plain_reason == reason
    sent = run(engines, tensors, speculate=True)
    expected = ToyEngines(target, target)._greedy(target, PROMPT, 20)
    assert engines.calls == [("decode", 20)] and tokens_of(sent) == expected
    assert skipped(sent) == {reason: 20}
    if reason == "log_probs":  # each response: the log probs of its ids (prefix included), and its new tokens'
        import json

        got = [lp for r in sent for lp in r["output_log_probs"].reshape(-1)[int(r["prefix_length"][0, 0]):]]
        assert got == pytest.approx([-t / 100 for t in expected])
        top = [entry for r in sent for entry in json.loads(r["top_log_probs"][0, 0])]
        assert top == [[t, pytest.approx(-t / 100), []] for t in expected]
    else:
        assert all("output_log_probs" not in r for r in sent)  # the gate fills in neutral ones


def test_log_probs_cut_with_the_answer_at_a_stop_word_and_max_tokens():
    target = toy(7)
    full = ToyEngines(target, target)._greedy(target, PROMPT, 30)
    word = tuple(full[12:14])
    stop = next(i for i in range(1, len(full)) if tuple(full[i - 1:i + 1]) == word)
    sent = run(ToyEngines(target, target, stream_chunk=5),
               request_tensors(PROMPT, 30, stream=True, stop_words=[word], return_log_probs=True))
    got = [lp for r in sent for lp in r["output_log_probs"].reshape(-1)[int(r["prefix_length"][0, 0]):]]
    assert tokens_of(sent) == full[:stop + 1] and got == pytest.approx([-t / 100 for t in full[:stop + 1]])


def test_the_targets_log_probs_are_read_from_the_end_of_what_it_returns():
    """TensorRT-LLM's output_log_probs hold every generated token's so far, streaming too: a response's new tokens
    are the last ones. None where they were asked for is an error, not zeros."""
    from pipeline.triton.draft_target import EngineCallError, _new_log_probs

    assert _new_log_probs({"output_log_probs": np.array([[[-1.0, -2.0, -3.0]]], np.float32)}, 2) == [-2.0, -3.0]
    assert _new_log_probs({"output_log_probs": np.array([[[-1.0]]], np.float32)}, 1) == [-1.0]
    with pytest.raises(EngineCallError, match="no output_log_probs"):
        _new_log_probs({}, 1)
    with pytest.raises(EngineCallError, match="1 log probs for 2 tokens"):
        _new_log_probs({"output_log_probs": np.array([[[-1.0]]], np.float32)}, 2)


@pytest.mark.parametrize("speculate", [True, False])
def test_stops_on_end_id_and_on_a_stop_word(speculate):
    target = toy(7)
    full = ToyEngines(target, target)._greedy(target, PROMPT, 30)
    end_id = full[9]
    first = full.index(end_id)
    sent = run(ToyEngines(target, toy(8), end_id=end_id), request_tensors(PROMPT, 30, end_id=end_id),
               speculate=speculate)
    assert tokens_of(sent) == full[:first + 1]
    word = tuple(full[12:14])
    stop = next(i for i in range(1, len(full)) if tuple(full[i - 1:i + 1]) == word)
    sent = run(ToyEngines(target, toy(8)), request_tensors(PROMPT, 30, stop_words=[word]), speculate=speculate)
    assert tokens_of(sent) == full[:stop + 1]


def test_cancellation_stops_between_iterations():
    target = toy(7)
    engines = ToyEngines(target, target)
    sent = run(engines, request_tensors(PROMPT, 200, stream=True), cancel_after=2)
    assert len(sent) == 2 and len(engines.calls) == 4


def test_streamed_chunks_resend_a_prefix_for_split_characters():
    target = toy(7)
    sent = run(ToyEngines(target, target), request_tensors(PROMPT, 20, stream=True))
    # Each chunk after the first resends up to PREFIX_TOKENS (6) already-sent ids, and brings new ones.
    assert [int(r["prefix_length"][0, 0]) for r in sent] == [0, 5, 6, 6]
    assert all(r["output_ids"].shape[1] > int(r["prefix_length"][0, 0]) for r in sent)


def test_the_prefix_counts_only_text_tokens():
    """Ids past the tokenizer's vocabulary decode to nothing: a run of them must not push a split
    character's first bytes out of the resent prefix."""
    sent = []
    emit = Emitter(TritonRequest.from_tensors(request_tensors(PROMPT, 20, stream=True)), sent.append, lambda t: t < 50)
    for t in [1, 2, 3] + [99] * 7 + [4]:
        emit.add([t])
    assert sent[-1]["output_ids"].tolist() == [[1, 2, 3] + [99] * 7 + [4]]
    assert int(sent[-1]["prefix_length"][0, 0]) == 10


def test_a_stop_word_straddling_two_steps_still_stops():
    r = TritonRequest.from_tensors(request_tensors(PROMPT, 9, stop_words=[(4, 5, 6)]))
    assert stop_at([1, 4], [5, 6, 7], r) == 2
    assert stop_at([1, 4, 5], [6], r) == 1
    assert stop_at([], [4, 5], r) is None


def test_accepted_count_reads_the_targets_answer():
    assert accepted_count([1, 2, 3], [1, 2, 9]) == (2, False)
    assert accepted_count([1, 2, 3], [1, 2, 3, 4]) == (3, False)
    assert accepted_count([1, 2, 3], [7]) == (0, False)
    assert accepted_count([1, 2, 3], [1, 2]) == (2, True)  # stopped on an end_id left out of the output
    assert accepted_count([], [5]) == (0, False)
    assert accepted_count([1, 2, 3], [1, 9, 5, 6]) == (1, False)  # tokens past the correction are the target's


def test_stop_words_round_trip_tensorrtllm_layout():
    words = ((5,), (7, 8, 9), (2, 2))
    tensor = stop_words_tensor(words)
    assert tensor.tolist() == [[[5, 7, 8, 9, 2, 2], [1, 4, 6, -1, -1, -1]]]
    assert parse_stop_words(tensor) == words
    assert parse_stop_words(np.array([[[-1], [-1]]], np.int32)) == ()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_tensors_sent_to_tensorrt_llm_are_inputs_of_its_config_with_their_dtype_and_rank(temperature):
    from pipeline.triton.draft_target import TritonEngines
    from pipeline.triton.interface import TRTLLM_INPUTS

    dtypes = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
    specs = {t.name: t for t in TRTLLM_INPUTS}
    request = TritonRequest.from_tensors(request_tensors(PROMPT, 9, end_id=2, stop_words=[(4, 5)], temperature=temperature))
    engines = TritonEngines("tensorrt_llm", "tensorrt_llm_draft", request, lambda: False)
    sent = engines._inputs(PROMPT, 4, greedy=request.greedy, streaming=True) | {
        "draft_input_ids": np.array([[1, 2]], np.int32)}
    for name, value in sent.items():
        spec = specs[name]
        assert value.dtype == dtypes[spec.dtype], name
        assert value.ndim == 1 + len(spec.dims), name  # the batch dim, then the config's dims
    assert {t.name for t in TRTLLM_INPUTS if not t.optional} <= set(sent)
    assert ("temperature" in sent) == (temperature > 0)


def test_penalties_and_log_probs_reach_the_target_as_tensorrt_llms_own_inputs():
    from pipeline.triton.draft_target import LOG_PROBS_OUTPUT, SENT_INPUTS, TRTLLM_OUTPUTS, TritonEngines
    from pipeline.triton.interface import TRTLLM_INPUTS
    from pipeline.triton.interface import TRTLLM_OUTPUTS as OUTPUTS

    specs = {t.name: t for t in TRTLLM_INPUTS}
    request = TritonRequest.from_tensors(request_tensors(PROMPT, 9, repetition_penalty=1.3, presence_penalty=0.5,
                                                         return_log_probs=True))
    sent = TritonEngines("tensorrt_llm", "tensorrt_llm_draft", request, lambda: False)._decode_inputs(PROMPT, 9)
    assert sent["repetition_penalty"].tolist() == [[pytest.approx(1.3)]]
    assert sent["presence_penalty"].tolist() == [[0.5]]
    assert "frequency_penalty" not in sent and sent["return_log_probs"].tolist() == [[True]]
    for name, value in sent.items():
        assert SENT_INPUTS[name] == specs[name].dtype and value.ndim == 1 + len(specs[name].dims), name
    assert set(TRTLLM_OUTPUTS + [LOG_PROBS_OUTPUT]) <= {t.name for t in OUTPUTS}
    plain = TritonRequest.from_tensors(request_tensors(PROMPT, 9))
    assert set(TritonEngines("t", "d", plain, lambda: False)._decode_inputs(PROMPT, 9)) & {
        "repetition_penalty", "presence_penalty", "frequency_penalty", "return_log_probs",
        "guided_decoding_guide_type", "guided_decoding_guide"} == set()


@pytest.mark.parametrize("guide_type, guide", [("json_schema", '{"type": "object"}'), ("regex", r"\d+"),
                                               ("json", "")])
def test_a_guide_reaches_the_target_as_upstreams_guided_decoding_inputs(guide_type, guide):
    from pipeline.triton.draft_target import SENT_INPUTS, TritonEngines
    from pipeline.triton.interface import TRTLLM_INPUTS

    specs = {t.name: t for t in TRTLLM_INPUTS}
    request = TritonRequest.from_tensors(request_tensors(PROMPT, 9, guide_type=guide_type, guide=guide))
    assert (request.guide_type, request.guide, request.plain_reason) == (guide_type, guide, "guided")
    sent = TritonEngines("tensorrt_llm", "tensorrt_llm_draft", request, lambda: False)._decode_inputs(PROMPT, 9)
    assert sent["guided_decoding_guide_type"].tolist() == [[guide_type.encode()]]
    # upstream's "json" takes no guide text: none is sent
    assert ("guided_decoding_guide" in sent) == bool(guide)
    for name, value in sent.items():
        assert SENT_INPUTS[name] == specs[name].dtype and value.ndim == 1 + len(specs[name].dims), name


def test_request_reads_the_gate_tensors():
    r = TritonRequest.from_tensors(request_tensors(PROMPT + [0, 0], 9, stream=True, end_id=2) |
                             {"input_lengths": np.array([[5]], np.int32)})
    assert (r.prompt, r.max_tokens, r.end_id, r.stream, r.greedy) == (tuple(PROMPT), 9, 2, True, True)


# ---- served: a trtllm repository with stand-in engine models, on a real tritonserver ------------

MAX_TOKENS = 40
DRAFT_MAX_INPUT_LEN = 120  # past every test prompt + MAX_TOKENS


def standin_repo(root: Path, target: Path, draft: Path, guided: bool = False) -> Path:
    from pipeline.policy.gate_policy import GatePolicy
    from pipeline.triton.assemble import write_repository
    from pipeline.triton.config import TRTLLM_DRAFT, TRTLLM_TARGET, RepoSpec, read_config, write_config

    spec = RepoSpec(backend="trtllm", tokenizer_dir=str(target), engine_dir=str(target), draft_engine_dir=str(draft),
                    max_batch_size=16, max_seq_len=256, num_draft_tokens=3,
                    gate=GatePolicy(max_batch_size=16, hysteresis=2, min_tokens=0),
                    guide_tokenizer_info=str(root / "xgrammar_tokenizer_info.json") if guided else "")
    repo = root / "repo"
    repo.mkdir(parents=True)
    write_repository(repo, spec)
    for name in (TRTLLM_TARGET, TRTLLM_DRAFT):  # same names and interface, backend python
        msg = read_config(repo / name)
        msg.backend = "python"
        msg.parameters["standin_max_draft_len"].string_value = str(spec.num_draft_tokens)
        if name == TRTLLM_DRAFT:  # a draft engine built for shorter inputs than the target's
            msg.parameters["standin_max_input_len"].string_value = str(DRAFT_MAX_INPUT_LEN)
        write_config(repo / name, msg)
        shutil.copyfile(Path(__file__).parent / "trtllm_standin.py", repo / name / "1" / "model.py")
    return repo


@pytest.fixture(scope="module", params=["same_draft", "other_draft"])
def served(request, tiny_target, tiny_draft, tmp_path_factory):
    from pipeline.triton.ports import free_ports
    from pipeline.triton.server import ServeOptions, TritonServer, find_tritonserver

    binary = find_tritonserver()
    draft = tiny_target if request.param == "same_draft" else tiny_draft
    # The same-draft repository's target has guided decoding on (compile wrote its tokenizer file), the other's not.
    repo = standin_repo(tmp_path_factory.mktemp("trtllm"), tiny_target, draft, guided=request.param == "same_draft")
    grpc, http, metrics = free_ports()
    with TritonServer(ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics), binary) as srv:
        yield request.param, srv


@pytest.fixture(scope="module")
def reference(tiny_target):
    """prompt, max_tokens -> the target-only greedy text, decoded as postprocessing decodes it."""
    from trtllm_standin import greedy_generate, load_model

    from pipeline.engine.config import ModelConfig
    from pipeline.models.tokenizer import answer_text, encode_prompt, load_tokenizer, stop_token_ids

    model, tokenizer = load_model(str(tiny_target)), load_tokenizer(tiny_target)
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(tiny_target).eos_token_ids)

    def text(prompt: str, max_tokens: int, *, as_ids: bool = False):
        ids = encode_prompt(tokenizer, prompt, raw=False)
        out = greedy_generate(model, ids, max_tokens, stops[0])
        for i, t in enumerate(out):
            if t in stops:
                out = out[:i + 1]
                break
        if as_ids:
            return ids, out
        return answer_text(tokenizer, out)  # as every route sends it
    return text


def ask(url: str, prompt: str, max_tokens: int, *, stream: bool = True, speculation: str = "auto",
        num_draft_tokens: int | None = None, leave_after: int | None = None) -> list[tuple[str, int, int]]:
    """(text, accepted, drafted) per response on a connection of its own; leave_after: cancel after that many."""
    import tritonclient.grpc as grpcclient

    extra = [tensor("num_draft_tokens", np.array([[num_draft_tokens]], np.int32), "INT32")] if num_draft_tokens else []
    client = grpcclient.InferenceServerClient(url)
    try:
        return responses(client, prompt, max_tokens, stream, speculation, extra=extra, leave_after=leave_after,
                         timeout=120)
    finally:
        client.close()


@pytest.mark.slow  # two tritonservers with five python models each: 20-60 s to start on 2 cores
def test_served_answers_equal_target_only_greedy_streamed_or_not_speculating_or_not(served, reference):
    kind, server = served
    prompt = "abcabcabc hello"
    expected = reference(prompt, MAX_TOKENS)
    [(text, accepted, drafted)] = ask(server.endpoints.grpc, prompt, MAX_TOKENS, stream=False)
    assert text == expected and 0 <= accepted <= drafted and drafted > 0
    if kind == "same_draft":
        assert accepted == drafted
    # More drafts than the engine was built for (its max_draft_len, 3): refused in one line, never clamped.
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="num_draft_tokens 10 is more than the 3 drafts"):
        ask(server.endpoints.grpc, prompt, MAX_TOKENS, stream=False, num_draft_tokens=10)
    [(text, _, _)] = ask(server.endpoints.grpc, prompt, MAX_TOKENS, stream=False, num_draft_tokens=3)
    assert text == expected
    for speculation in ("auto", "off"):
        chunks = ask(server.endpoints.grpc, prompt, MAX_TOKENS, speculation=speculation)
        assert "".join(t for t, _, _ in chunks) == expected and len(chunks) > 1
        accepted, drafted = sum(a for _, a, _ in chunks), sum(d for _, _, d in chunks)
        assert (drafted == 0) == (speculation == "off") and 0 <= accepted <= drafted
        if kind == "same_draft":
            assert accepted == drafted


@pytest.mark.slow
def test_penalties_and_log_probs_are_tensorrt_llms_own_and_top_n_is_refused_in_one_line(served, reference,
                                                                                        tiny_target):
    """The target gets repetition_penalty and return_log_probs as its own inputs and answers alone: the text is its
    penalised greedy answer, output_log_probs its log probs (sent whole each time, read from the end)."""
    import tritonclient.grpc as grpcclient
    from serving_checks import ensemble_results
    from tritonclient.utils import InferenceServerException
    from trtllm_standin import load_model, penalised_next

    from pipeline.engine.config import ModelConfig
    from pipeline.models.tokenizer import answer_text, encode_prompt, load_tokenizer, stop_token_ids

    _, server = served
    prompt, n = "abcabcabc hello", 24
    model, tokenizer = load_model(str(tiny_target)), load_tokenizer(tiny_target)
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(tiny_target).eos_token_ids)
    ids, out, logprobs = encode_prompt(tokenizer, prompt, raw=False), [], []
    while len(out) < n and not (out and out[-1] in stops):
        token, logprob = penalised_next(model, ids + out, len(ids), 1.2)
        out.append(token)
        logprobs.append(logprob)
    assert answer_text(tokenizer, out) != reference(prompt, n)  # the penalty changed the answer
    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    try:
        for stream in (False, True):
            results = ensemble_results(client, prompt, n, stream, repetition_penalty=np.array([[1.2]], np.float32),
                                       return_log_probs=np.array([[True]]))
            assert "".join(r.as_numpy("text_output")[0, 0].decode() for r in results) == answer_text(tokenizer, out)
            got = [float(v) for r in results for v in r.as_numpy("output_log_probs").reshape(-1)]
            assert got == pytest.approx(logprobs, abs=1e-5)
            assert sum(float(r.as_numpy("cum_log_probs").reshape(-1)[0]) for r in results) == \
                pytest.approx(sum(logprobs), abs=1e-4)
            assert sum(int(r.as_numpy("num_drafted_tokens")[0, 0]) for r in results) == 0
        with pytest.raises(InferenceServerException, match="num_logprobs 2 isn't served on the TensorRT-LLM route"):
            ensemble_results(client, prompt, n, True, return_log_probs=np.array([[True]]),
                             num_logprobs=np.array([[2]], np.int32))
        [(text, _, _)] = responses(client, prompt, n, stream=False)
        assert text == reference(prompt, n)
    finally:
        client.close()


@pytest.mark.slow
def test_a_guide_goes_to_the_target_alone_by_upstreams_names_or_is_refused_where_guided_decoding_is_off(served,
                                                                                                      reference):
    import tritonclient.grpc as grpcclient
    from serving_checks import ensemble_results
    from tritonclient.utils import InferenceServerException

    kind, server = served
    prompt, n = "abcabcabc hello", 16
    guide = dict(guided_decoding_guide_type=np.array([[b"regex"]], np.object_),
                 guided_decoding_guide=np.array([[rb"[a-z ]+"]], np.object_))
    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    try:
        if kind == "same_draft":
            results = ensemble_results(client, prompt, n, True, **guide)
            # The stand-in applies no grammar: the answer is the target's own, drafted by nobody.
            assert "".join(r.as_numpy("text_output")[0, 0].decode() for r in results) == reference(prompt, n)
            assert sum(int(r.as_numpy("num_drafted_tokens")[0, 0]) for r in results) == 0
        else:
            with pytest.raises(InferenceServerException, match="has guided decoding off .*rerun `pipeline compile`"):
                ensemble_results(client, prompt, n, True, **guide)
        [(text, _, _)] = responses(client, prompt, n, stream=False)
        assert text == reference(prompt, n)
    finally:
        client.close()


@pytest.mark.slow
def test_concurrent_streams_each_get_their_own_answer_beside_a_cancelled_one(served, reference):
    _, server = served
    prompts = [f"prompt {i} {'xy' * i}" for i in range(8)]
    got: dict[int, str] = {}
    errors: list[Exception] = []

    def one(i):
        try:
            got[i] = "".join(t for t, _, _ in ask(server.endpoints.grpc, prompts[i], MAX_TOKENS,
                                                  speculation="off" if i % 4 == 3 else "auto"))
        except Exception as err:  # noqa: BLE001  reported below
            errors.append(err)

    leaver = threading.Thread(target=ask, args=(server.endpoints.grpc, "walk away", 200), kwargs={"leave_after": 2})
    threads = [leaver] + [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors
    assert got == {i: reference(p, MAX_TOKENS) for i, p in enumerate(prompts)}
    assert time.monotonic() - start < 180
    # The server still answers after the cancelled stream.
    assert "".join(t for t, _, _ in ask(server.endpoints.grpc, "after", 8)) == reference("after", 8)


@pytest.mark.slow
def test_an_engine_error_mid_stream_reaches_the_client_in_one_line_and_others_go_on(served, reference):
    from tritonclient.utils import InferenceServerException

    _, server = served
    # A prompt whose answer runs past the draft's max_input_len: the draft refuses the step that gets there.
    prompt = next(p for p in (f"long answer {i}" for i in range(50))
                  if sum(map(len, reference(p, 150, as_ids=True))) > DRAFT_MAX_INPUT_LEN + 4)
    with pytest.raises(InferenceServerException, match=r"tensorrt_llm_draft: .*Prompt length \(12\d\) exceeds "
                                                        r"maximum input length \(120\)") as err:
        ask(server.endpoints.grpc, prompt, 150)
    assert "\n" not in str(err.value)
    # Without speculation the target alone answers it; and the next request speculates as before.
    plain = ask(server.endpoints.grpc, prompt, 150, speculation="off")
    assert "".join(t for t, _, _ in plain) == reference(prompt, 150)
    assert "".join(t for t, _, _ in ask(server.endpoints.grpc, "after", 8)) == reference("after", 8)


@pytest.mark.slow
def test_a_request_without_a_required_input_is_refused_naming_it_on_every_transport(served, reference):
    from serving_checks import assert_missing_inputs_refused

    _, server = served
    assert_missing_inputs_refused(server)
    assert "".join(t for t, _, _ in ask(server.endpoints.grpc, "after", 8)) == reference("after", 8)


@pytest.mark.slow
def test_the_server_stops_in_seconds_after_cancelled_failed_and_early_stopped_streams(tiny_target, reference,
                                                                                       tmp_path):
    """A BLS stream left unread, an error followed by a separate final, or a CANCELLED error from a step each
    kept a model alive in Triton 2.51 until its 30 s exit timeout at unload (so a restart waited 30 s)."""
    from tritonclient.utils import InferenceServerException

    from pipeline.triton.ports import free_ports
    from pipeline.triton.server import ServeOptions, TritonServer, find_tritonserver

    repo = standin_repo(tmp_path, tiny_target, tiny_target)
    grpc, http, metrics = free_ports()
    server = TritonServer(ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics),
                          find_tritonserver())
    with server:
        url = server.endpoints.grpc
        ask(url, "abc", 6, speculation="off")  # streamed: the target's stream ends after its last token
        ask(url, "walk away", 200, leave_after=2)  # a client that leaves mid-stream
        prompt = next(p for p in (f"long answer {i}" for i in range(50))
                      if sum(map(len, reference(p, 150, as_ids=True))) > DRAFT_MAX_INPUT_LEN + 4)
        with pytest.raises(InferenceServerException):  # the draft refuses a step: an engine error mid-stream
            ask(url, prompt, 150)
        start = time.monotonic()
    assert time.monotonic() - start < 20  # about 4 s; Triton's exit timeout is 30 s
