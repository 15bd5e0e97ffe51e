"""What TensorRT-LLM accepts, copied from its source, so generated commands and configs can be checked.

Releases (pipeline.trtllm.version.RELEASES): the LLM API's names have one table per release (LLM_API_TABLES, with
DIFFERENCES_1_2_TO_1_4 naming where upstream changed each); the engine route's (trtllm-build, run.py) exist only for
1.2.1, since 1.3.0rc21 removed that route. Build and serve in one container, so the engines are built by the
TensorRT-LLM that loads them. TensorRT-LLM can't be installed on the machines
this is developed on (no GPU, and no wheel for them), so tests check every generated flag and key against
these tables: a typo'd flag fails a test instead of a build in the container.
Sources (NVIDIA/TensorRT-LLM):
  tensorrt_llm/commands/build.py     parse_arguments(): trtllm-build's own flags
  tensorrt_llm/plugin/plugin.py      cli_plugin_args + add_plugin_argument(): the plugin flags; PluginConfig
                                     .use_paged_context_fmha (1.2.1: default True, "Allow advanced features like
                                     KV cache reuse and chunked context")
  tensorrt_llm/builder.py            build(): FP8 paged context FMHA needs the FP8 quantization workflow
  tensorrt_llm/llmapi/llm_args.py    DecodingBaseConfig.from_dict, EagleDecodingConfig, DraftTargetDecodingConfig,
                                     NGramDecodingConfig, KvCacheConfig, BaseLlmArgs/TorchLlmArgs (1.2.1: read
                                     as rendered at NVIDIA/TensorRT-LLM gh-pages 1.2.1/_modules/..., @58fb435e)
  tensorrt_llm/_torch/speculative/drafter.py   Drafter.should_use_spec_decode: the only reader of max_concurrency
  tensorrt_llm/_torch/speculative/utils.py     get_spec_drafter: which modes get a Drafter
  tensorrt_llm/commands/serve.py     trtllm-serve's click options
  examples/utils.py                  add_common_args(): examples/run.py's flags
  examples/draft_target_model/README.md   the draft-target build recipe and its run.py smoke test
  examples/generate_xgrammar_tokenizer_info.py   the tokenizer file the C++ runtime's guided decoding reads
  tensorrt_llm/_torch/speculative/interface.py   SpeculativeDecodingMode.support_guided_decoder and
                                     support_capturable_guided_decoder: which speculation modes take a guide
  SPECULATION_COMBINATIONS below: chunked prefill/context and KV block reuse beside each speculation mode, each
  pinned to the file and symbol that decides it
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.trtllm.version import TRITON_CONTAINER, TRTLLM_VERSION  # noqa: F401  (re-exported)

TRTLLM_CONTAINER = TRITON_CONTAINER

# ---- the engine route: TensorRT-LLM 1.2.1 only (RELEASES[...].engine_route) ------------------------------------------
# trtllm-build flags we may emit (a subset of build.py's parser plus plugin.py's cli_plugin_args).
TRTLLM_BUILD_FLAGS = frozenset({
    # build.py
    "--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len",
    "--max_beam_width", "--max_num_tokens", "--opt_num_tokens", "--kv_cache_type", "--workers",
    "--log_level", "--gather_generation_logits", "--gather_context_logits",
    "--speculative_decoding_mode", "--max_draft_len",
    # plugin.py cli_plugin_args (each is exposed as --<name>)
    "--gpt_attention_plugin", "--gemm_plugin", "--context_fmha", "--remove_input_padding",
    "--tokens_per_block", "--use_paged_context_fmha", "--use_fp8_context_fmha", "--multiple_profiles",
})
# build.py: choices of --speculative_decoding_mode.
SPECULATIVE_DECODING_MODES = frozenset({
    "draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"})
# plugin.py PluginConfig.gemm_plugin: Optional[Literal["auto", "float16", "float32", "bfloat16", "int32",
# "fp8", "nvfp4", None]]; "auto" takes the checkpoint's dtype.
GEMM_PLUGIN_CHOICES = frozenset({"auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"})

# builder.py build(): paged context FMHA with an FP8 KV cache needs the FP8 quantization workflow (the old
# builder raises "FP8 Paged Context FMHA only works with fp8 quantization workflow currently"; 1.x builders
# switch paged context FMHA off instead, which draft-target's KV reuse needs). So an FP8 KV cache is allowed
# only on a checkpoint whose quant_algo is one of these.
FP8_KV_QUANT_ALGOS = frozenset({"FP8"})

# examples/utils.py add_common_args() (+ examples/run.py's own --max_output_len, --input_text): run.py flags
# of the draft-target smoke test.
RUN_PY_FLAGS = frozenset({
    "--engine_dir", "--tokenizer_dir", "--max_output_len", "--input_text", "--kv_cache_enable_block_reuse",
    "--kv_cache_free_gpu_memory_fraction", "--max_tokens_in_paged_kv_cache", "--draft_engine_dir",
    "--draft_target_model_config", "--enable_chunked_context"})

# Guided decoding on the engine route (triton-inference-server/tensorrtllm_backend docs/guided_decoding.md, "C++
# Backend"): examples/generate_xgrammar_tokenizer_info.py --model_dir HF --output_dir DIR writes DIR/GUIDE_INFO_FILE
# (its argparse and generate_xgrammar_tokenizer_info()), which the tensorrt_llm model's xgrammar_tokenizer_info_path
# names. It imports tensorrt_llm, so it runs in NVIDIA's container, which keeps examples/ under /app.
GUIDE_INFO_SCRIPT = "examples/generate_xgrammar_tokenizer_info.py"
GUIDE_INFO_FLAGS = frozenset({"--model_dir", "--output_dir"})
GUIDE_INFO_FILE = "xgrammar_tokenizer_info.json"


# ---- chunked prefill (chunked context) and KV block reuse beside speculation ----------------------------------------
# Files in NVIDIA/TensorRT-LLM. The LLM API's classes and the feature matrix were read in the 1.2.1 docs build
# (gh-pages 1.2.1/_modules and 1.2.1/features, @58fb435e, generated from TensorRT-LLM 376f7e1); release/1.2.1's own
# tree wasn't readable here, so the rest at the newest stored commit named beside each.
LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
FEATURE_MATRIX = "docs/source/features/feature-combination-matrix.md"  # the PyTorch backend's, 1.2.1
PY_EXECUTOR_CREATOR = "tensorrt_llm/_torch/pyexecutor/py_executor_creator.py"  # @000429d5
PY_EXECUTOR_UTIL = "tensorrt_llm/_torch/pyexecutor/_util.py"
MODEL_DRAFTER = "tensorrt_llm/_torch/speculative/model_drafter.py"
NGRAM_DRAFTER = "tensorrt_llm/_torch/speculative/ngram.py"
TRT_GPT_MODEL = "cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp"  # @00825c4e
MICRO_BATCH_SCHEDULER = "cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp"  # @0a949d31
PLUGIN = "tensorrt_llm/plugin/plugin.py"  # 1.2.1, gh-pages 1.2.1/_modules
EXAMPLES_UTILS = "examples/utils.py"
RELEASE_NOTES = "release notes (github.com/NVIDIA/TensorRT-LLM/releases)"
MODEL_ENGINE = "tensorrt_llm/_torch/pyexecutor/model_engine.py"
DRAFTER = "tensorrt_llm/_torch/speculative/drafter.py"
SPEC_UTILS = "tensorrt_llm/_torch/speculative/utils.py"
DOCS_1_4 = "nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference"
SPEC_INTERFACE = "tensorrt_llm/_torch/speculative/interface.py"  # @0c8de69a
SOURCES = frozenset({LLM_ARGS, FEATURE_MATRIX, PY_EXECUTOR_CREATOR, PY_EXECUTOR_UTIL, MODEL_DRAFTER, NGRAM_DRAFTER,
                     TRT_GPT_MODEL, MICRO_BATCH_SCHEDULER, PLUGIN, EXAMPLES_UTILS, RELEASE_NOTES, MODEL_ENGINE,
                     DRAFTER, SPEC_UTILS, DOCS_1_4, SPEC_INTERFACE, GUIDE_INFO_SCRIPT})


@dataclass(frozen=True)
class Pin:
    """An upstream file (one of SOURCES) and the symbol in it."""

    path: str
    symbol: str


# ---- the LLM API (PyTorch backend), one table per release ------------------------------------------------------
# 1.2.1: llm_args.py as rendered in the 1.2.1 docs build (gh-pages 1.2.1/_modules, @58fb435e), _torch/speculative
# drafter.py and utils.py. 1.4.0rc4: the LLM-API reference of the 1.4.0rc4 docs build
# (nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/*DecodingConfig.html), and main's llm_args.py and
# _torch/pyexecutor/model_engine.py as of PR #10860 (fb7c6341fe, first tagged in v1.3.0rc8). The pre-release wheels
# come from pypi.nvidia.com, which isn't reachable here, so 1.4.0rc4's source was not read at its tag.


@dataclass(frozen=True)
class LlmApiTable:
    """What one release's LLM API takes: the names llmapi.py writes into extra_llm_api_options and trtllm-serve."""

    version: str
    decoding_types: dict[str, str]  # draft kind -> decoding_type
    model_key: str  # the speculative_config field naming the draft's folder
    speculative_config_keys: frozenset[str]
    kv_cache_config_keys: frozenset[str]
    llm_api_keys: frozenset[str]
    serve_flags: frozenset[str]
    # How EAGLE-3 is gated by load: "two-model" (max_concurrency needs a Drafter, which one-model EAGLE-3 lacks) or
    # "one-model" (the one-model path reads draft_len_schedule, a draft length per batch-size bound), and the
    # upstream symbols that decide it.
    eagle3_gate: str
    eagle3_gate_where: tuple[Pin, ...]


_SPEC_1_2 = frozenset({
    "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model_dir", "max_concurrency",
    "draft_len_schedule", "load_format", "acceptance_window", "acceptance_length_threshold",
    # Eagle3DecodingConfig / EagleDecodingConfig
    "eagle3_one_model", "eagle3_layers_to_capture", "eagle_choices", "greedy_sampling", "use_dynamic_tree",
    # NGramDecodingConfig
    "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
})
_KV = frozenset({"enable_block_reuse", "max_tokens", "free_gpu_memory_fraction", "dtype", "tokens_per_block"})
_LLM_API_1_2 = frozenset({
    "speculative_config", "kv_cache_config", "max_batch_size", "max_num_tokens", "max_seq_len",
    "max_input_len", "enable_chunked_prefill", "tensor_parallel_size", "pipeline_parallel_size",
    # TorchLlmArgs; the 1.2.1 speculative-decoding docs set it for two-model EAGLE-3 ("Two-model based
    # speculation implementations do not support overlap scheduler").
    "disable_overlap_scheduler",
    # BaseLlmArgs.guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]], default None (no guide is
    # enforced: trtllm-serve still turns response_format into guided-decoding parameters, with nothing to apply them).
    "guided_decoding_backend"})
_SERVE = frozenset({
    "--backend", "--tp_size", "--pp_size", "--max_batch_size", "--max_num_tokens", "--max_seq_len",
    "--kv_cache_free_gpu_memory_fraction", "--extra_llm_api_options", "--host", "--port", "--tokenizer"})

LLM_API_TABLES: dict[str, LlmApiTable] = {
    # DecodingBaseConfig.from_dict maps "Eagle" (EagleDecodingConfig, used for EAGLE-3), "DraftTarget" and "NGram"
    # and raises "Invalid decoding type" for anything else. max_concurrency: "When specified, speculation will be
    # disabled at batch sizes above this value", read only by Drafter.should_use_spec_decode; get_spec_drafter gives
    # one-model EAGLE-3 (eagle3_one_model: true, the default) no Drafter ("for one engine mode, we are not able to
    # turn off spec decode at runtime", model_engine.py), so a gated EAGLE-3 is written two-model.
    "1.2": LlmApiTable("1.2.1", {"model": "DraftTarget", "eagle3": "Eagle", "ngram": "NGram"},
                       "speculative_model_dir", _SPEC_1_2, _KV, _LLM_API_1_2, _SERVE, eagle3_gate="two-model",
                       eagle3_gate_where=(Pin(DRAFTER, "Drafter.should_use_spec_decode"),
                                          Pin(SPEC_UTILS, "get_spec_drafter"))),
    "1.4": LlmApiTable(
        "1.4.0rc4", {"model": "Draft_Target", "eagle3": "Eagle3", "ngram": "NGram"}, "speculative_model",
        (_SPEC_1_2 - {"speculative_model_dir", "acceptance_window", "acceptance_length_threshold",
                      "eagle3_one_model", "greedy_sampling", "eagle_choices"})
        | {"speculative_model", "acceptance_rate_window_size", "acceptance_rate_threshold"},
        _KV, _LLM_API_1_2, _SERVE, eagle3_gate="one-model",
        eagle3_gate_where=(Pin(MODEL_ENGINE, "PyTorchModelEngine._compute_dynamic_draft_len_mapping"),
                           Pin(LLM_ARGS, "DecodingBaseConfig.draft_len_schedule"))),
}


@dataclass(frozen=True)
class Difference:
    """Names one LlmApiTable field lost (old) and gained (new) from one release to the next, and where upstream
    changed them. A set field's old/new hold only the names removed/added; a dict field is named per key
    ("decoding_types.eagle3")."""

    field: str
    old: frozenset[str] | str
    new: frozenset[str] | str
    where: Pin


def _names(*names: str) -> frozenset[str]:
    return frozenset(names)


# Every difference between LLM_API_TABLES["1.2"] and ["1.4"]. tests/test_compile.py computes the two tables'
# difference field by field and checks it is exactly this list, so a table edit without its upstream reference fails.
DIFFERENCES_1_2_TO_1_4: tuple[Difference, ...] = (
    Difference("decoding_types.model", "DraftTarget", "Draft_Target",
               Pin(LLM_ARGS, "DraftTargetDecodingConfig.decoding_type: Literal['Draft_Target'] (the pydantic "
                             "discriminator of SpeculativeConfig replaces from_dict)")),
    Difference("decoding_types.eagle3", "Eagle", "Eagle3",
               Pin(LLM_ARGS, "Eagle3DecodingConfig.decoding_type: Literal['Eagle3'] (PR #10124 deprecates 'Eagle')")),
    Difference("model_key", "speculative_model_dir", "speculative_model",
               Pin(LLM_ARGS, "DecodingBaseConfig.speculative_model (speculative_model_dir a validation alias)")),
    Difference("speculative_config_keys", _names("speculative_model_dir"), _names("speculative_model"),
               Pin(LLM_ARGS, "DecodingBaseConfig.speculative_model")),
    Difference("speculative_config_keys", _names("acceptance_window", "acceptance_length_threshold"),
               _names("acceptance_rate_window_size", "acceptance_rate_threshold"),
               Pin(LLM_ARGS, "DecodingBaseConfig.acceptance_rate_threshold (accepted / drafted tokens, 0-1)")),
    Difference("speculative_config_keys", _names("eagle3_one_model"), _names(),
               Pin(RELEASE_NOTES, "PR #17366 forces two-model speculation to one-model; PR #18721 removes it")),
    Difference("speculative_config_keys", _names("greedy_sampling", "eagle_choices"), _names(),
               Pin(DOCS_1_4, "Eagle3DecodingConfig (neither field in its signature)")),
    Difference("eagle3_gate", "two-model", "one-model",
               Pin(MODEL_ENGINE, "PyTorchModelEngine._compute_dynamic_draft_len_mapping (PR #10860, v1.3.0rc8)")),
)


def llm_api_table(version: str) -> LlmApiTable:
    from pipeline.trtllm.version import check_supported

    return LLM_API_TABLES[check_supported(version, "TensorRT-LLM").key]


# The names every supported release takes, for checks that don't know the release.
DECODING_TYPES = frozenset(t for table in LLM_API_TABLES.values() for t in table.decoding_types.values())
SPECULATIVE_CONFIG_KEYS = frozenset().union(*(t.speculative_config_keys for t in LLM_API_TABLES.values()))
KV_CACHE_CONFIG_KEYS = _KV
LLM_API_KEYS = frozenset().union(*(t.llm_api_keys for t in LLM_API_TABLES.values()))
TRTLLM_SERVE_FLAGS = _SERVE

# draft_len_schedule on the one-model path (1.4 table; main's llm_args.py DecodingBaseConfig validators, PR #10860):
# {bound: draft_len, ...}, each key the largest batch size its draft length serves, past the largest key 0 (no
# speculation); keys >= 1, values 0..max_draft_len, the smallest key's value == max_draft_len; it may not be set
# with max_concurrency, which the one-model path turns into {max_concurrency: max_draft_len}.
DRAFT_LEN_SCHEDULE = Pin(LLM_ARGS, "DecodingBaseConfig.draft_len_schedule (validate_draft_len_schedule_and_sort, "
                                   "validate_max_concurrency_and_draft_len_schedule_mutually_exclusive)")

# The settings compile writes for these features, each where it is defined. The tensorrtllm backend's parameters
# enable_chunked_context and enable_kv_cache_reuse are pinned with the backend's other parameters
# (pipeline.trtllm.upstream.TEMPLATE_PARAMETERS: getExecutorConfigFromParams reads enable_chunked_context as a bool,
# default false; getKvCacheConfigFromParams reads enable_kv_cache_reuse, default true).
FEATURE_SETTINGS: dict[str, Pin] = {
    "enable_chunked_prefill": Pin(LLM_ARGS, "BaseLlmArgs.enable_chunked_prefill"),  # default False
    "kv_cache_config.enable_block_reuse": Pin(LLM_ARGS, "KvCacheConfig.enable_block_reuse"),  # default True
    "guided_decoding_backend": Pin(LLM_ARGS, "BaseLlmArgs.guided_decoding_backend"),  # default None
    # Both features need the engine built with it (default True in 1.2.1): without it executorImpl.cpp
    # fixExecutorConfig turns chunked context off and TrtGptModelInflightBatching::fixExecutorConfig KV reuse.
    "--use_paged_context_fmha": Pin(PLUGIN, "PluginConfig.use_paged_context_fmha"),
    # examples/run.py hands it to the draft's and the target's runner alike (examples/ngram/run_dtm_ngram.py
    # run_dtm_ngram, common_runner_kwargs).
    "--enable_chunked_context": Pin(EXAMPLES_UTILS, "add_common_args"),
    "--kv_cache_enable_block_reuse": Pin(EXAMPLES_UTILS, "add_common_args"),
}


@dataclass(frozen=True)
class Combination:
    """One setting beside one speculation mode: whether TensorRT-LLM 1.2.1 runs them together, and where that is
    decided. A refusal (allowed False) keeps the setting off, and `why` is the line compile prints about it."""

    allowed: bool
    where: Pin
    why: str = ""


def _allowed(path: str, symbol: str) -> Combination:
    return Combination(True, Pin(path, symbol))


# Speculation modes as compile writes them. LLM API: "none", "model" (DraftTarget), "ngram" (NGram),
# "eagle3:one-model" / "eagle3:two-model" (Eagle, eagle3_one_model true / false). Engine route: the target built
# with --speculative_decoding_mode draft_tokens_external, or a "plain" engine (the draft, or a target alone).
# Every (setting, mode) compile can write has an entry; a missing one is a KeyError in compile and fails the tests.
# 1.2.1 refuses none of them.
SPECULATION_COMBINATIONS: dict[tuple[str, str], Combination] = {
    # LLM API (PyTorch backend). validate_feature_combination's CONFLICT_RULES pair neither chunked_prefill nor
    # kv_cache_reuse with anything; create_py_executor hands both to AttentionRuntimeFeatures beside
    # has_speculative_draft_tokens, and the attention then runs paged context FMHA for any of the three.
    ("enable_chunked_prefill", "none"): _allowed(PY_EXECUTOR_CREATOR, "create_py_executor"),
    # A two-model drafter fills its own KV cache for each prefill chunk the target ran.
    ("enable_chunked_prefill", "model"): _allowed(MODEL_DRAFTER, "ModelDrafter._prepare_draft_batch"),
    # The n-gram drafter drafts for generation requests only; a prompt still in chunks gets none.
    ("enable_chunked_prefill", "ngram"): _allowed(NGRAM_DRAFTER, "NGramDrafter.prepare_draft_tokens"),
    ("enable_chunked_prefill", "eagle3:one-model"):
        _allowed(FEATURE_MATRIX, "Chunked Prefill x EAGLE-3(One Model Engine): Yes"),
    ("enable_chunked_prefill", "eagle3:two-model"):
        _allowed(FEATURE_MATRIX, "Chunked Prefill x EAGLE-3(Two Model Engine): Yes"),
    ("kv_cache_config.enable_block_reuse", "none"): _allowed(FEATURE_MATRIX, "KV Cache Reuse x Chunked Prefill: Yes"),
    ("kv_cache_config.enable_block_reuse", "model"): _allowed(PY_EXECUTOR_UTIL, "validate_feature_combination"),
    ("kv_cache_config.enable_block_reuse", "ngram"): _allowed(PY_EXECUTOR_UTIL, "validate_feature_combination"),
    ("kv_cache_config.enable_block_reuse", "eagle3:one-model"):
        _allowed(FEATURE_MATRIX, "KV Cache Reuse x EAGLE-3(One Model Engine): Yes"),
    ("kv_cache_config.enable_block_reuse", "eagle3:two-model"):
        _allowed(FEATURE_MATRIX, "KV Cache Reuse x EAGLE-3(Two Model Engine): Yes"),
    # A guide beside speculation: create_py_executor builds a GuidedDecoder (masking every draft position) where
    # support_guided_decoder holds (no speculation, or a mode with a Drafter) and hands a CapturableGuidedDecoder to
    # the one-model modes; any other mode raises "Guided decoding is not supported for speculative decoding mode".
    ("guided_decoding_backend", "none"): _allowed(SPEC_INTERFACE, "SpeculativeDecodingMode.support_guided_decoder"),
    ("guided_decoding_backend", "model"): _allowed(SPEC_INTERFACE, "SpeculativeDecodingMode.has_spec_drafter"),
    ("guided_decoding_backend", "ngram"): _allowed(SPEC_INTERFACE, "SpeculativeDecodingMode.has_spec_drafter"),
    ("guided_decoding_backend", "eagle3:two-model"): _allowed(SPEC_INTERFACE, "SpeculativeDecodingMode.has_spec_drafter"),
    ("guided_decoding_backend", "eagle3:one-model"):
        _allowed(SPEC_INTERFACE, "SpeculativeDecodingMode.support_capturable_guided_decoder"),
    # Engine route (the C++ runtime behind the tensorrtllm backend and examples/run.py). Chunked context needs
    # paged context FMHA ("Chunked context requires context FMHA, paged kv_cache and paged context FMHA all enabled
    # at the same time"); a request's draft tokens ride its last chunk, and fitDraftTokens drops any that don't fit.
    ("enable_chunked_context", "draft_tokens_external"):
        _allowed(MICRO_BATCH_SCHEDULER, "MicroBatchScheduler::fitDraftTokens"),
    ("enable_chunked_context", "plain"):
        _allowed(TRT_GPT_MODEL, "TrtGptModelInflightBatching::TrtGptModelInflightBatching"),
    # Required, not only allowed: "KV cache block reuse must be enabled for speculative decoding target model".
    ("enable_kv_cache_reuse", "draft_tokens_external"):
        _allowed(TRT_GPT_MODEL, "TrtGptModelInflightBatching::TrtGptModelInflightBatching"),
    # Turned off only without paged context FMHA, or when the engine gathers context logits.
    ("enable_kv_cache_reuse", "plain"): _allowed(TRT_GPT_MODEL, "TrtGptModelInflightBatching::fixExecutorConfig"),
}


def combination(setting: str, mode: str) -> Combination:
    return SPECULATION_COMBINATIONS[(setting, mode)]


def refusal_notes(settings: tuple[str, ...], modes: tuple[str, ...]) -> list[str]:
    """One line per setting compile leaves off because upstream refuses it beside one of these modes."""
    notes = []
    for setting in settings:
        for mode in modes:
            c = combination(setting, mode)
            if not c.allowed:
                notes.append(f"{setting} off with speculation {mode}: {c.why} ({c.where.path} {c.where.symbol})")
    return notes
