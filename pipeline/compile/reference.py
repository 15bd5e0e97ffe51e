"""What TensorRT-LLM accepts, copied from its source, so generated commands and configs can be checked.

Reference version: TensorRT-LLM 1.2 (container nvcr.io/nvidia/tensorrt-llm/release:1.2.1). TensorRT-LLM
can't be installed here (see /work/shared/FACTS.md), so tests check every generated flag and key
against these tables: a typo'd flag fails a test instead of a build in the container.
Sources (NVIDIA/TensorRT-LLM):
  tensorrt_llm/commands/build.py     parse_arguments(): trtllm-build's own flags
  tensorrt_llm/plugin/plugin.py      cli_plugin_args + add_plugin_argument(): the plugin flags
  tensorrt_llm/llmapi/llm_args.py    DecodingBaseConfig, DraftTargetDecodingConfig, Eagle3DecodingConfig,
                                     NGramDecodingConfig, KvCacheConfig, BaseLlmArgs
  tensorrt_llm/commands/serve.py     trtllm-serve's click options
  examples/draft_target_model/README.md   the draft-target build recipe
"""

from __future__ import annotations

TRTLLM_VERSION = "1.2.1"
TRTLLM_CONTAINER = f"nvcr.io/nvidia/tensorrt-llm/release:{TRTLLM_VERSION}"

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

# llm_args.py: the decoding_type discriminators (Literal[...] on each *DecodingConfig).
DECODING_TYPES = frozenset({"Draft_Target", "Eagle3", "NGram"})
# llm_args.py DecodingBaseConfig fields (plus each subclass's own). `speculative_model_dir` is the
# older name; newer releases keep it as a validation alias of `speculative_model`
# (AliasChoices("speculative_model", "speculative_model_dir")), so it is the spelling every 1.x accepts.
# max_concurrency: "When specified (>0), speculation will be disabled at batch sizes above this value."
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
    "max_input_len", "enable_chunked_prefill", "tensor_parallel_size", "pipeline_parallel_size"})
# serve.py click options of `trtllm-serve MODEL ...` we may emit.
TRTLLM_SERVE_FLAGS = frozenset({
    "--backend", "--tp_size", "--pp_size", "--max_batch_size", "--max_num_tokens", "--max_seq_len",
    "--kv_cache_free_gpu_memory_fraction", "--extra_llm_api_options", "--host", "--port", "--tokenizer"})
