"""The LLM-API route's compile steps (PyTorch backend): an extra_llm_api_options YAML plus the trtllm-serve line
that uses it.

Keys follow the release's table (reference.LLM_API_TABLES). The batch-size gate is TensorRT-LLM's own:
- 1.2.1: speculative_config.max_concurrency turns speculation off above that batch size, for the speculation modes
  that have a Drafter. One-model EAGLE-3 (eagle3_one_model: true, TensorRT-LLM's default) has none, so nothing
  turns it off under load; whenever a gate is asked for, EAGLE-3 is written two-model (eagle3_one_model: false),
  which max_concurrency does gate. The cost, said in compile's output: a separate draft engine and draft KV cache,
  a draft loop driven from Python, no overlap scheduler, and TensorRT-LLM finds one-model faster at low latency.
  Without a gate (--gate-batch-size none) one-model it is.
- 1.4: the one-model path reads draft_len_schedule (PR #10860), so EAGLE-3 stays one-model and gets a schedule
  from the cost model (draft_schedule.py): long drafts at small batches, shorter ones as the batch grows, none
  above the ceiling. Two-model EAGLE-3 is gone there (PRs #17366, #18721).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeline.compiler.job import BuildSizes, CompileJob
from pipeline.compiler.options import CompileResult, RouteFiles
from pipeline.draft_spec import DraftSpec
from pipeline.trtllm.reference import TRTLLM_VERSION, combination, llm_api_table, refusal_notes

OPTIONS_FILE = "extra_llm_api_options.yaml"
# Turned on beside every speculation mode that TensorRT-LLM runs them with (reference.SPECULATION_COMBINATIONS):
# chunked prefill keeps a long prompt from stalling the decode steps of the batch beside it, and block reuse lets a
# resent conversation skip its cached prefix.
FEATURES = ("enable_chunked_prefill", "kv_cache_config.enable_block_reuse", "guided_decoding_backend")
# Guided decoding (response_format, guided_json, ...): xgrammar, the backend both TensorRT-LLM runtimes implement (the
# engine route's C++ GuidedDecoder takes no other), so a guide means the same on either route.
GUIDED_DECODING_BACKEND = "xgrammar"
EAGLE3_TWO_MODEL_COST = ("two-model EAGLE-3, so max_concurrency can turn it off (1.2.1's one-model EAGLE-3 has no "
                         "Drafter and never turns off; --trtllm-version 1.4 gates one-model): a separate draft "
                         "engine and KV cache, a Python-driven draft loop and no overlap scheduler; TensorRT-LLM "
                         "finds one-model faster at low latency")


@dataclass(frozen=True)
class LlmApiSettings:
    gate_batch_size: int | None  # speculate while the batch is at or below this; None: always
    kv_cache_dtype: str  # "fp8" | "auto"
    free_gpu_memory_fraction: float
    tp_size: int = 1
    pp_size: int = 1
    tensorrt_llm_version: str = TRTLLM_VERSION  # whose names to write
    # One-model EAGLE-3's gate where the release reads it (draft_schedule.py); None: max_concurrency alone
    draft_len_schedule: dict[int, int] | None = None


def compile_into(stage: Path, job: CompileJob, result: CompileResult, manifest: dict) -> None:
    """Write the YAML and serve.sh into the staging folder: trtllm-serve reads the checkpoint as it starts."""
    # The target's shape only where a one-model EAGLE-3 schedule needs it (an HF checkpoint).
    shape = job.target.read_shape() if job.draft.kind == "eagle3" and job.target.layout == "hf" else None
    route_files(job, shape).write_into(stage, result, manifest)


def route_files(job: CompileJob, target_shape=None) -> RouteFiles:
    """The YAML, the trtllm-serve line (and its mpirun form past one GPU) and serve.sh. Pure, but for asking
    nvidia-smi which GPU this is when a one-model EAGLE-3 schedule needs one and --gpu names none. target_shape (a
    ModelShape): sizes the cost model behind that schedule."""
    out, o, version = RouteFiles(), job.options, job.tensorrt_llm_version
    schedule = None
    if job.draft.kind == "eagle3" and o.gate_batch_size is not None and one_model_gates(version):
        schedule = eagle3_schedule(job, target_shape)
        out.notes.append(schedule.note(o.gate_batch_size) if schedule else
                         f"no GPU named (--gpu) for the cost model: max_concurrency {o.gate_batch_size}, which "
                         f"TensorRT-LLM turns into draft_len_schedule {{{o.gate_batch_size}: "
                         f"{job.sizes.max_draft_len}}}")
    settings = LlmApiSettings(o.gate_batch_size, job.kv_cache_dtype, o.free_gpu_memory_fraction, job.tp, job.pp,
                              version, schedule.lengths if schedule is not None else None)
    out.notes += [n for n in (gate_note(job.draft, o.gate_batch_size, version),) if n]
    out.notes += feature_notes(job.draft, o.gate_batch_size, version)
    config = llm_api_options(job.draft, job.sizes, settings)
    out.files[OPTIONS_FILE] = to_yaml(config)
    serve = serve_command(job.target.path, job.output / OPTIONS_FILE, job.sizes, settings)
    out.commands["serve"] = serve
    if job.tp * job.pp > 1:
        out.commands["serve_multi_gpu"] = launch_command(serve, job.tp * job.pp)
    out.files["serve.sh"] = job.script_header() + f"exec {shlex.join(serve)}\n"
    out.configs[OPTIONS_FILE] = config
    return out


def eagle3_schedule(job: CompileJob, shape):
    """One-model EAGLE-3's draft_len_schedule from the roofline of the GPU the plan names (--gpu, else the one
    nvidia-smi reports); None without one. Pure but for nvidia-smi."""
    from pipeline.compiler.draft_schedule import draft_len_schedule, roofline
    from pipeline.plan.gpus import detect_gpu, get_gpu
    from pipeline.plan.memory import PlanDraft, PlanInputs, plan_memory

    gpu = get_gpu(job.options.gpu) if job.options.gpu is not None else detect_gpu()
    if gpu is None or shape is None:
        return None
    qformat = job.target.qformat
    plan = plan_memory(PlanInputs(job.target.path.name, shape, gpu, tp=job.tp, target_qformat=qformat,
                                  draft=PlanDraft("eagle3", "eagle3")))
    tflops = gpu.fp8_tflops if qformat == "fp8" and gpu.fp8 else gpu.bf16_tflops
    cost = roofline(plan.target_weights_per_gpu + plan.draft_weights_per_gpu, shape.param_count, job.tp,
                    gpu.bandwidth_tb_s, tflops, job.sizes.max_draft_len)
    return draft_len_schedule(cost, job.sizes.max_draft_len, job.options.gate_batch_size)


def decoding_type(kind: str, version: str) -> str:
    return llm_api_table(version).decoding_types[kind]


def one_model_gates(version: str) -> bool:
    return llm_api_table(version).eagle3_gate == "one-model"


def speculation_mode(draft: DraftSpec, gate_batch_size: int | None, version: str = TRTLLM_VERSION) -> str:
    """The mode reference.SPECULATION_COMBINATIONS knows this route by: none, model, ngram, or EAGLE-3 one-model
    (no gate, or a release whose one-model path gates) / two-model (gated on 1.2.1; see the module docstring)."""
    if not draft.speculates:
        return "none"
    if draft.kind == "eagle3":
        return "eagle3:one-model" if gate_batch_size is None or one_model_gates(version) else "eagle3:two-model"
    return draft.kind


def llm_api_options(draft: DraftSpec, sizes: BuildSizes, settings: LlmApiSettings) -> dict:
    """The extra_llm_api_options mapping (written as YAML)."""
    table = llm_api_table(settings.tensorrt_llm_version)
    mode = speculation_mode(draft, settings.gate_batch_size, settings.tensorrt_llm_version)
    # Written either way: KvCacheConfig.enable_block_reuse defaults to True, so leaving it out would not turn it off.
    kv: dict = {"free_gpu_memory_fraction": settings.free_gpu_memory_fraction,
                "enable_block_reuse": combination("kv_cache_config.enable_block_reuse", mode).allowed}
    if settings.kv_cache_dtype == "fp8":
        kv["dtype"] = "fp8"
    options: dict = {"kv_cache_config": kv}
    if combination("enable_chunked_prefill", mode).allowed:
        options["enable_chunked_prefill"] = True  # BaseLlmArgs default False
    if combination("guided_decoding_backend", mode).allowed:
        # Default None: trtllm-serve would take response_format and enforce nothing.
        options["guided_decoding_backend"] = GUIDED_DECODING_BACKEND
    if draft.speculates:
        spec: dict = {"decoding_type": table.decoding_types[draft.kind], "max_draft_len": sizes.max_draft_len}
        if draft.path is not None:
            spec[table.model_key] = str(draft.path)
        if draft.kind == "ngram":
            spec["max_matching_ngram_size"] = 2  # NGramDecodingConfig's default, written out
        if draft.kind == "eagle3" and table.eagle3_gate == "two-model":
            spec["eagle3_one_model"] = mode == "eagle3:one-model"
            if mode == "eagle3:two-model":
                options["disable_overlap_scheduler"] = True
        if settings.gate_batch_size is not None:
            if draft.kind == "eagle3" and table.eagle3_gate == "one-model" and settings.draft_len_schedule:
                # Upstream refuses it beside max_concurrency; its largest bound is the ceiling.
                spec["draft_len_schedule"] = dict(settings.draft_len_schedule)
            else:
                spec["max_concurrency"] = settings.gate_batch_size
        options["speculative_config"] = spec
    return options


def gate_note(draft: DraftSpec, gate_batch_size: int | None, version: str = TRTLLM_VERSION) -> str:
    """What the LLM-API route does under load, for the plan and compile's output."""
    if not draft.speculates:
        return ""
    if gate_batch_size is None:
        what = "one-model EAGLE-3" if draft.kind == "eagle3" else "speculation"
        return f"gate: none (--gate-batch-size none): {what} stays on at every batch size"
    if draft.kind == "eagle3" and one_model_gates(version):
        return (f"gate: one-model EAGLE-3, which TensorRT-LLM {version} turns off above its draft_len_schedule's "
                f"largest bound (PR #10860); upstream's open NVIDIA/TensorRT-LLM#16888 reports acceptance staying "
                f"low for requests that ran through a spell above it")
    gate = f"gate: TensorRT-LLM turns speculation off above {gate_batch_size} active requests (max_concurrency)"
    return f"{gate}; {EAGLE3_TWO_MODEL_COST}" if draft.kind == "eagle3" else gate


def feature_notes(draft: DraftSpec, gate_batch_size: int | None, version: str = TRTLLM_VERSION) -> list[str]:
    """One line for each of FEATURES left off because upstream refuses it beside this speculation mode."""
    return refusal_notes(FEATURES, (speculation_mode(draft, gate_batch_size, version),))


def to_yaml(options: dict) -> str:
    import yaml  # pyyaml: a dependency of huggingface_hub, always present with transformers

    return yaml.safe_dump(options, sort_keys=False)


def serve_command(model: Path, options_file: Path, sizes: BuildSizes, settings: LlmApiSettings) -> list[str]:
    return ["trtllm-serve", str(model), "--backend", "pytorch",
            "--tp_size", str(settings.tp_size), "--pp_size", str(settings.pp_size),
            "--max_batch_size", str(sizes.max_batch_size), "--max_num_tokens", str(sizes.max_num_tokens),
            "--max_seq_len", str(sizes.max_seq_len),
            "--kv_cache_free_gpu_memory_fraction", str(settings.free_gpu_memory_fraction),
            "--extra_llm_api_options", str(options_file)]


def launch_command(serve: list[str], world_size: int) -> list[str]:
    """Multi-GPU/multi-node (e.g. under Slurm): trtllm-llmapi-launch starts the MPI workers around trtllm-serve."""
    return ["mpirun", "-n", str(world_size), "--allow-run-as-root", "trtllm-llmapi-launch", *serve]
