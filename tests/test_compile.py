"""`pipeline compile`: generated trtllm-build commands and LLM-API YAML checked against TensorRT-LLM 1.2's
own flag and key tables (pipeline/trtllm/reference.py), the checks that run before building, --dry-run
output, and the portable engine folder's round trip through LLMEngine."""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.compiler import CompileOptions, compile_model
from pipeline.compiler.checkpoint import read_checkpoint
from pipeline.compiler.llmapi import LlmApiSettings, llm_api_options, serve_command
from pipeline.compiler.job import derive_sizes
from pipeline.compiler.trtllm_build import build_command, flags_of
from pipeline.draft_spec import DraftSpec, parse_draft
from pipeline.engine import load_engine
from pipeline.engine.config import EngineConfig
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import ConfigError, DraftMismatchError
from pipeline.trtllm import reference as ref
from pipeline.trtllm.version import CONTAINER_APP
from cli_checks import assert_one_line_error  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_trt_checkpoint(folder: Path, tokenizer_from: Path, *, vocab: int = 320, tp: int = 1, pp: int = 1,
                         kv_quant: str | None = None, quant: str | None = None, **shape) -> Path:
    """A minimal TensorRT-LLM checkpoint: what compile reads (config.json, rank files, tokenizer), no weights."""
    folder.mkdir(parents=True)
    config = {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "vocab_size": vocab,
              "max_position_embeddings": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64, "head_size": 16, "intermediate_size": 128,
              "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
              "quantization": {"quant_algo": quant, "kv_cache_quant_algo": kv_quant}, **shape}
    (folder / "config.json").write_text(json.dumps(config))
    for rank in range(tp * pp):
        (folder / f"rank{rank}.safetensors").write_bytes(b"")
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture
def trt(tmp_path, tiny_target):
    def make(name: str, **kw) -> Path:
        return write_trt_checkpoint(tmp_path / name, tiny_target, **kw)
    return make


def run(*args: str):
    return CliRunner().invoke(main, ["compile", *args])


def value_of(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# ---- trtllm-build commands (pure) ---------------------------------------------------------------


def test_target_gets_the_speculative_flags_and_the_draft_builds_plainly(trt, tmp_path):
    target, draft = read_checkpoint(trt("target")), read_checkpoint(trt("draft"))
    sizes = derive_sizes(16, 5, 1024)
    t_cmd = build_command(target, tmp_path / "out/target", sizes, role="target")
    d_cmd = build_command(draft, tmp_path / "out/draft", sizes, role="draft")
    for cmd in (t_cmd, d_cmd):
        assert cmd[0] == "trtllm-build"
        assert set(flags_of(cmd)) <= ref.TRTLLM_BUILD_FLAGS, set(flags_of(cmd)) - ref.TRTLLM_BUILD_FLAGS
        assert len(flags_of(cmd)) == len(set(flags_of(cmd)))
        assert value_of(cmd, "--use_paged_context_fmha") == "enable"  # draft-target needs KV reuse
        assert value_of(cmd, "--gemm_plugin") in ref.GEMM_PLUGIN_CHOICES
        assert int(value_of(cmd, "--max_num_tokens")) >= 16 * (5 + 1)
    assert value_of(t_cmd, "--speculative_decoding_mode") == "draft_tokens_external"
    assert value_of(t_cmd, "--speculative_decoding_mode") in ref.SPECULATIVE_DECODING_MODES
    assert value_of(t_cmd, "--max_draft_len") == "5"
    assert "--speculative_decoding_mode" not in d_cmd and "--max_draft_len" not in d_cmd


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft-target", "target-alone"])
def test_the_smoke_test_turns_on_chunked_context_and_block_reuse_with_pinned_flags(trt, tmp_path, with_draft):
    """run.py hands its flags to the draft's and the target's runner alike; each flag is one add_common_args
    defines, pinned in FEATURE_SETTINGS, and the runtime takes it beside both engines' speculation modes."""
    from pipeline.compiler.trtllm_build import FEATURES, engine_modes, run_command

    target = read_checkpoint(trt("target"))
    cmd = run_command(tmp_path / "target", tmp_path / "draft" if with_draft else None, target.path,
                      derive_sizes(8, 4 if with_draft else 0, 1024), 0.9)
    assert set(flags_of(cmd)) <= ref.RUN_PY_FLAGS, set(flags_of(cmd)) - ref.RUN_PY_FLAGS
    for flag, setting in (("--enable_chunked_context", "enable_chunked_context"),
                          ("--kv_cache_enable_block_reuse", "enable_kv_cache_reuse")):
        assert flag in cmd, flag
        assert ref.FEATURE_SETTINGS[flag].path == ref.EXAMPLES_UTILS and setting in FEATURES
        assert all(ref.combination(setting, mode).allowed for mode in engine_modes(with_draft))
    build = build_command(target, tmp_path / "e", derive_sizes(8, 4, 1024), role="target")
    # Without paged context FMHA the runtime turns both features off at load.
    assert value_of(build, "--use_paged_context_fmha") == "enable"
    assert "--use_paged_context_fmha" in ref.FEATURE_SETTINGS


def test_no_speculative_flags_without_a_draft(trt, tmp_path):
    cmd = build_command(read_checkpoint(trt("target")), tmp_path / "e", derive_sizes(8, 0, 1024), role="target")
    assert "--speculative_decoding_mode" not in cmd and "--max_draft_len" not in cmd


@pytest.mark.parametrize("batch,k,input_len", [(1, 1, 8), (64, 4, 2048), (256, 7, 100), (8, 10, 20000)])
def test_max_num_tokens_covers_a_full_batch_of_drafts_and_a_context_chunk(batch, k, input_len):
    sizes = derive_sizes(batch, k, 32768, max_seq_len=input_len + 100, max_input_len=input_len)
    assert sizes.max_num_tokens >= batch * (k + 1) + min(input_len, 8192)
    assert sizes.max_input_len < sizes.max_seq_len


def test_sizes_that_cant_work_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="can't hold a full batch's draft tokens"):
        derive_sizes(64, 4, 4096, max_num_tokens=100)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        derive_sizes(8, 4, 1024, max_seq_len=2048)
    with pytest.raises(ConfigError, match="--max-input-len"):
        derive_sizes(8, 4, 1024, max_seq_len=512, max_input_len=512)


def test_tp_and_pp_come_from_a_real_quantize_export(tmp_path_factory):
    from tiny_models import make_tiny_llama

    from pipeline.quantize import QuantizeOptions, quantize

    base = tmp_path_factory.mktemp("export")
    source = make_tiny_llama(base / "src", seed=0, layers=2)
    out = base / "trt"
    quantize(QuantizeOptions(model=str(source), output=out, qformat="none", export="trtllm", tp_size=2,
                             calib_seq_len=16, eval_size=2))
    ckpt = read_checkpoint(out)
    assert (ckpt.layout, ckpt.tp_size, ckpt.pp_size, ckpt.vocab_size) == ("trtllm", 2, 1, 320)
    cmd = build_command(ckpt, base / "engine", derive_sizes(4, 4, ckpt.max_position_embeddings), role="target")
    assert value_of(cmd, "--workers") == "2"  # one engine per rank, built in parallel
    assert_one_line_error(run("-b", "trtllm", "-t", str(out), "--tp-size", "1", "--dry-run", "-o", str(base / "x")),
                          "--tp-size 1 disagrees with the checkpoint's mapping (2)")


# ---- LLM-API YAML (pure) ------------------------------------------------------------------------


# Each release's decoding_type strings: 1.2.1's DecodingBaseConfig.from_dict takes "Eagle" (EagleDecodingConfig
# serves EAGLE-3), "DraftTarget", "NGram" and raises "Invalid decoding type" for "Eagle3"/"Draft_Target"; the 1.4
# pre-release's pydantic discriminator takes "Draft_Target", "Eagle3", "NGram".
RELEASE_KINDS = [("1.2.1", "model", "DraftTarget"), ("1.2.1", "eagle3", "Eagle"), ("1.2.1", "ngram", "NGram"),
                 ("1.4.0rc4", "model", "Draft_Target"), ("1.4.0rc4", "eagle3", "Eagle3"), ("1.4.0rc4", "ngram", "NGram")]


@pytest.mark.parametrize("version,kind,decoding_type", RELEASE_KINDS)
def test_llm_api_yaml_uses_only_its_releases_keys_with_the_right_values(version, kind, decoding_type):
    """Checked against the release's own table, not the union of all releases: 1.2.1's speculative_model_dir in
    a 1.4 YAML (or 1.4's speculative_model in a 1.2.1 one) fails here."""
    table = ref.llm_api_table(version)
    draft = DraftSpec(kind, "" if kind == "ngram" else "/ckpt/draft")
    sizes = derive_sizes(64, 3, 4096)
    options = llm_api_options(draft, sizes, LlmApiSettings(gate_batch_size=32, kv_cache_dtype="fp8",
                                                            free_gpu_memory_fraction=0.85, tensorrt_llm_version=version))
    options = yaml.safe_load(yaml.safe_dump(options))  # what TensorRT-LLM will read
    assert set(options) <= table.llm_api_keys, set(options) - table.llm_api_keys
    spec, kv = options["speculative_config"], options["kv_cache_config"]
    assert set(spec) <= table.speculative_config_keys, set(spec) - table.speculative_config_keys
    assert set(kv) <= table.kv_cache_config_keys
    assert spec["decoding_type"] == decoding_type == table.decoding_types[kind]
    assert spec["max_draft_len"] == 3
    if kind != "eagle3" or table.eagle3_gate == "two-model":
        assert spec["max_concurrency"] == 32  # the gate, in TensorRT-LLM's own terms
    assert kv == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True, "dtype": "fp8"}
    assert options["enable_chunked_prefill"] is True
    if kind != "ngram":
        assert spec[table.model_key] == "/ckpt/draft"


def test_the_release_tables_differ_exactly_where_upstream_changed_them():
    """Computed field by field from the two tables; each difference must be one DIFFERENCES_1_2_TO_1_4 names with
    its upstream file and symbol, and each named one must be real."""
    from dataclasses import fields

    old, new = ref.LLM_API_TABLES["1.2"], ref.LLM_API_TABLES["1.4"]
    found: dict[str, tuple] = {}
    for f in fields(ref.LlmApiTable):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name in ("version", "eagle3_gate_where") or a == b:  # where each release's fact was read, not a name
            continue
        if isinstance(a, frozenset):
            found[f.name] = (a - b, b - a)
        elif isinstance(a, dict):
            for key in a.keys() | b.keys():
                if a.get(key) != b.get(key):
                    found[f"{f.name}.{key}"] = (a.get(key), b.get(key))
        else:
            found[f.name] = (a, b)
    for table in (old, new):
        assert table.eagle3_gate_where and all(p.path in ref.SOURCES and p.symbol for p in table.eagle3_gate_where)
    listed: dict[str, tuple] = {}
    for d in ref.DIFFERENCES_1_2_TO_1_4:
        assert d.where.path in ref.SOURCES and d.where.symbol, d.field
        if isinstance(d.old, frozenset):
            was_old, was_new = listed.get(d.field, (frozenset(), frozenset()))
            listed[d.field] = (was_old | d.old, was_new | d.new)
        else:
            assert d.field not in listed, d.field
            listed[d.field] = (d.old, d.new)
    assert listed == found


def test_eagle3_on_1_4_stays_one_model_and_gates_by_a_draft_len_schedule_upstream_accepts():
    """PR #10860: the one-model path reads draft_len_schedule; upstream's validators (reference.DRAFT_LEN_SCHEDULE):
    keys >= 1, the smallest key's value == max_draft_len, values in 0..max_draft_len, never beside
    max_concurrency. No two-model keys: 1.4 has no two-model EAGLE-3."""
    from pipeline.compiler.llmapi import gate_note, speculation_mode

    head = DraftSpec("eagle3", "/heads/eagle3")
    schedule = {8: 4, 16: 3, 32: 2}
    options = llm_api_options(head, derive_sizes(64, 4, 4096),
                              LlmApiSettings(32, "auto", 0.9, tensorrt_llm_version="1.4.0rc4",
                                             draft_len_schedule=schedule))
    spec = yaml.safe_load(yaml.safe_dump(options))["speculative_config"]
    assert spec["draft_len_schedule"] == schedule and "max_concurrency" not in spec
    assert "eagle3_one_model" not in spec and "disable_overlap_scheduler" not in options
    keys = sorted(spec["draft_len_schedule"])
    assert keys[0] >= 1 and spec["draft_len_schedule"][keys[0]] == spec["max_draft_len"]
    assert all(0 <= v <= spec["max_draft_len"] for v in spec["draft_len_schedule"].values())
    assert speculation_mode(head, 32, "1.4.0rc4") == "eagle3:one-model"
    assert speculation_mode(head, 32, "1.2.1") == "eagle3:two-model"
    assert "#16888" in gate_note(head, 32, "1.4.0rc4")
    # No cost model (no GPU named): max_concurrency, which the one-model path turns into {32: max_draft_len}.
    bare = llm_api_options(head, derive_sizes(64, 4, 4096), LlmApiSettings(32, "auto", 0.9,
                                                                            tensorrt_llm_version="1.4.0rc4"))
    assert bare["speculative_config"]["max_concurrency"] == 32


# Every speculation mode the LLM-API route writes: (draft, gate) -> its mode in SPECULATION_COMBINATIONS.
LLM_API_MODES = [(DraftSpec("none"), None, "none"), (DraftSpec("model", "/ckpt/draft"), 32, "model"),
                 (DraftSpec("ngram"), 32, "ngram"), (DraftSpec("eagle3", "/heads/e"), None, "eagle3:one-model"),
                 (DraftSpec("eagle3", "/heads/e"), 32, "eagle3:two-model")]


@pytest.mark.parametrize("draft,gate,mode", LLM_API_MODES, ids=[m for _, _, m in LLM_API_MODES])
def test_llm_api_yaml_turns_on_chunked_prefill_block_reuse_and_guides_beside_every_speculation_mode(draft, gate, mode):
    """Each is a field of llm_args.py (FEATURE_SETTINGS), and 1.2.1 runs it beside this mode (the table names the
    file and symbol that say so); leaving either out of the YAML fails here."""
    from pipeline.compiler.llmapi import FEATURES, feature_notes, speculation_mode

    assert speculation_mode(draft, gate) == mode
    sizes = derive_sizes(16, 0 if mode == "none" else 4, 4096)
    options = llm_api_options(draft, sizes, LlmApiSettings(gate, "auto", 0.9))
    options = yaml.safe_load(yaml.safe_dump(options))
    assert options["enable_chunked_prefill"] is True and "enable_chunked_prefill" in ref.LLM_API_KEYS
    assert options["kv_cache_config"]["enable_block_reuse"] is True
    assert "enable_block_reuse" in ref.KV_CACHE_CONFIG_KEYS
    assert options["guided_decoding_backend"] == "xgrammar" and "guided_decoding_backend" in ref.LLM_API_KEYS
    for setting in FEATURES:
        assert ref.FEATURE_SETTINGS[setting].path == ref.LLM_ARGS
        entry = ref.combination(setting, mode)
        assert entry.allowed and entry.where.path in ref.SOURCES and entry.where.symbol
    assert feature_notes(draft, gate) == []


def test_every_speculation_combination_is_pinned_to_an_upstream_file_and_symbol():
    from pipeline.compiler.llmapi import FEATURES as LLM_API_FEATURES
    from pipeline.compiler.trtllm_build import FEATURES as ENGINE_FEATURES
    from pipeline.trtllm import upstream

    modes = {m for _, _, m in LLM_API_MODES}
    assert set(ref.SPECULATION_COMBINATIONS) == ({(s, m) for s in LLM_API_FEATURES for m in modes}
                                                 | {(s, m) for s in ENGINE_FEATURES
                                                    for m in ("draft_tokens_external", "plain")})
    for key, entry in ref.SPECULATION_COMBINATIONS.items():
        assert entry.where.path in ref.SOURCES and entry.where.symbol, key
        assert entry.allowed or entry.why, key  # a refusal says why
    for name, pin in ref.FEATURE_SETTINGS.items():
        assert pin.path in ref.SOURCES and pin.symbol, name
    # The backend's parameters are pinned with the rest of its template, each to the function that reads it.
    readers = {p.key: (p.read_by.path, p.read_by.symbol) for p in upstream.TEMPLATE_PARAMETERS}
    assert readers["enable_chunked_context"] == (upstream.MODEL_INSTANCE_STATE, "getExecutorConfigFromParams")
    assert readers["enable_kv_cache_reuse"] == (upstream.MODEL_INSTANCE_STATE, "getKvCacheConfigFromParams")


def refuse(monkeypatch, setting: str, mode: str, why: str) -> None:
    """Plant a refusal in the table, as a later release might have one."""
    where = ref.SPECULATION_COMBINATIONS[(setting, mode)].where
    monkeypatch.setitem(ref.SPECULATION_COMBINATIONS, (setting, mode), ref.Combination(False, where, why))


def test_a_combination_upstream_refuses_is_left_off_and_compile_says_why_in_one_line(
        monkeypatch, tiny_target, tiny_draft, tmp_path):
    refuse(monkeypatch, "enable_chunked_prefill", "model", "draft tokens can't ride a prefill chunk")
    refuse(monkeypatch, "kv_cache_config.enable_block_reuse", "model", "the draft's blocks aren't rewound")
    out = tmp_path / "ll"
    result = run("-b", "trtllm", "-t", str(tiny_target), "-d", str(tiny_draft), "-k", "3", "-o", str(out))
    assert result.exit_code == 0, result.output
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert "enable_chunked_prefill" not in options  # BaseLlmArgs' default: off
    assert options["kv_cache_config"]["enable_block_reuse"] is False  # KvCacheConfig defaults to on: written off
    notes = [line for line in result.output.splitlines() if line.startswith("note: ") and " off with " in line]
    assert notes == [
        "note: enable_chunked_prefill off with speculation model: draft tokens can't ride a prefill chunk "
        f"({ref.MODEL_DRAFTER} ModelDrafter._prepare_draft_batch)",
        "note: kv_cache_config.enable_block_reuse off with speculation model: the draft's blocks aren't rewound "
        f"({ref.PY_EXECUTOR_UTIL} validate_feature_combination)"]


def test_an_engine_route_refusal_leaves_the_flag_and_the_parameter_off(monkeypatch, trt, tmp_path):
    from pipeline.triton.config import TRTLLM_DRAFT, TRTLLM_TARGET, RepoSpec, repository_configs

    refuse(monkeypatch, "enable_chunked_context", "draft_tokens_external", "drafts can't ride a chunk")
    result = run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d")), "--dry-run", "--json", "-o",
                 str(tmp_path / "dt"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert "--enable_chunked_context" not in report["commands"]["smoke_test"]
    assert "--kv_cache_enable_block_reuse" in report["commands"]["smoke_test"]
    assert [n for n in report["notes"] if " off with " in n] == [
        "enable_chunked_context off with speculation draft_tokens_external: drafts can't ride a chunk "
        f"({ref.MICRO_BATCH_SCHEDULER} MicroBatchScheduler::fitDraftTokens)"]
    configs = repository_configs(RepoSpec(backend="trtllm", tokenizer_dir="/t", engine_dir="/e/t",
                                          draft_engine_dir="/e/d", kv_fraction_target=0.5, kv_fraction_draft=0.5))
    params = {name: {k: v.string_value for k, v in configs[name].parameters.items()}
              for name in (TRTLLM_TARGET, TRTLLM_DRAFT)}
    assert params[TRTLLM_TARGET]["enable_chunked_context"] == "false"
    assert params[TRTLLM_DRAFT]["enable_chunked_context"] == "true"  # the plain draft engine still takes it


def test_eagle3_with_a_gate_is_two_model_so_max_concurrency_can_turn_it_off():
    """1.2's max_concurrency is read only by Drafter.should_use_spec_decode, and one-model EAGLE-3 gets no
    Drafter (get_spec_drafter): a gate asked for means eagle3_one_model false; no gate, one-model."""
    from pipeline.compiler.llmapi import gate_note

    head = DraftSpec("eagle3", "/heads/eagle3")
    gated = llm_api_options(head, derive_sizes(16, 4, 4096), LlmApiSettings(32, "auto", 0.9))
    assert gated["speculative_config"]["eagle3_one_model"] is False
    assert gated["speculative_config"]["max_concurrency"] == 32
    assert gated["disable_overlap_scheduler"] is True  # two-model has no overlap scheduler (1.2.1 docs)
    always = llm_api_options(head, derive_sizes(16, 4, 4096), LlmApiSettings(None, "auto", 0.9))
    assert always["speculative_config"]["eagle3_one_model"] is True
    assert "max_concurrency" not in always["speculative_config"] and "disable_overlap_scheduler" not in always
    assert "two-model EAGLE-3" in gate_note(head, 32) and "draft engine" in gate_note(head, 32)
    assert "stays on at every batch size" in gate_note(head, None)


def test_decoding_type_names_follow_the_installed_release_and_an_unknown_one_is_refused(monkeypatch):
    from pipeline.compiler.llmapi import decoding_type
    from pipeline.trtllm import version as trtllm_version

    assert decoding_type("eagle3", "1.2.1") == decoding_type("eagle3", "1.2.0rc8") == "Eagle"
    assert decoding_type("eagle3", "1.4.0rc1") == "Eagle3"
    monkeypatch.setattr(trtllm_version, "installed", lambda: "1.3.0rc2")
    with pytest.raises(ConfigError, match=r"TensorRT-LLM 1\.3\.0rc2 is not one this pipeline writes for.*"
                                          r"supported: 1\.2\.1, 1\.4\.0rc4 \(pre-release\).*"
                                          r"tritonserver:26\.07-trtllm-python-py3"):
        trtllm_version.check_supported(trtllm_version.installed(), "pipeline compile")


def test_trtllm_version_picks_the_release_and_must_agree_with_the_installed_one(monkeypatch, tiny_target, tmp_path):
    from pipeline.trtllm import version as trtllm_version

    assert trtllm_version.pick(None, None, "x") == "1.2.1"  # the newest stable release
    assert trtllm_version.pick("1.4", None, "x") == "1.4.0rc4"  # a release's recorded version
    assert trtllm_version.pick(None, "1.4.0rc1", "x") == "1.4.0rc1"  # the installed one wins
    out = tmp_path / "e"
    result = run("-b", "trtllm", "-t", str(tiny_target), "-d", "ngram", "--trtllm-version", "1.4", "--dry-run",
                 "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "compile.json").read_text())["tensorrt_llm_version"] == "1.4.0rc4"
    assert json.loads((out / "compile.json").read_text())["container"] is None  # no Triton container ships it
    assert_one_line_error(run("-b", "trtllm", "-t", str(tiny_target), "--trtllm-version", "0.9", "--dry-run",
                              "-o", str(tmp_path / "x")), "TensorRT-LLM 0.9 is not one this pipeline writes for")
    monkeypatch.setattr(trtllm_version, "installed", lambda: "1.2.1")
    assert_one_line_error(run("-b", "trtllm", "-t", str(tiny_target), "--trtllm-version", "1.4", "--dry-run",
                              "-o", str(tmp_path / "y")), "--trtllm-version 1.4.0rc4 but TensorRT-LLM 1.2.1 is installed")


def test_the_engine_route_is_refused_on_a_release_without_trtllm_build(trt, tmp_path):
    """TensorRT-LLM removed trtllm-build and the tensorrtllm backend after 1.3.0rc20 (PRs #15907, #15918)."""
    assert_one_line_error(run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d")), "--trtllm-version", "1.4",
                              "--dry-run", "-o", str(tmp_path / "dt")),
                          "TensorRT-LLM 1.4.0rc4 has no TensorRT engine route", "--route llmapi",
                          "--trtllm-version 1.2.1")


def test_llm_api_yaml_without_a_draft_or_gate():
    options = llm_api_options(DraftSpec("none"), derive_sizes(8, 0, 4096),
                              LlmApiSettings(gate_batch_size=None, kv_cache_dtype="auto", free_gpu_memory_fraction=0.9))
    assert "speculative_config" not in options and "dtype" not in options["kv_cache_config"]
    spec = llm_api_options(DraftSpec("ngram"), derive_sizes(8, 2, 4096),
                           LlmApiSettings(None, "auto", 0.9))["speculative_config"]
    assert "max_concurrency" not in spec


def test_serve_command_uses_known_trtllm_serve_flags():
    cmd = serve_command(Path("/m"), Path("/e/extra_llm_api_options.yaml"), derive_sizes(8, 4, 4096),
                        LlmApiSettings(32, "auto", 0.9, tp_size=2))
    assert cmd[:2] == ["trtllm-serve", "/m"]
    assert set(flags_of(cmd)) <= ref.TRTLLM_SERVE_FLAGS
    assert value_of(cmd, "--backend") == "pytorch" and value_of(cmd, "--tp_size") == "2"


def test_one_parser_reads_every_spelling_of_draft_and_writes_it_back():
    for text, spec in ((None, DraftSpec("none")), ("NGram", DraftSpec("ngram")), ("eagle3", DraftSpec("eagle3")),
                       ("eagle3:/x/head", DraftSpec("eagle3", "/x/head")), ("/x/draft", DraftSpec("model", "/x/draft")),
                       ("smollm2-135m", DraftSpec("model", "smollm2-135m"))):
        assert parse_draft(text) == spec
        assert parse_draft(str(spec)) == spec  # str() is the --draft spelling
    assert parse_draft("eagle3:/x/head").path == Path("/x/head") and parse_draft("ngram").path is None
    assert parse_draft("auto", allow_auto=True).kind == "auto"
    for bad, needle in (("eagle3:", "eagle3: needs a folder"), ("auto", "is for `pipeline build`"), ("  ", "empty")):
        with pytest.raises(ConfigError, match=needle):
            parse_draft(bad)


def test_draft_is_read_once_where_a_command_takes_it_and_travels_as_its_spelling(tiny_target, tmp_path, monkeypatch):
    """--draft is parsed by the option's type (or an options object's field, for a library caller); the spec it makes
    reaches the compile job as it is, and goes into JSON, a stage key, a pickle or asdict as its spelling."""
    import copy
    import dataclasses
    import pickle

    import pipeline.build.plan  # noqa: F401  (imported before counting: a class's default is read at its import)
    import pipeline.draft_spec as draft_spec
    from pipeline.compiler.options import CompileOptions

    read = []
    real = draft_spec.parse_draft

    def counting(value, **kwargs):
        if not isinstance(value, DraftSpec):
            read.append(str(value))
        return real(value, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("pipeline")]:
        if getattr(module, "parse_draft", None) is real:  # every binding, however it was imported
            monkeypatch.setattr(module, "parse_draft", counting)
    result = run("-b", "torch", "-t", str(tiny_target), "-o", str(tmp_path / "e"), "-d", "NGram", "--max-seq-len",
                 "64", "--max-batch-size", "2", "--no-calibrate")
    assert result.exit_code == 0, result.output
    assert read == ["NGram"]
    read.clear()
    from pipeline.cli import main as cli

    result = CliRunner().invoke(cli, ["build", "--target", str(tiny_target), "--draft", "NGram", "--dry-run",
                                      "--engines-dir", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert read == ["NGram"]
    options = CompileOptions(backend="torch", target=Path("/t"), output=Path("/o"), draft="eagle3:/x/head")
    spec = options.draft
    assert (spec.kind, spec.ref) == ("eagle3", "/x/head") and CompileOptions.__dataclass_fields__["draft"].default == "none"
    for back in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), dataclasses.asdict(options)["draft"]):
        assert (back.kind, back.ref, str(back)) == ("eagle3", "/x/head", "eagle3:/x/head")
    assert json.dumps({"draft": spec}) == '{"draft": "eagle3:/x/head"}'
    with pytest.raises(ConfigError, match="is for `pipeline build`"):
        CompileOptions(backend="torch", target=Path("/t"), output=Path("/o"), draft="auto")
    assert_one_line_error(run("-b", "torch", "-t", str(tiny_target), "-o", str(tmp_path / "f"), "-d", "auto"),
                          "--draft auto is for `pipeline build`")


# ---- validation before building -----------------------------------------------------------------


def test_vocab_mismatch_is_refused(trt, tmp_path):
    result = run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d", vocab=321)), "--dry-run",
                 "-o", str(tmp_path / "e"))
    assert_one_line_error(result, "vocab_size 321", "320", "--draft ngram")
    assert not (tmp_path / "e").exists()


def test_different_tokenizers_are_refused(tiny_target, tmp_path):
    from tiny_models import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=0, layers=1, extra_tokens=0)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftMismatchError):
        compile_model(CompileOptions("trtllm", tiny_target, tmp_path / "e", draft=str(other), dry_run=True))


def test_an_eagle3_head_passed_as_a_draft_model_is_refused(tiny_target, tmp_path):
    head = tmp_path / "eagle3-head"
    shutil.copytree(tiny_target, head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle3"]}))
    assert_one_line_error(run("-b", "trtllm", "-t", str(tiny_target), "-d", str(head), "--dry-run",
                              "-o", str(tmp_path / "e")), f"--draft eagle3:{head}")
    result = compile_model(CompileOptions("trtllm", tiny_target, tmp_path / "e", draft=f"eagle3:{head}", dry_run=True))
    assert result.route == "llmapi"
    assert result.manifest["configs"]["extra_llm_api_options.yaml"]["speculative_config"]["decoding_type"] == "Eagle"


def test_compile_for_1_4_writes_a_schedule_for_the_named_gpu_and_max_concurrency_without_one(tiny_target, tmp_path):
    """The real compile reads the target's config.json for the roofline; the schedule depends on the GPU."""
    head = tmp_path / "eagle3-head"
    shutil.copytree(tiny_target, head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle3"]}))

    def spec(out: str, *extra: str) -> tuple[dict, str]:
        result = run("-b", "trtllm", "-t", str(tiny_target), "-d", f"eagle3:{head}", "--trtllm-version", "1.4",
                     "--dry-run", "-o", str(tmp_path / out), *extra)
        assert result.exit_code == 0, result.output
        return yaml.safe_load((tmp_path / out / "extra_llm_api_options.yaml").read_text())["speculative_config"], \
            result.output

    named, text = spec("h100", "--gpu", "h100", "--force")
    assert named["decoding_type"] == "Eagle3" and named["speculative_model"] == str(head)
    assert named["draft_len_schedule"] and "max_concurrency" not in named and "note: draft_len_schedule {" in text
    bare, text = spec("none")  # no --gpu, and no nvidia-smi here
    assert bare["max_concurrency"] == 32 and "draft_len_schedule" not in bare and "no GPU named" in text
    assert_one_line_error(run("-b", "torch", "-t", str(tiny_target), "--trtllm-version", "1.4", "--dry-run", "-o",
                              str(tmp_path / "t")), "--trtllm-version is for --backend trtllm")


def test_zero_draft_tokens_is_refused_quoting_trtllms_error(trt, tmp_path):
    result = run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d")), "-k", "0", "--dry-run",
                 "-o", str(tmp_path / "e"))
    assert_one_line_error(result, "Number of draft tokens (56) is larger than maximum number of draft tokens (0)",
                          "--num-draft-tokens 4")


def test_tp_mismatch_between_target_and_draft_is_refused(trt, tmp_path):
    result = run("-b", "trtllm", "-t", str(trt("t", tp=2)), "-d", str(trt("d", tp=1)), "--dry-run",
                 "-o", str(tmp_path / "e"))
    assert_one_line_error(result, "tp 1", "tp 2", "--tp-size 2")


def test_fp8_kv_on_the_engine_route_needs_an_fp8_checkpoint(trt, tmp_path):
    result = run("-b", "trtllm", "-t", str(trt("t")), "--kv-cache-dtype", "fp8", "--dry-run", "-o", str(tmp_path / "e"))
    assert_one_line_error(result, "--kv-cache-dtype fp8")
    ok = compile_model(CompileOptions("trtllm", trt("t8", kv_quant="FP8", quant="FP8"), tmp_path / "e8", dry_run=True))
    assert ok.manifest["kv_cache_dtype"] == "fp8"


def test_an_int4_awq_draft_with_an_fp8_kv_cache_is_refused_as_trtllm_build_would(trt, tmp_path):
    """builder.py: FP8 paged context FMHA "only works with fp8 quantization workflow", and the draft-target
    recipe needs paged context FMHA; the draft's checkpoint is checked as the target's is."""
    target = trt("t", kv_quant="FP8", quant="FP8")
    draft = trt("d", kv_quant="FP8", quant="W4A16_AWQ")
    result = run("-b", "trtllm", "-t", str(target), "-d", str(draft), "--kv-cache-dtype", "fp8", "--dry-run",
                 "-o", str(tmp_path / "e"))
    assert_one_line_error(result, "draft checkpoint d is W4A16_AWQ with an FP8 KV cache",
                          "FP8 Paged Context FMHA only works with fp8 quantization workflow")
    # The same draft without an FP8 KV cache builds beside the FP8-KV target: each engine takes its own.
    ok = compile_model(CompileOptions("trtllm", target, tmp_path / "ok", draft=str(trt("d2", quant="W4A16_AWQ")),
                                      kv_cache_dtype="fp8", dry_run=True))
    assert ok.manifest["kv_cache_dtype"] == "fp8" and ok.manifest["draft"]["kv_cache_quant_algo"] is None


def test_sizes_are_checked_against_the_gpu_plan(trt, tmp_path):
    small = compile_model(CompileOptions("trtllm", trt("t"), tmp_path / "e", draft=str(trt("d")), dry_run=True,
                                         gpu="h100"))
    assert small.manifest["plan"]["fits"] and small.manifest["plan"]["draft_kind"] == "model"
    # A Llama-70B shape in bf16 on one 80 GB GPU: the planner's one-line refusal, before anything is written.
    big = trt("big", vocab=320, num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
              num_key_value_heads=8, head_size=128, intermediate_size=28672)
    result = run("-b", "trtllm", "-t", str(big), "--gpu", "h100", "--dry-run", "-o", str(tmp_path / "big-out"))
    assert_one_line_error(result, "short")
    assert not (tmp_path / "big-out").exists()
    # --force builds anyway, and the manifest keeps the plan that didn't fit.
    forced = run("-b", "trtllm", "-t", str(big), "--gpu", "h100", "--dry-run", "--force", "-o", str(tmp_path / "big-out"))
    assert forced.exit_code == 0, forced.output
    assert json.loads((tmp_path / "big-out" / "compile.json").read_text())["plan"]["fits"] is False


def test_the_gpu_is_matched_from_nvidia_smi_names():
    from pipeline.plan.gpus import match_gpu

    assert match_gpu("NVIDIA H100 80GB HBM3", 81559).key == "h100-80gb"
    assert match_gpu("NVIDIA H200", 143771).key == "h200-141gb"
    assert match_gpu("NVIDIA A100-SXM4-40GB", 40960).key == "a100-40gb"
    assert match_gpu("NVIDIA A100-SXM4-80GB", 81920).key == "a100-80gb"
    assert match_gpu("Tesla T4", 15360) is None


# ---- dry run and the real run without TensorRT-LLM ----------------------------------------------


def test_dry_run_writes_the_configs_and_prints_the_commands(trt, tmp_path):
    out, target = tmp_path / "engines" / "dt", trt("t")
    result = run("-b", "trtllm", "-t", str(target), "-d", str(trt("d")), "-k", "4", "--max-batch-size", "8",
                 "--dry-run", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "trtllm-build --checkpoint_dir" in result.output and "--speculative_decoding_mode" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["build.sh", "compile.json"]
    assert [p.name for p in out.parent.iterdir()] == ["dt"]  # no staging folder left behind
    manifest = json.loads((out / "compile.json").read_text())
    assert manifest["tensorrt_llm_version"] == ref.TRTLLM_VERSION and manifest["dry_run"]
    assert manifest["commands"]["build_target"] in result.output
    assert manifest["commands"]["build_draft"] in (out / "build.sh").read_text()
    # Guided decoding's vocabulary, by upstream's own script where NVIDIA's container keeps it, into the output folder.
    guide = shlex.split(manifest["commands"]["build_guide_info"])
    assert guide[1] == f"{CONTAINER_APP}/{ref.GUIDE_INFO_SCRIPT}" and set(flags_of(guide)) == ref.GUIDE_INFO_FLAGS
    assert value_of(guide, "--output_dir") == str(out) and value_of(guide, "--model_dir") == str(target)
    assert manifest["commands"]["build_guide_info"] in (out / "build.sh").read_text()


def test_a_real_engine_build_runs_each_step_into_the_staging_folder(trt, tmp_path, monkeypatch):
    """Outside the container nothing runs, so the steps are recorded: each writes into the staging folder that becomes
    the output, the guide's vocabulary beside the engines, where assemble looks for it."""
    import pipeline.compiler.job as compile_job
    import pipeline.compiler.trtllm_build as engine_route

    ran = []

    def fake_run(argv):
        where = Path(argv[argv.index("--output_dir") + 1])
        ran.append((Path(argv[1]).name if argv[0] == "python3" else argv[0], where.name))
        where.mkdir(parents=True, exist_ok=True)
        (where / (ref.GUIDE_INFO_FILE if argv[0] == "python3" else "config.json")).write_text("{}")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(compile_job, "trtllm_available", lambda: True)
    monkeypatch.setattr(engine_route.subprocess, "run", fake_run)
    out = tmp_path / "e"
    result = run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d")), "-k", "4", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert [program for program, _ in ran] == ["trtllm-build", "trtllm-build", Path(ref.GUIDE_INFO_SCRIPT).name]
    assert all(folder.startswith(".") or folder in ("target", "draft") for _, folder in ran)  # the staging folder
    assert (out / "target" / "config.json").is_file() and (out / ref.GUIDE_INFO_FILE).is_file()


def test_llmapi_route_writes_yaml_and_serve_command(tiny_target, tiny_draft, tmp_path):
    out = tmp_path / "ll"
    result = run("-b", "trtllm", "-t", str(tiny_target), "-d", str(tiny_draft), "-k", "3", "--gate-batch-size", "16",
                 "--kv-cache-dtype", "fp8", "--json", "-o", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["route"] == "llmapi"
    spec = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "DraftTarget", "max_draft_len": 3,
                    "speculative_model_dir": str(tiny_draft), "max_concurrency": 16}
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert options["guided_decoding_backend"] == "xgrammar"  # without it trtllm-serve enforces no response_format
    assert ref.combination("guided_decoding_backend", "model").where.path == ref.SPEC_INTERFACE
    assert str(out / "extra_llm_api_options.yaml") in " ".join(report["commands"]["serve"])


def test_real_engine_build_without_trtllm_names_the_container(trt, tmp_path, monkeypatch):
    import pipeline.compiler.job as compile_job

    monkeypatch.setattr(compile_job, "trtllm_available", lambda: False)
    out = tmp_path / "e"
    result = run("-b", "trtllm", "-t", str(trt("t")), "-d", str(trt("d")), "-o", str(out))
    assert_one_line_error(result, ref.TRTLLM_CONTAINER, "--dry-run")
    assert not out.exists()


# ---- the portable engine folder -----------------------------------------------------------------


@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_torch_engine_folder_generates_what_the_source_folders_do(tiny_target, tiny_draft, tmp_path, draft):
    draft_arg = {"none": "none", "ngram": "ngram", "model": str(tiny_draft)}[draft]
    out = tmp_path / "engine"
    compile_model(CompileOptions("torch", tiny_target, out, draft=draft_arg, num_draft_tokens=3, max_batch_size=4,
                                 max_seq_len=128, gate_batch_size=4))
    manifest = json.loads((out / "engine.json").read_text())
    assert (manifest["max_batch_size"], manifest["max_seq_len"], manifest["dtype"]) == (4, 128, "fp32")
    assert manifest["draft"]["kind"] == draft and (out / "target" / "tokenizer.json").is_file()
    assert (out / "draft").is_dir() == (draft == "model")

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 40, 41, 42, 40]]
    params = SamplingParams(max_tokens=60)  # past the gate's min_tokens (50), so the draft really runs
    source_draft = {"none": None, "ngram": "ngram", "model": tiny_draft}[draft]
    config = EngineConfig(max_batch_size=4, max_seq_len=128, num_draft_tokens=3)
    expected = [r.output_ids for r in LLMEngine.load(tiny_target, config, draft=source_draft).generate(prompts, params)]
    engine = load_engine(out)
    assert engine.config.gate.max_batch_size == 4
    assert (engine.proposer is None) == (draft == "none")
    assert draft == "none" or engine.config.num_draft_tokens == 3
    assert [r.output_ids for r in engine.generate(prompts, params)] == expected


def test_a_torch_engine_with_a_draft_carries_the_cost_model_measured_here(tiny_target, tmp_path):
    from pipeline.policy.cost_model import CostModel

    out = tmp_path / "engine"
    result = compile_model(CompileOptions("torch", tiny_target, out, draft="ngram", num_draft_tokens=3, max_batch_size=4,
                                          max_seq_len=128))
    cost = CostModel.load(out)
    assert cost.rows == (1, 2, 4) and cost.widths == (1, 2, 3, 4) and cost.proposer == "ngram"
    assert cost.source.startswith("measured on ") and all(v > 0 for row in cost.target_s for v in row)
    assert cost.context == 64 and cost.context_token_s < cost.target_s[0][0] / 64  # a token, not a step's worth
    assert "cost_model.json" in result.files and any("cost model measured in" in n for n in result.notes)
    assert load_engine(out).cost_model == cost
    plain = tmp_path / "plain"
    compile_model(CompileOptions("torch", tiny_target, plain, max_batch_size=4, max_seq_len=128))
    skipped = tmp_path / "skipped"
    compile_model(CompileOptions("torch", tiny_target, skipped, draft="ngram", max_batch_size=4, max_seq_len=128,
                                 calibrate=False))
    assert CostModel.load(plain) is None and CostModel.load(skipped) is None  # nothing to plan / not asked
    assert not load_engine(skipped).cost_model.measured and load_engine(out).cost_model.measured


def test_torch_dry_run_writes_engine_json_that_refuses_to_load(tiny_target, tmp_path):
    out = tmp_path / "engine"
    compile_model(CompileOptions("torch", tiny_target, out, dry_run=True))
    assert (out / "engine.json").is_file() and not (out / "target").exists()
    with pytest.raises(Exception, match="dry-run"):
        load_engine(out)


# ---- CLI bad inputs -----------------------------------------------------------------------------


def test_cli_bad_inputs_are_one_line_errors(trt, tiny_target, tmp_path):
    existing = tmp_path / "exists"
    existing.mkdir()
    cases = [
        (["-b", "trtllm", "-t", str(tmp_path / "missing")], "does not exist"),
        (["-b", "trtllm", "-t", str(tiny_target), "-o", str(existing)], "--force"),
        (["-b", "torch", "-t", str(trt("t"))], "--export hf"),
        (["-b", "torch", "-t", str(tiny_target), "-d", f"eagle3:{tiny_target}"], "EAGLE-3"),
        (["-b", "trtllm", "--route", "engine", "-t", str(tiny_target)], "--export trtllm"),
        (["-b", "trtllm", "--route", "engine", "-t", str(trt("t2")), "-d", "ngram"], "--route llmapi"),
        (["-b", "trtllm", "-t", str(tiny_target), "--free-gpu-memory-fraction", "1.5"], "(0, 1]"),
        (["-b", "trtllm", "-t", str(tiny_target), "--gate-batch-size", "0"], "--gate-batch-size"),
        (["-b", "trtllm", "-t", str(tiny_target), "--gpu", "no-such-gpu"], "no-such-gpu"),
    ]
    for args, needle in cases:
        if "-o" not in args:
            args = [*args, "--dry-run", "-o", str(tmp_path / "out")]
        assert_one_line_error(run(*args), needle)
        assert not (tmp_path / "out").exists()


def test_default_output_is_under_engines(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("-b", "trtllm", "-t", str(tiny_target), "--dry-run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "engines" / f"{tiny_target.name}-trtllm" / "compile.json").is_file()


def test_pipeline_generate_runs_an_engine_folder_with_its_own_draft(tiny_target, tiny_draft, tmp_path):
    out = tmp_path / "engine"
    compile_model(CompileOptions("torch", tiny_target, out, draft=str(tiny_draft), num_draft_tokens=3,
                                 max_batch_size=2, max_seq_len=128))
    result = CliRunner().invoke(main, ["generate", "hello there", "--model", str(out), "--max-tokens", "60", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["config"]["draft"] != "none" and got["config"]["dtype"] == "fp32"  # the folder's settings
    assert got["stats"]["drafted_tokens"] > 0
    plain = CliRunner().invoke(main, ["generate", "hello there", "--model", str(tiny_target), "--dtype", "fp32",
                                      "--max-tokens", "60", "--json"])
    assert json.loads(plain.stdout)["outputs"][0]["token_ids"] == got["outputs"][0]["token_ids"]
    # An explicit --draft none runs the folder's target alone (it used to be taken as "the folder's own").
    alone = CliRunner().invoke(main, ["generate", "hello there", "--model", str(out), "--draft", "none",
                                      "--max-tokens", "60", "--json"])
    alone = json.loads(alone.stdout)
    assert alone["config"]["draft"] == "none" and alone["stats"]["drafted_tokens"] == 0
    assert alone["outputs"][0]["token_ids"] == got["outputs"][0]["token_ids"]
