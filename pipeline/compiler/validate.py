"""Checks that run before anything is built or written; each raises a one-line error that says the fix."""

from __future__ import annotations

from pipeline.compiler.checkpoint import Checkpoint
from pipeline.draft_spec import DraftSpec
from pipeline.errors import ConfigError, DraftMismatchError
from pipeline.routes import ENGINE, Route


def check_draft_len(draft: DraftSpec, num_draft_tokens: int) -> None:
    # A target built with max_draft_len 0 fails at the first request with TensorRT-LLM's
    # "Number of draft tokens (56) is larger than maximum number of draft tokens (0)"; refuse it here.
    if draft.speculates and num_draft_tokens < 1:
        raise ConfigError(f"--num-draft-tokens must be at least 1 with --draft {draft.kind}: a target built with "
                          f"max_draft_len 0 fails with \"Number of draft tokens (56) is larger than maximum number "
                          f"of draft tokens (0)\"; pass --num-draft-tokens 4, or --draft none")


def check_draft_matches(target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None) -> None:
    """Same vocabulary (and tokenizer, where both folders carry one); same TP/PP for draft-target engines."""
    if draft_ckpt is None:
        return
    if draft.kind == "model" and draft_ckpt.is_eagle3:
        raise ConfigError(f"{draft_ckpt.path.name} is an EAGLE-3 head, not a draft model; pass "
                          f"--draft eagle3:{draft_ckpt.path}")
    if draft.kind == "eagle3" and not draft_ckpt.is_eagle3:
        raise ConfigError(f"{draft_ckpt.path.name} is not an EAGLE-3 head (its config.json names no Eagle3 "
                          f"architecture or eagle_config); pass a head folder, e.g. from `pipeline draft train`")
    fix = "pick a draft from the target's model family, or use --draft ngram"
    if draft_ckpt.vocab_size != target.vocab_size:
        raise DraftMismatchError(f"draft '{draft_ckpt.path.name}' has vocab_size {draft_ckpt.vocab_size} but the "
                                 f"target has {target.vocab_size}; {fix}")
    if draft.kind == "model" and target.has_tokenizer and draft_ckpt.has_tokenizer:
        from pipeline.models.tokenizer import check_draft_compatible

        check_draft_compatible(target.path, draft_ckpt.path)
    if draft.kind == "model" and (draft_ckpt.tp_size, draft_ckpt.pp_size) != (target.tp_size, target.pp_size):
        raise ConfigError(f"draft checkpoint is split tp {draft_ckpt.tp_size} x pp {draft_ckpt.pp_size} but the "
                          f"target tp {target.tp_size} x pp {target.pp_size}; re-export the draft with "
                          f"`pipeline quantize --export trtllm --tp-size {target.tp_size} --pp-size {target.pp_size}`")


def check_plan(target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None, gpu: str | None,
               max_batch_size: int, max_seq_len: int, kv_cache_dtype: str, force: bool = False,
               tp: int | None = None, route: Route = ENGINE) -> dict | None:
    """Sizes within the GPU plan: the one call into pipeline.plan, for --gpu or else the GPU nvidia-smi
    reports. Skipped when neither names a GPU. A plan that doesn't fit is refused unless `force`."""
    from pipeline.plan.gpus import detect_gpu, get_gpu
    from pipeline.plan.memory import PlanDraft, PlanInputs, check_fits, plan_memory

    gpu_spec = get_gpu(gpu) if gpu is not None else detect_gpu()
    if gpu_spec is None:
        return None

    plan_draft = PlanDraft("none", "none")
    if draft.kind in ("ngram", "eagle3"):
        plan_draft = PlanDraft(draft.kind, draft.kind)
    elif draft_ckpt is not None:
        plan_draft = PlanDraft("model", draft_ckpt.path.name, model_shape(draft_ckpt))
    kv = "fp8" if kv_cache_dtype == "fp8" else "bf16"
    draft_kv = kv
    if route.kv_from_checkpoint and draft_ckpt is not None:  # a draft engine takes its own checkpoint's KV dtype
        draft_kv = "fp8" if (draft_ckpt.kv_cache_quant_algo or "").upper() == "FP8" else "bf16"
    plan = plan_memory(PlanInputs(
        target_name=target.path.name, target=model_shape(target), gpu=gpu_spec, tp=tp or target.tp_size,
        target_qformat=qformat_of(target), draft=plan_draft,
        draft_qformat=qformat_of(draft_ckpt) if draft_ckpt is not None and draft.kind == "model" else "none",
        kv_cache_dtype=kv, draft_kv_cache_dtype=draft_kv,
        max_batch_size=max_batch_size, max_seq_len=max_seq_len))
    if not force:
        check_fits(plan)
    return plan.to_dict()


def model_shape(ckpt: Checkpoint):
    from pipeline.models.shape import ModelShape

    return ModelShape.from_folder(ckpt.path)


def qformat_of(ckpt: Checkpoint) -> str:
    from pipeline.quantize.formats import FORMATS

    by_algo = {f.trtllm_algo: name for name, f in FORMATS.items() if f.trtllm_algo}
    return by_algo.get(ckpt.quant_algo, "none")
