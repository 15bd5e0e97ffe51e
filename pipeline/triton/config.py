"""config.pbtxt for every model in the Triton repository, built as ModelConfig protobuf messages.

Each model's config is a pure function of one validated `RepoSpec`; tensors come from the table in
`pipeline.triton.interface`, so the ensemble and its steps can't drift apart. Messages are written
with protobuf's text_format: no string templates, nothing left for a later `sed` to fill.

The graph: ensemble = preprocessing -> speculation_gate -> postprocessing. The gate is decoupled
and streams; it calls the engine (torch_engine, or tensorrt_llm with tensorrt_llm_draft) through
BLS, which is why the engine models are not ensemble steps.

The LLM-API route ("llmapi") is different: TensorRT-LLM's llmapi Triton model takes text and gives
text, tokenizing and speculating inside (speculative_config.max_concurrency turns speculation off
above that batch size), so its ensemble maps the client's names straight onto that model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.engine.gate_policy import GatePolicy
from pipeline.errors import ConfigError, MissingDependencyError
from pipeline.triton.interface import (
    ENSEMBLE_INPUTS,
    STREAM_ID,
    ENSEMBLE_OUTPUTS,
    GENERATION_TENSORS,
    REQUEST_TENSORS,
    TRTLLM_INPUTS,
    TRTLLM_OUTPUTS,
    TensorSpec,
)

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

CONFIG_FILE = "config.pbtxt"
ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
POSTPROCESSING = "postprocessing"
GATE = "speculation_gate"
TORCH_ENGINE = "torch_engine"
TRTLLM_TARGET = "tensorrt_llm"
TRTLLM_DRAFT = "tensorrt_llm_draft"
LLMAPI_MODEL = "tensorrt_llm"  # the llmapi route's one model, named as upstream's all_models/llmapi
# Where NVIDIA's Triton + TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3)
# keeps the llmapi model's source (model.py, helpers.py); TensorRT-LLM's own checkout has it at
# triton_backend/all_models/llmapi/tensorrt_llm/1. We reference it, we don't ship it.
LLMAPI_MODEL_DIR = "/app/all_models/llmapi/tensorrt_llm/1"
LLMAPI_YAML = "model.yaml"


@dataclass(frozen=True)
class RepoSpec:
    """Everything the repository's configs depend on, validated here and nowhere else."""

    backend: Literal["torch", "trtllm", "llmapi"]
    tokenizer_dir: str  # a Hugging Face folder with the tokenizer (and chat template); llmapi: the model
    engine_dir: str  # torch: the portable engine folder; trtllm: the target's engine folder; llmapi: compile's
    draft_engine_dir: str = ""  # trtllm only: the draft's engine folder
    max_batch_size: int = 64
    max_seq_len: int = 2048  # prompt + new tokens; preprocessing refuses longer requests
    apply_chat_template: bool = True
    num_draft_tokens: int = 4  # k, when a request doesn't say
    gate: GatePolicy = field(default_factory=GatePolicy)  # load threshold, hysteresis, min tokens
    # The gate stops speculating on "auto" while the rolling acceptance rate (accepted / drafted over
    # recent verifications) is below this; 0 turns the floor off.
    acceptance_floor: float = 0.5
    kv_fraction_target: float = 0.6  # trtllm: kv_cache_free_gpu_mem_fraction of the target
    kv_fraction_draft: float = 0.2  # trtllm: the same for the draft, on the same GPU
    llmapi_model_dir: str = LLMAPI_MODEL_DIR  # llmapi: the folder with TensorRT-LLM's llmapi model.py

    def __post_init__(self):
        if self.backend not in ("torch", "trtllm", "llmapi"):
            raise ConfigError(f"unknown backend {self.backend!r}; use 'torch', 'trtllm' or 'llmapi'")
        if not self.tokenizer_dir or not self.engine_dir:
            raise ConfigError("tokenizer_dir and engine_dir must be set; pass the model and engine folders")
        if self.backend == "trtllm" and not self.draft_engine_dir:
            raise ConfigError("the trtllm backend needs draft_engine_dir; build the draft engine and pass its folder")
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size must be >= 1")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len must be >= 2")
        if self.num_draft_tokens < 1:
            raise ConfigError("num_draft_tokens must be >= 1; send speculation='off' to turn it off")
        if not 0.0 <= self.acceptance_floor <= 1.0:
            raise ConfigError("acceptance_floor must be between 0 and 1")
        for name in ("kv_fraction_target", "kv_fraction_draft"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be between 0 and 1 (exclusive)")
        total = self.kv_fraction_target + self.kv_fraction_draft
        if self.backend == "trtllm" and total > 1.0:
            raise ConfigError(f"kv_fraction_target + kv_fraction_draft = {total:g} > 1 on one GPU; "
                              f"lower them, e.g. 0.6 and 0.2")

    @property
    def engine_model(self) -> str:
        return {"trtllm": TRTLLM_TARGET, "llmapi": LLMAPI_MODEL}.get(self.backend, TORCH_ENGINE)


def _model_config_pb2():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as err:
        raise MissingDependencyError("Triton configs need tritonclient; pip install 'tritonclient[grpc]'") from err
    return model_config_pb2


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _base(name: str, spec: RepoSpec, *, backend: str, inputs: tuple[TensorSpec, ...],
          outputs: tuple[TensorSpec, ...], parameters: dict[str, str], decoupled: bool) -> ModelConfig:
    pb = _model_config_pb2()
    msg = pb.ModelConfig(name=name, backend=backend, max_batch_size=spec.max_batch_size)
    for t in inputs:
        msg.input.append(pb.ModelInput(
            name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims),
            optional=t.optional, allow_ragged_batch=t.ragged,
            reshape=pb.ModelTensorReshape(shape=[]) if t.squeeze else None))
    for t in outputs:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    if decoupled:
        msg.model_transaction_policy.decoupled = True
    # One instance: the decoupled models send every response from one scheduler thread (many
    # sender threads crashed the python backend at 40 streams), and one instance is enough for
    # the tokenizer models, whose work is microseconds next to a decode step.
    msg.instance_group.append(pb.ModelInstanceGroup(count=1, kind=pb.ModelInstanceGroup.KIND_CPU))
    for key, value in parameters.items():
        msg.parameters[key].string_value = value
    return msg


def preprocessing_config(spec: RepoSpec) -> ModelConfig:
    """Tokenizes (with the chat template), validates, and fills every default of a request."""
    return _base(PREPROCESSING, spec, backend="python", inputs=ENSEMBLE_INPUTS, outputs=REQUEST_TENSORS,
                 decoupled=False, parameters={
                     "tokenizer_dir": spec.tokenizer_dir,
                     "apply_chat_template": _flag(spec.apply_chat_template),
                     "max_seq_len": str(spec.max_seq_len),
                     "num_draft_tokens": str(spec.num_draft_tokens),
                 })


def postprocessing_config(spec: RepoSpec) -> ModelConfig:
    """Detokenizes one generation response; passes the acceptance counts on to the client."""
    return _base(POSTPROCESSING, spec, backend="python", inputs=GENERATION_TENSORS, outputs=ENSEMBLE_OUTPUTS,
                 decoupled=False, parameters={"tokenizer_dir": spec.tokenizer_dir, "skip_special_tokens": "true"})


def speculation_gate_config(spec: RepoSpec) -> ModelConfig:
    """Decides per request and per step whether to speculate, and relays the engine's stream."""
    params = {
        "backend": spec.backend,
        "engine_model": spec.engine_model,
        "num_draft_tokens": str(spec.num_draft_tokens),
        "gate_max_batch_size": str(spec.gate.max_batch_size),
        "gate_hysteresis": str(spec.gate.hysteresis),
        "gate_min_tokens": str(spec.gate.min_tokens),
        "acceptance_floor": str(spec.acceptance_floor),
    }
    if spec.backend == "trtllm":
        params["draft_model"] = TRTLLM_DRAFT
        params["tokenizer_dir"] = spec.tokenizer_dir  # draft_target counts text tokens for the prefix resend
    return _base(GATE, spec, backend="python", inputs=REQUEST_TENSORS, outputs=GENERATION_TENSORS,
                 decoupled=True, parameters=params)


def torch_engine_config(spec: RepoSpec) -> ModelConfig:
    """The portable engine: continuous batching and speculation in one python model."""
    return _base(TORCH_ENGINE, spec, backend="python", inputs=REQUEST_TENSORS + (STREAM_ID,),
                 outputs=GENERATION_TENSORS,
                 decoupled=True, parameters={
                     "engine_dir": spec.engine_dir,
                     "max_batch_size": str(spec.max_batch_size),
                     "max_seq_len": str(spec.max_seq_len),
                     "num_draft_tokens": str(spec.num_draft_tokens),
                 })


def tensorrt_llm_config(spec: RepoSpec, *, draft: bool = False) -> ModelConfig:
    """The tensorrtllm backend's model, target or draft.

    Parameter keys as in tensorrtllm_backend's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt
    (there `gpt_model_type` takes the template's ${batching_strategy}).
    """
    params = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": spec.draft_engine_dir if draft else spec.engine_dir,
        # Both models take their fraction of the GPU memory free when each loads; the sum <= 1
        # check in RepoSpec is the necessary condition, the memory plan is the sufficient one.
        "kv_cache_free_gpu_mem_fraction": str(spec.kv_fraction_draft if draft else spec.kv_fraction_target),
        "max_beam_width": "1",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "exclude_input_in_output": "true",
        # Draft-target resends the accepted prefix every step; reuse keeps it from being recomputed.
        "enable_kv_cache_reuse": "true",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    }
    return _base(TRTLLM_DRAFT if draft else TRTLLM_TARGET, spec, backend="tensorrtllm",
                 inputs=TRTLLM_INPUTS, outputs=TRTLLM_OUTPUTS, decoupled=True, parameters=params)


def _step(model: str, input_map: dict[str, str], output_map: dict[str, str]):
    pb = _model_config_pb2()
    return pb.ModelEnsembling.Step(model_name=model, model_version=-1, input_map=input_map, output_map=output_map)


def ensemble_config(spec: RepoSpec) -> ModelConfig:
    """preprocessing -> speculation_gate -> postprocessing; intermediate tensors are `_`-prefixed."""
    pb = _model_config_pb2()
    msg = pb.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.max_batch_size)
    for t in ENSEMBLE_INPUTS:
        msg.input.append(pb.ModelInput(name=t.name, data_type=pb.DataType.Value(t.config_dtype),
                                       dims=list(t.dims), optional=t.optional))
    for t in ENSEMBLE_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    request = {t.name: f"_{t.name}" for t in REQUEST_TENSORS}
    generation = {t.name: f"_{t.name}" for t in GENERATION_TENSORS}
    msg.ensemble_scheduling.step.extend([
        _step(PREPROCESSING, {t.name: t.name for t in ENSEMBLE_INPUTS}, request),
        _step(GATE, request, generation),
        _step(POSTPROCESSING, generation, {t.name: t.name for t in ENSEMBLE_OUTPUTS}),
    ])
    return msg


# The llmapi model's inputs we feed (upstream's all_models/llmapi/tensorrt_llm/config.pbtxt; it reads
# each with get_input_tensor_by_name, so one left out is simply not set) and the ensemble's name for each.
# max_batch_size is 0 there ("does not support batching"): every dim below is the whole shape.
LLMAPI_INPUTS: tuple[tuple[TensorSpec, str], ...] = (
    (TensorSpec("text_input", "BYTES", (-1,)), "text_input"),
    (TensorSpec("streaming", "BOOL", (1,), optional=True), "stream"),
    (TensorSpec("sampling_param_max_tokens", "INT32", (1,), optional=True), "max_tokens"),
    (TensorSpec("sampling_param_temperature", "FP32", (1,), optional=True), "temperature"),
    (TensorSpec("sampling_param_top_k", "INT32", (1,), optional=True), "top_k"),
    (TensorSpec("sampling_param_top_p", "FP32", (1,), optional=True), "top_p"),
    (TensorSpec("sampling_param_seed", "UINT64", (1,), optional=True), "random_seed"),
    (TensorSpec("sampling_param_stop", "BYTES", (-1,), optional=True), "stop_words"),
)
LLMAPI_OUTPUTS: tuple[TensorSpec, ...] = (TensorSpec("text_output", "BYTES", (-1,)),)


def llmapi_model_config(spec: RepoSpec) -> ModelConfig:
    """TensorRT-LLM's llmapi model (python backend), run through our loader models/llmapi.py.

    max_batch_size and decoupled are left out on purpose: upstream's model sets them from model.yaml's
    triton_config in auto_complete_config, which can't override values config.pbtxt already sets.
    """
    pb = _model_config_pb2()
    msg = pb.ModelConfig(name=LLMAPI_MODEL, backend="python")
    for t, _ in LLMAPI_INPUTS:
        msg.input.append(pb.ModelInput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims),
                                       optional=t.optional))
    for t in LLMAPI_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    msg.instance_group.append(pb.ModelInstanceGroup(count=1, kind=pb.ModelInstanceGroup.KIND_CPU))
    msg.parameters["llmapi_model_dir"].string_value = spec.llmapi_model_dir
    return msg


def llmapi_ensemble_config(spec: RepoSpec) -> ModelConfig:
    """The client's names (text_input, max_tokens, stream, ...) onto the llmapi model's. Unbatched, as that
    model is; there is no speculation/num_draft_tokens input: the LLM API takes no per-request switch."""
    pb = _model_config_pb2()
    msg = pb.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=0)
    for t, outer in LLMAPI_INPUTS:
        msg.input.append(pb.ModelInput(name=outer, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims),
                                       optional=t.optional))
    for t in LLMAPI_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    msg.ensemble_scheduling.step.append(_step(
        LLMAPI_MODEL, {t.name: outer for t, outer in LLMAPI_INPUTS}, {t.name: t.name for t in LLMAPI_OUTPUTS}))
    return msg


def llmapi_model_yaml(model: str, llm_args: dict) -> dict:
    """model.yaml for the llmapi model: LLM(...) arguments plus its triton_config.

    `llm_args` are compile's extra_llm_api_options merged with the sizes; upstream's model passes
    everything but triton_config to LLM(**args) (update_llm_args_with_extra_dict).
    """
    return {"model": model, "backend": "pytorch", **llm_args,
            "triton_config": {"max_batch_size": 0, "decoupled": True}}


def repository_configs(spec: RepoSpec) -> dict[str, ModelConfig]:
    """Every model's config for the chosen backend, by model name."""
    if spec.backend == "llmapi":
        return {c.name: c for c in (llmapi_ensemble_config(spec), llmapi_model_config(spec))}
    configs = [preprocessing_config(spec), postprocessing_config(spec), speculation_gate_config(spec),
               ensemble_config(spec)]
    if spec.backend == "trtllm":
        configs += [tensorrt_llm_config(spec), tensorrt_llm_config(spec, draft=True)]
    else:
        configs.append(torch_engine_config(spec))
    return {c.name: c for c in configs}


def config_text(msg: ModelConfig) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(msg)


def write_config(folder: str | Path, msg: ModelConfig) -> Path:
    """Write `msg` as folder/config.pbtxt (creating folder); returns the file's path."""
    path = Path(folder) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_text(msg))
    return path


def read_config(path: str | Path) -> ModelConfig:
    """Parse a config.pbtxt (or the folder holding one) back into a ModelConfig."""
    from google.protobuf import text_format

    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing; write the repository first")
    try:
        return text_format.Parse(path.read_text(), _model_config_pb2().ModelConfig())
    except text_format.ParseError as err:
        raise ConfigError(f"{path} is not a valid ModelConfig: {err}") from err
