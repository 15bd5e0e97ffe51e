"""The tensorrt_llm (and tensorrt_llm_draft) model config: upstream's template, filled with our values.

Two ways to the same file:
- In NVIDIA's Triton + TensorRT-LLM container the backend's own template and tools/fill_template.py are
  on disk (/app, pipeline.trtllm.upstream.CONTAINER_APP): `container_config` copies that template and
  runs that tool, so the repository always matches the backend version that serves it.
- Elsewhere (a CPU machine, a dry run), `table_config` writes every input, output and parameter of the
  template from pipeline.trtllm.upstream's tables, filled with the same values.
Either way the values are `fills(...)`, and the result goes through `check_config`, which refuses what
the C++ backend would refuse at load. A placeholder we leave unfilled stays as the literal `${name}`,
exactly as fill_template.py leaves it and as NVIDIA's own CI runs its draft/target models: every such
key is read in a try/catch that falls back to its default (upstream.TEMPLATE_PARAMETERS, `guarded`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import ConfigError
from pipeline.triton.model_config_pb import model_config_pb2
from pipeline.trtllm import upstream

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig


@dataclass(frozen=True)
class TrtllmModel:
    """What differs between the target's and the draft's tensorrt_llm model."""

    name: str  # tensorrt_llm | tensorrt_llm_draft
    engine_dir: str
    kv_cache_free_gpu_mem_fraction: float
    max_tokens_in_paged_kv_cache: int | None = None  # an absolute KV bound (the draft's): min(this, the fraction)
    gpu_device_ids: str | None = None  # "0,1": orchestrator mode; None leaves the template's (all visible GPUs)
    # How the engine was built: "draft_tokens_external" (a target with a draft) or "plain"; it decides what the
    # runtime takes beside it (pipeline.trtllm.reference.SPECULATION_COMBINATIONS).
    speculation: str = "plain"
    # The target's: compile's xgrammar_tokenizer_info.json, which turns its guided decoding on; "" leaves it off.
    # The draft never needs one: a guided request decodes on the target alone (draft_target.TritonRequest).
    guide_tokenizer_info: str = ""


def fills(model: TrtllmModel, *, max_batch_size: int, tokenizer_dir: str) -> dict[str, str]:
    """Placeholder name -> value, as fill_template.py takes them (names from upstream.TEMPLATE_FIELDS and
    TEMPLATE_PARAMETERS' placeholders). Pure."""
    from pipeline.trtllm.reference import combination

    def on(setting: str) -> str:
        return "true" if combination(setting, model.speculation).allowed else "false"

    values = {
        "triton_backend": "tensorrtllm",
        "triton_max_batch_size": str(max_batch_size),
        # The gate drives both models through BLS with exec(decoupled=True), streaming or not.
        "decoupled_mode": "true",
        "max_queue_delay_microseconds": "0",  # fill_template.py's own default
        "max_queue_size": "0",
        "encoder_input_features_data_type": "TYPE_FP16",
        "logits_datatype": "TYPE_FP32",
        "prompt_embedding_table_data_type": "TYPE_FP16",
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": model.engine_dir,
        "max_beam_width": "1",
        "kv_cache_free_gpu_mem_fraction": f"{model.kv_cache_free_gpu_mem_fraction:g}",
        "batch_scheduler_policy": "guaranteed_no_evict",
        # The draft -> target loop reads generated tokens only.
        "exclude_input_in_output": "true",
        # Draft-target resends the accepted prefix every step; reuse keeps it from being recomputed
        # (examples/draft_target_model/README.md: "--use_paged_context_fmha=enable ... we need KV-Cache reuse"),
        # and the runtime refuses a draft_tokens_external target without it (trtGptModelInflightBatching.cpp).
        "enable_kv_cache_reuse": on("enable_kv_cache_reuse"),
        # Off by default in getExecutorConfigFromParams. A long prompt then runs in chunks beside the other requests'
        # decode steps instead of stalling them; the engines are built with paged context FMHA, which it needs.
        "enable_chunked_context": on("enable_chunked_context"),
        # Read unguarded by getGuidedDecodingConfigFromParams: set, as NVIDIA's CI fills its main model
        # (tests/integration/defs/triton_server/common.py). "" leaves guided decoding off.
        "tokenizer_dir": tokenizer_dir,
        # Both set, or guided decoding stays off (getGuidedDecodingConfigFromParams returns no config if either is
        # empty); xgrammar is the only backend it takes.
        "guided_decoding_backend": upstream.GUIDED_DECODING_BACKEND if model.guide_tokenizer_info else "",
        "xgrammar_tokenizer_info_path": model.guide_tokenizer_info,
    }
    if model.max_tokens_in_paged_kv_cache is not None:
        values["max_tokens_in_paged_kv_cache"] = str(model.max_tokens_in_paged_kv_cache)
    if model.gpu_device_ids is not None:
        values["gpu_device_ids"] = model.gpu_device_ids
    return values


def parameters(values: dict[str, str]) -> dict[str, str]:
    """Every TEMPLATE parameter key -> its value after filling: the fill, the template's literal, or the
    placeholder left as fill_template.py leaves it."""
    out = {}
    for p in upstream.TEMPLATE_PARAMETERS:
        out[p.key] = values.get(p.placeholder, p.value) if p.placeholder else p.value
    return out


def table_config(model: TrtllmModel, *, max_batch_size: int, tokenizer_dir: str) -> ModelConfig:
    """The filled template, written from pipeline.trtllm.upstream's tables (no container needed)."""
    pb = model_config_pb2()
    values = fills(model, max_batch_size=max_batch_size, tokenizer_dir=tokenizer_dir)
    msg = pb.ModelConfig(name=model.name, backend=values["triton_backend"], max_batch_size=max_batch_size)
    msg.model_transaction_policy.decoupled = values["decoupled_mode"] == "true"
    msg.dynamic_batching.preferred_batch_size.append(max_batch_size)
    msg.dynamic_batching.max_queue_delay_microseconds = int(values["max_queue_delay_microseconds"])
    msg.dynamic_batching.default_queue_policy.max_queue_size = int(values["max_queue_size"])
    for t in upstream.TENSORRT_LLM_INPUTS:
        msg.input.append(pb.ModelInput(
            name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims), optional=t.optional,
            allow_ragged_batch=t.ragged, reshape=pb.ModelTensorReshape(shape=[]) if t.squeeze else None))
    for t in upstream.TENSORRT_LLM_OUTPUTS:
        msg.output.append(pb.ModelOutput(name=t.name, data_type=pb.DataType.Value(t.config_dtype), dims=list(t.dims)))
    msg.instance_group.append(pb.ModelInstanceGroup(count=1, kind=pb.ModelInstanceGroup.KIND_CPU))
    for key, value in parameters(values).items():
        msg.parameters[key].string_value = value
    return msg


# ---- NVIDIA's container -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerTools:
    """The backend's template and fill tool, where NVIDIA's container keeps them."""

    template: Path  # .../all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt
    fill_template: Path  # .../tools/fill_template.py


def find_container_tools(app: str | Path | None = None) -> ContainerTools | None:
    """The container's template and fill_template.py, or None when either is missing (not in the container).
    $PIPELINE_TRTLLM_BACKEND_DIR overrides /app, for a checkout of TensorRT-LLM's triton_backend/."""
    root = Path(app or os.environ.get("PIPELINE_TRTLLM_BACKEND_DIR") or upstream.CONTAINER_APP)
    tools = ContainerTools(root / upstream.CONTAINER_TEMPLATES / "tensorrt_llm" / "config.pbtxt",
                           root / upstream.CONTAINER_FILL_TEMPLATE)
    return tools if tools.template.is_file() and tools.fill_template.is_file() else None


def escape(value: str) -> str:
    """A value as fill_template.py's split() reads it: a backslash escapes the next character and is consumed,
    and the text is split on ',' and then on ':' (so a ':' needs two backslashes to survive both splits)."""
    return value.replace("\\", "\\\\\\\\").replace(",", "\\,").replace(":", "\\\\:")


def fill_argument(values: dict[str, str], template_text: str) -> str:
    """fill_template.py's `substitutions` argument. It asserts every key occurs in the template, so keys an
    older or newer template lacks are left out (check_config then says if one mattered)."""
    return ",".join(f"{k}:{escape(v)}" for k, v in values.items() if "${%s}" % k in template_text)


def container_config(tools: ContainerTools, model: TrtllmModel, *, max_batch_size: int,
                     tokenizer_dir: str) -> ModelConfig:
    """Copy the container's template, fill it with the container's fill_template.py, parse it back."""
    from google.protobuf import text_format

    values = fills(model, max_batch_size=max_batch_size, tokenizer_dir=tokenizer_dir)
    text = tools.template.read_text()
    with tempfile.TemporaryDirectory(prefix="pipeline-fill-") as tmp:
        path = Path(tmp) / "config.pbtxt"
        shutil.copyfile(tools.template, path)
        done = subprocess.run([sys.executable, str(tools.fill_template), "-i", str(path),
                               fill_argument(values, text)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ConfigError(f"{tools.fill_template} failed on {tools.template} ({last}); check that the "
                              f"container's TensorRT-LLM backend is {upstream.TRTLLM_VERSION}")
        filled = path.read_text()
    try:
        msg = text_format.Parse(filled, model_config_pb2().ModelConfig())
    except text_format.ParseError as err:
        raise ConfigError(f"{tools.template} filled by {tools.fill_template} is not a valid ModelConfig ({err}); "
                          f"a placeholder we don't know is left in it: compare the template with "
                          f"pipeline/trtllm/upstream.py (TensorRT-LLM {upstream.TRTLLM_VERSION})") from None
    msg.name = model.name  # upstream renames its copy the same way (name: "tensorrt_llm" -> "tensorrt_llm_draft")
    return msg


# ---- what the backend refuses at load ----------------------------------------------------------------------------------


def check_config(msg: ModelConfig, sent: dict[str, str]) -> None:
    """Refuse a tensorrt_llm config the backend wouldn't load, or that lacks a tensor the gate sends.

    `sent`: input name -> dtype (tritonclient's name) that pipeline.triton.draft_target sends.
    """
    where = f"model {msg.name!r}"
    params = {k: v.string_value for k, v in msg.parameters.items()}
    missing = [k for k in upstream.UNGUARDED if k not in params]
    if missing:
        raise ConfigError(f"{where} lacks parameter(s) {', '.join(missing)}: the tensorrtllm backend throws \"Cannot "
                          f"find parameter with name\" for them at load; fill the whole template")
    if params["gpt_model_type"] not in upstream.GPT_MODEL_TYPES:
        raise ConfigError(f"{where} has gpt_model_type {params['gpt_model_type']!r}; the backend takes only "
                          f"{', '.join(upstream.GPT_MODEL_TYPES)}")
    if not params.get("gpt_model_path") or params["gpt_model_path"].startswith("${"):
        raise ConfigError(f"{where} has no gpt_model_path; pass the engine folder")
    pb = model_config_pb2()
    inputs = {t.name: pb.DataType.Name(t.data_type) for t in msg.input}
    for name, dtype in sent.items():
        want = "TYPE_STRING" if dtype == "BYTES" else f"TYPE_{dtype}"
        if inputs.get(name) != want:
            raise ConfigError(f"{where} has no input {name} of {want} (got {inputs.get(name, 'none')}); the "
                              f"draft -> target loop sends it: this template is not TensorRT-LLM "
                              f"{upstream.TRTLLM_VERSION}'s")
    outputs = {t.name for t in msg.output}
    lacking = [n for n in upstream.REQUIRED_OUTPUTS if n not in outputs]
    if lacking:
        raise ConfigError(f"{where} has no output {', '.join(lacking)}; the backend needs them")
