"""What TensorRT-LLM accepts, copied from its source, so generated commands and configs can be checked.

Reference version: TensorRT-LLM 1.2.1, the release in NVIDIA's Triton container that serves it
(pipeline.trtllm_version: TRTLLM_VERSION, TRITON_CONTAINER); build and serve in that one container, so
the engines are built by the TensorRT-LLM that loads them. TensorRT-LLM can't be installed on the machines
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
  SPECULATION_COMBINATIONS below: chunked prefill/context and KV block reuse beside each speculation mode, each
  pinned to the file and symbol that decides it
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.trtllm_version import TRITON_CONTAINER, TRTLLM_VERSION  # noqa: F401  (re-exported)

TRTLLM_CONTAINER = TRITON_CONTAINER

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

# llm_args.py DecodingBaseConfig.from_dict: the decoding_type strings, by release. They changed: 1.2.1 maps
# "Eagle" (EagleDecodingConfig, used for EAGLE-3), "DraftTarget" and "NGram", and raises "Invalid decoding
# type" for anything else; later main has Eagle3DecodingConfig ("Eagle3", "Eagle" an alias) and
# "Draft_Target". pipeline.trtllm_version refuses a release not listed here.
DECODING_TYPES_BY_RELEASE = {
    "1.2": {"model": "DraftTarget", "eagle3": "Eagle", "ngram": "NGram"},
}
DECODING_TYPES = frozenset(t for names in DECODING_TYPES_BY_RELEASE.values() for t in names.values())
# llm_args.py DecodingBaseConfig fields (plus each subclass's own). `speculative_model_dir` is the
# older name; newer releases keep it as a validation alias of `speculative_model`
# (AliasChoices("speculative_model", "speculative_model_dir")), so it is the spelling every 1.x accepts.
# max_concurrency: "When specified, speculation will be disabled at batch sizes above this value." It is read
# only by Drafter.should_use_spec_decode, and get_spec_drafter gives one-model EAGLE-3 (eagle3_one_model: true,
# the default) no Drafter: "for one engine mode, we are not able to turn off spec decode at runtime"
# (_torch/pyexecutor/model_engine.py). Two-model EAGLE-3 (eagle3_one_model: false) gets a ModelDrafter, so
# max_concurrency gates it; the 1.2.1 docs list two-model EAGLE-3 for Llama 3.1 8B and 3.3 70B.
SPECULATIVE_CONFIG_KEYS = frozenset({
    "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model_dir", "max_concurrency",
    "draft_len_schedule", "load_format", "acceptance_window", "acceptance_length_threshold",
    # Eagle3DecodingConfig / EagleDecodingConfig
    "eagle3_one_model", "eagle3_layers_to_capture", "eagle_choices", "greedy_sampling", "use_dynamic_tree",
    # NGramDecodingConfig
    "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
})
# llm_args.py KvCacheConfig fields we may emit; dtype is "a pure python field ... only for the Pytorch backend".
KV_CACHE_CONFIG_KEYS = frozenset({
    "enable_block_reuse", "max_tokens", "free_gpu_memory_fraction", "dtype", "tokens_per_block"})
# llm_args.py BaseLlmArgs / TorchLlmArgs top-level fields we may emit in extra_llm_api_options.
LLM_API_KEYS = frozenset({
    "speculative_config", "kv_cache_config", "max_batch_size", "max_num_tokens", "max_seq_len",
    "max_input_len", "enable_chunked_prefill", "tensor_parallel_size", "pipeline_parallel_size",
    # TorchLlmArgs; the 1.2.1 speculative-decoding docs set it for two-model EAGLE-3 ("Two-model based
    # speculation implementations do not support overlap scheduler").
    "disable_overlap_scheduler"})
# serve.py click options of `trtllm-serve MODEL ...` we may emit.
TRTLLM_SERVE_FLAGS = frozenset({
    "--backend", "--tp_size", "--pp_size", "--max_batch_size", "--max_num_tokens", "--max_seq_len",
    "--kv_cache_free_gpu_memory_fraction", "--extra_llm_api_options", "--host", "--port", "--tokenizer"})

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
SOURCES = frozenset({LLM_ARGS, FEATURE_MATRIX, PY_EXECUTOR_CREATOR, PY_EXECUTOR_UTIL, MODEL_DRAFTER, NGRAM_DRAFTER,
                     TRT_GPT_MODEL, MICRO_BATCH_SCHEDULER, PLUGIN, EXAMPLES_UTILS})


@dataclass(frozen=True)
class Pin:
    """An upstream file (one of SOURCES) and the symbol in it."""

    path: str
    symbol: str


# The settings compile writes for these features, each where it is defined. The tensorrtllm backend's parameters
# enable_chunked_context and enable_kv_cache_reuse are pinned with the backend's other parameters
# (pipeline.triton.upstream.TEMPLATE_PARAMETERS: getExecutorConfigFromParams reads enable_chunked_context as a bool,
# default false; getKvCacheConfigFromParams reads enable_kv_cache_reuse, default true).
FEATURE_SETTINGS: dict[str, Pin] = {
    "enable_chunked_prefill": Pin(LLM_ARGS, "BaseLlmArgs.enable_chunked_prefill"),  # default False
    "kv_cache_config.enable_block_reuse": Pin(LLM_ARGS, "KvCacheConfig.enable_block_reuse"),  # default True
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
