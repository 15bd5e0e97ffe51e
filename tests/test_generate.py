"""pipeline.generate: the library behind `pipeline generate`, called directly."""

import json

import pytest

from pipeline.errors import ConfigError, DraftMismatchError, ModelNotFoundError, RequestError
from pipeline.generate import GenerateOptions, generate, read_prompts_file, stats_line


def opts(target, *prompts, **kw) -> GenerateOptions:
    return GenerateOptions(prompts=prompts or ("hello",), model=str(target), **{"max_tokens": 8, **kw})


def test_generate_returns_one_output_per_prompt_with_decoded_text(tiny_target):
    result = generate(opts(tiny_target, "hello", "bye", dtype="fp32"))
    assert [o.prompt for o in result.outputs] == ["hello", "bye"]
    for out in result.outputs:
        assert 1 <= len(out.token_ids) <= 8
        assert out.finish_reason in ("stop", "length")
    assert result.info.max_batch_size == 2  # raised to the number of prompts
    assert result.stats["generated_tokens"] == sum(len(o.token_ids) for o in result.outputs)


def test_text_skips_special_tokens(tiny_target):
    from pipeline.models.tokenizer import answer_text, load_tokenizer

    tok = load_tokenizer(tiny_target)
    out = generate(opts(tiny_target, max_tokens=30)).outputs[0]
    assert out.text == answer_text(tok, out.token_ids)


def test_generation_stops_at_the_chat_end_token(tiny_target):
    from pipeline.models.tokenizer import load_tokenizer

    im_end = load_tokenizer(tiny_target).convert_tokens_to_ids("<|im_end|>")
    out = generate(opts(tiny_target, max_tokens=60)).outputs[0]
    assert im_end not in out.token_ids


def test_json_dict_keeps_the_documented_layout(tiny_target):
    data = generate(opts(tiny_target, draft="ngram")).to_json_dict()
    assert list(data) == ["outputs", "stats", "config"]
    assert list(data["outputs"][0]) == ["prompt", "text", "token_ids", "speculation"]
    assert list(data["outputs"][0]["speculation"]) == ["draft_steps", "skipped_steps"]
    assert data["config"]["draft"] == "ngram"
    json.dumps(data)  # serializable as is


def test_stats_line_mentions_acceptance_only_when_drafting(tiny_target):
    plain = generate(opts(tiny_target))
    assert "acceptance" not in stats_line(plain)
    ngram = generate(opts(tiny_target, "abcabcabcabcabcabc", draft="ngram", raw=True, max_tokens=20,
                          min_spec_tokens=0))
    assert ngram.stats["drafted_tokens"] > 0
    assert "acceptance" in stats_line(ngram)


def test_the_draft_cost_is_a_proposal_against_a_target_step(tiny_target, tiny_draft):
    """generate's stats time the proposer's calls and the target's decode steps in the same run: what a proposal
    costs in target steps, the figure that says whether a head pays."""
    plain = generate(opts(tiny_target))
    assert plain.stats["draft_cost"] is None and "a proposal" not in stats_line(plain)
    drafted = generate(opts(tiny_target, "abcabcabcabc", draft=str(tiny_draft), raw=True, max_tokens=24,
                            min_spec_tokens=0))
    cost = drafted.stats["draft_cost"]
    assert drafted.stats["drafted_tokens"] > 0 and cost["proposal_ms"] > 0 and cost["verify_step_ms"] > 0
    assert cost["proposal_vs_verify_step"] == pytest.approx(cost["proposal_ms"] / cost["verify_step_ms"], rel=0.02)
    assert cost["per_drafted_token_ms"] <= cost["proposal_ms"]
    assert f"a proposal {cost['proposal_ms']:.1f} ms" in stats_line(drafted)


def test_the_stats_line_and_each_output_say_why_steps_did_not_draft(tiny_target):
    """Under min_spec_tokens every step is 'short'; the counts add up to the steps in the output and the line."""
    short = generate(opts(tiny_target, "abcabcabcabcabcabc", draft="ngram", raw=True, max_tokens=12,
                          min_spec_tokens=50))
    out = short.outputs[0]
    assert out.draft_steps == 0 and set(out.skipped_steps) == {"short"}
    assert out.skipped_steps["short"] == short.stats["steps"]
    assert f"drafted in 0 of {short.stats['steps']} steps; not in {short.stats['steps']}: short" in stats_line(short)
    plain = generate(opts(tiny_target))
    assert "drafted in" not in stats_line(plain)  # no draft: nothing to explain


def test_small_gate_batch_size_clamps_hysteresis(tiny_target):
    result = generate(opts(tiny_target, draft="ngram", gate_batch_size=1))
    assert result.info.gate_batch_size == 1


# ---- errors are library exceptions, raised before weights load ----------------------------------

def test_errors_are_pipeline_errors(tiny_target, tmp_path):
    with pytest.raises(RequestError, match="max_tokens"):
        generate(opts(tiny_target, max_tokens=0))
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        generate(opts(tiny_target, num_draft_tokens=0))
    with pytest.raises(ConfigError, match="dtype"):
        generate(opts(tiny_target, dtype="int3"))
    with pytest.raises(ModelNotFoundError):
        generate(opts(tmp_path / "missing"))
    with pytest.raises(RequestError, match="no prompt"):
        generate(GenerateOptions(prompts=(), model=str(tiny_target)))


def test_too_long_prompt_names_which_prompt(tiny_target):
    with pytest.raises(RequestError, match=r"prompt 2 is \d+ tokens but --max-seq-len is 16"):
        generate(opts(tiny_target, "ok", "x" * 40, max_seq_len=16, raw=True))


def test_vocab_mismatch_is_a_draft_error(tiny_target, tmp_path):
    from tiny_models import make_tiny_llama

    draft = make_tiny_llama(tmp_path / "d", seed=2, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                            vocab_size=384, extra_tokens=40)
    with pytest.raises(DraftMismatchError):
        generate(opts(tiny_target, draft=str(draft)))


# ---- prompts files ------------------------------------------------------------------------------

def test_jsonl_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b\\nc", "id": 3}\n')
    assert read_prompts_file(f) == ["a", "b\nc"]


def test_jsonl_content_in_a_txt_file_is_read_as_jsonl(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert read_prompts_file(f) == ["a", "b"]


def test_plain_text_file_keeps_lines_that_merely_look_like_json(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('{"prompt": "a"}\nplain line\n')
    assert read_prompts_file(f) == ['{"prompt": "a"}', "plain line"]


def test_bad_jsonl_line_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(RequestError, match=r"p.jsonl:2 is not a JSON object"):
        read_prompts_file(f)


def test_empty_and_unreadable_files(tmp_path):
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(RequestError, match="is empty"):
        read_prompts_file(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(RequestError, match="can't read prompts file"):
        read_prompts_file(tmp_path / "bin.txt")
    with pytest.raises(RequestError, match="can't read prompts file"):
        read_prompts_file(tmp_path / "missing.txt")


def test_auto_dtype_is_the_fastest_lossless_one_here_and_says_why(tiny_target, monkeypatch):
    from pipeline.engine import cpu_kernels
    from pipeline.generate import dtype_line

    monkeypatch.setattr(cpu_kernels, "fast_lossless_dtype", lambda: ("fp32", "a CPU without bf16 instructions"))
    result = generate(opts(tiny_target))
    assert result.info.dtype == "fp32" and dtype_line(result) == "dtype fp32: a CPU without bf16 instructions"
    asked = generate(opts(tiny_target, dtype="bf16"))
    assert asked.info.dtype == "bf16" and "asked for" in dtype_line(asked)
