"""`pipeline` through click's CliRunner, on the seeded tiny models (and one slow run on SmolLM2)."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_llama

from pipeline import __version__
from pipeline.cli import main
from cli_checks import assert_one_line_error  # noqa: E402

STATS_KEYS = {"steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
              "acceptance_per_position", "spec_steps", "nonspec_steps", "generated_tokens", "tokens_per_s",
              "failed_requests", "proposer_failures", "skip_reasons", "verified_rows", "draft_cost"}
# Repetitive, so prompt lookup finds n-grams to draft from.
COPY_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_json(*args: str) -> dict:
    result = run("generate", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---- root group ---------------------------------------------------------------------------------

def test_help_lists_generate():
    result = run("--help")
    assert result.exit_code == 0
    assert "generate" in result.output


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert __version__ in result.output


def test_help_does_not_import_torch_or_transformers():
    code = ("import sys; from click.testing import CliRunner; from pipeline.cli import main; "
            "r = CliRunner().invoke(main, ['generate', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- output -------------------------------------------------------------------------------------

def test_json_has_exactly_the_documented_keys(tiny_target):
    data = run_json("hello", "--model", tiny_target, "--max-tokens", 8)
    assert set(data) >= {"outputs", "stats"}
    assert set(data) <= {"outputs", "stats", "config"}
    assert len(data["outputs"]) == 1
    out = data["outputs"][0]
    assert set(out) == {"prompt", "text", "token_ids", "speculation"}
    assert out["speculation"] == {"draft_steps": 0, "skipped_steps": {}}  # no draft: nothing to explain
    assert out["prompt"] == "hello"
    assert isinstance(out["text"], str)
    assert 1 <= len(out["token_ids"]) <= 8
    assert set(data["stats"]) == STATS_KEYS
    assert data["stats"]["generated_tokens"] == len(out["token_ids"])
    assert data["stats"]["drafted_tokens"] == 0


def test_text_output_prints_the_generation_and_a_stats_line_on_stderr(tiny_target):
    expected = run_json("hello", "--model", tiny_target, "--max-tokens", 8)["outputs"][0]["text"]
    result = run("generate", "hello", "--model", tiny_target, "--max-tokens", 8)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"
    assert "tok/s" in result.stderr and "draft none" in result.stderr


def test_raw_skips_the_chat_template(tiny_target):
    chat = run_json("hi", "--model", tiny_target, "--max-tokens", 4)
    raw = run_json("hi", "--model", tiny_target, "--max-tokens", 4, "--raw")
    assert chat["config"]["chat_template"] is True
    assert raw["config"]["chat_template"] is False


def test_ngram_and_draft_model_give_the_same_greedy_tokens_as_no_draft(tiny_target, tiny_draft):
    # fp32: in bf16 a k+1-token verify forward rounds differently from a 1-token step, so a near-tie
    # (this model has a 0.014 logit gap at token 11) can flip; the guarantee is exact in fp32.
    common = [COPY_PROMPT, "--model", tiny_target, "--max-tokens", 40, "--raw", "--dtype", "fp32",
              "--min-spec-tokens", 0]
    plain = run_json(*common, "--draft", "none")
    ngram = run_json(*common, "--draft", "ngram")
    drafted = run_json(*common, "--draft", tiny_draft, "--num-draft-tokens", 3)
    assert ngram["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    assert drafted["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    assert ngram["stats"]["drafted_tokens"] > 0 and drafted["stats"]["drafted_tokens"] > 0
    assert drafted["config"]["draft"] == tiny_draft.name


def test_short_requests_do_not_speculate_below_min_spec_tokens(tiny_target):
    data = run_json(COPY_PROMPT, "--model", tiny_target, "--raw", "--draft", "ngram", "--max-tokens", 10)
    assert data["stats"]["drafted_tokens"] == 0  # default --min-spec-tokens is 50


# ---- several prompts ----------------------------------------------------------------------------

PROMPTS = ["hello there", "write a poem", COPY_PROMPT]


def test_jsonl_prompts_file_decodes_every_prompt_in_one_batch(tiny_target, tmp_path):
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    data = run_json("--prompts-file", file, "--model", tiny_target, "--max-tokens", 12, "--dtype", "fp32")
    assert [o["prompt"] for o in data["outputs"]] == PROMPTS
    assert data["config"]["max_batch_size"] == len(PROMPTS)
    alone = [run_json(p, "--model", tiny_target, "--max-tokens", 12, "--dtype", "fp32")["outputs"][0]
             for p in PROMPTS]
    assert [o["token_ids"] for o in data["outputs"]] == [o["token_ids"] for o in alone]


def test_text_prompts_file_has_one_prompt_per_line_after_the_argument(tiny_target, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text("first prompt\n\n{not json\nthird prompt\n")
    data = run_json("zeroth", "--prompts-file", file, "--model", tiny_target, "--max-tokens", 4)
    assert [o["prompt"] for o in data["outputs"]] == ["zeroth", "first prompt", "{not json", "third prompt"]


def test_text_output_separates_several_prompts(tiny_target, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text("one\ntwo\n")
    result = run("generate", "--prompts-file", file, "--model", tiny_target, "--max-tokens", 4)
    assert result.exit_code == 0, result.output
    assert "=== [1/2] one" in result.stdout and "=== [2/2] two" in result.stdout


# ---- bad input: one line, names the problem, no traceback ---------------------------------------

def test_no_prompt_is_a_usage_error(tiny_target):
    result = run("generate", "--model", tiny_target)
    assert result.exit_code == 2
    assert "PROMPT or --prompts-file" in result.output


def test_unknown_model():
    assert_one_line_error(run("generate", "hi", "--model", "no-such-model"), "unknown model 'no-such-model'",
                          "smollm2-135m")


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run("generate", "hi", "--model", tmp_path / "nowhere" / "model"), "no such folder")


def test_unknown_draft(tiny_target):
    assert_one_line_error(run("generate", "hi", "--model", tiny_target, "--draft", "no-such-draft"),
                          "unknown model 'no-such-draft'")


def test_draft_with_another_vocabulary(tiny_target, tmp_path):
    draft = make_tiny_llama(tmp_path / "other-vocab", seed=2, layers=1, hidden=32, heads=2, kv_heads=1,
                            intermediate=64, vocab_size=384, extra_tokens=40)
    result = run("generate", "hi", "--model", tiny_target, "--draft", draft)
    assert_one_line_error(result, "does not share the target's vocabulary", "--draft ngram")


def test_prompt_longer_than_max_seq_len(tiny_target):
    result = run("generate", "a long prompt " * 10, "--model", tiny_target, "--max-seq-len", 16)
    assert_one_line_error(result, "tokens but --max-seq-len is 16", "raise --max-seq-len")


def test_max_tokens_below_one(tiny_target):
    assert_one_line_error(run("generate", "hi", "--model", tiny_target, "--max-tokens", 0), "max_tokens must be >= 1")


def test_num_draft_tokens_below_one(tiny_target):
    result = run("generate", "hi", "--model", tiny_target, "--draft", "ngram", "--num-draft-tokens", 0)
    assert_one_line_error(result, "--num-draft-tokens must be >= 1 (got 0)")


# Each command that takes a shared setting (pipeline/setting.py) reads its flag, bound and meaning from the one
# declaration: the same one-line refusal everywhere (a command's own lower bound where it gives smaller values a
# meaning: generate's --gate-batch-size 0 never speculates, and a draft length of 0 builds without a draft).
SETTING_COMMANDS = {
    "build": ("build", "--dry-run"), "compile": ("compile", "-b", "torch", "-t", "nowhere", "-o", "nowhere-out"),
    "generate": ("generate", "hi", "--model", "nowhere"), "plan": ("plan", "-t", "llama-70b", "-g", "h100"),
    "assemble": ("assemble", "-e", "nowhere"),
}


@pytest.mark.parametrize("command, flag, value, says", [
    ("build", "--max-batch-size", "0", "--max-batch-size must be >= 1 (got 0)"),
    ("build", "--max-seq-len", "1", "--max-seq-len must be >= 2 (got 1)"),
    ("build", "--gate-batch-size", "0", "--gate-batch-size must be >= 1 (got 0)"),
    ("build", "--num-draft-tokens", "-1", "--num-draft-tokens must be >= 0 (got -1)"),
    ("compile", "--gate-batch-size", "0", "--gate-batch-size must be >= 1 (got 0)"),
    ("compile", "--gate-batch-size", "many", "--gate-batch-size takes a whole number or none (got 'many')"),
    ("compile", "--max-batch-size", "0", "--max-batch-size must be >= 1 (got 0)"),
    ("generate", "--max-seq-len", "1", "--max-seq-len must be >= 2 (got 1)"),
    ("generate", "--gate-batch-size", "-1", "--gate-batch-size must be >= 0 (got -1)"),
    ("generate", "--max-batch-size", "x", "--max-batch-size takes a whole number (got 'x')"),
    ("plan", "--max-batch-size", "0", "--max-batch-size must be >= 1 (got 0)"),
    ("plan", "--max-seq-len", "0", "--max-seq-len must be >= 2 (got 0)"),
    ("assemble", "--gate-batch-size", "0", "--gate-batch-size must be >= 1 (got 0)"),
    ("assemble", "--max-queue-size", "-1", "--max-queue-size must be >= 0 (got -1)"),
])
def test_a_shared_setting_out_of_bounds_is_one_line_on_every_command(command, flag, value, says):
    assert_one_line_error(run(*SETTING_COMMANDS[command], flag, value), says)


@pytest.mark.parametrize("command", list(SETTING_COMMANDS))
def test_a_shared_settings_help_is_its_declared_meaning_on_every_command(command):
    from pipeline.setting import SETTINGS

    options = {o.name: o for o in main.commands[command].params}
    taken = [s for s in SETTINGS if s.name in options]
    assert taken, command
    for setting in taken:
        option = options[setting.name]
        assert setting.flag in option.opts and option.help.startswith(setting.meaning), (command, setting.name)


def test_empty_prompts_file(tiny_target, tmp_path):
    file = tmp_path / "empty.txt"
    file.write_text("\n  \n")
    assert_one_line_error(run("generate", "--prompts-file", file, "--model", tiny_target), "is empty")


def test_jsonl_prompts_file_with_a_bad_line(tiny_target, tmp_path):
    file = tmp_path / "bad.jsonl"
    file.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert_one_line_error(run("generate", "--prompts-file", file, "--model", tiny_target), "bad.jsonl:2")


def test_missing_prompts_file(tiny_target, tmp_path):
    result = run("generate", "--prompts-file", tmp_path / "missing.txt", "--model", tiny_target)
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_a_bad_option_value_exits_2_and_names_its_own_flag(tiny_target, tmp_path):
    """As click's own usage errors: 2. build's two format flags each name themselves."""
    result = run("build", "--target", tiny_target, "--target-qformat", "bogus", "--engines-dir", tmp_path / "e",
                 "--repo", tmp_path / "r", "--dry-run")
    assert result.exit_code == 2
    assert_one_line_error(result, "unknown --target-qformat 'bogus'")
    result = run("quantize", "--model", tiny_target, "--qformat", "bogus", "-o", tmp_path / "q")
    assert result.exit_code == 2
    assert_one_line_error(result, "unknown --qformat 'bogus'")


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch):
    import pipeline.plan

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.plan, "plan_memory", interrupted)
    result = run("plan", "--target", "llama-70b", "--gpu", "h100")
    assert result.exit_code == 130 and result.output == "Interrupted.\n", result.output


# ---- the real default model ---------------------------------------------------------------------

@pytest.mark.slow
def test_ngram_on_the_embedded_default_is_lossless():
    prompt = ("Rewrite this code with comments:\n\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
              "        a, b = b, a + b\n    return a\n")
    # Default --model smollm2-135m; fp32 so the comparison is exact (see the tiny-model test above).
    common = [prompt, "--max-tokens", 32, "--min-spec-tokens", 0, "--dtype", "fp32"]
    plain = run_json(*common, "--draft", "none")
    ngram = run_json(*common, "--draft", "ngram")
    assert ngram["config"]["model"] == "smollm2-135m"
    assert ngram["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    assert ngram["stats"]["drafted_tokens"] > 0
