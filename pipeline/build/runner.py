"""`run_build(options)`: the executor behind `pipeline build`. Plans (pure), then runs or reuses each stage.

Order: detect the machine; plan; stop with one line if the machine lacks a GPU, TensorRT-LLM or weights;
refuse output folders this build doesn't own; resolve the models (the embedded GGUF converts once) and plan
again with their folders; hash the model files (cached in build.json); then for each stage either reuse it
(same input key, output complete and its files as recorded when built) or run its library call, whose output
is staged and renamed into place. build.json is rewritten after every stage, so an interrupted build resumes
at the stage it was in. --force rebuilds every stage and re-hashes every source, cached conversions included.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pipeline import checksums
from pipeline.build import manifest as mf
from pipeline.build.options import BuildOptions, Environment, Weights, detect_environment
from pipeline.build.plan import BuildPlan, Stage, plan_build
from pipeline.build.progress import StageProgress, progress_enabled
from pipeline.errors import ConfigError, MissingDependencyError
from pipeline.models.gguf import quiet_conversion

PLACEHOLDER = "README.md"
# What a finished output holds: a folder without it is not reused.
COMPLETE_MARKER = {"quantize": "report.json", "train": "train_report.json", "compile": "compile.json",
                   "assemble": "ensemble/config.pbtxt"}
# First-run ETA guesses (seconds) when build.json has no earlier duration: SmolLM2 fp8 on 2 CPU cores.
FIRST_ESTIMATE_S = {"quantize": 135.0, "train": 600.0, "compile": 5.0, "assemble": 2.0}


@dataclass
class StageResult:
    name: str
    kind: str
    status: str  # built | reused | not run
    output: str
    duration_s: float  # this run's time; for a reused stage, the time it took when built
    key: str
    bytes: int = 0
    note: str = ""


@dataclass
class BuildResult:
    name: str
    backend: str
    draft: str
    build_dir: str
    manifest: str
    engine: str
    repo: str
    stages: list[StageResult] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # cached sources found damaged and made again
    dtype_line: str = ""  # the portable engine's dtype and why (empty on TensorRT-LLM)
    device_line: str = ""  # the portable engine's device and why (empty on TensorRT-LLM)
    prepare_s: float = 0.0  # resolving (maybe converting) and hashing the models
    total_s: float = 0.0

    @property
    def next_command(self) -> str:
        if any(s.name == "assemble" and s.status in ("built", "reused") for s in self.stages):
            return f"pipeline serve --repo {_short(self.repo)}"
        # No repository yet (TensorRT-LLM without an assemble backend): serve what compile wrote.
        script = next((f for f in ("serve.sh", "build.sh") if (Path(self.engine) / f).is_file()), "compile.json")
        return f"bash {_short(str(Path(self.engine) / script))}" if script != "compile.json" else \
            f"see {_short(str(Path(self.engine) / script))} for the commands"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["skipped"] = [{"stage": s, "reason": r} for s, r in self.skipped]
        d["next_command"] = self.next_command
        return d


def run_build(options: BuildOptions, env: Environment | None = None, *, quiet: bool = True,
              stream: TextIO | None = None) -> BuildResult:
    t_start = time.perf_counter()
    env = env if env is not None else detect_environment(options)
    plan = plan_build(options, env)
    if plan.settings.runs_on.places_device and env.device is None:  # before anything converts: the stages take it
        env = dataclasses.replace(env, device=options.device.choose()[0])
        plan = plan_build(options, env)
    if plan.missing:
        raise MissingDependencyError(plan.missing_line())
    previous = mf.read_manifest(plan.manifest_file)
    _check_ownership(plan, previous, options.force)

    show = progress_enabled(quiet, stream)

    def say(line: str) -> None:  # why the build is redoing something, as it decides to
        if not quiet:
            print(line, file=stream or sys.stderr, flush=True)

    manifest = previous or mf.new_manifest(plan.name)
    if options.force:  # re-hash every source file, not only those whose size or mtime moved
        manifest["file_hashes"] = {}
    t0 = time.perf_counter()
    # The embedded GGUF converts once (20-60 s); hashing reads every model byte the first time only.
    first = not manifest.get("models")
    with StageProgress("prepare models", 45.0 if first or options.force else 1.0, show, stream), quiet_conversion():
        plan, env, notes = _with_resolved_models(options, plan, env)
        model_hashes = _hash_models(plan, env, manifest)
    for note in notes:
        say(note)
    prepare_s = round(time.perf_counter() - t0, 3)
    manifest.update(inputs=plan.to_dict()["options"], settings=plan.to_dict()["settings"],
                    environment={"gpu": env.gpu.key if env.gpu else None, "tensorrt_llm": env.trtllm},
                    tools=mf.tool_versions(),
                    memory_plan=plan.memory_plan.to_dict() if plan.memory_plan is not None else None,
                    plan=[s.to_dict() for s in plan.stages])
    mf.write_manifest(plan.manifest_file, manifest)

    result = BuildResult(plan.name, plan.settings.backend, plan.settings.draft_label, str(plan.build_dir),
                         str(plan.manifest_file), str(plan.engine_dir), str(plan.repo), skipped=list(plan.skipped),
                         notes=notes, prepare_s=prepare_s, device_line=plan.settings.reasons.get("device", ""),
                         dtype_line=(f"{plan.settings.engine_dtype}: {plan.settings.reasons['engine_dtype']}"
                                     if plan.settings.runs_on.places_device else ""))
    keys: dict[str, str] = {}
    for stage in plan.stages:
        key = mf.input_key(stage.config_key, [keys[d] for d in stage.deps],
                           [model_hashes[ref] for ref in stage.models])
        keys[stage.name] = key
        result.stages.append(_run_or_reuse(stage, key, manifest, plan.manifest_file, options.force, say,
                                           lambda name, expected: StageProgress(name, expected, show, stream)))
    result.total_s = round(time.perf_counter() - t_start, 3)
    manifest["last_run"] = {"total_s": result.total_s, "statuses": {s.name: s.status for s in result.stages}}
    mf.write_manifest(plan.manifest_file, manifest)
    return result


def _run_or_reuse(stage: Stage, key: str, manifest: dict, manifest_file: Path, force: bool, say,
                  progress) -> StageResult:
    """Reuse the stage's output when its input key matches and its files are as recorded; else run it and record
    it in the manifest, written at once so the next run resumes after this stage. progress(name, expected_s):
    the bar to run it under."""
    record = manifest["stages"].get(stage.name) or {}
    if not stage.runnable:
        manifest["stages"][stage.name] = {"key": key, "status": "not run", "note": stage.note}
        return StageResult(stage.name, stage.kind, "not run", str(stage.output), 0.0, key, note=stage.note)
    note = ""
    if not force and record.get("key") == key and _complete(stage):
        changed = _changed_output(stage, record)
        if changed is None:
            record.update(reused=True, last_reused=mf._now())
            return StageResult(stage.name, stage.kind, "reused", str(stage.output), record.get("duration_s", 0.0),
                               key, record.get("bytes", 0))
        say(f"{stage.name}: {changed}; rebuilding")
        note = f"rebuilt: {changed}"
    t0 = time.perf_counter()
    with progress(stage.name, record.get("duration_s") or FIRST_ESTIMATE_S[stage.kind]):
        run_stage(stage)
    duration = round(time.perf_counter() - t0, 3)
    # What a later run checks before reusing this output: it reads the bytes once, here.
    files = checksums.record_files(stage.output)
    size = sum(f["size"] for f in files.values())
    manifest["stages"][stage.name] = {
        "key": key, "config_key": stage.config_key, "status": "built", "reused": False, "built": mf._now(),
        "duration_s": duration, "output": str(stage.output), "bytes": size,
        "outputs": sorted(p.name + ("/" if p.is_dir() else "") for p in stage.output.iterdir()),
        "files": files, "command": " ".join(stage.command)}
    mf.write_manifest(manifest_file, manifest)
    return StageResult(stage.name, stage.kind, "built", str(stage.output), duration, key, size, note)


def run_stage(stage: Stage) -> None:
    """The stage's one library call; each writes its output staged and renamed into place."""
    if stage.kind == "quantize":
        from pipeline.quantize.quantizer import quantize

        quantize(stage.options)
    elif stage.kind == "train":
        from pipeline.draft.train import train_draft

        train_draft(stage.options)
    elif stage.kind == "compile":
        from pipeline.compiler.compiler import compile_model

        compile_model(stage.options)
    else:
        from pipeline.triton.assemble import assemble

        # A fresh clone's triton_repo/ holds only a tracked README (Triton ignores top-level files): the
        # staged repository replaces the folder, so put the README back rather than leave git a deletion.
        readme = stage.output / PLACEHOLDER
        kept = readme.read_bytes() if readme.is_file() else None
        assemble(stage.options)
        if kept is not None:
            readme.write_bytes(kept)


def _complete(stage: Stage) -> bool:
    return (stage.output / COMPLETE_MARKER[stage.kind]).is_file()


def _changed_output(stage: Stage, record: dict) -> str | None:
    """Why the stage's output is not what it built ("target/model.safetensors changed since it was built"),
    or None. Sizes are compared always, hashes only where an mtime moved (and the new mtime is then kept)."""
    files = record.get("files")
    if files is None:  # built by a pipeline that recorded no files: nothing shows it is intact
        return "its files were not recorded when it was built"
    changed = checksums.first_change(stage.output, files)
    return f"{changed} changed since it was built" if changed else None


def _check_ownership(plan: BuildPlan, previous: dict | None, force: bool) -> None:
    """Replace only what this build wrote before: never a folder the user made, unless --force."""
    if force:
        return
    if previous is None and plan.build_dir.is_dir() and any(plan.build_dir.iterdir()):
        raise ConfigError(f"{plan.build_dir} exists and has no {plan.manifest_file.name} (not a build folder); "
                          f"pass --force to replace what is in it, or pick another --engines-dir")
    built_repo = ((previous or {}).get("stages", {}).get("assemble") or {}).get("output")
    if _has_content(plan.repo) and built_repo != str(plan.repo):
        raise ConfigError(f"--repo {plan.repo} exists and was not written by this build; pass --force to replace "
                          f"it, or pick another --repo")


def _has_content(folder: Path) -> bool:
    """Anything but the placeholder README a fresh clone carries in triton_repo/ (a file is content too)."""
    if not folder.is_dir():
        return folder.exists()
    return any(p.name != PLACEHOLDER for p in folder.iterdir())


def _with_resolved_models(options: BuildOptions, plan: BuildPlan,
                          env: Environment) -> tuple[BuildPlan, Environment, list[str]]:
    """Resolve target and draft model to local folders (converting a GGUF once) and plan again with them; and
    a note for each cached model found damaged and made again (--force hashes them all)."""
    from pipeline.models.resolve import resolve_model

    s = plan.settings
    weights = dict(env.weights)
    refs = [s.target] + ([s.draft.ref] if s.draft.kind == "model" else [])
    notes = []
    for ref in refs:
        resolved = resolve_model(ref, verify=options.force)
        weights[ref] = Weights(ref, resolved.path)
        notes += [resolved.note] if resolved.note else []
    env = dataclasses.replace(env, weights=weights)
    return plan_build(options, env), env, notes


def _hash_models(plan: BuildPlan, env: Environment, manifest: dict) -> dict[str, dict]:
    """{ref: {path, files: {name: size, sha256}}} for every model a stage reads; also recorded in build.json."""
    cache = manifest.setdefault("file_hashes", {})
    out = {}
    for ref in dict.fromkeys(ref for stage in plan.stages for ref in stage.models):
        path = env.weights_of(ref).path
        out[ref] = {"ref": ref, "path": str(path), "files": mf.hash_files(mf.model_files(path), cache)}
    manifest["models"] = out
    return out


def _short(path: str) -> str:
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
