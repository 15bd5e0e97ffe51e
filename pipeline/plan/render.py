"""A MemoryPlan (TensorRT-LLM) or a PortablePlan (the portable engine on a GPU) as the table `pipeline plan` prints."""

from __future__ import annotations

from tabulate import tabulate

from pipeline.plan.memory import FP8_FORMATS, GB, MemoryPlan
from pipeline.plan.portable import KV_BLOCK_TOKENS, PortablePlan
from pipeline.plan.weights import KV_DTYPE_BYTES


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if abs(n) < 10 * GB else f"{n / GB:.1f} GB"


def _kb(n: int) -> str:
    return f"{n / 1e3:.1f} KB"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], align: str) -> str:
    """Columns two spaces apart under a dashed header; align: "l" or "r" per column."""
    return tabulate(rows, header, tablefmt="simple", disable_numparse=True,
                    colalign=["left" if a == "l" else "right" for a in align])


def render_table(plan: MemoryPlan) -> str:
    i, gpu, tp = plan.inputs, plan.inputs.gpu, plan.tp
    draft = i.draft.name if i.draft.kind != "model" else f"{i.draft.name} (draft model)"
    rows: list[tuple[str, str, str, str]] = []  # item, detail, total, per GPU

    for fmt, w in plan.target_weights.items():
        note = " (no FP8 on this GPU)" if fmt in FP8_FORMATS and not gpu.fp8 else ""
        mark = " *" if fmt == i.target_qformat else ""
        label = "none (bf16)" if fmt == "none" else fmt
        rows.append(("target weights" if not rows else "", f"{label}{mark}{note}", _gb(w.total), _gb(w.per_gpu(tp))))
    dq = f" ({i.draft_qformat})" if i.draft.kind in ("eagle3", "model") else ""
    rows.append(("draft weights", f"{i.draft.name}{dq}", _gb(plan.draft_weights.total),
                 _gb(plan.draft_weights_per_gpu)))
    for role in ("target", "draft"):
        per = plan.kv_per_token[role]
        rows.append(("KV per token" if role == "target" else "", f"{role} bf16 / fp8", "",
                     f"{_kb(per['bf16'])} / {_kb(per['fp8'])}"))
    first = True
    for role in ("target", "draft"):
        for d in KV_DTYPE_BYTES:
            mark = " *" if d == (i.draft_kv if role == "draft" else i.kv_cache_dtype) else ""
            rows.append((f"KV {i.max_batch_size} x {i.max_seq_len}" if first else "", f"{role} {d}{mark}", "",
                         _gb(plan.kv_cache(role, d))))
            first = False
    rows.append(("reserve", "CUDA context (1 GiB)", "", _gb(plan.cuda_context)))
    rows.append(("", "activations/workspace: max(2 GiB, 10%)", "", _gb(plan.activations)))
    rows.append(("used (* rows)", "", "", _gb(plan.used)))
    rows.append(("GPU memory", gpu.name, "", _gb(gpu.memory_bytes)))
    rows.append(("headroom", "", "", _gb(plan.headroom)))

    lines = [
        f"{i.target_name} + draft {draft} on {tp} x {gpu.name} ({gpu.arch}, {gpu.bandwidth_tb_s:g} TB/s, "
        f"FP8 {'yes' if gpu.fp8 else 'no'}), batch {i.max_batch_size} x {i.max_seq_len} tokens",
        _table(("item", "detail", "total", f"per GPU (tp={tp})"), rows, "llrr"), "",
        _verdict(plan),
        "* = this plan. Assumes:",
        *(f"  - {a}" for a in plan.assumptions),
    ]
    return "\n".join(lines)


def _verdict(plan: MemoryPlan) -> str:
    i = plan.inputs
    smallest = (f"smallest TP that fits: {plan.min_tp}" if plan.min_tp
                else "no TP up to 8 fits with these settings")
    if plan.fits:
        return f"verdict: FITS on {plan.tp} x {i.gpu.name} with {_gb(plan.headroom)} headroom per GPU; {smallest}"
    return (f"verdict: DOES NOT FIT on {plan.tp} x {i.gpu.name}: {_gb(-plan.headroom)} short per GPU; {smallest}; "
            f"fixes: {', '.join(plan.fixes())}")


def render_portable(plan: PortablePlan) -> str:
    """The portable engine's plan on one GPU: weights, reserve, the KV pool it sizes and the requests it holds."""
    i, gpu = plan.inputs, plan.inputs.gpu
    draft = i.draft.name if i.draft.kind != "model" else f"{i.draft.name} (draft model)"
    tokens = f"{i.max_batch_size} x {i.max_seq_len} tokens"
    held = plan.blocks_free_memory_holds // plan.blocks_per_request
    rows = [
        ("target weights", f"bf16, {i.target.param_count / 1e6:,.0f}M params", _gb(plan.target_weights)),
        ("draft weights", draft + (" (bf16)" if i.draft.kind in ("eagle3", "model") else ""), _gb(plan.draft_weights)),
        ("draft KV cache", f"its own, {tokens}" if plan.draft_cache else "none", _gb(plan.draft_cache)),
        ("reserve", "CUDA context (1 GiB)", _gb(plan.cuda_context)),
        ("free for KV", "GPU memory less the rows above", _gb(plan.free_for_kv)),
        ("KV per block", f"{KV_BLOCK_TOKENS} tokens, {i.target.num_layers} layers, bf16",
         f"{plan.kv_bytes_per_block / 1e6:.2f} MB"),
        ("KV pool", f"{plan.kv_blocks} blocks: {plan.fraction:g} of free" + (f", capped at {tokens}" if plan.capped
                                                                               else ""), _gb(plan.kv_pool_bytes)),
        ("used", "", _gb(plan.used)),
        ("GPU memory", gpu.name, _gb(gpu.memory_bytes)),
    ]
    if plan.fits:
        why = (f"the pool is capped at --max-batch-size x --max-seq-len; the free memory would hold {held}"
               if plan.capped else f"the free memory holds that many; --max-batch-size is {i.max_batch_size}")
        verdict = (f"verdict: FITS on 1 x {gpu.name}: {plan.requests_that_fit} requests of {i.max_seq_len} tokens at "
                   f"once ({why})")
    else:
        verdict = (f"verdict: DOES NOT FIT on 1 x {gpu.name}: the KV pool holds {plan.kv_blocks} blocks, and one "
                   f"request of {i.max_seq_len} tokens needs {plan.blocks_per_request}; "
                   f"fixes: {', '.join(plan.fixes())}")
    return "\n".join([
        f"{i.target_name} + draft {draft} on 1 x {gpu.name}, portable engine (--backend torch) on cuda, "
        f"batch {tokens}",
        _table(("item", "detail", "bytes"), rows, "llr"), "",
        verdict,
        "Assumes:",
        *(f"  - {a}" for a in plan.assumptions),
    ])
