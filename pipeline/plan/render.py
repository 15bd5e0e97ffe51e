"""A MemoryPlan as the plain-text table `pipeline plan` prints."""

from __future__ import annotations

from pipeline.plan.memory import FP8_FORMATS, GB, MemoryPlan
from pipeline.plan.weights import KV_DTYPE_BYTES


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if abs(n) < 10 * GB else f"{n / GB:.1f} GB"


def _kb(n: int) -> str:
    return f"{n / 1e3:.1f} KB"


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

    header = ("item", "detail", "total", f"per GPU (tp={tp})")
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(4)]
    fmt_row = lambda r: "  ".join((r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]),  # noqa: E731
                                   r[3].rjust(widths[3]))).rstrip()
    lines = [
        f"{i.target_name} + draft {draft} on {tp} x {gpu.name} ({gpu.arch}, {gpu.bandwidth_tb_s:g} TB/s, "
        f"FP8 {'yes' if gpu.fp8 else 'no'}), batch {i.max_batch_size} x {i.max_seq_len} tokens",
        fmt_row(header), fmt_row(tuple("-" * w for w in widths)), *map(fmt_row, rows), "",
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
