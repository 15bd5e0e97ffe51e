"""Guided decoding (pipeline/engine/guide.py): a guide holds the output to its grammar, a bad guide fails its own
request in one line, and speculation changes no token of a guided greedy answer.

The models are seeded tiny random Llamas with a byte-level tokenizer: a grammar then decides almost every token,
and the random model picks among what it allows, so answers differ per prompt and per guide.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine.guide import Guide, GuideSpec, tokenizer_for
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.request import FinishReason
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import RequestError
from pipeline.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_eagle3_head, make_tiny_llama  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "colour", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
REGEX = r"(yes|no), [0-9]{1,3} (cats|dogs)\."
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "[" [0-9] "]"'


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("guide-target"), seed=3, layers=2)


@pytest.fixture(scope="module")
def tokenizer(target):
    return load_tokenizer(target)


def engine(target, tokenizer, draft=None, **config) -> LLMEngine:
    e = LLMEngine.load(target, EngineConfig(max_batch_size=4, max_seq_len=256, num_draft_tokens=3,
                                            gate=GatePolicy(min_tokens=0), **config), draft=draft)
    e.tokenizer = tokenizer
    return e


def test_a_guide_spec_names_what_is_wrong():
    with pytest.raises(RequestError, match="'yaml' is not one of json, json_schema, regex, ebnf_grammar"):
        GuideSpec("yaml", "a: 1")
    with pytest.raises(RequestError, match="a regex guide needs its text"):
        GuideSpec("regex")
    with pytest.raises(RequestError, match="the most is 65536"):
        GuideSpec("regex", "a" * 70_000)
    GuideSpec("json")  # any JSON needs no text


@pytest.mark.parametrize("spec, message", [
    (GuideSpec("regex", "(ab"), "the regex guide doesn't compile: .*unclosed group"),
    (GuideSpec("json_schema", "{not json"), "the json_schema guide is not JSON"),
    (GuideSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GuideSpec("json_schema", '{"type": "frob"}'), "the json_schema guide doesn't compile"),
    (GuideSpec("ebnf_grammar", "root ::= item"), "ebnf_grammar guide"),
    # issue 52: guides no text matches were a 200 with an empty answer, finish stop
    (GuideSpec("regex", r"a+[^\s\S]"), "the regex guide matches no text"),
    (GuideSpec("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
     "matches no JSON value: every value it allows goes through \\$ref '#/\\$defs/a' again"),
    (GuideSpec("json_schema", json.dumps({"type": "object", "required": ["x"], "properties": {"x": {
        "$ref": "#/$defs/a"}}, "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {
            "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}}})), "matches no JSON value"),
    (GuideSpec("ebnf_grammar", 'root ::= "x" root'), "the ebnf_grammar guide matches no text: its rules root only"),
    (GuideSpec("ebnf_grammar", 'root ::= "<" v ">"\nv ::= o | a\no ::= "{" v "}"\na ::= "[" v ("," v)* "]"'),
     "matches no text: its rules root, v, o, a only ever recurse"),
])
def test_a_bad_guide_fails_its_request_alone_in_one_line(target, tokenizer, spec, message):
    e = engine(target, tokenizer)
    with pytest.raises(RequestError, match=message) as err:
        e.add_request([5, 6, 7], SamplingParams(max_tokens=4, guide=spec))
    assert "\n" not in str(err.value)
    [ok] = e.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # the engine goes on
    assert len(ok.output_ids) == 4


def test_a_recursive_schema_with_a_way_out_is_served(target, tokenizer):
    """The $ref check refuses only schemas with no value: a list whose `next` is optional, or a tree whose children
    may be empty, has finite values and compiles."""
    from pipeline.engine.guide import looping_ref

    linked = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}}}}}
    tree = {"type": "object", "required": ["kids"], "properties": {"kids": {"type": "array", "items": {
        "$ref": "#"}}}}
    either = {"anyOf": [{"$ref": "#"}, {"type": "null"}]}
    assert looping_ref(linked) is looping_ref(tree) is looping_ref(either) is None
    e = engine(target, tokenizer)
    [req] = e.generate([[5, 6, 7]], SamplingParams(max_tokens=40, guide=GuideSpec("json_schema", json.dumps(linked))))
    assert req.error is None


@pytest.mark.parametrize("gbnf", [
    'root ::= "x" root | "y"',
    'root ::= x{0,3} "z"\nx ::= "a" x',  # x never ends, but root may hold none of it
    'root ::= "<" v ">"\nv ::= o | a | "n"\no ::= "{" v "}"\na ::= "[" (v ("," v)*)? "]"  # a way out: "n", "[]"',
])
def test_a_recursive_grammar_with_a_way_out_compiles(target, tokenizer, gbnf):
    """The grammar check refuses only grammars with no finite string; recursion with a base case, or behind a part
    that may be left out, compiles and is served."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    from pipeline.engine.guide import endless_rules

    assert endless_rules(gbnf_to_lark(gbnf)) is None
    [req] = engine(target, tokenizer).generate([[5, 6, 7]], SamplingParams(
        max_tokens=8, guide=GuideSpec("ebnf_grammar", gbnf)))
    assert req.error is None


def test_a_guide_compiled_off_the_stepping_thread_answers_as_one_compiled_in_add_request(target, tokenizer):
    """The served engine compiles a request's guide where Triton hands it the request, not on the thread that
    steps every request (torch_engine._parse); the answer is the same."""
    import threading

    spec = GuideSpec("regex", REGEX)
    params = SamplingParams(max_tokens=30, guide=spec)
    e = engine(target, tokenizer)
    compiled = []
    worker = threading.Thread(target=lambda: compiled.append(e.compile_guide(spec)))
    worker.start()
    worker.join()
    handed = e.add_request([5, 6, 7], params, guide=compiled[0])
    own = e.add_request([5, 6, 7], params)
    while e.has_unfinished():
        e.step()
    assert handed.output_ids == own.output_ids and handed.guide is compiled[0]
    with pytest.raises(ValueError, match="isn't the one params.guide names"):
        e.add_request([5], SamplingParams(guide=GuideSpec("json")), guide=e.compile_guide(spec))
    with pytest.raises(RequestError, match="matches no text"):
        e.compile_guide(GuideSpec("regex", "a+[^\\s\\S]"))


def test_a_guide_needs_the_engines_tokenizer(target):
    e = LLMEngine.load(target, EngineConfig(max_batch_size=1, max_seq_len=64))
    with pytest.raises(RequestError, match="guided decoding needs the engine's tokenizer"):
        e.add_request([5], SamplingParams(guide=GuideSpec("json")))


def test_verify_rows_are_masked_by_the_state_after_their_drafts_and_then_rolled_back(tokenizer):
    guide = Guide(GuideSpec("regex", REGEX), tokenizer_for(tokenizer), vocab_size=320)
    ids = tokenizer.encode("yes, 4", add_special_tokens=False)  # one token per byte
    before = guide.allowed()
    assert before.sum() == 2 and before[tokenizer.encode("y")[0]] and before[tokenizer.encode("n")[0]]
    assert not before[256:].any()  # past the tokenizer's vocabulary: never allowed
    wrong = ids[:3] + tokenizer.encode("x", add_special_tokens=False)
    refused = guide.row_refusals(wrong)
    assert guide.valid_prefix(wrong) == 3 and refused.shape == (5, 320)
    assert torch.equal(guide.allowed(), before)  # rolled back: nothing was taken
    step = Guide(GuideSpec("regex", REGEX), tokenizer_for(tokenizer), vocab_size=320)
    for j in range(4):  # row j: the grammar after the first j drafts; the row past the refused draft: refuses none
        assert torch.equal(refused[j], ~step.allowed()), j
        if j < 3:
            step.advance([wrong[j]])
    assert not refused[4].any()


def answer(tokenizer, req) -> str:
    return tokenizer.decode(req.output_ids, skip_special_tokens=True)


@pytest.mark.parametrize("spec, check", [
    (GuideSpec("json_schema", json.dumps(SCHEMA)), lambda text: set(json.loads(text)) == {"n", "colour", "ok"}),
    (GuideSpec("json"), lambda text: isinstance(json.loads(text), (dict, list))),
    (GuideSpec("regex", REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    (GuideSpec("ebnf_grammar", GBNF), lambda text: re.fullmatch(r"\((?:[a-c]|\[\d\])(?:,(?:[a-c]|\[\d\]))*\)", text)),
], ids=["json_schema", "json", "regex", "ebnf"])
def test_greedy_with_a_guide_is_the_same_with_every_draft_and_in_a_batch(target, tokenizer, tmp_path, spec, check):
    """Speculation and batching change no token of a guided greedy answer; each finished answer matches its
    guide (a random model stops where the grammar lets it end, at its end token)."""
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], [9] * 12]
    params = SamplingParams(max_tokens=60, guide=spec)
    plain = engine(target, tokenizer)
    alone = [plain.generate([p], params)[0] for p in prompts]
    texts = [answer(tokenizer, r) for r in alone]
    assert len(set(texts)) > 1 or spec.type == "json"  # the model's choices within the grammar differ by prompt
    for r, text in zip(alone, texts):
        if r.finish_reason is FinishReason.STOP:
            assert check(text), text
    assert any(r.finish_reason is FinishReason.STOP for r in alone) or spec.type == "json"
    expected = [r.output_ids for r in alone]
    assert [r.output_ids for r in plain.generate(prompts, params)] == expected
    head = make_tiny_eagle3_head(tmp_path / "head", target, seed=0)
    for draft in ("ngram", str(target), f"eagle3:{head}"):
        spec_engine = engine(target, tokenizer, draft=draft)
        got = spec_engine.generate(prompts, params, speculation="on")
        assert [r.output_ids for r in got] == expected, draft
        stats = spec_engine.stats
        assert stats.drafted_tokens > 0 or draft == "ngram", draft  # short answers may repeat no n-gram
        if draft == str(target):  # the target as its own draft, drafting under the same grammar: every draft kept
            assert stats.accepted_tokens == stats.drafted_tokens


def test_log_probs_are_the_masked_distributions(target, tokenizer):
    e = engine(target, tokenizer)
    [r] = e.generate([[5, 6, 7]], SamplingParams(max_tokens=6, logprobs=5, guide=GuideSpec("regex", REGEX)))
    first = r.logprobs[0]
    # The first token is "y" or "n": the masked distribution has two tokens, whose probabilities sum to 1.
    live = [(t, lp) for t, lp in first.top if lp > -9999.0]  # what a mask or top-k rules out is reported so
    assert {t for t, _ in live} == set(tokenizer.encode("yn", add_special_tokens=False))
    assert sum(torch.tensor([lp for _, lp in live]).exp().tolist()) == pytest.approx(1.0, abs=1e-5)
