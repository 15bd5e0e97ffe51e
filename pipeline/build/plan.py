"""`plan_build(options, environment) -> BuildPlan`: every decision of `pipeline build`, with no side effects.

The plan fills the `auto` options per backend and GPU (each with its reason), sizes the GPU memory with
`pipeline plan` (and picks the smallest TP that fits), and lists the stages: quantize the target (and a
draft model), compile, assemble. Each stage carries the options object its library function takes, the
equivalent command line, its output folder and a key over its configuration and its dependencies' keys,
so a changed input reruns exactly the stages downstream of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.build.options import EAGLE3, EAGLE3_PREFIX, KV_CACHE_DTYPES, BACKENDS, BuildOptions, Environment
from pipeline.errors import ConfigError
from pipeline.plan.gpus import GPU, get_gpu

MANIFEST_FILE = "build.json"
ENGINE_FOLDER = "engine"
PLAN_GPU = "h100-80gb"  # what a trtllm plan assumes when there is no GPU here and no --gpu
# Per backend: (max batch size, max sequence length, gate batch size).
TORCH_SIZES = (8, 2048, 4)  # bench_engine: n-gram pays 1.11x at batch 4 and 0.87x at 16 on a 2-core CPU
TRTLLM_SIZES = (16, 4096, 32)  # `pipeline plan`'s defaults; speculation pays up to batch ~32 on a GPU
QFORMAT_REASONS = {
    ("trtllm", "target", True): "fp8: FP8 tensor cores halve the weight reads at about 2% perplexity",
    ("trtllm", "target", False): "none (bf16): this GPU has no FP8; --target-qformat int4_awq shrinks it 4x",
    ("trtllm", "model"): "int4_awq: a draft model is memory-bound, and its quality never changes the output",
    ("trtllm", "eagle3"): "none: an EAGLE-3 head is one layer, kept in bf16 as published",
    ("torch", "target"): "none (bf16): fastest on CPU; fp8 is dequantized at load (0.93x), int4_awq costs "
                         "+30% perplexity on SmolLM2",
    ("torch", "model"): "int4_awq: torch's CPU int4 kernel decodes 1.6x faster, and a draft's quality never "
                        "changes the output",
    ("torch", "eagle3"): "none: an EAGLE-3 head is one layer",
}


@dataclass(frozen=True)
class Settings:
    """BuildOptions with every `auto` resolved; `reasons` says why, per field."""

    backend: str
    target: str
    draft_kind: str  # none | ngram | eagle3 | model
    draft_ref: str  # the draft model or EAGLE-3 head ("" for none/ngram)
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
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def draft_label(self) -> str:
        return self.draft_kind if self.draft_kind in ("none", "ngram") else f"{self.draft_kind} {self.draft_ref}"


@dataclass(frozen=True)
class Stage:
    name: str  # quantize_target | quantize_draft | compile | assemble
    kind: str  # quantize | compile | assemble
    options: Any  # the library call's options object; None: shown, not run here (see note)
    command: tuple[str, ...]  # the equivalent `pipeline ...` command
    output: Path
    deps: tuple[str, ...] = ()
    models: tuple[str, ...] = ()  # model refs read directly: their files' hashes join the input key
    config_key: str = ""
    note: str = ""

    @property
    def runnable(self) -> bool:
        return self.options is not None

    def to_dict(self) -> dict:
        config = _plain(dataclasses.asdict(self.options)) if self.options is not None else None
        return {"name": self.name, "kind": self.kind, "command": shlex.join(self.command), "output": str(self.output),
                "deps": list(self.deps), "models": list(self.models), "config_key": self.config_key,
                "config": config, "runnable": self.runnable, "note": self.note}


@dataclass(frozen=True)
class BuildPlan:
    options: BuildOptions
    settings: Settings
    name: str
    build_dir: Path  # engines/<name>: build.json, quantized checkpoints, engine/
    repo: Path
    stages: tuple[Stage, ...]
    skipped: tuple[tuple[str, str], ...]  # (stage, why)
    memory_plan: Any  # pipeline.plan.MemoryPlan on trtllm; None on the portable engine
    missing: tuple[str, ...]  # what this machine lacks to run the plan, each with how to get it

    @property
    def manifest_file(self) -> Path:
        return self.build_dir / MANIFEST_FILE

    @property
    def engine_dir(self) -> Path:
        return self.build_dir / ENGINE_FOLDER

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def missing_line(self) -> str:
        return (f"can't build {self.name} on this machine: it lacks {'; and '.join(self.missing)} "
                f"(`pipeline build ... --dry-run` prints the plan)")

    def to_dict(self) -> dict:
        return {"name": self.name, "build_dir": str(self.build_dir), "repo": str(self.repo),
                "options": _plain(dataclasses.asdict(self.options)), "settings": _plain(dataclasses.asdict(self.settings)),
                "stages": [s.to_dict() for s in self.stages],
                "skipped": [{"stage": s, "reason": r} for s, r in self.skipped],
                "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
                "missing": list(self.missing)}


def plan_build(options: BuildOptions, env: Environment) -> BuildPlan:
    """The whole build, decided; raises a one-line PipelineError on bad input. Reads nothing but config.json."""
    _check_options(options)
    settings, memory_plan = resolve_settings(options, env)
    name = model_name(options.target)
    build_dir = Path(options.engines_dir).expanduser().absolute() / name
    repo = Path(options.repo).expanduser().absolute()
    stages, skipped = _stages(settings, options, env, build_dir, repo)
    return BuildPlan(options, settings, name, build_dir, repo, tuple(stages), tuple(skipped), memory_plan,
                     _missing(settings, env))


# ---- settings ---------------------------------------------------------------------------------------------------


def resolve_settings(o: BuildOptions, env: Environment) -> tuple[Settings, Any]:
    reasons: dict[str, str] = {}
    arch = _arch_or_none(o.target, env)
    backend = _backend(o, env, arch, reasons)
    gpu = _plan_gpu(o, env, backend, reasons)
    draft_kind, draft_ref = _draft(o, env, backend, reasons)
    target_q = _qformat(o.target_qformat, backend, "target", gpu, reasons, "target_qformat")
    draft_q = (_qformat(o.draft_qformat, backend, draft_kind, gpu, reasons, "draft_qformat")
               if draft_kind in ("model", EAGLE3) else "none")
    kv = "bf16" if o.kv_cache_dtype in ("auto", "bf16") else "fp8"
    if backend == "torch" and kv == "fp8":
        raise ConfigError("the portable engine keeps its KV cache in the compute dtype; drop --kv-cache-dtype fp8 "
                          "(or build with --backend trtllm)")
    batch, seq, gate = TORCH_SIZES if backend == "torch" else TRTLLM_SIZES
    max_seq = o.max_seq_len
    if max_seq is None and backend == "torch":
        max_seq = min(seq, _max_position_embeddings(o.target, env) or seq)
    elif max_seq is None:
        max_seq = seq
    settings = Settings(
        backend=backend, target=o.target, draft_kind=draft_kind, draft_ref=draft_ref, target_qformat=target_q,
        draft_qformat=draft_q, kv_cache_dtype=kv, num_draft_tokens=o.num_draft_tokens,
        gate_batch_size=o.gate_batch_size if o.gate_batch_size is not None else gate,
        max_batch_size=o.max_batch_size if o.max_batch_size is not None else batch,
        max_input_len=o.max_input_len, max_seq_len=max_seq, tp_size=o.tp_size or 1,
        gpu=gpu.key if gpu is not None else None,
        export="trtllm" if backend == "trtllm" and draft_kind == "model" else "hf", reasons=reasons)
    if o.gate_batch_size is None:
        reasons["gate_batch_size"] = (f"{settings.gate_batch_size}: " + (
            "on a 2-core CPU n-gram speculation pays at batch 4 (1.11x) and not at 16 (0.87x)"
            if backend == "torch" else "speculation pays while decoding is memory-bound, up to batch ~32"))
    if backend == "torch":
        if (o.tp_size or 1) > 1:
            raise ConfigError("the portable engine runs on one device; drop --tp-size (or build with --backend trtllm)")
        return settings, None
    return _with_memory_plan(settings, o, arch, gpu, reasons)


def _with_memory_plan(s: Settings, o: BuildOptions, arch, gpu: GPU, reasons: dict) -> tuple[Settings, Any]:
    from pipeline.plan.memory import DraftSpec, PlanInputs, check_fits, plan_memory
    from pipeline.plan.resolve import model_arch

    if arch is None:
        return s, None  # a hub id with nothing local: nothing to size yet (`missing` says what to fetch)
    draft = DraftSpec(s.draft_kind, s.draft_kind) if s.draft_kind != "model" else \
        DraftSpec("model", *model_arch(s.draft_ref))
    inputs = PlanInputs(target_name=model_name(o.target), target=arch, gpu=gpu, tp=s.tp_size,
                        target_qformat=s.target_qformat, draft=draft, draft_qformat=s.draft_qformat,
                        kv_cache_dtype=s.kv_cache_dtype, max_batch_size=s.max_batch_size,
                        max_seq_len=s.max_seq_len or TRTLLM_SIZES[1])
    plan = plan_memory(inputs)
    if o.tp_size is None and plan.min_tp is not None and plan.min_tp != s.tp_size:
        s = dataclasses.replace(s, tp_size=plan.min_tp)
        plan = plan_memory(dataclasses.replace(inputs, tp=plan.min_tp))
    if o.tp_size is None:
        reasons["tp_size"] = f"{s.tp_size}: the smallest TP whose memory plan fits on {gpu.name}"
    if not o.force:
        check_fits(plan)
    return s, plan


def _backend(o: BuildOptions, env: Environment, arch, reasons: dict) -> str:
    if o.backend != "auto":
        return o.backend
    if env.gpu is not None and env.trtllm:
        reasons["backend"] = f"trtllm: a {env.gpu.name} and TensorRT-LLM are here"
        return "trtllm"
    bf16_bytes = 2 * arch.param_count if arch is not None else 0
    if env.host_memory_bytes and bf16_bytes > env.host_memory_bytes // 2:
        reasons["backend"] = (f"trtllm: {bf16_bytes / 1e9:.0f} GB of bf16 weights is too much for this machine's "
                              f"{env.host_memory_bytes / 1e9:.0f} GB on the portable engine")
        return "trtllm"
    reasons["backend"] = "torch: the portable engine (no GPU with TensorRT-LLM here)"
    return "torch"


def _plan_gpu(o: BuildOptions, env: Environment, backend: str, reasons: dict) -> GPU | None:
    if o.gpu is not None:
        return get_gpu(o.gpu)
    if backend != "trtllm":
        return None
    if env.gpu is not None:
        return env.gpu
    reasons["gpu"] = f"{PLAN_GPU}: no GPU here, so the plan assumes one; pass --gpu to plan for another"
    return get_gpu(PLAN_GPU)


def _draft(o: BuildOptions, env: Environment, backend: str, reasons: dict) -> tuple[str, str]:
    from pipeline.models.presets import get_preset

    text = o.draft.strip()
    kind = text.lower()
    preset = get_preset(o.target)
    head = preset.eagle3_head if preset is not None else None
    if kind == "auto":
        if backend == "trtllm" and head:
            reasons["draft"] = f"eagle3: {head} is published for {preset.name}"
            return EAGLE3, head
        reasons["draft"] = "ngram: needs no weights and pays when answers copy from the prompt"
        return "ngram", ""
    if kind in ("ngram", "none"):
        return kind, ""
    if kind.startswith(EAGLE3_PREFIX):
        folder = text[len(EAGLE3_PREFIX):].strip()
        if not folder:
            raise ConfigError("--draft eagle3: needs a folder after the colon, e.g. --draft eagle3:heads/my-head")
        return EAGLE3, folder
    if kind == EAGLE3:
        if backend == "torch":
            raise ConfigError(f"--draft eagle3 on the portable engine is not yet available for {o.target}: train a "
                              f"head with `pipeline draft train --target {o.target} --method eagle3 -o DIR` and "
                              f"pass --draft eagle3:DIR, or use --draft ngram")
        if not head:
            raise ConfigError(f"{o.target} has no published EAGLE-3 head; pass --draft eagle3:DIR with a trained "
                              f"head, or use --draft ngram")
        return EAGLE3, head
    return "model", text


def _qformat(requested: str, backend: str, role: str, gpu: GPU | None, reasons: dict, key: str) -> str:
    from pipeline.quantize.formats import get_format

    value = requested.strip().lower()
    if value != "auto":
        return get_format(value).name  # raises with the list of formats
    if backend == "trtllm" and role == "target":
        reason = QFORMAT_REASONS[("trtllm", "target", bool(gpu and gpu.fp8))]
    else:
        reason = QFORMAT_REASONS[(backend, role)]
    reasons[key] = reason
    return reason.split(":")[0].split(" ")[0]


def _check_options(o: BuildOptions) -> None:
    if o.backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {o.backend!r}; pick one of {', '.join(BACKENDS)}")
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown --kv-cache-dtype {o.kv_cache_dtype!r}; pick one of {', '.join(KV_CACHE_DTYPES)}")
    if o.gate_batch_size is not None and o.gate_batch_size < 1:
        raise ConfigError(f"--gate-batch-size must be at least 1 (got {o.gate_batch_size}); "
                          f"use --draft none to turn speculation off")
    for flag, value in (("--max-batch-size", o.max_batch_size), ("--max-seq-len", o.max_seq_len),
                        ("--max-input-len", o.max_input_len), ("--tp-size", o.tp_size), ("calib size", o.calib_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if o.num_draft_tokens < 1 and o.draft.strip().lower() != "none":
        raise ConfigError(f"--num-draft-tokens must be at least 1 with a draft (got {o.num_draft_tokens}); "
                          f"pass --num-draft-tokens 4, or --draft none")


# ---- stages -----------------------------------------------------------------------------------------------------


def _stages(s: Settings, o: BuildOptions, env: Environment, build_dir: Path, repo: Path):
    from pipeline.compile.run import CompileOptions
    from pipeline.quantize.run import QuantizeOptions

    stages: list[Stage] = []
    skipped: list[tuple[str, str]] = []
    quant_kv = "fp8" if s.export == "trtllm" and s.kv_cache_dtype == "fp8" else "none"

    def checkpoint(role: str, ref: str, qformat: str) -> tuple[Path, str | None]:
        """The folder compile reads for `ref`: a quantize stage's output, or the model's own folder."""
        if qformat == "none" and s.export == "hf":
            skipped.append((f"quantize_{role}", f"--{role}-qformat none: compile reads {ref}'s own folder"))
            return _weights_path(ref, env), None
        suffix = f"-trtllm-tp{s.tp_size}" if s.export == "trtllm" else ""
        out = build_dir / f"{role}-{qformat}{suffix}"
        local = env.weights_of(ref).path
        opts = QuantizeOptions(model=str(local) if local is not None and local.suffix != ".gguf" else ref,
                               output=out, qformat=qformat, kv_cache_dtype=quant_kv if qformat != "none" else "none",
                               calib_size=o.calib_size, export=s.export, tp_size=s.tp_size if s.export == "trtllm" else 1,
                               force=True)
        cmd = ("pipeline", "quantize", "--model", opts.model, "--qformat", qformat, "--kv-cache-dtype",
               opts.kv_cache_dtype, "--calib-size", str(o.calib_size), "--export", s.export, "--tp-size",
               str(opts.tp_size), "-o", str(out), "--force")
        stages.append(_keyed(Stage(f"quantize_{role}", "quantize", opts, cmd, out, models=(ref,)), stages))
        return out, stages[-1].name

    target_ckpt, target_dep = checkpoint("target", s.target, s.target_qformat)
    deps = [target_dep] if target_dep else []
    models = [] if target_dep else [s.target]
    draft_arg = s.draft_kind
    if s.draft_kind == "model":
        draft_ckpt, draft_dep = checkpoint("draft", s.draft_ref, s.draft_qformat)
        draft_arg = str(draft_ckpt)
        deps += [draft_dep] if draft_dep else []
        models += [] if draft_dep else [s.draft_ref]
    elif s.draft_kind == EAGLE3:
        if s.draft_qformat != "none":
            raise ConfigError(f"an EAGLE-3 head is compiled as it is; drop --draft-qformat {s.draft_qformat}")
        skipped.append(("quantize_draft", "an EAGLE-3 head is compiled as it is"))
        draft_arg = f"{EAGLE3_PREFIX}{_weights_path(s.draft_ref, env)}"
        models.append(s.draft_ref)

    trt = s.backend == "trtllm"
    # On the portable engine the Triton speculation_gate model sends every request an explicit on/off, so the
    # engine folder keeps compile's default gate (used only by `pipeline generate --model engines/...`) and the
    # gate lives in the assemble stage alone: changing --gate-batch-size rebuilds only the repository.
    gate = s.gate_batch_size if trt else CompileOptions.gate_batch_size
    engine = build_dir / ENGINE_FOLDER
    copts = CompileOptions(
        backend=s.backend, target=target_ckpt, output=engine, draft=draft_arg, num_draft_tokens=s.num_draft_tokens,
        max_batch_size=s.max_batch_size, max_input_len=s.max_input_len, max_seq_len=s.max_seq_len,
        gate_batch_size=gate, kv_cache_dtype="fp8" if s.kv_cache_dtype == "fp8" else "auto",
        tp_size=s.tp_size if trt and s.export == "hf" else None, dtype="auto" if trt else "bf16",
        gpu=s.gpu if trt else None, force=True)
    cmd = ["pipeline", "compile", "-b", s.backend, "-t", str(target_ckpt), "-d", draft_arg,
           "-k", str(s.num_draft_tokens), "--max-batch-size", str(s.max_batch_size)]
    cmd += ["--max-input-len", str(s.max_input_len)] if s.max_input_len else []
    cmd += ["--max-seq-len", str(s.max_seq_len)] if s.max_seq_len else []
    cmd += ["--gate-batch-size", str(gate)] if trt else []
    cmd += ["--kv-cache-dtype", copts.kv_cache_dtype, "--dtype", copts.dtype]
    cmd += ["--tp-size", str(copts.tp_size)] if copts.tp_size else []
    cmd += ["--gpu", s.gpu] if trt and s.gpu else []
    cmd += ["-o", str(engine), "--force"]
    stages.append(_keyed(Stage("compile", "compile", copts, tuple(cmd), engine, tuple(deps), tuple(models)), stages))

    aopts, note = _assemble_options(s, engine, repo)
    cmd = ("pipeline", "assemble", "--engine", str(engine), "--repo", str(repo), "--gate-batch-size",
           str(s.gate_batch_size), "--force")
    stages.append(_keyed(Stage("assemble", "assemble", aopts, cmd, repo, ("compile",), note=note), stages))
    return stages, skipped


def _assemble_options(s: Settings, engine: Path, repo: Path):
    from pipeline.triton.assemble import AssembleOptions

    common = dict(engine=engine, repo=repo, gate_batch_size=s.gate_batch_size, force=True)
    if s.backend == "torch":
        return AssembleOptions(**common), ""
    if "backend" in {f.name for f in dataclasses.fields(AssembleOptions)}:
        try:
            return AssembleOptions(backend="trtllm", **common), ""
        except (TypeError, ValueError):
            pass
    return None, "shown, not run: `pipeline assemble` has no TensorRT-LLM backend yet"


def _keyed(stage: Stage, earlier: list[Stage]) -> Stage:
    """The stage with its config key: its options (less force) and the keys of the stages it reads."""
    keys = {s.name: s.config_key for s in earlier}
    config = _plain(dataclasses.asdict(stage.options)) if stage.options is not None else {"note": stage.note}
    config.pop("force", None)
    config.pop("dry_run", None)
    blob = json.dumps({"stage": stage.name, "config": config, "deps": [keys[d] for d in stage.deps]}, sort_keys=True)
    return dataclasses.replace(stage, config_key=hashlib.sha256(blob.encode()).hexdigest()[:16])


# ---- what the machine lacks -------------------------------------------------------------------------------------


def _missing(s: Settings, env: Environment) -> tuple[str, ...]:
    from pipeline.compile.reference import TRTLLM_CONTAINER

    out = []
    if s.backend == "trtllm":
        if env.gpu is None:
            out.append("an NVIDIA GPU (TensorRT-LLM builds and runs on one; use a GPU machine)")
        if not env.trtllm:
            out.append(f"TensorRT-LLM (run the build inside NVIDIA's container {TRTLLM_CONTAINER})")
    flags = {s.target: "--target DIR"}
    if s.draft_ref:
        flags[s.draft_ref] = "--draft eagle3:DIR" if s.draft_kind == EAGLE3 else "--draft DIR"
    for ref, flag in flags.items():
        w = env.weights_of(ref)
        if not w.present:
            out.append(f"the {ref} weights ({w.how_to_get.replace('pass DIR', 'pass ' + flag)})")
    return tuple(out)


# ---- helpers ----------------------------------------------------------------------------------------------------


def model_name(ref: str) -> str:
    """The build's folder name: the preset's name, else the folder's (or .gguf's) name."""
    from pipeline.models.presets import get_preset

    preset = get_preset(ref)
    if preset is not None:
        return preset.name
    path = Path(ref.rstrip("/"))
    return (path.stem if path.suffix.lower() == ".gguf" else path.name) or "model"


def _weights_path(ref: str, env: Environment) -> Path:
    w = env.weights_of(ref)
    return w.path if w.path is not None else Path(f"<{ref} weights>")


def _arch_or_none(ref: str, env: Environment):
    from pipeline.errors import PipelineError
    from pipeline.models.presets import get_preset
    from pipeline.plan.resolve import model_arch

    w = env.weights_of(ref)
    local = w.path if w.path is not None and w.path.is_dir() else None
    preset = get_preset(ref)
    try:
        if preset is not None and preset.arch is not None:
            return model_arch(ref)[1]
        return model_arch(str(local))[1] if local is not None else None
    except PipelineError:
        return None


def _max_position_embeddings(ref: str, env: Environment) -> int | None:
    w = env.weights_of(ref)
    config = w.path / "config.json" if w.path is not None else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def _plain(value):
    """asdict() output as JSON-ready values (Paths become strings)."""
    return json.loads(json.dumps(value, default=str))
