"""Turn what the user typed (--target, --draft, --gpu, ...) into PlanInputs. Reads config.json for a local
folder; presets carry their architecture, so planning needs no weights and no hub."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ModelNotFoundError, PlanError
from pipeline.models.presets import PRESETS, get_preset
from pipeline.models.shape import ModelShape
from pipeline.plan.gpus import get_gpu
from pipeline.draft_spec import MODEL, DraftSpec, parse_draft
from pipeline.plan.memory import PlanDraft, PlanInputs

KV_DTYPE_ALIASES = {"bf16": "bf16", "fp16": "bf16", "none": "bf16", "auto": "bf16", "fp8": "fp8"}


def model_shape(ref: str) -> tuple[str, ModelShape]:
    """(display name, shape) of a preset or a local Hugging Face folder."""
    preset = get_preset(ref)
    if preset is not None and preset.shape is not None:
        return preset.name, preset.shape
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve().name, ModelShape.from_folder(path)
    raise ModelNotFoundError(f"unknown model {ref!r} for planning: pass a preset ({', '.join(PRESETS)}) "
                             "or a local folder with config.json")


def plan_draft(ref: str | DraftSpec) -> PlanDraft:
    """--draft (or its parsed spec): eagle3 (the target's EAGLE-3 head, or eagle3:DIR), ngram (no weights), none,
    or a draft model, whose shape the plan reads."""
    draft = ref if isinstance(ref, DraftSpec) else parse_draft(ref)
    if draft.kind != MODEL:
        return PlanDraft(draft.kind, draft.kind)
    name, shape = model_shape(draft.ref)
    return PlanDraft(MODEL, name, shape)


def kv_dtype(name: str) -> str:
    try:
        return KV_DTYPE_ALIASES[name.strip().lower()]
    except KeyError:
        raise PlanError(f"unknown --kv-cache-dtype {name!r}; pick bf16 or fp8") from None


def plan_inputs(target: str, gpu: str, draft: str = "none", tp: int = 1, target_qformat: str = "none",
                draft_qformat: str = "none", kv_cache_dtype: str = "bf16", max_batch_size: int = 16,
                max_seq_len: int = 4096) -> PlanInputs:
    """PlanInputs from the strings a command line carries; raises PlanError/ModelNotFoundError on bad input."""
    target_name, shape = model_shape(target)
    return PlanInputs(
        target_name=target_name, target=shape, gpu=get_gpu(gpu), tp=tp,
        target_qformat=target_qformat.strip().lower(), draft=plan_draft(draft),
        draft_qformat=draft_qformat.strip().lower(), kv_cache_dtype=kv_dtype(kv_cache_dtype),
        max_batch_size=max_batch_size, max_seq_len=max_seq_len)
