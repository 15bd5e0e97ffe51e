"""Text for `pipeline build`: the plan (--dry-run) and the summary at the end of a build."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tabulate import tabulate

from pipeline.build.plan import BuildPlan
from pipeline.build.runner import BuildResult


def render_plan(plan: BuildPlan) -> str:
    s, why = plan.settings, plan.settings.reasons

    def line(label: str, value: str, key: str | None = None) -> str:
        reason = why.get(key or "")
        return f"{label:<10}{value}" + (f"  ({reason})" if reason else "")

    lines = [f"dry run: nothing built. {plan.name} -> {_short(plan.build_dir)}, {_short(plan.repo)}",
             line("backend", s.backend, "backend"),
             line("target", f"{s.target}, {s.target_qformat}", "target_qformat"),
             line("draft", s.draft_label, "draft")]
    if s.draft.kind in ("model", "eagle3"):
        lines.append(line("draft fmt", s.draft_qformat, "draft_qformat"))
    sizes = f"max batch {s.max_batch_size} x {s.max_seq_len or 'auto'} tokens"
    lines += [line("sizes", f"{sizes}, K={s.num_draft_tokens}, kv cache {s.kv_cache_dtype}"),
              line("gate", f"speculate at batch <= {s.gate_batch_size}", "gate_batch_size")]
    if s.runs_on.trtllm_release:
        lines += [line("gpu", f"{s.gpu}", "gpu"), line("tp", str(s.tp_size), "tp_size"),
                  line("trtllm", str(s.trtllm_version), "trtllm_version")]
    else:
        lines += [line("dtype", s.engine_dtype, "engine_dtype"), line("device", s.device)]  # picked when it runs
    lines.append("")
    for i, stage in enumerate(plan.stages, 1):
        note = f"  [{stage.note}]" if stage.note else ""
        lines.append(f"stage {i}: {stage.name} -> {_short(stage.output)}  (key {stage.config_key}){note}")
        lines.append(f"  $ {shlex.join(stage.command)}")
        if stage.options is not None:
            config = stage.to_dict()["config"]
            for k in ("output", "force", "dry_run"):
                config.pop(k, None)
            lines.append(f"  config: {json.dumps(config)}")
    for name, reason in plan.skipped:
        lines.append(f"skipped: {name}: {reason}")
    if plan.preview is not None:
        lines += ["", *render_preview(plan.preview)]
    elif plan.settings.runs_on.trtllm_release:
        lines += ["", "TensorRT-LLM commands: not shown until the target's config.json is here (a preset or a folder)"]
    if plan.memory_plan is not None:
        from pipeline.plan.render import render_table

        lines += ["", "memory plan:", render_table(plan.memory_plan)]
    else:
        lines += ["", "memory plan: none (the portable engine sizes its KV pool as it loads; `pipeline plan --backend "
                      "torch --gpu KIND` plans it on a GPU)"]
    if plan.missing:
        lines += ["", f"this machine lacks: {'; '.join(plan.missing)}. A build without --dry-run stops here."]
    return "\n".join(lines)


def render_preview(p) -> list[str]:
    """What will run in NVIDIA's container, exactly as compile and serve will write and run it."""
    lines = [f"TensorRT-LLM {p.tensorrt_llm_version}, {p.route} route: what runs in the container"]
    for name, command in p.commands.items():
        lines.append(f"  # {name}")
        lines.append(f"  $ {command}")
    for name, text in p.files.items():
        if name.endswith(".yaml"):
            lines.append(f"  # {name}")
            lines += [f"    {line}" for line in text.rstrip().splitlines()]
    mode = p.launch["mode"]
    ranks = f"{p.launch['world_size']} rank(s)" if mode == "leader" else "1 rank"
    lines += [f"  # pipeline serve: {mode} mode, {ranks}, {p.launch['gpus']} GPU(s)", f"  $ {p.serve_command}"]
    lines += [f"  note: {n}" for n in p.notes]
    return lines


def render_summary(result: BuildResult) -> str:
    built = sum(s.status == "built" for s in result.stages)
    reused = sum(s.status == "reused" for s in result.stages)
    lines = [f"built {result.name} ({result.backend} backend, draft {result.draft}) in {result.total_s:.1f} s: "
             f"{built} stage(s) built, {reused} reused"]
    rows = [("prepare models", "done", _secs(result.prepare_s), "", "resolve, convert if needed, hash")]
    for name, reason in result.skipped:
        rows.append((name, "skipped", "", "", reason))
    for st in result.stages:
        time_s = _secs(st.duration_s) if st.status != "not run" else ""
        rows.append((st.name, st.status, time_s, _size(st.bytes) if st.bytes else "", _short(st.output)
                     + (f"  ({st.note})" if st.note else "")))
    lines.append(tabulate(rows, ("stage", "status", "time", "size", "output"), tablefmt="plain", disable_numparse=True,
                          colalign=("left", "left", "right", "right", "left")))
    if any(st.status == "reused" for st in result.stages):
        lines.append("(a reused stage's time is what it took when built)")
    if result.device_line:
        lines.append(f"device    {result.device_line.removeprefix('device: ')}")
    if result.dtype_line:
        lines.append(f"dtype     {result.dtype_line}")
    lines += [f"note      {note}" for note in result.notes]
    lines += [f"manifest  {_short(result.manifest)}", f"engine    {_short(result.engine)}",
              f"next      {result.next_command}"]
    return "\n".join(lines)


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _short(path) -> str:
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
