"""What TensorRT-LLM accepts, copied from its source, so generated commands and configs can be checked.

Reference version: TensorRT-LLM 1.2.1, the release in NVIDIA's Triton container that serves it
(pipeline.trtllm_version: TRTLLM_VERSION, TRITON_CONTAINER); build and serve in that one container, so
the engines are built by the TensorRT-LLM that loads them. TensorRT-LLM can't be installed on the machines
this is developed on (no GPU, and no wheel for them), so tests check every generated flag and key against
these tables: a typo'd flag fails a test instead of a build in the container.
Sources (NVIDIA/TensorRT-LLM):
  tensorrt_llm/commands/build.py     parse_arguments(): trtllm-build's own flags
  tensorrt_llm/plugin/plugin.py      cli_plugin_args + add_plugin_argument(): the plugin flags
  tensorrt_llm/builder.py            build(): FP8 paged context FMHA needs the FP8 quantization workflow
  tensorrt_llm/llmapi/llm_args.py    DecodingBaseConfig.from_dict, EagleDecodingConfig, DraftTargetDecodingConfig,
                                     NGramDecodingConfig, KvCacheConfig, BaseLlmArgs/TorchLlmArgs (1.2.1: read
                                     as rendered at NVIDIA/TensorRT-LLM gh-pages 1.2.1/_modules/..., @58fb435e)
  tensorrt_llm/_torch/speculative/drafter.py   Drafter.should_use_spec_decode: the only reader of max_concurrency
  tensorrt_llm/_torch/speculative/utils.py     get_spec_drafter: which modes get a Drafter
  tensorrt_llm/commands/serve.py     trtllm-serve's click options
  examples/utils.py                  add_common_args(): examples/run.py's flags
  examples/draft_target_model/README.md   the draft-target build recipe and its run.py smoke test
"""

from __future__ import annotations

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
    "--draft_target_model_config"})
