"""config.pbtxt for every model in the Triton repository, built as ModelConfig protobuf messages.

Each model's config is a pure function of one validated `RepoSpec`; tensors come from the table in
`pipeline.triton.interface`, so the ensemble and its steps can't drift apart. Messages are written
with protobuf's text_format: no string templates, nothing left for a later `sed` to fill.

The graph: ensemble = preprocessing -> speculation_gate -> postprocessing. The gate is decoupled
and streams; it calls the engine (torch_engine, or tensorrt_llm with tensorrt_llm_draft) through
BLS, which is why the engine models are not ensemble steps.

The LLM-API route ("llmapi"): TensorRT-LLM's llmapi Triton model takes text and gives text, tokenizing
and speculating inside (speculative_config.max_concurrency turns speculation off above that batch
size). The same ensemble interface fronts it: ensemble = llmapi_frontend, which validates, applies
the chat template, calls that model through BLS and turns its running text into per-response deltas
with token counts, so a client can't tell the routes apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping

from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ConfigError
from pipeline.policy.gate_policy import GatePolicy
from pipeline.routes import ROUTES, Route, route_named
from pipeline.setting import MAX_BATCH_SIZE, MAX_QUEUE_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS
from pipeline.triton.interface import (
    ENSEMBLE_INPUTS,
    ENSEMBLE_OUTPUTS,
    GENERATION_TENSORS,
    REQUEST_TENSORS,
    STOP_INPUTS,
    STOP_OUTPUTS,
    STREAM_ID,
    TensorSpec,
)
from pipeline.triton.model_config_pb import model_config_pb2
from pipeline.triton.trtllm_template import TrtllmModel, table_config

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

CONFIG_FILE = "config.pbtxt"
ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
POSTPROCESSING = "postprocessing"
GATE = "speculation_gate"
STOP_REQUEST = "stop_request"  # a client stops its request by id (pipeline.triton.cancel_marks), no stream cancelled
TORCH_ENGINE = "torch_engine"
TRTLLM_TARGET = "tensorrt_llm"
TRTLLM_DRAFT = "tensorrt_llm_draft"
LLMAPI_MODEL = "tensorrt_llm"  # the llmapi route's engine model, named as upstream's all_models/llmapi
LLMAPI_FRONTEND = "llmapi_frontend"  # the llmapi route's ensemble step: our interface onto LLMAPI_MODEL
# Where NVIDIA's Triton + TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3)
# keeps the llmapi model's source (model.py, helpers.py); TensorRT-LLM's own checkout has it at
# triton_backend/all_models/llmapi/tensorrt_llm/1. We reference it, we don't ship it.
LLMAPI_MODEL_DIR = "/app/all_models/llmapi/tensorrt_llm/1"
LLMAPI_YAML = "model.yaml"
# The portable engine's default queue: 4 waiting requests per slot, so a queued request waits for about four
# answers per slot to finish. On the embedded default (8 slots, 64-token answers, about 1.4 answers a second
# under the soak's load) that is under half a minute; at 8 per slot the last of the queue waited up to 55 s
# and 20 of its 957 greedy requests, all non-streamed, passed the soak's 60 s without a word (scripts/soak.py).
QUEUE_PER_SLOT = 4
# Generous: byte-level BPE tokens average 3-5 bytes of English or code, and a UTF-8 character is at most 4.
BYTES_PER_TOKEN = 32
# `pipeline serve --device` reaches torch_engine through the server's environment, which tritonserver passes on to
# the python backend's stubs: a model's config.pbtxt is fixed when assemble writes it, and the device is the
# serving machine's choice. Set, it wins over the config's `device` parameter.
DEVICE_ENV = "PIPELINE_DEVICE"
REPO_BACKENDS = tuple(route.repo_backend for route in ROUTES)  # RepoSpec.backend: torch, trtllm, llmapi


@dataclass(frozen=True)
class RepoSpec:
    """Everything the repository's configs depend on, validated here and nowhere else."""

    backend: Literal["torch", "trtllm", "llmapi"]  # the route's repo_backend (pipeline.routes)
    tokenizer_dir: str  # a Hugging Face folder with the tokenizer (and chat template); llmapi: the model
    engine_dir: str  # torch: the portable engine folder; trtllm: the target's engine folder; llmapi: compile's
    draft_engine_dir: str = ""  # trtllm only: the draft's engine folder; "" serves the target alone
    # The class AutoTokenizer picked for it when the repository was assembled ("module:Class"): the tokenizing
    # models load it directly, without the auto classes' torch import. "": AutoTokenizer at load.
    tokenizer_class: str = ""
    max_batch_size: int = 64
    max_seq_len: int = 2048  # prompt + new tokens; preprocessing refuses longer requests
    # The most bytes of text_input a request may carry, checked before any tokenizing (a 20 MB prompt took
    # 20 s to refuse, and held up every request behind it); None: max_seq_len x BYTES_PER_TOKEN.
    max_input_bytes: int | None = None
    # torch: requests that may wait for a free slot; one more is refused at once as busy (UNAVAILABLE) instead
    # of queueing for minutes (tensorrtllm_backend's max_queue_size, docs/model_config.md). None: QUEUE_PER_SLOT
    # per slot; 0: no bound.
    max_queue_size: int | None = None
    apply_chat_template: bool = True
    num_draft_tokens: int = 4  # k, when a request doesn't say
    gate: GatePolicy = field(default_factory=GatePolicy)  # load threshold, hysteresis, min tokens
    # trtllm: kv_cache_free_gpu_mem_fraction of each model. The draft's KV is also bounded in tokens
    # (max_tokens_in_paged_kv_cache; the backend takes the smaller), so whichever model loads first, the
    # other still fits (pipeline.triton.assemble.kv_budget).
    kv_fraction_target: float = 0.5
    kv_fraction_draft: float = 0.5
    draft_max_tokens: int | None = None
    gpu_device_ids: str | None = None  # trtllm, orchestrator mode: the GPUs both models use, "0,1"
    # trtllm: compile's xgrammar_tokenizer_info.json, which turns the target's guided decoding on; "": off, and the
    # gate refuses a guided request in one line
    guide_tokenizer_info: str = ""
    llmapi_model_dir: str = LLMAPI_MODEL_DIR  # llmapi: the folder with TensorRT-LLM's llmapi model.py
    # torch: where torch_engine loads the engine (auto|cpu|cuda|cuda:N), resolved in the model's process as it
    # loads; `pipeline serve --device` overrides it for its own runs through DEVICE_ENV
    device: DeviceChoice = DeviceField()

    def __post_init__(self):
        if self.backend not in REPO_BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; use {', '.join(map(repr, REPO_BACKENDS))}")
        if not self.tokenizer_dir or not self.engine_dir:
            raise ConfigError("tokenizer_dir and engine_dir must be set; pass the model and engine folders")
        MAX_BATCH_SIZE.check(self.max_batch_size, by_flag=False)
        MAX_SEQ_LEN.check(self.max_seq_len, by_flag=False)
        if self.max_input_bytes is not None and self.max_input_bytes < 1:
            raise ConfigError("max_input_bytes must be >= 1")
        if self.max_queue_size is not None:
            MAX_QUEUE_SIZE.check(self.max_queue_size, by_flag=False, fix="0 means no bound")
        NUM_DRAFT_TOKENS.check(self.num_draft_tokens, by_flag=False, fix="send speculation='off' to turn it off")
        for name in ("kv_fraction_target", "kv_fraction_draft"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be between 0 and 1 (exclusive)")
        if self.draft_max_tokens is not None and self.draft_max_tokens < 1:
            raise ConfigError("draft_max_tokens must be >= 1")
        if self.guide_tokenizer_info and not self.route.guide_tokenizer_info:
            raise ConfigError("guide_tokenizer_info is the engine route's (backend 'trtllm'); the portable engine "
                              "and the LLM-API route take guides without it")
        self.route.check_device(self.device, f"a repository of backend {self.backend!r}")

    @property
    def queue_limit(self) -> int:
        return QUEUE_PER_SLOT * self.max_batch_size if self.max_queue_size is None else self.max_queue_size

    @property
    def input_byte_limit(self) -> int:
        return self.max_input_bytes or self.max_seq_len * BYTES_PER_TOKEN

    @property
    def route(self) -> Route:
        return route_named(self.backend)

    @property
    def has_draft(self) -> bool:
        """A draft model of its own in the repository (the engine route's tensorrt_llm_draft)."""
        return self.route.upstream_engine_models and bool(self.draft_engine_dir)

    @property
    def engine_model(self) -> str:
        """The model the gate (or the LLM API's frontend step) sends a request on to."""
        if self.route.upstream_engine_models:
            return TRTLLM_TARGET
        return LLMAPI_MODEL if self.route.upstream_llmapi_model else TORCH_ENGINE


def _flag(value: bool) -> str:
    return "true" if value else "false"


# Two preprocessing instances: a prompt near the byte limit tokenizing in one doesn't hold every other
# request's tokenizing behind it (the limit itself keeps that to milliseconds).
PREPROCESSING_INSTANCES = 2


def _base(name: str, spec: RepoSpec, *, backend: str, inputs: tuple[TensorSpec, ...],
          outputs: tuple[TensorSpec, ...], parameters: dict[str, str], decoupled: bool,
          instances: int = 1) -> ModelConfig:
    pb = model_config_pb2()
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
    # One instance by default: the decoupled models send every response from one scheduler thread (many
    # sender threads crashed the python backend at 40 streams), and postprocessing must handle a stream's
    # responses in order. Preprocessing answers each request once, so it takes PREPROCESSING_INSTANCES.
    msg.instance_group.append(pb.ModelInstanceGroup(count=instances, kind=pb.ModelInstanceGroup.KIND_CPU))
    for key, value in parameters.items():
        msg.parameters[key].string_value = value
    return msg


def _request_parameters(spec: RepoSpec) -> dict[str, str]:
    """What a model reading the client's request needs: the tokenizer, the chat template switch, the limits."""
    return {"tokenizer_dir": spec.tokenizer_dir, **_tokenizer_class(spec),
            "apply_chat_template": _flag(spec.apply_chat_template),
            "max_seq_len": str(spec.max_seq_len), "num_draft_tokens": str(spec.num_draft_tokens),
            "max_input_bytes": str(spec.input_byte_limit)}


def _tokenizer_class(spec: RepoSpec) -> dict[str, str]:
    return {"tokenizer_class": spec.tokenizer_class} if spec.tokenizer_class else {}


def preprocessing_config(spec: RepoSpec) -> ModelConfig:
    """Tokenizes (with the chat template), validates, and fills every default of a request."""
    return _base(PREPROCESSING, spec, backend="python", inputs=ENSEMBLE_INPUTS, outputs=REQUEST_TENSORS,
                 decoupled=False, parameters=_request_parameters(spec), instances=PREPROCESSING_INSTANCES)


def stop_request_config(spec: RepoSpec) -> ModelConfig:
    """Marks a client's request to be stopped: the gate ends it, and the client reads its stream to the end."""
    return _base(STOP_REQUEST, spec, backend="python", inputs=STOP_INPUTS, outputs=STOP_OUTPUTS, parameters={},
                 decoupled=False)


def postprocessing_config(spec: RepoSpec) -> ModelConfig:
    """Detokenizes one generation response; passes the acceptance counts on to the client."""
    return _base(POSTPROCESSING, spec, backend="python", inputs=GENERATION_TENSORS, outputs=ENSEMBLE_OUTPUTS,
                 decoupled=False, parameters={"tokenizer_dir": spec.tokenizer_dir, **_tokenizer_class(spec),
                             "skip_special_tokens": "true"})


def speculation_gate_config(spec: RepoSpec) -> ModelConfig:
    """Decides per request and per step whether to speculate, and relays the engine's stream."""
    params = {
        "backend": spec.backend,
        "engine_model": spec.engine_model,
        "num_draft_tokens": str(spec.num_draft_tokens),
        "gate_max_batch_size": str(spec.gate.max_batch_size),
        "gate_hysteresis": str(spec.gate.hysteresis),
        "gate_min_tokens": str(spec.gate.min_tokens),
    }
    if spec.route.own_queue and spec.queue_limit:
        # The gate refuses a request the engine has no room for, before the BLS call (serving_gate.Busy).
        params["engine_slots"] = str(spec.max_batch_size)
        params["engine_max_queue_size"] = str(spec.queue_limit)
    if spec.route.upstream_engine_models:
        if spec.has_draft:
            params["draft_model"] = TRTLLM_DRAFT
        params["tokenizer_dir"] = spec.tokenizer_dir  # draft_target counts text tokens for the prefix resend
        params["guided_decoding"] = "on" if spec.guide_tokenizer_info else "off"  # the target's (trtllm_models)
    return _base(GATE, spec, backend="python", inputs=REQUEST_TENSORS, outputs=GENERATION_TENSORS,
                 decoupled=True, parameters=params)


def torch_engine_config(spec: RepoSpec) -> ModelConfig:
    """The portable engine: continuous batching and speculation in one python model.

    Its instance group stays KIND_CPU on a GPU too; the engine puts itself on the device the `device` parameter
    (or serve's DEVICE_ENV) names. The python backend places nothing on a GPU for KIND_GPU: it only hands the model
    a device id, so the engine would still place its own tensors. And KIND_GPU would fix the device when assemble
    runs, not when the server starts: on a machine without a GPU Triton refuses to load a KIND_GPU model, and without
    a `gpus` list it starts one instance per GPU, each its own engine with its own weights and KV pool, where this
    model is one engine with one scheduler thread."""
    return _base(TORCH_ENGINE, spec, backend="python", inputs=REQUEST_TENSORS + (STREAM_ID,),
                 outputs=GENERATION_TENSORS,
                 decoupled=True, parameters={
                     "engine_dir": spec.engine_dir,
                     **_tokenizer_class(spec),
                     "max_batch_size": str(spec.max_batch_size),
                     "max_seq_len": str(spec.max_seq_len),
                     "num_draft_tokens": str(spec.num_draft_tokens),
                     "max_queue_size": str(spec.queue_limit),
                     "device": spec.device,
                 })


def served_device(parameters: dict, environ: Mapping[str, str]) -> str:
    """The device choice torch_engine loads on: serve's DEVICE_ENV, else its config's `device` parameter (a model
    config as the python backend hands it over, parsed from JSON), else auto."""
    return environ.get(DEVICE_ENV) or parameters.get("device", {}).get("string_value") or "auto"


def trtllm_models(spec: RepoSpec) -> list:
    """The tensorrt_llm model (the target), and tensorrt_llm_draft when there is a draft engine."""
    models = [TrtllmModel(TRTLLM_TARGET, spec.engine_dir, spec.kv_fraction_target, None, spec.gpu_device_ids,
                          speculation="draft_tokens_external" if spec.has_draft else "plain",
                          guide_tokenizer_info=spec.guide_tokenizer_info)]
    if spec.has_draft:
        models.append(TrtllmModel(TRTLLM_DRAFT, spec.draft_engine_dir, spec.kv_fraction_draft, spec.draft_max_tokens,
                                  spec.gpu_device_ids))
    return models


def tensorrt_llm_config(spec: RepoSpec, *, draft: bool = False) -> ModelConfig:
    """The tensorrtllm backend's model, target or draft: upstream's whole template, filled
    (pipeline.triton.trtllm_template; in NVIDIA's container assemble fills the container's own copy)."""
    model = trtllm_models(spec)[1 if draft else 0]
    return table_config(model, max_batch_size=spec.max_batch_size, tokenizer_dir=spec.tokenizer_dir)


def _step(model: str, input_map: dict[str, str], output_map: dict[str, str]):
    pb = model_config_pb2()
    return pb.ModelEnsembling.Step(model_name=model, model_version=-1, input_map=input_map, output_map=output_map)


def _ensemble(spec: RepoSpec) -> ModelConfig:
    """The ensemble clients call, every route alike: ENSEMBLE_INPUTS in, ENSEMBLE_OUTPUTS out; steps to add."""
    pb = model_config_pb2()
    msg = pb.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.max_batch_size)
    for t in ENSEMBLE_INPUTS:
        msg.input.append(pb.ModelInput(name=t.name, data_type=pb.DataType.Value(t.config_dtype),
                                       dims=list(t.dims), optional=t.optional))
    for t in ENSEMBLE_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    return msg


def ensemble_config(spec: RepoSpec) -> ModelConfig:
    """preprocessing -> speculation_gate -> postprocessing; intermediate tensors are `_`-prefixed."""
    msg = _ensemble(spec)
    request = {t.name: f"_{t.name}" for t in REQUEST_TENSORS}
    generation = {t.name: f"_{t.name}" for t in GENERATION_TENSORS}
    msg.ensemble_scheduling.step.extend([
        _step(PREPROCESSING, {t.name: t.name for t in ENSEMBLE_INPUTS}, request),
        _step(GATE, request, generation),
        _step(POSTPROCESSING, generation, {t.name: t.name for t in ENSEMBLE_OUTPUTS}),
    ])
    return msg


def llmapi_frontend_config(spec: RepoSpec) -> ModelConfig:
    """The LLM-API route's one ensemble step: our interface in, TensorRT-LLM's llmapi model behind it (BLS)."""
    return _base(LLMAPI_FRONTEND, spec, backend="python", inputs=ENSEMBLE_INPUTS, outputs=ENSEMBLE_OUTPUTS,
                 decoupled=True, parameters={**_request_parameters(spec), "llmapi_model": LLMAPI_MODEL})


def llmapi_model_config(spec: RepoSpec) -> ModelConfig:
    """TensorRT-LLM's llmapi model (python backend), run through our loader models/llmapi.py.

    max_batch_size and decoupled are written out as model.yaml's triton_config has them: upstream's model sets
    them in auto_complete_config, which the MPI launch (--disable-auto-complete-config) skips."""
    from pipeline.trtllm.upstream import LLMAPI_INPUTS, LLMAPI_OUTPUTS, LLMAPI_TRITON_CONFIG

    pb = model_config_pb2()
    msg = pb.ModelConfig(name=LLMAPI_MODEL, backend="python", max_batch_size=LLMAPI_TRITON_CONFIG["max_batch_size"])
    msg.model_transaction_policy.decoupled = LLMAPI_TRITON_CONFIG["decoupled"]
    for t in LLMAPI_INPUTS:
        msg.input.append(pb.ModelInput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims),
                                       optional=t.optional))
    for t in LLMAPI_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    msg.instance_group.append(pb.ModelInstanceGroup(count=1, kind=pb.ModelInstanceGroup.KIND_CPU))
    msg.parameters["llmapi_model_dir"].string_value = spec.llmapi_model_dir
    return msg


def llmapi_ensemble_config(spec: RepoSpec) -> ModelConfig:
    """The same ensemble interface as the other routes, answered by llmapi_frontend."""
    msg = _ensemble(spec)
    msg.ensemble_scheduling.step.append(_step(
        LLMAPI_FRONTEND, {t.name: t.name for t in ENSEMBLE_INPUTS}, {t.name: t.name for t in ENSEMBLE_OUTPUTS}))
    return msg


def llmapi_model_yaml(model: str, llm_args: dict) -> dict:
    """model.yaml for the llmapi model: LLM(...) arguments plus its triton_config.

    `llm_args` are compile's extra_llm_api_options merged with the sizes; upstream's model passes
    everything but triton_config to LLM(**args) (update_llm_args_with_extra_dict).
    """
    from pipeline.trtllm.upstream import LLMAPI_TRITON_CONFIG

    return {"model": model, "backend": "pytorch", **llm_args, "triton_config": dict(LLMAPI_TRITON_CONFIG)}


def repository_configs(spec: RepoSpec) -> dict[str, ModelConfig]:
    """Every model's config for the chosen backend, by model name."""
    if spec.route.upstream_llmapi_model:
        return {c.name: c for c in (llmapi_ensemble_config(spec), llmapi_frontend_config(spec),
                                    llmapi_model_config(spec))}
    configs = [preprocessing_config(spec), postprocessing_config(spec), speculation_gate_config(spec),
               ensemble_config(spec), stop_request_config(spec)]
    if spec.route.upstream_engine_models:
        configs += [tensorrt_llm_config(spec, draft=m.name == TRTLLM_DRAFT) for m in trtllm_models(spec)]
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
        return text_format.Parse(path.read_text(), model_config_pb2().ModelConfig())
    except text_format.ParseError as err:
        raise ConfigError(f"{path} is not a valid ModelConfig: {err}") from err
