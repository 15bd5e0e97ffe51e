"""The memory planner: will target + draft + KV cache fit on N GPUs of a kind, and what is the smallest N?

Pure: typed inputs to a typed plan, no I/O. `pipeline plan` prints it; `pipeline build`/`compile` call
`check_fits` and refuse a plan that doesn't fit unless --force.

Assumptions (also in `MemoryPlan.assumptions`):
- Tensor parallelism splits the attention/MLP linears, the lm_head and the KV heads tp ways; the embedding
  and norms are replicated (TensorRT-LLM replicates the embedding unless --use_parallel_embedding).
- The draft runs with the target's TP and is sharded the same way (TensorRT-LLM draft-target runs both with
  one mapping; an EAGLE-3 head is built into the target engine). n-gram drafting holds no weights and no KV.
- KV cache = per token x batch x max_seq_len. A draft engine keeps its checkpoint's KV dtype (an INT4-AWQ
  draft can't take an FP8 KV cache; see pipeline.trtllm.reference.FP8_KV_QUANT_ALGOS).
- Reserve per GPU: 1 GiB CUDA context + activations/workspace of max(2 GiB, 10% of GPU memory): the 10% is
  what TensorRT-LLM leaves free with its default free_gpu_memory_fraction=0.9.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.draft_spec import DRAFT_KINDS
from pipeline.errors import PlanError
from pipeline.models.shape import ModelShape
from pipeline.plan.gpus import GPU
from pipeline.plan.weights import (
    KV_DTYPE_BYTES, WEIGHT_FORMATS, WeightBytes, eagle3_weight_bytes, kv_bytes_per_token, model_weight_bytes,
)
from pipeline.setting import MAX_BATCH_SIZE, MAX_SEQ_LEN

GIB = 1024 ** 3
GB = 1e9
TP_SIZES = (1, 2, 4, 8)  # one node
CUDA_CONTEXT_BYTES = 1 * GIB
MIN_ACTIVATION_BYTES = 2 * GIB
ACTIVATION_FRACTION = 0.10  # 1 - TensorRT-LLM's free_gpu_memory_fraction (0.9)
FP8_FORMATS = ("fp8", "w4a8_awq")  # formats with FP8 tensors
ASSUMPTIONS = (
    "GB = 1e9 bytes",
    "TP splits attention/MLP linears, the lm_head and KV heads; the embedding and norms are replicated",
    "the draft runs with the target's TP, sharded the same way; an EAGLE-3 head reuses the target's embedding",
    "embeddings, lm_head and norms stay 16-bit in every ModelOpt export",
    "KV cache = per token x max batch size x max seq len; a draft engine keeps its own checkpoint's KV dtype",
    "reserve per GPU = 1 GiB CUDA context + max(2 GiB, 10% of GPU memory) activations/workspace "
    "(TensorRT-LLM free_gpu_memory_fraction 0.9)",
)


@dataclass(frozen=True)
class PlanDraft:
    """A draft as the memory plan sees it: its kind, a name for the table and, for a draft model, its shape
    (the --draft text itself is parsed once, by pipeline/draft_spec.py)."""

    kind: str  # none | ngram | eagle3 | model
    name: str
    shape: ModelShape | None = None  # a draft model's shape; None for the others (EAGLE-3 takes the target's)

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS:
            raise PlanError(f"unknown draft kind {self.kind!r}; pick one of {', '.join(DRAFT_KINDS)}")
        if self.kind == "model" and self.shape is None:
            raise PlanError(f"draft model {self.name!r} needs its shape (config.json)")


@dataclass(frozen=True)
class PlanInputs:
    target_name: str
    target: ModelShape
    gpu: GPU
    tp: int = 1
    target_qformat: str = "none"
    draft: PlanDraft = field(default_factory=lambda: PlanDraft("none", "none"))
    draft_qformat: str = "none"
    kv_cache_dtype: str = "bf16"
    max_batch_size: int = 16
    max_seq_len: int = 4096
    # The draft's KV dtype where it differs: a TensorRT-LLM engine takes its own checkpoint's (an INT4-AWQ draft
    # keeps bf16 KV beside an FP8-KV target); None = kv_cache_dtype.
    draft_kv_cache_dtype: str | None = None

    @property
    def draft_kv(self) -> str:
        return self.draft_kv_cache_dtype or self.kv_cache_dtype

    def __post_init__(self):
        for flag, value in (("--target-qformat", self.target_qformat), ("--draft-qformat", self.draft_qformat)):
            if value not in WEIGHT_FORMATS:
                raise PlanError(f"unknown {flag} {value!r}; pick one of {', '.join(WEIGHT_FORMATS)}")
        for value in (self.kv_cache_dtype, self.draft_kv):
            if value not in KV_DTYPE_BYTES:
                raise PlanError(f"unknown --kv-cache-dtype {value!r}; pick one of {', '.join(KV_DTYPE_BYTES)}")
        if self.tp < 1:
            raise PlanError(f"--tp-size must be >= 1 (got {self.tp})")
        MAX_BATCH_SIZE.check(self.max_batch_size, error=PlanError)
        MAX_SEQ_LEN.check(self.max_seq_len, error=PlanError)
        self._check_fp8()
        for name, shape in self._sharded_models():
            problem = tp_problem(shape, self.tp)
            if problem:
                ok = _or([str(t) for t in TP_SIZES if not tp_problem(shape, t)])
                raise PlanError(f"--tp-size {self.tp} does not divide {name}'s {problem}; use --tp-size {ok}")

    def _check_fp8(self):
        if self.gpu.fp8:
            return
        wants = [f"--target-qformat {self.target_qformat}"] if self.target_qformat in FP8_FORMATS else []
        if self.draft.kind in ("eagle3", "model") and self.draft_qformat in FP8_FORMATS:
            wants.append(f"--draft-qformat {self.draft_qformat}")
        if self.kv_cache_dtype == "fp8":
            wants.append("--kv-cache-dtype fp8")
        if wants:
            raise PlanError(f"{self.gpu.name} ({self.gpu.arch}) has no FP8 tensor cores, so {' and '.join(wants)} "
                            "can't run; use int4_awq, int8_sq or none (and --kv-cache-dtype bf16), "
                            "or an FP8 GPU (l40s, h100-80gb, h200-141gb, b200-180gb)")

    def _sharded_models(self) -> list[tuple[str, ModelShape]]:
        models = [(self.target_name, self.target)]
        if self.draft.kind == "model":
            models.append((self.draft.name, self.draft.shape))
        return models


def tp_problem(shape: ModelShape, tp: int) -> str | None:
    """What of `shape` tp can't split evenly, or None."""
    if shape.num_heads % tp:
        return f"{shape.num_heads} attention heads"
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        return f"{shape.num_kv_heads} KV heads"
    if shape.intermediate_size % tp:
        return f"intermediate size {shape.intermediate_size}"
    return None


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU (unless named total) for one plan; every format's target weights for comparison."""

    inputs: PlanInputs
    target_weights: dict[str, WeightBytes]  # every weight format, so the trade-off shows
    draft_weights: WeightBytes
    kv_per_token: dict[str, dict[str, int]]  # "target"/"draft" -> kv dtype -> bytes per token per GPU
    cuda_context: int
    activations: int
    min_tp: int | None = None  # smallest TP in TP_SIZES that fits with everything else the same

    @property
    def tp(self) -> int:
        return self.inputs.tp

    @property
    def tokens(self) -> int:
        return self.inputs.max_batch_size * self.inputs.max_seq_len

    @property
    def target_weights_per_gpu(self) -> int:
        return self.target_weights[self.inputs.target_qformat].per_gpu(self.tp)

    @property
    def draft_weights_per_gpu(self) -> int:
        return self.draft_weights.per_gpu(self.tp)

    def kv_cache(self, role: str, kv_dtype: str | None = None) -> int:
        default = self.inputs.draft_kv if role == "draft" else self.inputs.kv_cache_dtype
        return self.kv_per_token[role][kv_dtype or default] * self.tokens

    @property
    def kv_per_gpu(self) -> int:
        return self.kv_cache("target") + self.kv_cache("draft")

    @property
    def reserve(self) -> int:
        return self.cuda_context + self.activations

    @property
    def used(self) -> int:
        return self.target_weights_per_gpu + self.draft_weights_per_gpu + self.kv_per_gpu + self.reserve

    @property
    def headroom(self) -> int:
        return self.inputs.gpu.memory_bytes - self.used

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def max_batch_size_that_fits(self) -> int:
        """The largest batch at this max_seq_len whose KV cache fits beside the weights and the reserve."""
        per_seq = (self.kv_per_token["target"][self.inputs.kv_cache_dtype]
                   + self.kv_per_token["draft"][self.inputs.draft_kv]) * self.inputs.max_seq_len
        room = self.inputs.gpu.memory_bytes - self.target_weights_per_gpu - self.draft_weights_per_gpu - self.reserve
        return max(0, room // per_seq) if per_seq else 0

    def fixes(self) -> list[str]:
        """Changes, one at a time, that would make this plan fit (empty when it fits)."""
        if self.fits:
            return []
        out = []
        if self.min_tp and self.min_tp > self.tp:
            out.append(f"--tp-size {self.min_tp}")
        smaller = [f for f in ("fp8", "int4_awq") if self.target_weights[f].total
                   < self.target_weights[self.inputs.target_qformat].total]
        for fmt in smaller:
            if _fits_with(self.inputs, target_qformat=fmt):
                out.append(f"--target-qformat {fmt}")
                break
        if self.inputs.kv_cache_dtype != "fp8" and _fits_with(self.inputs, kv_cache_dtype="fp8"):
            out.append("--kv-cache-dtype fp8")
        if 1 <= self.max_batch_size_that_fits < self.inputs.max_batch_size:
            out.append(f"--max-batch-size {self.max_batch_size_that_fits}")
        return out or ["a GPU with more memory"]

    @property
    def assumptions(self) -> tuple[str, ...]:
        moe = self.inputs.target.moe
        if moe is None:
            return ASSUMPTIONS
        t = self.inputs.target
        return ASSUMPTIONS + (
            f"mixture of experts: every expert is held ({t.param_count / 1e9:.1f}B parameters), a token reads "
            f"{moe.top_k} of {moe.num_experts} in each of {len(moe.layers)} layers ({t.active_param_count / 1e9:.2f}B); "
            "the routers stay 16-bit",)

    def to_dict(self) -> dict:
        i = self.inputs
        return {
            "target": i.target_name, "draft": i.draft.name, "draft_kind": i.draft.kind,
            "gpu": i.gpu.key, "gpu_name": i.gpu.name, "gpu_memory_bytes": i.gpu.memory_bytes,
            "gpu_bandwidth_tb_s": i.gpu.bandwidth_tb_s, "gpu_fp8": i.gpu.fp8, "gpu_arch": i.gpu.arch,
            "tp": i.tp, "target_qformat": i.target_qformat, "draft_qformat": i.draft_qformat,
            "kv_cache_dtype": i.kv_cache_dtype, "draft_kv_cache_dtype": i.draft_kv,
            "max_batch_size": i.max_batch_size, "max_seq_len": i.max_seq_len,
            "target_params": i.target.param_count, "target_active_params": i.target.active_param_count,
            "target_weight_bytes": {f: {"total": w.total, "per_gpu": w.per_gpu(i.tp)}
                                    for f, w in self.target_weights.items()},
            "draft_weight_bytes": {"total": self.draft_weights.total, "per_gpu": self.draft_weights_per_gpu},
            "kv_bytes_per_token": self.kv_per_token,
            "kv_cache_bytes": {role: {d: self.kv_cache(role, d) for d in KV_DTYPE_BYTES} for role in self.kv_per_token},
            "reserve_bytes": {"cuda_context": self.cuda_context, "activations": self.activations},
            "used_bytes": self.used, "headroom_bytes": self.headroom,
            "fits": self.fits, "min_tp": self.min_tp, "fixes": self.fixes(),
            "assumptions": list(self.assumptions),
        }


def _draft_weights(inputs: PlanInputs) -> WeightBytes:
    if inputs.draft.kind == "eagle3":
        return eagle3_weight_bytes(inputs.target, inputs.draft_qformat)
    if inputs.draft.kind == "model":
        return model_weight_bytes(inputs.draft.shape, inputs.draft_qformat)
    return WeightBytes(0, 0)


def _draft_kv(inputs: PlanInputs, kv_dtype: str) -> int:
    if inputs.draft.kind == "eagle3":
        return kv_bytes_per_token(inputs.target, 1, kv_dtype, inputs.tp)
    if inputs.draft.kind == "model":
        return kv_bytes_per_token(inputs.draft.shape, inputs.draft.shape.num_layers, kv_dtype, inputs.tp)
    return 0


def _plan(inputs: PlanInputs) -> MemoryPlan:
    memory = inputs.gpu.memory_bytes
    return MemoryPlan(
        inputs=inputs,
        target_weights={f: model_weight_bytes(inputs.target, f) for f in WEIGHT_FORMATS},
        draft_weights=_draft_weights(inputs),
        kv_per_token={
            "target": {d: kv_bytes_per_token(inputs.target, inputs.target.num_layers, d, inputs.tp)
                       for d in KV_DTYPE_BYTES},
            "draft": {d: _draft_kv(inputs, d) for d in KV_DTYPE_BYTES},
        },
        cuda_context=CUDA_CONTEXT_BYTES,
        activations=max(MIN_ACTIVATION_BYTES, int(ACTIVATION_FRACTION * memory)),
    )


def _fits_with(inputs: PlanInputs, **changes) -> bool:
    try:
        return _plan(replace(inputs, **changes)).fits
    except PlanError:  # e.g. a tp that doesn't divide the heads, fp8 on a GPU without it
        return False


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """The memory plan for `inputs`, with the smallest TP (of 1, 2, 4, 8) that fits."""
    min_tp = next((tp for tp in TP_SIZES if _fits_with(inputs, tp=tp)), None)
    return replace(_plan(inputs), min_tp=min_tp)


def check_fits(plan: MemoryPlan) -> None:
    """Raise PlanError naming the shortfall and the fixes when `plan` doesn't fit."""
    if plan.fits:
        return
    i = plan.inputs
    weights = "bf16" if i.target_qformat == "none" else i.target_qformat
    draft = f" + {plan.draft_weights_per_gpu / GB:.1f} GB {i.draft.name} draft" if plan.draft_weights.total else ""
    raise PlanError(
        f"{i.target_name} {weights} needs {plan.target_weights_per_gpu / GB:.1f} GB for weights{draft} "
        f"+ {plan.kv_per_gpu / GB:.1f} GB KV ({i.kv_cache_dtype}, {i.max_batch_size} x {i.max_seq_len} tokens) "
        f"+ {plan.reserve / GB:.1f} GB reserve per GPU on {i.tp} x {i.gpu.name} "
        f"({i.gpu.memory_bytes / GB:.1f} GB each): {-plan.headroom / GB:.1f} GB short; "
        f"use {_or(plan.fixes())} (or --force to build anyway)")


def _or(items: list[str]) -> str:
    if len(items) <= 2:
        return " or ".join(items)
    return ", ".join(items[:-1]) + ", or " + items[-1]
