"""The engine route's compile steps: trtllm-build command lines (pure functions from sizes and checkpoints to argv
lists), build.sh, and running them where TensorRT-LLM is installed (NVIDIA's container).

Draft-target (examples/draft_target_model/README.md, TensorRT-LLM 1.2): the target is built with
`--speculative_decoding_mode draft_tokens_external --max_draft_len K`, the draft plainly; both with
`--use_paged_context_fmha enable`, because the runtime reuses the KV cache of accepted tokens and runs long prompts
in chunks, and neither works without it (reference.FEATURE_SETTINGS).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from pipeline.compiler.checkpoint import Checkpoint
from pipeline.compiler.job import BuildSizes, CompileJob
from pipeline.compiler.options import CompileResult, RouteFiles
from pipeline.errors import ConfigError
from pipeline.trtllm.reference import GUIDE_INFO_FILE, combination, refusal_notes

SHARED_KV_FRACTION = 0.5  # examples/draft_target_model/README.md: "--kv_cache_free_gpu_memory_fraction=0.5"
# The runtime settings turned on beside speculation where TensorRT-LLM runs them (reference.SPECULATION_COMBINATIONS),
# by their tensorrtllm backend names: the Triton config and run.py's flags follow the same entries.
FEATURES = ("enable_chunked_context", "enable_kv_cache_reuse")


def compile_into(stage: Path, job: CompileJob, result: CompileResult, manifest: dict) -> None:
    """Write build.sh into the staging folder and, unless a dry run, build the engines there."""
    route_files(job).write_into(stage, result, manifest)
    if not job.options.dry_run:
        run_builds(stage, result)


def route_files(job: CompileJob, target_shape=None) -> RouteFiles:
    """The trtllm-build commands and build.sh, the guided-decoding vocabulary's command, and run.py's smoke test.
    Pure. (target_shape: unused here; the LLM-API route's schedule reads it.)"""
    out = RouteFiles()
    target, draft, sizes, output = job.target, job.draft_ckpt, job.sizes, job.output
    out.commands["build_target"] = build_command(target, output / "target", sizes, role="target")
    if draft is not None:
        out.commands["build_draft"] = build_command(draft, output / "draft", sizes, role="draft")
    # Guided decoding's vocabulary, beside the engines (assemble points the target's config at it).
    out.commands["build_guide_info"] = guide_info_command(target.path, output)
    out.commands["smoke_test"] = run_command(output / "target", output / "draft" if draft else None, target.path,
                                             sizes, job.options.free_gpu_memory_fraction, target.world_size)
    builds = [cmd for name, cmd in out.commands.items() if name.startswith("build_")]
    out.files["build.sh"] = (job.script_header() + "set -euo pipefail\n"
                             + "\n".join(shlex.join(c) for c in builds) + "\n")
    out.notes += feature_notes(draft is not None)  # chunked context / KV reuse upstream refuses, if any
    return out


def run_builds(stage: Path, result: CompileResult) -> None:
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


def build_command(ckpt: Checkpoint, output_dir: Path, sizes: BuildSizes, *, role: str) -> list[str]:
    """argv of trtllm-build for the target (role="target") or the draft (role="draft").

    TP/PP aren't flags: trtllm-build takes them from the checkpoint's config.json "mapping", and writes
    one engine per rank (ckpt.world_size of them)."""
    if role not in ("target", "draft"):
        raise ValueError(f"role must be target or draft, not {role!r}")
    cmd = [
        "trtllm-build",
        "--checkpoint_dir", str(ckpt.path),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(sizes.max_batch_size),
        "--max_input_len", str(sizes.max_input_len),
        "--max_seq_len", str(sizes.max_seq_len),
        "--max_num_tokens", str(sizes.max_num_tokens),
        "--gemm_plugin", "auto",  # plugin.py: "auto" = the checkpoint's dtype
        # 1.2.1's default already (plugin.py PluginConfig.use_paged_context_fmha), written out: KV reuse and chunked
        # context are silently turned off at load without it.
        "--use_paged_context_fmha", "enable",
    ]
    if ckpt.world_size > 1:
        cmd += ["--workers", str(ckpt.world_size)]
    if role == "target" and sizes.max_draft_len > 0:
        cmd += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(sizes.max_draft_len)]
    return cmd


def guide_info_command(tokenizer_dir: Path, output_dir: Path) -> list[str]:
    """argv of upstream's generate_xgrammar_tokenizer_info.py, where NVIDIA's container keeps it: it writes
    output_dir/reference.GUIDE_INFO_FILE, the vocabulary the tensorrt_llm model's guided decoding compiles
    grammars against (tensorrtllm_backend docs/guided_decoding.md, "C++ Backend")."""
    from pipeline.trtllm.reference import GUIDE_INFO_SCRIPT
    from pipeline.trtllm.version import CONTAINER_APP

    return ["python3", f"{CONTAINER_APP}/{GUIDE_INFO_SCRIPT}", "--model_dir", str(tokenizer_dir),
            "--output_dir", str(output_dir)]


def flags_of(cmd: list[str]) -> list[str]:
    return [a for a in cmd if a.startswith("--")]


def engine_modes(has_draft: bool) -> tuple[str, ...]:
    """The speculation modes of the engines a pair runs: the target's (draft_tokens_external with a draft), then the
    draft's (a plain engine)."""
    return ("draft_tokens_external", "plain") if has_draft else ("plain",)


def feature_allowed(setting: str, has_draft: bool) -> bool:
    """Whether every engine of the pair runs `setting` (run.py gives its flags to both runners)."""
    return all(combination(setting, mode).allowed for mode in engine_modes(has_draft))


def feature_notes(has_draft: bool) -> list[str]:
    """One line for each of FEATURES left off because upstream refuses it beside one of these engines."""
    return refusal_notes(FEATURES, engine_modes(has_draft))


def run_command(target_engine: Path, draft_engine: Path | None, tokenizer_dir: Path, sizes: BuildSizes,
                free_gpu_memory_fraction: float, world_size: int = 1) -> list[str]:
    """examples/run.py invocation from the draft-target README (a smoke test in the container), where NVIDIA's
    Triton container keeps it (/app/examples/run.py).

    Two models on the same GPUs: run.py gives both ModelRunnerCpp the same KV fraction, and the one that loads
    first takes that share of all free memory, so the README lowers it to 0.5; a one-sequence token bound
    (--max_tokens_in_paged_kv_cache, the smaller of the two bounds wins) keeps either from crowding the other
    out whatever the load order."""
    from pipeline.trtllm.version import CONTAINER_APP, CONTAINER_RUN_PY

    mpi = ["mpirun", "-n", str(world_size), "--allow-run-as-root"] if world_size > 1 else []
    has_draft = draft_engine is not None
    fraction = min(free_gpu_memory_fraction, SHARED_KV_FRACTION) if has_draft else free_gpu_memory_fraction
    cmd = [*mpi, "python3", f"{CONTAINER_APP}/{CONTAINER_RUN_PY}", "--engine_dir", str(target_engine),
           "--tokenizer_dir", str(tokenizer_dir), "--max_output_len", "128"]
    # The README: "--kv_cache_enable_block_reuse must be specified" for draft-target.
    cmd += ["--kv_cache_enable_block_reuse"] if feature_allowed("enable_kv_cache_reuse", has_draft) else []
    cmd += ["--enable_chunked_context"] if feature_allowed("enable_chunked_context", has_draft) else []
    cmd += ["--kv_cache_free_gpu_memory_fraction", f"{fraction:g}",
            "--input_text", "How does speculative decoding work?"]
    if has_draft:
        # [draft_len, draft device list, target device list, use_logits]: one device per TP rank, both
        # models sharing the GPUs (the README's single-GPU layout, which it finds faster).
        devices = "[" + ",".join(str(d) for d in range(world_size)) + "]"
        cmd += ["--max_tokens_in_paged_kv_cache", str(sizes.max_seq_len),
                "--draft_engine_dir", str(draft_engine),
                "--draft_target_model_config", f"[{sizes.max_draft_len},{devices},{devices},False]"]
    return cmd
