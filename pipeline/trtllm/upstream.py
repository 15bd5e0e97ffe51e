"""What TensorRT-LLM's Triton backend expects, recorded from its source: the reference table for the engine route.

TensorRT-LLM can't run on our machines, so these facts are the only test the generated repository gets.
Every parameter, tensor and launch step `pipeline assemble` and `pipeline serve` emit for the
tensorrtllm backend comes from a table here, and each table entry names the upstream file and symbol
it was read from; tests/test_upstream.py checks every emitted name against these tables.

Version. The tables follow TensorRT-LLM 1.2.1, the release tensorrtllm_backend's Dockerfile builds the
Triton container from (triton-inference-server/tensorrtllm_backend@0b9d7d5
dockerfile/Dockerfile.triton.trt_llm_backend: TENSORRTLLM_REPO_TAG=release/1.2.1, TENSORRTLLM_VER=1.2.1, built
FROM nvcr.io/nvidia/tritonserver:25.12-py3-min; the published containers with it are 26.04-26.07, see
pipeline.trtllm.version). release/1.2.1 itself was not readable here; the files were read at
NVIDIA/TensorRT-LLM@0c8de69a (tensorrt_llm/version.py: 1.2.0rc8, after PR #10018 "Expose enable_trt_overlap in
Triton_backend"), the newest snapshot of triton_backend/ we could read.

Per release: everything for the tensorrtllm C++ backend and its inflight_batcher_llm templates (TEMPLATE_*,
TENSORRT_LLM_*, ENSEMBLE_*, the leader/orchestrator LAUNCH_FACTS) exists only on releases with the engine route
(1.2.1): NVIDIA/TensorRT-LLM PR #15907 removed them after 1.3.0rc20, keeping all_models/llmapi and
scripts/launch_triton_server.py. The llmapi model's tensors (LLMAPI_*) were read again at c8c6df08, after that
PR, and are unchanged, so they serve every release in pipeline.trtllm.version.RELEASES.
Inside NVIDIA's container `pipeline assemble` doesn't use these tables for the model config at all: it
copies the container's own template and fills it with the container's own fill_template.py
(pipeline.triton.trtllm_template), so the repository matches the backend that serves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.tensor_spec import TensorSpec as Tensor
# The release and its container's layout live with the version checks (compile reads them too); re-exported here,
# where the tables that cite them are.
from pipeline.trtllm.version import (CONTAINER_APP, CONTAINER_FILL_TEMPLATE, CONTAINER_LAUNCH_SCRIPT,  # noqa: F401
                                     CONTAINER_LLMAPI_MODEL, CONTAINER_RUN_PY, CONTAINER_TEMPLATES,
                                     CONTAINER_TRITONSERVER, TRITON_CONTAINER, TRTLLM_VERSION)

TEMPLATE_COMMIT = "0c8de69a1ca6213eebb20a51873890ff128666c2"  # NVIDIA/TensorRT-LLM, tensorrt_llm/version.py 1.2.0rc8

# Upstream files, in NVIDIA/TensorRT-LLM unless the path names another repository.
TEMPLATE = "triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"
ENSEMBLE_TEMPLATE = "triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt"
MODEL_INSTANCE_STATE = "triton_backend/inflight_batcher_llm/src/model_instance_state.cc"
MODEL_STATE = "triton_backend/inflight_batcher_llm/src/model_state.cc"
UTILS_H = "triton_backend/inflight_batcher_llm/src/utils.h"
FILL_TEMPLATE = "triton_backend/tools/fill_template.py"
LAUNCH_SCRIPT = "triton_backend/scripts/launch_triton_server.py"
EXECUTOR_IMPL = "cpp/tensorrt_llm/executor/executorImpl.cpp"
DOCKERFILE = "triton-inference-server/tensorrtllm_backend:dockerfile/Dockerfile.triton.trt_llm_backend"
MULTI_INSTANCE_DOC = "triton-inference-server/tensorrtllm_backend:docs/llama_multi_instance.md"
DRAFT_TARGET_README = "examples/draft_target_model/README.md"
GUIDED_DECODER = "cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp"  # @000a01de
GUIDED_DECODING_DOC = "triton-inference-server/tensorrtllm_backend:docs/guided_decoding.md"
LLMAPI_TEMPLATE = "triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt"
LLMAPI_MODEL_PY = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py"
LLMAPI_HELPERS = "triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py"
LLMAPI_DOC = "triton-inference-server/tensorrtllm_backend:docs/llmapi.md"
LLMAPI_LAUNCHER = "tensorrt_llm/llmapi/trtllm-llmapi-launch"  # read at 020c89e6
# Across pods (pipeline deploy kubernetes, multi-node): LeaderWorkerSet's Triton + TensorRT-LLM example, read at
# kubernetes-sigs/lws v0.10.0 (2161f38f), and the kubessh it copies from NVIDIA's tutorials (e8489525).
LWS_SERVER = "kubernetes-sigs/lws:docs/examples/tensorrt-llm/build/server.py"
LWS_RBAC = "kubernetes-sigs/lws:docs/examples/tensorrt-llm/rbac.yaml"
KUBESSH = "triton-inference-server/tutorials:Deployment/Kubernetes/TensorRT-LLM_Multi-Node_Distributed_Models/containers/kubessh"
# Triton's own OpenAI frontend (in NVIDIA's container, python/openai): how it calls a TensorRT-LLM-style ensemble
# (read at 0019b9d6107db8228745b118005d198ab4db5682), and where it renders the chat template before that.
TRITON_OPENAI_REQUEST = "triton-inference-server/server:python/openai/openai_frontend/engine/utils/triton.py"
TRITON_OPENAI_ENGINE = "triton-inference-server/server:python/openai/openai_frontend/engine/triton_engine.py"
# The python backend that runs every python model (its --backend-config keys are parsed at backend load).
PYTHON_BACKEND = "triton-inference-server/python_backend:src/python_be.cc"
# The LLM API's model classes for the families after Llama (PyTorch backend; each read at the commit named in
# LLMAPI_EAGLE3 below), and its support matrix (read at aeead21a93d9881f8000e8646d2a6ca1085d910c).
MODELING_QWEN3 = "tensorrt_llm/_torch/models/modeling_qwen3.py"
MODELING_QWEN3_MOE = "tensorrt_llm/_torch/models/modeling_qwen3_moe.py"
MODELING_GEMMA3 = "tensorrt_llm/_torch/models/modeling_gemma3.py"
SUPPORTED_MODELS_DOC = "docs/source/models/supported-models.md"
SOURCES = frozenset({TEMPLATE, ENSEMBLE_TEMPLATE, MODEL_INSTANCE_STATE, MODEL_STATE, UTILS_H, FILL_TEMPLATE,
                     LAUNCH_SCRIPT, EXECUTOR_IMPL, DOCKERFILE, MULTI_INSTANCE_DOC, DRAFT_TARGET_README,
                     LLMAPI_TEMPLATE, LLMAPI_MODEL_PY, LLMAPI_HELPERS, LLMAPI_DOC, LLMAPI_LAUNCHER, LWS_SERVER,
                     LWS_RBAC, KUBESSH, TRITON_OPENAI_REQUEST, TRITON_OPENAI_ENGINE, GUIDED_DECODER,
                     GUIDED_DECODING_DOC, PYTHON_BACKEND, MODELING_QWEN3, MODELING_QWEN3_MOE, MODELING_GEMMA3,
                     SUPPORTED_MODELS_DOC})


@dataclass(frozen=True)
class Ref:
    """Where an emitted thing comes from: an upstream file (one of SOURCES) and the symbol in it."""

    path: str
    symbol: str


# NVIDIA's container (the layout above, in pipeline.trtllm.version):
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"  # TEMPLATE executor_worker_path


# ---- the tensorrt_llm model's parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateParameter:
    """One `parameters` entry of TEMPLATE: its value there (a ${placeholder} or a literal) and who reads it.

    guarded: the C++ reads it inside try/catch (a missing key or an unparsable value falls back to a default);
    unguarded keys throw "Cannot find parameter with name: <key>" from ModelState::GetParameter when missing,
    and the model instance is never created.
    """

    key: str
    value: str  # "${name}" as the template has it, or the literal it ships
    read_by: Ref
    guarded: bool = True

    @property
    def placeholder(self) -> str | None:
        return self.value[2:-1] if self.value.startswith("${") and self.value.endswith("}") else None


def _p(key: str, reader: str, *, value: str | None = None, guarded: bool = True, path: str = MODEL_INSTANCE_STATE):
    return TemplateParameter(key, value if value is not None else "${%s}" % key, Ref(path, reader), guarded)


# Every key of TEMPLATE's parameters, in its order (46 at TEMPLATE_COMMIT).
TEMPLATE_PARAMETERS: tuple[TemplateParameter, ...] = (
    _p("max_beam_width", "getExecutorConfigFromParams"),
    _p("FORCE_CPU_ONLY_INPUT_TENSORS", "(not read by the C++; the template ships it)", value="no", path=TEMPLATE),
    _p("gpt_model_type", "getBatchingTypeFromParams", value="${batching_strategy}", guarded=False),
    _p("gpt_model_path", "ModelInstanceState::ModelInstanceState", value="${engine_dir}"),
    _p("encoder_model_path", "ModelInstanceState::ModelInstanceState", value="${encoder_engine_dir}"),
    _p("max_tokens_in_paged_kv_cache", "getKvCacheConfigFromParams"),
    _p("max_attention_window_size", "getKvCacheConfigFromParams"),
    _p("sink_token_length", "getKvCacheConfigFromParams"),
    _p("batch_scheduler_policy", "getSchedulerConfigFromParams"),
    _p("kv_cache_free_gpu_mem_fraction", "getKvCacheConfigFromParams"),
    _p("cross_kv_cache_fraction", "getKvCacheConfigFromParams"),
    _p("kv_cache_host_memory_bytes", "getKvCacheConfigFromParams"),
    _p("kv_cache_onboard_blocks", "getKvCacheConfigFromParams"),
    _p("enable_trt_overlap", "getExecutorConfigFromParams"),
    _p("exclude_input_in_output", "ModelInstanceState::ModelInstanceState"),
    _p("cancellation_check_period_ms", "ModelInstanceState::ModelInstanceState"),
    _p("stats_check_period_ms", "ModelInstanceState::ModelInstanceState"),
    _p("iter_stats_max_iterations", "getExecutorConfigFromParams"),
    _p("request_stats_max_iterations", "getExecutorConfigFromParams"),
    # Both filled "true" where the runtime takes them beside the engine's speculation mode, each combination pinned
    # in pipeline.trtllm.reference.SPECULATION_COMBINATIONS (default: reuse true, chunked context false).
    _p("enable_kv_cache_reuse", "getKvCacheConfigFromParams"),
    _p("normalize_log_probs", "getExecutorConfigFromParams"),
    _p("enable_chunked_context", "getExecutorConfigFromParams"),
    _p("gpu_device_ids", "ModelState::LoadParameters", path=MODEL_STATE),
    _p("participant_ids", "ModelState::LoadParameters", path=MODEL_STATE),
    _p("num_nodes", "getParallelConfigFromParams"),
    _p("lora_cache_optimal_adapter_size", "getPeftCacheConfigFromParams"),
    _p("lora_cache_max_adapter_size", "getPeftCacheConfigFromParams"),
    _p("lora_cache_gpu_memory_fraction", "getPeftCacheConfigFromParams"),
    _p("lora_cache_host_memory_bytes", "getPeftCacheConfigFromParams"),
    _p("lora_prefetch_dir", "getPeftCacheConfigFromParams"),
    _p("decoding_mode", "getExecutorConfigFromParams"),
    _p("executor_worker_path", "ModelState::GetExecutorWorkerPath", value=EXECUTOR_WORKER, path=MODEL_STATE),
    _p("lookahead_window_size", "getExecutorConfigFromParams"),
    _p("lookahead_ngram_size", "getExecutorConfigFromParams"),
    _p("lookahead_verification_set_size", "getExecutorConfigFromParams"),
    _p("medusa_choices", "getExecutorConfigFromParams"),
    _p("eagle_choices", "getExecutorConfigFromParams"),
    _p("gpu_weights_percent", "getExecutorConfigFromParams"),
    _p("enable_context_fmha_fp32_acc", "getExtendedRuntimePerfKnobConfigFromParams"),
    _p("multi_block_mode", "getExtendedRuntimePerfKnobConfigFromParams"),
    _p("cuda_graph_mode", "getExtendedRuntimePerfKnobConfigFromParams"),
    _p("cuda_graph_cache_size", "getExtendedRuntimePerfKnobConfigFromParams"),
    _p("speculative_decoding_fast_logits", "getSpeculativeDecodingConfigFromParams"),
    # Read unguarded, last, in getGuidedDecodingConfigFromParams; "" or the literal "${name}" means unset there.
    _p("tokenizer_dir", "getGuidedDecodingConfigFromParams", guarded=False),
    _p("guided_decoding_backend", "getGuidedDecodingConfigFromParams", guarded=False),
    _p("xgrammar_tokenizer_info_path", "getGuidedDecodingConfigFromParams", guarded=False),
)
UNGUARDED = tuple(p.key for p in TEMPLATE_PARAMETERS if not p.guarded)
# getGuidedDecodingConfigFromParams: "Guided decoding is currently supported with 'xgrammar' backend" (it throws for any
# other value), with xgrammar_tokenizer_info_path naming upstream's generate_xgrammar_tokenizer_info.py output
# (pipeline.trtllm.reference.GUIDE_INFO_SCRIPT; GUIDED_DECODING_DOC, "C++ Backend").
GUIDED_DECODING_BACKEND = "xgrammar"
GUIDED_DECODING_REF = Ref(MODEL_INSTANCE_STATE, "getGuidedDecodingConfigFromParams")
# Why a guided request never speculates on this route: GuidedDecoder::build compiles the grammar at a request's first
# context step and then advances it by one token (getLastTokens) and fills one mask per step, so draft positions are
# never masked, and each draft-target verify, a new TensorRT-LLM request holding the answer so far as its prompt,
# would start the grammar over.
GUIDED_DECODER_REF = Ref(GUIDED_DECODER, "GuidedDecoder::build")
# getBatchingTypeFromParams throws "Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching."
GPT_MODEL_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")

# Placeholders of TEMPLATE outside `parameters`. The data types sit unquoted, so the file doesn't even parse as a
# ModelConfig until they are filled.
TEMPLATE_FIELDS: dict[str, Ref] = {
    "triton_backend": Ref(TEMPLATE, "backend"),
    "triton_max_batch_size": Ref(TEMPLATE, "max_batch_size, dynamic_batching.preferred_batch_size"),
    "decoupled_mode": Ref(TEMPLATE, "model_transaction_policy.decoupled"),
    "max_queue_delay_microseconds": Ref(TEMPLATE, "dynamic_batching.max_queue_delay_microseconds"),
    "max_queue_size": Ref(TEMPLATE, "dynamic_batching.default_queue_policy.max_queue_size"),
    "encoder_input_features_data_type": Ref(TEMPLATE, "input encoder_input_features data_type"),
    "logits_datatype": Ref(TEMPLATE, "input draft_logits, outputs context_logits/generation_logits data_type"),
    "prompt_embedding_table_data_type": Ref(TEMPLATE, "input prompt_embedding_table data_type"),
}


# ---- the tensorrt_llm model's tensors (TEMPLATE input/output; C++ names in UTILS_H InputFieldsNames) ----------------


# A ${placeholder} data type is recorded as we fill it (logits FP32, encoder features and prompt tables FP16).
def _in(name, dtype, dims=(1,), *, required=False, squeeze=None, ragged=False) -> Tensor:
    squeeze = dims == (1,) and not ragged if squeeze is None else squeeze  # reshape: { shape: [ ] }
    return Tensor(name, dtype, dims, optional=not required, squeeze=squeeze, ragged=ragged)


TENSORRT_LLM_INPUTS: tuple[Tensor, ...] = (
    _in("input_ids", "INT32", (-1,), ragged=True),
    _in("encoder_input_features", "FP16", (-1, -1), ragged=True),  # ${encoder_input_features_data_type}
    _in("encoder_output_lengths", "INT32"),
    _in("input_lengths", "INT32", required=True),
    _in("request_output_len", "INT32", required=True),
    _in("num_return_sequences", "INT32"),
    _in("draft_input_ids", "INT32", (-1,), ragged=True),
    _in("decoder_input_ids", "INT32", (-1,), ragged=True),
    _in("decoder_input_lengths", "INT32"),
    _in("draft_logits", "FP32", (-1, -1), ragged=True),  # ${logits_datatype}
    _in("draft_acceptance_threshold", "FP32"),
    _in("end_id", "INT32"),
    _in("pad_id", "INT32"),
    _in("stop_words_list", "INT32", (2, -1), ragged=True),
    _in("bad_words_list", "INT32", (2, -1), ragged=True),
    _in("embedding_bias", "FP32", (-1,), ragged=True),
    _in("beam_width", "INT32"),
    _in("temperature", "FP32"),
    _in("runtime_top_k", "INT32"),
    _in("runtime_top_p", "FP32"),
    _in("runtime_top_p_min", "FP32"),
    _in("runtime_top_p_decay", "FP32"),
    _in("runtime_top_p_reset_ids", "INT32"),
    _in("len_penalty", "FP32"),
    _in("early_stopping", "BOOL"),
    _in("repetition_penalty", "FP32"),
    _in("min_tokens", "INT32"),
    _in("beam_search_diversity_rate", "FP32"),
    _in("presence_penalty", "FP32"),
    _in("frequency_penalty", "FP32"),
    _in("seed", "UINT64"),  # InputFieldsNames::seed = "seed" (not random_seed), read as uint64_t
    _in("return_log_probs", "BOOL"),
    _in("return_context_logits", "BOOL"),
    _in("return_generation_logits", "BOOL"),
    _in("return_perf_metrics", "BOOL"),
    _in("return_num_input_tokens", "BOOL"),
    _in("return_num_output_tokens", "BOOL"),
    _in("exclude_input_in_output", "BOOL"),
    _in("stop", "BOOL"),
    _in("streaming", "BOOL"),
    _in("prompt_embedding_table", "FP16", (-1, -1), ragged=True),  # ${prompt_embedding_table_data_type}
    _in("prompt_table_extra_ids", "UINT64", (-1,), ragged=True),
    _in("prompt_vocab_size", "INT32"),
    _in("cross_attention_mask", "BOOL", (-1, -1), ragged=True),
    _in("mrope_rotary_cos_sin", "FP32", (-1,), squeeze=False),
    _in("mrope_position_deltas", "INT64", squeeze=False),
    _in("lora_task_id", "UINT64"),
    _in("lora_weights", "FP16", (-1, -1), ragged=True),
    _in("lora_config", "INT32", (-1, 3), ragged=True),
    _in("context_phase_params", "UINT8", (-1,), ragged=True),
    _in("skip_cross_attn_blocks", "BOOL", ragged=True),
    _in("retention_token_range_starts", "INT32", (-1,), ragged=True),
    _in("retention_token_range_ends", "INT32", (-1,), ragged=True),
    _in("retention_token_range_priorities", "INT32", (-1,), ragged=True),
    _in("retention_token_range_durations_ms", "INT32", (-1,), ragged=True),
    _in("retention_decode_priority", "INT32", ragged=True),
    _in("retention_decode_duration_ms", "INT32", ragged=True),
    _in("guided_decoding_guide_type", "BYTES", ragged=True),
    _in("guided_decoding_guide", "BYTES", ragged=True),
    _in("lookahead_window_size", "INT32", ragged=True),
    _in("lookahead_ngram_size", "INT32", ragged=True),
    _in("lookahead_verification_set_size", "INT32", ragged=True),
)


def _out(name, dtype, dims=(1,)) -> Tensor:
    return Tensor(name, dtype, dims, optional=False)


TENSORRT_LLM_OUTPUTS: tuple[Tensor, ...] = (
    _out("output_ids", "INT32", (-1, -1)),
    _out("sequence_length", "INT32", (-1,)),
    _out("cum_log_probs", "FP32", (-1,)),
    _out("output_log_probs", "FP32", (-1, -1)),
    _out("context_logits", "FP32", (-1, -1)),  # ${logits_datatype}
    _out("generation_logits", "FP32", (-1, -1, -1)),  # ${logits_datatype}
    _out("batch_index", "INT32"),
    _out("sequence_index", "INT32"),
    _out("context_phase_params", "UINT8", (-1,)),
    _out("kv_cache_alloc_new_blocks", "INT32"),
    _out("kv_cache_reused_blocks", "INT32"),
    _out("kv_cache_alloc_total_blocks", "INT32"),
    _out("arrival_time_ns", "INT64"),
    _out("first_scheduled_time_ns", "INT64"),
    _out("first_token_time_ns", "INT64"),
    _out("last_token_time_ns", "INT64"),
    _out("acceptance_rate", "FP32"),
    _out("total_accepted_draft_tokens", "INT32"),
    _out("total_draft_tokens", "INT32"),
    _out("num_input_tokens", "INT32"),
    _out("num_output_tokens", "INT32"),
)
TENSORS_REF = Ref(TEMPLATE, "input, output")
# What the backend insists on (utils.cc createRequestsFromInputTensors / the response path): output_ids and
# sequence_length must be among the requested outputs, or it throws "%s tensor must be present in list of
# output tensors".
REQUIRED_OUTPUTS = ("output_ids", "sequence_length")


# ---- the ensemble clients talk to (ENSEMBLE_TEMPLATE input/output) ---------------------------------------------------

ENSEMBLE_INPUTS: tuple[Tensor, ...] = (
    _in("text_input", "BYTES", required=True, squeeze=False),
    _in("decoder_text_input", "BYTES", squeeze=False),
    _in("max_tokens", "INT32", required=True, squeeze=False),
    _in("num_return_sequences", "INT32", squeeze=False),
    _in("bad_words", "BYTES", (-1,)),
    _in("stop_words", "BYTES", (-1,)),
    _in("exclude_input_in_output", "BOOL", squeeze=False),
    _in("end_id", "INT32", squeeze=False),
    _in("pad_id", "INT32", squeeze=False),
    _in("top_k", "INT32", squeeze=False),
    _in("top_p", "FP32", squeeze=False),
    _in("temperature", "FP32", squeeze=False),
    _in("length_penalty", "FP32", squeeze=False),
    _in("repetition_penalty", "FP32", squeeze=False),
    _in("min_tokens", "INT32", squeeze=False),
    _in("presence_penalty", "FP32", squeeze=False),
    _in("frequency_penalty", "FP32", squeeze=False),
    _in("seed", "UINT64", squeeze=False),
    _in("return_log_probs", "BOOL", squeeze=False),
    _in("return_context_logits", "BOOL", squeeze=False),
    _in("return_generation_logits", "BOOL", squeeze=False),
    _in("return_perf_metrics", "BOOL", squeeze=False),
    _in("return_num_input_tokens", "BOOL", squeeze=False),
    _in("return_num_output_tokens", "BOOL", squeeze=False),
    _in("beam_width", "INT32", squeeze=False),
    _in("stream", "BOOL", squeeze=False),
    _in("prompt_embedding_table", "FP16", (-1, -1)),
    _in("prompt_table_extra_id", "UINT64", squeeze=False),
    _in("prompt_vocab_size", "INT32", squeeze=False),
    _in("embedding_bias_words", "BYTES", (-1,)),
    _in("embedding_bias_weights", "FP32", (-1,)),
    _in("lora_task_id", "UINT64", squeeze=False),
    _in("lora_weights", "FP16", (-1, -1), ragged=True),
    _in("lora_config", "INT32", (-1, 3), ragged=True),
    _in("guided_decoding_guide_type", "BYTES", ragged=True),
    _in("guided_decoding_guide", "BYTES", ragged=True),
)
# The ensemble answers with text_output and passes tensorrt_llm's other outputs through (ENSEMBLE_TEMPLATE's
# tensorrt_llm step output_map), all but the token ids, their lengths and the disaggregated-serving params.
ENSEMBLE_OUTPUTS: tuple[Tensor, ...] = (_out("text_output", "BYTES", (-1,)),) + tuple(
    t for t in TENSORRT_LLM_OUTPUTS if t.name not in ("output_ids", "sequence_length", "context_phase_params"))
ENSEMBLE_REF = Ref(ENSEMBLE_TEMPLATE, "input, output")


# ---- launching (LAUNCH_SCRIPT; MULTI_INSTANCE_DOC; MODEL_INSTANCE_STATE getParallelConfigFromParams) ----------------


@dataclass(frozen=True)
class LaunchFact:
    what: str
    ref: Ref


LAUNCH_FACTS: dict[str, LaunchFact] = {
    # get_cmd: one MPMD mpirun, `-n 1 <rank cmd>` per rank joined by ':'
    "mpirun": LaunchFact("mpirun --allow-run-as-root, then -n 1 <rank command> per rank, joined by ':'",
                         Ref(LAUNCH_SCRIPT, "get_cmd")),
    "ports": LaunchFact("every rank gets the same --grpc-port/--http-port/--metrics-port; ranks > 0 never bind "
                        "them (they block in TRITONBACKEND_ModelInstanceInitialize)", Ref(LAUNCH_SCRIPT, "add_port_config")),
    "disable_auto_complete": LaunchFact("--disable-auto-complete-config on every rank", Ref(LAUNCH_SCRIPT, "get_cmd")),
    "shm_prefix": LaunchFact("--backend-config=python,shm-region-prefix-name=<prefix per rank>",
                             Ref(LAUNCH_SCRIPT, "get_cmd")),
    "python_shm": LaunchFact("--backend-config=python,shm-default-byte-size=<bytes> and shm-growth-byte-size=<bytes>: "
                             "each python model instance's shared-memory region is created at the first size (1 MB "
                             "by default, at least 1 MB) and grown by the second (1 MB by default)",
                             Ref(PYTHON_BACKEND, "TRITONBACKEND_Initialize")),
    "worker_ranks": LaunchFact("ranks > 0: --model-control-mode=explicit and --load-model=<each TensorRT-LLM model>",
                               Ref(LAUNCH_SCRIPT, "get_cmd")),
    "orchestrator_env": LaunchFact("--multi-model sets TRTLLM_ORCHESTRATOR=1 and TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 "
                                   "and needs world_size 1", Ref(LAUNCH_SCRIPT, "__main__")),
    "orchestrator_memory": LaunchFact("--multi-model on Triton > 24.06: --pinned-memory-pool-byte-size=0 "
                                      "--enable-peer-access=false --cuda-memory-pool-byte-size=<gpu>:0 per GPU",
                                      Ref(LAUNCH_SCRIPT, "add_multi_model_config")),
    "leader_world": LaunchFact("leader mode (TRTLLM_ORCHESTRATOR unset) needs MPI world size == tp*pp*cp",
                               Ref(EXECUTOR_IMPL, "Executor::Impl::initializeWorkers")),
    "spawn": LaunchFact("orchestrator mode spawns tp*pp*cp trtllmExecutorWorker processes per model "
                        "(executor_worker_path) with MPI_Comm_spawn: one node",
                        Ref(EXECUTOR_IMPL, "Executor::Impl::initializeOrchestrator")),
    "gpu_device_ids": LaunchFact("gpu_device_ids: comma-separated GPUs per instance (';' between instances), "
                                 "as many as tp*pp*cp; unset = the visible GPUs", Ref(MULTI_INSTANCE_DOC, "gpu_device_ids")),
    "participant_ids": LaunchFact("participant_ids must stay unset when the orchestrator spawns its workers",
                                  Ref(EXECUTOR_IMPL, "Executor::Impl::initializeWorkers")),
    "hosts": LaunchFact("across pods: mpirun --allow-run-as-root -mca plm_rsh_agent kubessh -np <tp*pp> --host "
                        "<pod>:<GPUs per pod>,... (the leader's pod first), then the per-rank commands; started once "
                        "every pod of the group is Running", Ref(LWS_SERVER, "do_leader, wait_for_workers")),
    "kubessh": LaunchFact("kubessh POD CMD... runs kubectl exec POD -- /bin/sh -c CMD: kubectl in the image and a "
                          "service account allowed pods get/list and pods/exec create", Ref(KUBESSH, "kubessh")),
    "workers_wait": LaunchFact("worker pods run nothing of their own; the leader's mpirun starts their ranks",
                               Ref(LWS_SERVER, "do_worker")),
    "rbac": LaunchFact("Role: get, list on pods; create on pods/exec; bound to the pods' service account",
                       Ref(LWS_RBAC, "Role tensorrt-sa")),
    "llmapi_ranks": LaunchFact("under MPI the LLM API runs one rank per GPU, each as trtllm-llmapi-launch "
                               "<command>: rank 0 runs the command and mgmn_leader_node, the others "
                               "mgmn_worker_node and ignore the command",
                               Ref(LLMAPI_LAUNCHER, "mpi_rank")),
    "llmapi_launch": LaunchFact("--trtllm_llmapi_launch puts trtllm-llmapi-launch before tritonserver in every "
                                "rank's -n 1 command", Ref(LAUNCH_SCRIPT, "get_cmd")),
    "two_models": LaunchFact("draft + target in one server: --multi-model (orchestrator), the draft and target "
                             "tensorrt_llm models named in --tensorrt_llm_model_name", Ref(DRAFT_TARGET_README, "Triton")),
}


# ---- the LLM-API route's model (LLMAPI_TEMPLATE; read in LLMAPI_HELPERS get_sampling_params_from_request) -----------
# Unbatched (max_batch_size 0, set from model.yaml's triton_config), so dims are whole shapes. The inputs the
# LLM-API frontend sends; the template has more (best_of, penalties, return_*, lora_*), left unsent.
LLMAPI_INPUTS: tuple[Tensor, ...] = (
    Tensor("text_input", "BYTES", (-1,)),
    Tensor("streaming", "BOOL", (1,), optional=True),
    Tensor("sampling_param_temperature", "FP32", (1,), optional=True),
    Tensor("sampling_param_top_k", "INT32", (1,), optional=True),
    Tensor("sampling_param_top_p", "FP32", (1,), optional=True),
    Tensor("sampling_param_max_tokens", "INT32", (1,), optional=True),
    Tensor("sampling_param_stop", "BYTES", (-1,), optional=True),
    Tensor("sampling_param_seed", "UINT64", (1,), optional=True),
    # SamplingParams(exclude_input_from_output=...): sent true, so text_output never holds the prompt.
    Tensor("sampling_param_exclude_input_from_output", "BOOL", (1,), optional=True),
)
# text_output: the text so far (CompletionOutput.text, not text_diff) in every streamed response (LLMAPI_MODEL_PY
# _create_response); there is no token count or token ids among its outputs.
LLMAPI_OUTPUTS: tuple[Tensor, ...] = (Tensor("text_output", "BYTES", (-1,)),)
LLMAPI_REF = Ref(LLMAPI_TEMPLATE, "input, output")
# LLMAPI_MODEL_PY TritonPythonModel.auto_complete_config sets max_batch_size and decoupled from model.yaml's
# triton_config; with launch_triton_server.py's --disable-auto-complete-config, config.pbtxt must carry them.
LLMAPI_TRITON_CONFIG = {"max_batch_size": 0, "decoupled": True}


@dataclass(frozen=True)
class Eagle3Support:
    """Whether the LLM API serves an EAGLE-3 head on a family's target, and where its source says so."""

    takes_head: bool
    ref: Ref
    read_at: str  # the commit of the file read


# A target takes an EAGLE-3 head (one- or two-model) when the class register_auto_model registers for its
# architecture is a SpecDecOneEngineForCausalLM, whose model's forward hands its layers' hidden states to the head
# (spec_metadata). A DecoderModelForCausalLM whose forward takes no spec_metadata can't feed one. By the target's
# Hugging Face model_type; Llama's EAGLE-3 route is cited where the LLM-API config is written (compiler/llmapi.py).
LLMAPI_EAGLE3: dict[str, Eagle3Support] = {
    "qwen3": Eagle3Support(True, Ref(MODELING_QWEN3, "Qwen3ForCausalLM(SpecDecOneEngineForCausalLM[Qwen3Model, ...])"),
                           "010bb95fbad3c678792a9edf659970299a1a320b"),
    # The support matrix agrees: Qwen3MoeForCausalLM, EAGLE-3 one-model and two-model "Yes".
    "qwen3_moe": Eagle3Support(True, Ref(MODELING_QWEN3_MOE, "Qwen3MoeForCausalLM(SpecDecOneEngineForCausalLM[...])"),
                               "03441af14b6675ec38275167cfd514595defb505"),
    "gemma3_text": Eagle3Support(False, Ref(MODELING_GEMMA3, "Gemma3ForCausalLM(DecoderModelForCausalLM[...]); "
                                                           "Gemma3TextModel.forward takes no spec_metadata"),
                                 "00e7d1037d247c72af2da216998cd7cf9e846461"),
}
LLMAPI_EAGLE3["gemma3"] = LLMAPI_EAGLE3["gemma3_text"]  # Gemma3ForConditionalGeneration's text model is that class


# ---- Triton's OpenAI frontend in front of the ensemble ------------------------------------------------------------

# The tensors _create_trtllm_inference_request sends (each only when the request sets it; frequency and presence
# penalty at OpenAI's neutral 0 pass our UNSUPPORTED_INPUTS check). text_input is the conversation already
# rendered by the model's chat template (TritonLLMEngine.chat), which preprocessing must not template again.
TRITON_OPENAI_REF = Ref(TRITON_OPENAI_REQUEST, "_create_trtllm_inference_request")
TRITON_OPENAI_RENDER_REF = Ref(TRITON_OPENAI_ENGINE, "TritonLLMEngine.chat")
TRITON_OPENAI_INPUTS: tuple[tuple[str, str], ...] = (
    ("text_input", "BYTES"), ("stream", "BOOL"), ("max_tokens", "INT32"), ("stop_words", "BYTES"), ("top_p", "FP32"),
    ("frequency_penalty", "FP32"), ("presence_penalty", "FP32"), ("seed", "UINT64"), ("temperature", "FP32"))
