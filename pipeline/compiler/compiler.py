"""`compile_model(options)`: the one function behind `pipeline compile`.

Order: check everything cheap (options, output folder, checkpoints, draft/target agreement, sizes, the
GPU plan) before anything is written; generate the commands and configs (pure: trtllm_build.py,
llmapi.py, engine_folder.py); then write into a staging folder renamed into place at the end, so the
output is never half-written. Only the engine route runs anything (trtllm-build), and only where
TensorRT-LLM is installed: NVIDIA's container.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.compiler import engine_folder, llmapi
from pipeline.compiler.checkpoint import Checkpoint, read_checkpoint
from pipeline.compiler.trtllm_build import (BuildSizes, build_command, derive_sizes, feature_notes, guide_info_command,
                                            run_command)
from pipeline.compiler.validate import check_draft_len, check_draft_matches, check_plan
from pipeline.draft_spec import DraftSpec, parse_draft
from pipeline.engine.folder import ENGINE_FILE, write_engine_manifest
from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ConfigError, MissingDependencyError
from pipeline.routes import Route, backend_named, pick_route
from pipeline.trtllm import version as trtllm_version
from pipeline.trtllm.reference import GUIDE_INFO_FILE, TRTLLM_CONTAINER

MANIFEST_FILE = "compile.json"
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_ENGINES_DIR = Path("engines")


@dataclass(frozen=True)
class CompileOptions:
    backend: str  # trtllm | torch
    target: Path  # a checkpoint folder from `pipeline quantize`
    output: Path  # the engine folder to write
    draft: str = "none"  # none | ngram | DIR | eagle3:DIR
    route: str = "auto"  # trtllm only: auto | engine (trtllm-build) | llmapi (PyTorch backend)
    num_draft_tokens: int = 4  # K: max draft length
    max_batch_size: int = 64
    max_input_len: int | None = None  # default: max_seq_len // 2
    max_seq_len: int | None = None  # default: min(4096, the target's max_position_embeddings)
    max_num_tokens: int | None = None  # default: max_batch_size * (K+1) + one context chunk
    gate_batch_size: int | None = 32  # speculate only at or below this batch size; None: always
    kv_cache_dtype: str = "auto"  # auto (the checkpoint's) | fp8
    free_gpu_memory_fraction: float = 0.9
    tp_size: int | None = None  # llmapi route; the engine route reads the checkpoint's mapping
    pp_size: int | None = None
    dtype: str = "auto"  # torch backend compute dtype: auto (the checkpoint's) | fp32 | bf16 | fp16
    # torch backend: the target's KV pool in bytes (None: max_batch_size x max_seq_len tokens), prompt tokens
    # prefilled per step (chunked prefill), and reuse of cached prefix blocks (EngineConfig's fields)
    kv_cache_bytes: int | None = None
    prefill_chunk: int = 256
    prefix_caching: bool = True
    ngram_first: bool = True  # torch backend, EAGLE-3 heads: n-gram lookup drafts where it matches (EngineConfig)
    gpu: str | None = None  # check the sizes against `pipeline plan` for this GPU
    # torch backend: where compile loads the engine to calibrate (auto|cpu|cuda|cuda:N; pipeline.engine.device)
    device: DeviceChoice = DeviceField()
    # torch backend with a draft: measure the cost model the draft planner reads (engine/calibrate.py)
    calibrate: bool = True
    # trtllm: the TensorRT-LLM release to write for (pipeline.trtllm.version.RELEASES); None: the installed one in
    # NVIDIA's container, else the newest stable release
    trtllm_version: str | None = None
    dry_run: bool = False
    force: bool = False


@dataclass
class CompileResult:
    backend: str
    route: str
    output: str
    dry_run: bool
    commands: dict[str, list[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # choices worth knowing (the gate, its cost)
    device: str | None = None  # torch backend: where the engine loads to calibrate; None on TensorRT-LLM
    device_line: str = ""  # what was picked and why (pipeline.engine.device.choose_device)

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        what = "dry run: nothing built" if self.dry_run else "compiled"
        lines = [f"{what}; {self.backend}/{self.route} -> {self.output}"]
        lines += [self.device_line] if self.device_line else []
        lines += [f"  wrote {f}" for f in self.files]
        lines += [f"note: {n}" for n in self.notes]
        for name, cmd in self.commands.items():
            lines += [f"# {name}", shlex.join(cmd)]
        return "\n".join(lines)


def trtllm_available() -> bool:
    return shutil.which("trtllm-build") is not None or importlib.util.find_spec("tensorrt_llm") is not None


@dataclass(frozen=True)
class Resolved:
    """What compile decides from the options and the checkpoints' config files, before anything is written."""

    route: Route
    sizes: BuildSizes
    kv_cache_dtype: str
    tp: int
    pp: int
    tensorrt_llm_version: str


def resolve(options: CompileOptions, target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None) -> Resolved:
    """Route, sizes, KV dtype, parallelism and TensorRT-LLM version; raises a one-line error on a bad combination.
    Reads nothing but the installed TensorRT-LLM's version: `pipeline build --dry-run` calls it with checkpoints
    described from a preset's architecture, before they exist."""
    route = pick_route(options.backend, options.route, target, draft)
    if draft_ckpt is not None and draft.kind == "model" and draft_ckpt.layout != target.layout:
        raise ConfigError(f"the draft is a {draft_ckpt.layout} checkpoint but the target a {target.layout} one; "
                          f"export both with the same `pipeline quantize --export`")
    check_draft_len(draft, options.num_draft_tokens)
    k = options.num_draft_tokens if draft.speculates else 0
    sizes = derive_sizes(options.max_batch_size, k, target.max_position_embeddings, options.max_seq_len,
                         options.max_input_len, options.max_num_tokens)
    kv_dtype = _kv_cache_dtype(options.kv_cache_dtype, target, route)
    if route.backend.kv_fp8 and draft_ckpt is not None and draft.kind == "model":
        # An engine's KV dtype comes from its own checkpoint; the LLM API's kv_cache_config covers both models.
        _kv_cache_dtype("auto" if route.kv_from_checkpoint else options.kv_cache_dtype, draft_ckpt, route,
                        role="draft")
    tp, pp = _parallel(options, target, route)
    version = _tensorrt_llm_version(route, options.trtllm_version)
    if route.builds_engines and not trtllm_version.for_version(version).engine_route:
        raise ConfigError(f"TensorRT-LLM {version} has no TensorRT engine route (trtllm-build and the tensorrtllm "
                          f"backend were removed after 1.3.0rc20, NVIDIA/TensorRT-LLM PRs #15907 and #15918); use "
                          f"--route llmapi with a Hugging Face checkpoint, or --trtllm-version "
                          f"{trtllm_version.TRTLLM_VERSION}")
    return Resolved(route, sizes, kv_dtype, tp, pp, version)


@dataclass
class RouteFiles:
    """A TensorRT-LLM route's product, as text: the commands, the files compile writes, the configs."""

    commands: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name in the output folder -> its text
    configs: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def route_files(options: CompileOptions, output: Path, target: Checkpoint, draft: DraftSpec,
                draft_ckpt: Checkpoint | None, r: Resolved, target_shape=None) -> RouteFiles:
    """The engine route's trtllm-build commands and build.sh, or the LLM-API route's YAML and serve line. Pure, but
    for asking nvidia-smi which GPU this is when a one-model EAGLE-3 schedule needs one and --gpu names none.
    target_shape (a ModelShape): sizes the cost model behind that schedule."""
    out = RouteFiles()
    release = trtllm_version.for_version(r.tensorrt_llm_version)
    where = release.container or "an image you build with it: no Triton container ships it"
    header = f"#!/usr/bin/env bash\n# TensorRT-LLM {r.tensorrt_llm_version} ({where})\n"
    if r.route.builds_engines:
        out.commands["build_target"] = build_command(target, output / "target", r.sizes, role="target")
        if draft_ckpt is not None:
            out.commands["build_draft"] = build_command(draft_ckpt, output / "draft", r.sizes, role="draft")
        # Guided decoding's vocabulary, beside the engines (assemble points the target's config at it).
        out.commands["build_guide_info"] = guide_info_command(target.path, output)
        out.commands["smoke_test"] = run_command(output / "target", output / "draft" if draft_ckpt else None,
                                                 target.path, r.sizes, options.free_gpu_memory_fraction,
                                                 target.world_size)
        builds = [cmd for name, cmd in out.commands.items() if name.startswith("build_")]
        out.files["build.sh"] = header + "set -euo pipefail\n" + "\n".join(shlex.join(c) for c in builds) + "\n"
        out.notes += feature_notes(draft_ckpt is not None)  # chunked context / KV reuse upstream refuses, if any
        return out
    schedule = None
    if (draft.kind == "eagle3" and options.gate_batch_size is not None
            and llmapi.one_model_gates(r.tensorrt_llm_version)):
        schedule = eagle3_schedule(options, target, target_shape, r)
        out.notes.append(schedule.note(options.gate_batch_size) if schedule else
                         f"no GPU named (--gpu) for the cost model: max_concurrency {options.gate_batch_size}, which "
                         f"TensorRT-LLM turns into draft_len_schedule {{{options.gate_batch_size}: "
                         f"{r.sizes.max_draft_len}}}")
    settings = llmapi.LlmApiSettings(options.gate_batch_size, r.kv_cache_dtype, options.free_gpu_memory_fraction,
                                     r.tp, r.pp, r.tensorrt_llm_version,
                                     schedule.lengths if schedule is not None else None)
    out.notes += [n for n in (llmapi.gate_note(draft, options.gate_batch_size, r.tensorrt_llm_version),) if n]
    out.notes += llmapi.feature_notes(draft, options.gate_batch_size, r.tensorrt_llm_version)
    config = llmapi.llm_api_options(draft, r.sizes, settings)
    out.files[llmapi.OPTIONS_FILE] = llmapi.to_yaml(config)
    serve = llmapi.serve_command(target.path, output / llmapi.OPTIONS_FILE, r.sizes, settings)
    out.commands["serve"] = serve
    if r.tp * r.pp > 1:
        out.commands["serve_multi_gpu"] = llmapi.launch_command(serve, r.tp * r.pp)
    out.files["serve.sh"] = header + f"exec {shlex.join(serve)}\n"
    out.configs[llmapi.OPTIONS_FILE] = config
    return out


def eagle3_schedule(options: CompileOptions, target: Checkpoint, shape, r: Resolved):
    """One-model EAGLE-3's draft_len_schedule from the roofline of the GPU the plan names (--gpu, else the one
    nvidia-smi reports); None without one. Pure but for nvidia-smi."""
    from pipeline.compiler.draft_schedule import draft_len_schedule, roofline
    from pipeline.compiler.validate import qformat_of
    from pipeline.plan.gpus import detect_gpu, get_gpu
    from pipeline.plan.memory import PlanDraft, PlanInputs, plan_memory

    gpu = get_gpu(options.gpu) if options.gpu is not None else detect_gpu()
    if gpu is None or shape is None:
        return None
    qformat = qformat_of(target)
    plan = plan_memory(PlanInputs(target.path.name, shape, gpu, tp=r.tp, target_qformat=qformat,
                                  draft=PlanDraft("eagle3", "eagle3")))
    tflops = gpu.fp8_tflops if qformat == "fp8" and gpu.fp8 else gpu.bf16_tflops
    cost = roofline(plan.target_weights_per_gpu + plan.draft_weights_per_gpu, shape.param_count, r.tp,
                    gpu.bandwidth_tb_s, tflops, r.sizes.max_draft_len)
    return draft_len_schedule(cost, r.sizes.max_draft_len, options.gate_batch_size)


def compile_model(options: CompileOptions) -> CompileResult:
    from pipeline.staging import check_output, staged_output

    _check_options(options)
    device, device_line = _device(options)
    output = Path(options.output).expanduser().absolute()
    check_output(output, options.force, ConfigError, "-o")
    target = read_checkpoint(options.target)
    draft = parse_draft(options.draft)
    if draft.kind == "eagle3" and not draft.ref:
        raise ConfigError("compile needs the head's folder: --draft eagle3:DIR (`pipeline build --draft eagle3` "
                          "finds the published head, or trains one)")
    draft_ckpt = read_checkpoint(draft.path) if draft.path is not None else None
    r = resolve(options, target, draft, draft_ckpt)
    check_draft_matches(target, draft, draft_ckpt)
    plan = check_plan(target, draft, draft_ckpt, options.gpu, r.sizes.max_batch_size, r.sizes.max_seq_len,
                      r.kv_cache_dtype, force=options.force, tp=r.tp, route=r.route)
    if r.route.builds_engines and not options.dry_run and not trtllm_available():
        raise MissingDependencyError(
            f"trtllm-build is not installed here (TensorRT-LLM needs NVIDIA's own build); run this in "
            f"NVIDIA's TensorRT-LLM container {TRTLLM_CONTAINER}, or add --dry-run to write the commands only")

    result = CompileResult(options.backend, r.route.name, str(output), options.dry_run, device=device,
                           device_line=device_line)
    manifest = {
        "tensorrt_llm_version": r.tensorrt_llm_version,
        "container": trtllm_version.for_version(r.tensorrt_llm_version).container,
        "backend": options.backend, "route": r.route.name, "dry_run": options.dry_run,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": _describe(target), "draft": {"kind": draft.kind, **(_describe(draft_ckpt) if draft_ckpt else {})},
        "sizes": asdict(r.sizes), "gate_batch_size": options.gate_batch_size, "kv_cache_dtype": r.kv_cache_dtype,
        "tp_size": r.tp, "pp_size": r.pp, "plan": plan,
    }
    if device is not None:
        manifest["device"] = device
    with staged_output(output, options.force, ConfigError, "-o") as stage:
        if r.route.portable:
            _torch_route(stage, target, draft, draft_ckpt, r.sizes, options, result, manifest)
        else:
            from pipeline.compiler.validate import model_shape

            # Read only where a one-model EAGLE-3 schedule needs it (an HF checkpoint, the LLM-API route).
            shape = model_shape(target) if draft.kind == "eagle3" and target.layout == "hf" else None
            generated = route_files(options, output, target, draft, draft_ckpt, r, shape)
            for name, text in generated.files.items():
                (stage / name).write_text(text)
            result.commands, result.files, result.notes = generated.commands, list(generated.files), generated.notes
            if generated.configs:
                manifest["configs"] = generated.configs
            if r.route.builds_engines and not options.dry_run:
                _run_builds(stage, result)
        manifest["commands"] = {name: shlex.join(cmd) for name, cmd in result.commands.items()}
        result.manifest = manifest
        (stage / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        result.files.append(MANIFEST_FILE)
    return result


def _run_builds(stage: Path, result: CompileResult) -> None:
    """trtllm-build, into the staging folder: the same argv with the --output_dir moved there."""
    output = Path(result.output)
    for name, cmd in result.commands.items():
        if not name.startswith("build_"):
            continue
        staged = list(cmd)
        i = staged.index("--output_dir") + 1
        where = Path(staged[i])  # output/target, output/draft, or output itself (the guide's vocabulary)
        staged[i] = str(stage if where == output else stage / where.name)
        done = subprocess.run(staged)  # its log streams to the terminal
        if done.returncode != 0:
            program = Path(cmd[1]).name if cmd[0] == "python3" else cmd[0]
            raise ConfigError(f"{program} exited {done.returncode} ({name}); its log is above, and `pipeline "
                              f"compile --dry-run` writes the commands to rerun by hand")
        result.files.append(GUIDE_INFO_FILE if where == output else where.name + "/")


def _torch_route(stage: Path, target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None,
                 sizes: BuildSizes, options: CompileOptions, result: CompileResult, manifest: dict) -> None:
    engine = engine_folder.engine_manifest(
        target, draft, draft_ckpt, max_batch_size=sizes.max_batch_size, max_seq_len=sizes.max_seq_len,
        num_draft_tokens=sizes.max_draft_len, dtype=engine_folder.runtime_dtype(target, options.dtype),
        gate_batch_size=options.gate_batch_size, kv_cache_bytes=options.kv_cache_bytes,
        prefill_chunk=options.prefill_chunk, prefix_caching=options.prefix_caching,
        gpu_memory_fraction=options.free_gpu_memory_fraction, ngram_first=options.ngram_first)
    if options.dry_run:
        write_engine_manifest(stage, engine)
    else:
        engine_folder.write_engine_dir(stage, engine, target, draft_ckpt)
        result.files += ["target/"] + (["draft/"] if draft_ckpt is not None else [])
        if options.calibrate and draft.speculates:
            _calibrate(stage, result, manifest, result.device or "cpu")
    result.files.insert(0, ENGINE_FILE)
    result.commands["load"] = ["python", "-c", f'from pipeline.engine import load_engine; '
                                               f'engine = load_engine("{result.output}")']
    manifest["configs"] = {ENGINE_FILE: engine}


def _calibrate(stage: Path, result: CompileResult, manifest: dict, device: str) -> None:
    """Measure the staged engine's cost model on this machine's device and store it with the engine."""
    from pipeline.engine.calibrate import calibrate
    from pipeline.engine.folder import load_engine
    from pipeline.policy.cost_model import FILENAME

    cal = calibrate(load_engine(stage, device=device))
    cal.cost.save(stage)
    result.files.append(FILENAME)
    result.notes.append(f"cost model measured in {cal.seconds:.0f} s ({cal.cost.source})"
                        + (f"; {cal.note}" if cal.note else ""))
    manifest["cost_model"] = {"seconds": round(cal.seconds, 1), "source": cal.cost.source, "note": cal.note}


def _device(o: CompileOptions) -> tuple[str | None, str]:
    """(device, its line) where the portable engine loads to calibrate: checked against this machine, but for a dry
    run (nothing loads; the spelling only). TensorRT-LLM places its engines by its own mapping: (None, "")."""
    backend = backend_named(o.backend)
    if not backend.places_device:
        backend.check_device(o.device, f"--backend {backend.name}")
        return None, ""
    return (o.device, "") if o.dry_run else o.device.choose()


def _check_options(o: CompileOptions) -> None:
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown --kv-cache-dtype {o.kv_cache_dtype!r}; pick one of {', '.join(KV_CACHE_DTYPES)}")
    if not 0 < o.free_gpu_memory_fraction <= 1:
        raise ConfigError(f"--free-gpu-memory-fraction must be in (0, 1] (got {o.free_gpu_memory_fraction})")
    if o.kv_cache_bytes is not None and o.kv_cache_bytes < 1:
        raise ConfigError(f"--kv-cache-bytes must be positive (got {o.kv_cache_bytes}); leave it out for room for "
                          f"--max-batch-size requests of --max-seq-len tokens")
    if o.prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be at least 1 token (got {o.prefill_chunk})")
    if o.gate_batch_size is not None and o.gate_batch_size < 1:
        raise ConfigError(f"--gate-batch-size must be at least 1 (got {o.gate_batch_size}); "
                          f"use --draft none to turn speculation off")
    for flag, value in (("--tp-size", o.tp_size), ("--pp-size", o.pp_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if not backend_named(o.backend).trtllm_release and o.trtllm_version is not None:
        raise ConfigError("--trtllm-version is for --backend trtllm; drop it for the portable engine")
    if o.dtype not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"unknown --dtype {o.dtype!r}; pick one of auto, fp32, bf16, fp16")


def _kv_cache_dtype(requested: str, ckpt: Checkpoint, route: Route, role: str = "target") -> str:
    """The KV cache dtype for one checkpoint; on the engine route an FP8 KV cache needs an FP8 checkpoint."""
    from pipeline.trtllm.reference import FP8_KV_QUANT_ALGOS

    quantized = (ckpt.kv_cache_quant_algo or "").upper() == "FP8"
    if route.kv_from_checkpoint and requested == "fp8" and not quantized:
        # trtllm-build takes the KV cache dtype from the checkpoint's quantization.kv_cache_quant_algo.
        raise ConfigError(f"the TensorRT-LLM {role} checkpoint {ckpt.path.name} has no FP8 KV cache; re-quantize with "
                          f"`pipeline quantize --kv-cache-dtype fp8 --export trtllm`, or drop --kv-cache-dtype fp8")
    if route.kv_from_checkpoint and quantized and (ckpt.quant_algo or "") not in FP8_KV_QUANT_ALGOS:
        # builder.py: FP8 paged context FMHA "only works with fp8 quantization workflow"; the draft-target
        # recipe needs --use_paged_context_fmha enable for KV reuse.
        raise ConfigError(f"the {role} checkpoint {ckpt.path.name} is {ckpt.quant_algo or 'unquantized'} with an FP8 KV "
                          f"cache, which trtllm-build refuses with paged context FMHA (\"FP8 Paged Context FMHA only "
                          f"works with fp8 quantization workflow\"); re-quantize it with --kv-cache-dtype none, or as fp8")
    if not route.int4_fp8_kv and requested == "fp8" and (ckpt.quant_algo or "").startswith("W4A16"):
        # The PyTorch flow fails the same way ("FMHA kernels are not found", NVIDIA/TensorRT-LLM#8862).
        raise ConfigError(f"the {role} checkpoint {ckpt.path.name} is {ckpt.quant_algo}, and TensorRT-LLM's PyTorch "
                          f"backend has no attention kernels for INT4-AWQ with an FP8 KV cache; drop --kv-cache-dtype "
                          f"fp8, or quantize the {role} as fp8")
    if not route.backend.kv_fp8 and requested == "fp8":
        raise ConfigError("the portable engine keeps its KV cache in the compute dtype; drop --kv-cache-dtype fp8")
    return "fp8" if requested == "fp8" or quantized else "auto"


def _tensorrt_llm_version(route: Route, requested: str | None) -> str:
    """The TensorRT-LLM the output is for: the installed one in NVIDIA's container (refused unless its names are
    the ones this pipeline writes, and unless --trtllm-version names another), else --trtllm-version, else the
    newest stable release."""
    if not route.probes_installed_trtllm:
        return trtllm_version.pick(requested, None, "pipeline compile")
    return trtllm_version.pick(requested, trtllm_version.installed(), "pipeline compile")


def _parallel(options: CompileOptions, target: Checkpoint, route: Route) -> tuple[int, int]:
    if route.parallel_from_checkpoint:
        for flag, given, have in (("--tp-size", options.tp_size, target.tp_size),
                                  ("--pp-size", options.pp_size, target.pp_size)):
            if given is not None and given != have:
                raise ConfigError(f"{flag} {given} disagrees with the checkpoint's mapping ({have}); the engine "
                                  f"route takes TP/PP from the checkpoint: re-export with "
                                  f"`pipeline quantize --export trtllm {flag} {given}`, or drop {flag}")
        return target.tp_size, target.pp_size
    if route.backend.one_device and ((options.tp_size or 1) > 1 or (options.pp_size or 1) > 1):
        raise ConfigError("the portable engine runs on one device; drop --tp-size/--pp-size")
    return options.tp_size or 1, options.pp_size or 1


def _describe(ckpt: Checkpoint) -> dict:
    return {"path": str(ckpt.path), "layout": ckpt.layout, "dtype": ckpt.dtype, "vocab_size": ckpt.vocab_size,
            "tp_size": ckpt.tp_size, "pp_size": ckpt.pp_size, "quant_algo": ckpt.quant_algo,
            "kv_cache_quant_algo": ckpt.kv_cache_quant_algo}
