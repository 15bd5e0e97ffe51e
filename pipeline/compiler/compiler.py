"""`compile_model(options)`: the one function behind `pipeline compile`.

First everything cheap is checked and decided (job.py: options, checkpoints, draft/target agreement, route,
sizes, the GPU plan) before anything is written; then the route's own steps write into a staging folder renamed
into place at the end (staging.py, which checks the output folder first), so the output is never half-written: engine_folder.py (the portable engine),
trtllm_build.py (TensorRT engines: runs trtllm-build, only where TensorRT-LLM is installed: NVIDIA's container) or
llmapi.py (TensorRT-LLM's LLM API: writes what trtllm-serve reads).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict

from pipeline.compiler import engine_folder, llmapi, trtllm_build
from pipeline.compiler.job import CompileJob, prepare
from pipeline.compiler.options import MANIFEST_FILE, CompileOptions, CompileResult, RouteFiles
from pipeline.errors import ConfigError
from pipeline.routes import ENGINE, LLMAPI, PORTABLE
from pipeline.staging import staged_output
from pipeline.trtllm import version as trtllm_version

# Each route's compile steps: (stage, job, result, manifest) -> what it writes into the staging folder, and runs.
ROUTE_STEPS = {PORTABLE: engine_folder.compile_into, ENGINE: trtllm_build.compile_into, LLMAPI: llmapi.compile_into}
# A TensorRT-LLM route's product as text, without writing it (`pipeline build --dry-run` shows it).
ROUTE_FILES = {ENGINE: trtllm_build.route_files, LLMAPI: llmapi.route_files}


def compile_model(options: CompileOptions) -> CompileResult:
    job = prepare(options)
    result = CompileResult(options.backend, job.route.name, str(job.output), options.dry_run, device=job.device,
                           device_line=job.device_line)
    manifest = _manifest(job)
    with staged_output(job.output, options.force, ConfigError, "-o") as stage:
        ROUTE_STEPS[job.route](stage, job, result, manifest)
        manifest["commands"] = {name: shlex.join(cmd) for name, cmd in result.commands.items()}
        result.manifest = manifest
        (stage / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        result.files.append(MANIFEST_FILE)
    return result


def _manifest(job: CompileJob) -> dict:
    """compile.json's fields every route writes (each route adds its own: configs, the cost model)."""
    o = job.options
    return {
        "tensorrt_llm_version": job.tensorrt_llm_version,
        "container": trtllm_version.for_version(job.tensorrt_llm_version).container,
        "backend": o.backend, "route": job.route.name, "dry_run": o.dry_run,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": job.target.describe(),
        "draft": {"kind": job.draft.kind, **(job.draft_ckpt.describe() if job.draft_ckpt else {})},
        "sizes": asdict(job.sizes), "gate_batch_size": o.gate_batch_size, "kv_cache_dtype": job.kv_cache_dtype,
        "tp_size": job.tp, "pp_size": job.pp, "plan": job.plan,
        **({"device": job.device} if job.device is not None else {}),
    }


def route_files(job: CompileJob, target_shape=None) -> RouteFiles:
    """What a TensorRT-LLM route would write, as text (target_shape, a ModelShape: sizes one-model EAGLE-3's
    schedule on the LLM-API route)."""
    return ROUTE_FILES[job.route](job, target_shape)
