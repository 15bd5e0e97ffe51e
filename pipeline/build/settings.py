"""Resolve BuildOptions' `auto` fields per backend and GPU, each with the reason it is shown with. Pure.

The defaults come from measurements on these machines and from TensorRT-LLM practice: bf16 is the fastest
target on CPU, FP8 on GPUs with FP8 tensor cores; a draft model is memory-bound, so INT4-AWQ; an EAGLE-3
head stays as published. On TensorRT-LLM the memory plan (`pipeline plan`) picks the smallest TP that fits.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pipeline.build.options import KV_CACHE_DTYPES, BACKENDS, BuildOptions, Environment, model_name
from pipeline.draft_spec import AUTO, EAGLE3, MODEL, NGRAM, NONE, DraftSpec
from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ConfigError
from pipeline.plan.gpus import GPU, get_gpu
from pipeline.policy.gate_policy import PORTABLE_CEILING
from pipeline.routes import PORTABLE_BACKEND, TRTLLM_BACKEND, Backend, backend_named
from pipeline.setting import GATE_BATCH_SIZE, MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS
from pipeline.trtllm.version import for_version

PLAN_GPU = "h100-80gb"  # what a trtllm plan assumes when there is no GPU here and no --gpu
# The gate's batch size when --gate-batch-size is left out, and why. (The other sizes are the backend's own:
# Backend.max_batch_size and max_seq_len, `pipeline plan`'s defaults on TensorRT-LLM.)
DEFAULT_GATE = {
    PORTABLE_BACKEND: (PORTABLE_CEILING, "on a 2-core CPU n-gram speculation pays at batch 4 (1.11x) and not at 16 "
                                         "(0.87x)"),
    TRTLLM_BACKEND: (32, "the gate's default (TensorRT-LLM's max_concurrency, or its draft_len_schedule's last "
                         "bound): above it decoding is compute-bound"),
}
QFORMAT_REASONS = {
    (TRTLLM_BACKEND, "target", True): "fp8: FP8 tensor cores halve the weight reads (perplexity +2-5% measured on "
                                      "SmolLM2)",
    (TRTLLM_BACKEND, "target", False): "none (bf16): this GPU has no FP8; --target-qformat int4_awq makes the weights "
                                       "~3.5x smaller",
    (TRTLLM_BACKEND, "model"): "int4_awq: a draft model is memory-bound, and its quality never changes the output",
    (TRTLLM_BACKEND, "eagle3"): "none: an EAGLE-3 head is one layer, kept in bf16 as published",
    (PORTABLE_BACKEND, "target"): "none (bf16): fastest on CPU; fp8 is dequantized at load (0.93x), int4_awq costs "
                                  "+30% perplexity on SmolLM2",
    (PORTABLE_BACKEND, "model"): "int4_awq: torch's CPU int4 kernel decodes 1.6x faster, and a draft's quality never "
                                 "changes the output",
    (PORTABLE_BACKEND, "eagle3"): "none: an EAGLE-3 head is one layer",
}


@dataclass(frozen=True)
class Settings:
    """BuildOptions with every `auto` resolved; `reasons` says why, per field."""

    backend: str
    target: str
    draft: DraftSpec  # resolved: none, ngram, a draft model, or an EAGLE-3 head (ref "": the build trains one)
    target_qformat: str
    draft_qformat: str
    kv_cache_dtype: str  # bf16 | fp8
    num_draft_tokens: int
    gate_batch_size: int
    max_batch_size: int
    max_input_len: int | None
    max_seq_len: int | None
    tp_size: int
    gpu: str | None  # GPU kind planned for (trtllm)
    export: str  # hf | trtllm
    engine_dtype: str = "bf16"  # the portable engine's compute dtype (Environment.engine_dtype)
    trtllm_version: str | None = None  # trtllm: the TensorRT-LLM release written for
    device: DeviceChoice = DeviceField()  # torch: auto, cpu or cuda:N (chosen where the build runs); trtllm: auto
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def runs_on(self) -> Backend:
        return backend_named(self.backend)

    @property
    def draft_label(self) -> str:
        return self.draft.kind if self.draft.kind in ("none", NGRAM) else f"{self.draft.kind} {self.draft.ref}"


def _trtllm_version(o: BuildOptions, backend: Backend, reasons: dict[str, str]) -> str | None:
    """The TensorRT-LLM release a trtllm build writes for (pipeline.trtllm.version.pick)."""
    from pipeline.trtllm import version as trtllm_version

    if not backend.trtllm_release:
        if o.trtllm_version is not None:
            raise ConfigError("--trtllm-version is for --backend trtllm; drop it for the portable engine")
        return None
    found = trtllm_version.installed()
    version = trtllm_version.pick(o.trtllm_version, found, "pipeline build")
    if o.trtllm_version is None:
        reasons["trtllm_version"] = (f"{version}: " + ("installed here" if found else
                                     "the newest stable release, the one NVIDIA's newest Triton container ships; "
                                     "--trtllm-version picks another"))
    return version


def resolve_settings(o: BuildOptions, env: Environment) -> tuple[Settings, Any]:
    reasons: dict[str, str] = {}
    shape = _shape_or_none(o.target, env)
    backend = _backend(o, env, shape, reasons)
    gpu = _plan_gpu(o, env, backend, reasons)
    draft = _draft(o, env, backend, reasons)
    target_q = _qformat(o.target_qformat, backend, "target", gpu, reasons, "target_qformat")
    draft_q = (_qformat(o.draft_qformat, backend, draft.kind, gpu, reasons, "draft_qformat")
               if draft.kind in (MODEL, EAGLE3) else "none")
    kv = "bf16" if o.kv_cache_dtype in ("auto", "bf16") else "fp8"
    if not backend.kv_fp8 and kv == "fp8":
        raise ConfigError("the portable engine keeps its KV cache in the compute dtype; drop --kv-cache-dtype fp8 "
                          "(or build with --backend trtllm)")
    if kv == "fp8" and draft.kind == MODEL and backend.trtllm_release and target_q != "fp8":
        # The engine route: each engine's KV dtype comes from its checkpoint, and only an FP8 one can hold FP8 KV.
        raise ConfigError(f"--kv-cache-dtype fp8 needs an fp8 target on TensorRT-LLM engines (trtllm-build refuses "
                          f"an FP8 KV cache beside {target_q} weights); add --target-qformat fp8, or drop "
                          f"--kv-cache-dtype fp8")
    batch, seq, (gate, gate_reason) = backend.max_batch_size, backend.max_seq_len, DEFAULT_GATE[backend]
    max_seq = o.max_seq_len
    if max_seq is None:  # the backend's default, at most the model's own limit where its config.json is here
        max_seq = min(seq, _max_position_embeddings(o.target, env) or seq)
    version = _trtllm_version(o, backend, reasons)
    device = env.device if env.device is not None and backend.places_device else o.device
    backend.check_device(o.device, f"--backend {backend.name}")
    if backend.one_device and (o.tp_size or 1) > 1:
        raise ConfigError("the portable engine runs on one device; drop --tp-size (or build with --backend trtllm)")
    settings = Settings(
        backend=backend.name, target=o.target, draft=draft, target_qformat=target_q,
        draft_qformat=draft_q, kv_cache_dtype=kv, num_draft_tokens=o.num_draft_tokens,
        gate_batch_size=o.gate_batch_size if o.gate_batch_size is not None else gate,
        max_batch_size=o.max_batch_size if o.max_batch_size is not None else batch,
        max_input_len=o.max_input_len, max_seq_len=max_seq, tp_size=o.tp_size or 1,
        gpu=gpu.key if gpu is not None else None,
        export=_export(backend, draft, version, shape, reasons),
        engine_dtype="bf16" if device.startswith("cuda") else env.engine_dtype[0], trtllm_version=version,
        device=device, reasons=reasons)
    if o.gate_batch_size is None:
        reasons["gate_batch_size"] = f"{settings.gate_batch_size}: {gate_reason}"
    if not backend.plans_gpu_memory:
        if env.device is not None:
            reasons["device"] = env.device.line
        reasons["engine_dtype"] = "bf16 on a GPU (its tensor cores' dtype)" if device.startswith("cuda") else \
            env.engine_dtype[1]
        return settings, None
    return _with_memory_plan(settings, o, shape, gpu, reasons)


def _with_memory_plan(s: Settings, o: BuildOptions, shape, gpu: GPU, reasons: dict) -> tuple[Settings, Any]:
    from pipeline.plan.memory import PlanInputs, check_fits, plan_memory
    from pipeline.plan.resolve import plan_draft

    if shape is None:
        return s, None  # a hub id with nothing local: nothing to size yet (`missing` says what to fetch)
    draft = plan_draft(s.draft)
    # A draft engine keeps its checkpoint's KV dtype: FP8 only where the draft is FP8 (plan.quant_kv).
    draft_kv = s.kv_cache_dtype if s.export == "hf" or s.draft_qformat == "fp8" else "bf16"
    inputs = PlanInputs(target_name=model_name(o.target), target=shape, gpu=gpu, tp=s.tp_size,
                        target_qformat=s.target_qformat, draft=draft, draft_qformat=s.draft_qformat,
                        kv_cache_dtype=s.kv_cache_dtype, draft_kv_cache_dtype=draft_kv,
                        max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len or TRTLLM_BACKEND.max_seq_len)
    plan = plan_memory(inputs)
    if o.tp_size is None and plan.min_tp is not None and plan.min_tp != s.tp_size:
        s = dataclasses.replace(s, tp_size=plan.min_tp)
        plan = plan_memory(dataclasses.replace(inputs, tp=plan.min_tp))
    if o.tp_size is None:
        reasons["tp_size"] = f"{s.tp_size}: the smallest TP whose memory plan fits on {gpu.name}"
    if not o.force:
        check_fits(plan)
    return s, plan


def _export(backend: Backend, draft: DraftSpec, version: str | None, shape, reasons: dict) -> str:
    """A draft model runs as a second TensorRT engine (the engine route: ModelOpt's TensorRT-LLM checkpoints) where
    the release still builds engines and ModelOpt's export has a decoder for the target's family; elsewhere both
    models load from Hugging Face folders on the LLM API (its draft-target mode)."""
    from pipeline.quantize.formats import trtllm_decoder_type

    if not (backend.trtllm_release and draft.kind == MODEL and for_version(version).engine_route):
        return "hf"
    if shape is not None and trtllm_decoder_type(shape.model_type) is None:
        reasons["export"] = (f"hf: ModelOpt's TensorRT-LLM export has no decoder for {shape.model_type}, so the draft "
                             f"and the target load on TensorRT-LLM's LLM API (draft-target), not as engines")
        return "hf"
    return "trtllm"


def _backend(o: BuildOptions, env: Environment, shape, reasons: dict) -> Backend:
    if o.backend != "auto":
        return backend_named(o.backend)
    if not o.device.auto:
        reasons["backend"] = f"torch: --device {o.device.asked} places the portable engine"
        return PORTABLE_BACKEND
    if env.gpu is not None and env.trtllm:
        reasons["backend"] = f"trtllm: a {env.gpu.name} and TensorRT-LLM are here"
        return TRTLLM_BACKEND
    bf16_bytes = 2 * shape.param_count if shape is not None else 0
    if env.host_memory_bytes and bf16_bytes > env.host_memory_bytes // 2:
        reasons["backend"] = (f"trtllm: {bf16_bytes / 1e9:.0f} GB of bf16 weights is too much for this machine's "
                              f"{env.host_memory_bytes / 1e9:.0f} GB on the portable engine")
        return TRTLLM_BACKEND
    reasons["backend"] = "torch: the portable engine (no GPU with TensorRT-LLM here)"
    return PORTABLE_BACKEND


def _plan_gpu(o: BuildOptions, env: Environment, backend: Backend, reasons: dict) -> GPU | None:
    if o.gpu is not None:
        return get_gpu(o.gpu)
    if not backend.plans_gpu_memory:
        return None
    if env.gpu is not None:
        return env.gpu
    reasons["gpu"] = f"{PLAN_GPU}: no GPU here, so the plan assumes one; pass --gpu to plan for another"
    return get_gpu(PLAN_GPU)


def _draft(o: BuildOptions, env: Environment, backend: Backend, reasons: dict) -> DraftSpec:
    """--draft resolved: auto picks, and a bare eagle3 names the head (published, trained earlier, or "" for one
    this build trains)."""
    from pipeline.models.presets import get_preset

    draft = o.draft
    preset = get_preset(o.target)
    head = preset.eagle3_head if preset is not None else None
    if draft.kind == AUTO:
        if head and not backend.trains_heads:  # TensorRT-LLM serves the published head
            reasons["draft"] = f"eagle3: {head} is published for {preset.name}"
            return DraftSpec(EAGLE3, head)
        reasons["draft"] = "ngram: needs no weights and pays when answers copy from the prompt"
        return DraftSpec(NGRAM)
    if draft.kind != EAGLE3 or draft.ref:
        return draft
    if backend.trains_heads and env.trained_head is not None:
        reasons["draft"] = f"eagle3: the head trained for {o.target} in the cache ({env.trained_head})"
        return DraftSpec(EAGLE3, str(env.trained_head))
    if backend.trains_heads:
        # "" = the build trains the head (a train_draft stage), reused by later builds like any stage.
        reasons["draft"] = (f"eagle3: no head given, so the build trains one for {o.target} with ModelOpt "
                            f"(`pipeline draft train`, at most {o.draft_budget_minutes:g} minutes) and reuses "
                            f"it on later builds; --draft eagle3:DIR takes a trained or published head")
        return draft
    if not head:
        raise ConfigError(f"{o.target} has no published EAGLE-3 head; pass --draft eagle3:DIR with a trained "
                          f"head, or use --draft ngram")
    return DraftSpec(EAGLE3, head)


def _qformat(requested: str, backend: Backend, role: str, gpu: GPU | None, reasons: dict, key: str) -> str:
    from pipeline.quantize.formats import get_format

    value = requested.strip().lower()
    if value != "auto":
        return get_format(value, "--" + key.replace("_", "-")).name  # raises with the list of formats
    if backend.plans_gpu_memory and role == "target":  # the GPU decides: FP8 where it has FP8 tensor cores
        reason = QFORMAT_REASONS[(backend, role, bool(gpu and gpu.fp8))]
    else:
        reason = QFORMAT_REASONS[(backend, role)]
    reasons[key] = reason
    return reason.split(":")[0].split(" ")[0]


def check_options(o: BuildOptions) -> None:
    if o.draft_budget_minutes <= 0:
        raise ConfigError(f"--draft-budget-minutes must be > 0 (got {o.draft_budget_minutes:g})")
    if o.backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {o.backend!r}; pick one of {', '.join(BACKENDS)}")
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown --kv-cache-dtype {o.kv_cache_dtype!r}; pick one of {', '.join(KV_CACHE_DTYPES)}")
    for setting in (GATE_BATCH_SIZE, MAX_BATCH_SIZE, MAX_SEQ_LEN):
        if getattr(o, setting.name) is not None:
            setting.check(getattr(o, setting.name))
    for flag, value in (("--max-input-len", o.max_input_len), ("--tp-size", o.tp_size), ("calib size", o.calib_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    NUM_DRAFT_TOKENS.check(o.num_draft_tokens, minimum=0 if o.draft.kind == NONE else 1,
                           fix="pass --num-draft-tokens 4, or --draft none")


# ---- helpers ----------------------------------------------------------------------------------------------------


def _shape_or_none(ref: str, env: Environment):
    from pipeline.errors import PipelineError
    from pipeline.models.presets import get_preset
    from pipeline.plan.resolve import model_shape

    w = env.weights_of(ref)
    local = w.path if w.path is not None and w.path.is_dir() else None
    preset = get_preset(ref)
    try:
        if preset is not None and preset.shape is not None:
            return preset.shape
        return model_shape(str(local))[1] if local is not None else None
    except PipelineError:
        return None


def _max_position_embeddings(ref: str, env: Environment) -> int | None:
    w = env.weights_of(ref)
    config = w.path / "config.json" if w.path is not None else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def plain(value):
    """asdict() output as JSON-ready values (Paths become strings)."""
    return json.loads(json.dumps(value, default=str))
