"""`plan_build(options, environment) -> BuildPlan`: every decision of `pipeline build`, with no side effects.

The settings (settings.py) fill the `auto` options and size the GPU memory; the plan then lists the stages:
quantize the target (and a draft model), compile, assemble. Each stage carries the options object its
library function takes, the equivalent command line, its output folder and a key over its configuration
and its dependencies' keys, so a changed input reruns exactly the stages downstream of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.build.options import BuildOptions, Environment, model_name
from pipeline.build.settings import Settings, check_options, plain, resolve_settings
from pipeline.draft_spec import EAGLE3, MODEL, DraftSpec
from pipeline.errors import ConfigError

MANIFEST_FILE = "build.json"
ENGINE_FOLDER = "engine"


@dataclass(frozen=True)
class Stage:
    name: str  # quantize_target | quantize_draft | train_draft | compile | assemble
    kind: str  # quantize | train | compile | assemble
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
        config = plain(dataclasses.asdict(self.options)) if self.options is not None else None
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
    preview: Any = None  # pipeline.build.preview.Preview on trtllm: the commands, YAML and launch that will run

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
                "options": plain(dataclasses.asdict(self.options)),
                "settings": plain(dataclasses.asdict(self.settings)),
                "stages": [s.to_dict() for s in self.stages],
                "skipped": [{"stage": s, "reason": r} for s, r in self.skipped],
                "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
                "missing": list(self.missing),
                "trtllm": self.preview.to_dict() if self.preview is not None else None}


def plan_build(options: BuildOptions, env: Environment) -> BuildPlan:
    """The whole build, decided; raises a one-line PipelineError on bad input. Reads nothing but config.json."""
    check_options(options)
    settings, memory_plan = resolve_settings(options, env)
    name = model_name(options.target)
    build_dir = Path(options.engines_dir).expanduser().absolute() / name
    repo = Path(options.repo).expanduser().absolute()
    stages, skipped = _stages(settings, options, env, build_dir, repo)
    preview = _preview(settings, memory_plan, stages, repo) if settings.runs_on.trtllm_release else None
    return BuildPlan(options, settings, name, build_dir, repo, tuple(stages), tuple(skipped), memory_plan,
                     _missing(settings, env), preview)


def _preview(s: Settings, memory_plan, stages: list[Stage], repo: Path):
    """The trtllm-build lines / LLM-API YAML and the server launch, from the shapes the memory plan read; None
    without one (a model with no config.json here)."""
    from pipeline.build.preview import preview_trtllm

    if memory_plan is None:
        return None
    by_name = {stage.name: stage for stage in stages}
    quant_kv = {role: by_name[f"quantize_{role}"].options.kv_cache_dtype
                for role in ("target", "draft") if f"quantize_{role}" in by_name}
    return preview_trtllm(by_name["compile"].options, s, memory_plan.inputs.target, memory_plan.inputs.draft.shape,
                          quant_kv, repo)


# ---- stages -----------------------------------------------------------------------------------------------------


def _stages(s: Settings, o: BuildOptions, env: Environment, build_dir: Path, repo: Path):
    stages: list[Stage] = []
    skipped: list[tuple[str, str]] = []

    def checkpoint(role: str, ref: str, qformat: str) -> tuple[Path, str | None]:
        """The folder compile reads for `ref`: a quantize stage's output, or the model's own folder."""
        if qformat == "none" and s.export == "hf":
            skipped.append((f"quantize_{role}", f"--{role}-qformat none: compile reads {ref}'s own folder"))
            return _weights_path(ref, env), None
        stages.append(_keyed(_quantize_stage(s, o, env, build_dir, role, ref, qformat), stages))
        return stages[-1].output, stages[-1].name

    target_ckpt, target_dep = checkpoint("target", s.target, s.target_qformat)
    deps = [target_dep] if target_dep else []
    models = [] if target_dep else [s.target]
    draft = s.draft  # as the compile stage takes it: a checkpoint or head folder where one is written
    if s.draft.kind == MODEL:
        draft_ckpt, draft_dep = checkpoint("draft", s.draft.ref, s.draft_qformat)
        draft = DraftSpec(MODEL, str(draft_ckpt))
        deps += [draft_dep] if draft_dep else []
        models += [] if draft_dep else [s.draft.ref]
    elif s.draft.kind == EAGLE3:
        if s.draft_qformat != "none":
            raise ConfigError(f"an EAGLE-3 head is compiled as it is; drop --draft-qformat {s.draft_qformat}")
        skipped.append(("quantize_draft", "an EAGLE-3 head is compiled as it is"))
        if s.draft.ref:
            draft = DraftSpec(EAGLE3, str(_weights_path(s.draft.ref, env)))
            models.append(s.draft.ref)
        else:
            head = _train_stage(s, o, env, build_dir, stages)
            draft = DraftSpec(EAGLE3, str(head))
            deps.append(stages[-1].name)

    engine = build_dir / ENGINE_FOLDER
    stages.append(_keyed(_compile_stage(s, target_ckpt, draft, engine, tuple(deps), tuple(models)), stages))
    aopts, note = _assemble_options(s, engine, repo)
    cmd = ("pipeline", "assemble", "--engine", str(engine), "--repo", str(repo), "--gate-batch-size",
           str(s.gate_batch_size), *(("--device", s.device) if s.runs_on.places_device else ()), "--force")
    stages.append(_keyed(Stage("assemble", "assemble", aopts, cmd, repo, ("compile",), note=note), stages))
    return stages, skipped


def _quantize_stage(s: Settings, o: BuildOptions, env: Environment, build_dir: Path, role: str, ref: str,
                    qformat: str) -> Stage:
    from pipeline.quantize.quantizer import QuantizeOptions

    # An FP8 KV cache goes only into an FP8 checkpoint: trtllm-build refuses it beside INT4-AWQ weights
    # (pipeline.trtllm.reference.FP8_KV_QUANT_ALGOS), so an INT4-AWQ draft keeps a bf16 KV cache.
    kv = "fp8" if s.export == "trtllm" and s.kv_cache_dtype == "fp8" and qformat == "fp8" else "none"
    suffix = f"-trtllm-tp{s.tp_size}" if s.export == "trtllm" else ""
    out = build_dir / f"{role}-{qformat}{suffix}"
    local = env.weights_of(ref).path
    opts = QuantizeOptions(model=str(local) if local is not None and local.suffix != ".gguf" else ref,
                           output=out, qformat=qformat, kv_cache_dtype=kv, calib_size=o.calib_size, export=s.export,
                           tp_size=s.tp_size if s.export == "trtllm" else 1, force=True)
    cmd = ("pipeline", "quantize", "--model", opts.model, "--qformat", qformat, "--kv-cache-dtype", kv,
           "--calib-size", str(o.calib_size), "--export", s.export, "--tp-size", str(opts.tp_size), "-o", str(out),
           "--force")
    return Stage(f"quantize_{role}", "quantize", opts, cmd, out, models=(ref,))


def _compile_stage(s: Settings, target_ckpt: Path, draft: DraftSpec, engine: Path, deps: tuple[str, ...],
                   models: tuple[str, ...]) -> Stage:
    from pipeline.compiler.options import CompileOptions

    trt = s.runs_on.trtllm_release
    # On the portable engine the Triton speculation_gate model decides load and short outputs for every
    # request, and the served engine leaves them to it (pipeline/triton/models/torch_engine.py). So the engine
    # folder keeps compile's default gate (used only by `pipeline generate --model engines/...`) and the gate
    # lives in the assemble stage alone: changing --gate-batch-size rebuilds only the repository.
    gate = s.gate_batch_size if trt else CompileOptions.gate_batch_size
    # The device is in the key: a cost model measured on a CPU prices nothing on a GPU.
    copts = CompileOptions(
        backend=s.backend, target=target_ckpt, output=engine, draft=draft, num_draft_tokens=s.num_draft_tokens,
        max_batch_size=s.max_batch_size, max_input_len=s.max_input_len, max_seq_len=s.max_seq_len,
        gate_batch_size=gate, kv_cache_dtype="fp8" if s.kv_cache_dtype == "fp8" else "auto",
        tp_size=s.tp_size if trt and s.export == "hf" else None, dtype="auto" if trt else s.engine_dtype,
        gpu=s.gpu if trt else None, trtllm_version=s.trtllm_version if trt else None, device=s.device, force=True)
    cmd = ["pipeline", "compile", "-b", s.backend, "-t", str(target_ckpt), "-d", draft,
           "-k", str(s.num_draft_tokens), "--max-batch-size", str(s.max_batch_size)]
    cmd += ["--max-input-len", str(s.max_input_len)] if s.max_input_len else []
    cmd += ["--max-seq-len", str(s.max_seq_len)] if s.max_seq_len else []
    cmd += ["--gate-batch-size", str(gate)] if trt else []
    cmd += ["--kv-cache-dtype", copts.kv_cache_dtype, "--dtype", copts.dtype]
    cmd += ["--tp-size", str(copts.tp_size)] if copts.tp_size else []
    cmd += ["--device", s.device] if not trt else []
    cmd += ["--gpu", s.gpu] if trt and s.gpu else []
    cmd += ["--trtllm-version", s.trtllm_version] if trt and s.trtllm_version else []
    cmd += ["-o", str(engine), "--force"]
    return Stage("compile", "compile", copts, tuple(cmd), engine, deps, models)


def _train_stage(s: Settings, o: BuildOptions, env: Environment, build_dir: Path, stages: list[Stage]) -> Path:
    """An EAGLE-3 head for the target, trained with ModelOpt on its own answers (`pipeline draft train`)."""
    from pipeline.draft.train import TrainOptions

    head = build_dir / "draft-eagle3"
    local = env.weights_of(s.target).path
    target = str(local) if local is not None and local.suffix != ".gguf" else s.target
    # The build's own bar shows the stage's ETA; the trainer's tqdm bars would interleave with it.
    opts = TrainOptions(target=target, output=head, budget_minutes=o.draft_budget_minutes, force=True,
                        progress=False, budget_flag="--draft-budget-minutes")
    cmd = ("pipeline", "draft", "train", "--target", target, "--method", "eagle3", "--budget-minutes",
           f"{o.draft_budget_minutes:g}", "-o", str(head), "--force")
    stages.append(_keyed(Stage("train_draft", "train", opts, cmd, head, models=(s.target,)), stages))
    return head


def _assemble_options(s: Settings, engine: Path, repo: Path):
    from pipeline.triton.assemble import AssembleOptions

    return AssembleOptions(engine=engine, repo=repo, backend=s.backend, gate_batch_size=s.gate_batch_size,
                           device=s.device, force=True), ""


def _keyed(stage: Stage, earlier: list[Stage]) -> Stage:
    """The stage with its config key: its options (less force) and the keys of the stages it reads."""
    keys = {s.name: s.config_key for s in earlier}
    config = plain(dataclasses.asdict(stage.options)) if stage.options is not None else {"note": stage.note}
    config.pop("force", None)
    config.pop("dry_run", None)
    if stage.name == "assemble":  # the repository's tensors and models are this version's, not only its options
        from pipeline.triton.assemble import sources_digest
        from pipeline.triton.interface import layout_digest

        config["layout"] = layout_digest()
        config["sources"] = sources_digest()
    blob = json.dumps({"stage": stage.name, "config": config, "deps": [keys[d] for d in stage.deps]}, sort_keys=True)
    return dataclasses.replace(stage, config_key=hashlib.sha256(blob.encode()).hexdigest()[:16])


# ---- what the machine lacks -------------------------------------------------------------------------------------


def _missing(s: Settings, env: Environment) -> tuple[str, ...]:
    from pipeline.trtllm.version import for_version

    out = []
    if s.runs_on.trtllm_release:
        if env.gpu is None:
            out.append("an NVIDIA GPU (TensorRT-LLM builds and runs on one; use a GPU machine)")
        if not env.trtllm:
            container = for_version(s.trtllm_version).container
            out.append(f"TensorRT-LLM (run the build inside NVIDIA's container {container})" if container else
                       f"TensorRT-LLM {s.trtllm_version} (a pre-release no NVIDIA Triton container ships: build "
                       f"the image with it, or use --trtllm-version {for_version(None).version})")
    flags = {s.target: "--target DIR"}
    if s.draft.ref:
        flags[s.draft.ref] = "--draft eagle3:DIR" if s.draft.kind == EAGLE3 else "--draft DIR"
    for ref, flag in flags.items():
        w = env.weights_of(ref)
        if not w.present:
            out.append(f"the {ref} weights ({w.how_to_get.replace('pass DIR', 'pass ' + flag)})")
    return tuple(out)


# ---- helpers ----------------------------------------------------------------------------------------------------


def _weights_path(ref: str, env: Environment) -> Path:
    w = env.weights_of(ref)
    return w.path if w.path is not None else Path(f"<{ref} weights>")
