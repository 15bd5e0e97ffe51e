"""What a compile will do, decided and checked before anything is written.

`prepare(options)` reads the options and the checkpoints' config files (never their weights) and returns a
CompileJob, or raises a one-line error that says the fix. In order: the options, the device, the checkpoints and
the draft's agreement with the target (checkpoint.py), the route, sizes, KV dtype, parallelism and TensorRT-LLM
release (`resolve`), and the GPU memory plan. The route's own steps (compiler.py hands the job to them) then only
write.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.compiler.checkpoint import Checkpoint, read_pair
from pipeline.compiler.options import KV_CACHE_DTYPES, CompileOptions
from pipeline.draft_spec import EAGLE3, DraftSpec
from pipeline.errors import ConfigError, MissingDependencyError
from pipeline.routes import Route, backend_named, pick_route
from pipeline.setting import GATE_BATCH_SIZE, MAX_BATCH_SIZE, NUM_DRAFT_TOKENS
from pipeline.trtllm import upstream
from pipeline.trtllm import version as trtllm_version
from pipeline.trtllm.reference import FP8_KV_QUANT_ALGOS, TRTLLM_CONTAINER

DEFAULT_MAX_SEQ_LEN = 4096
CONTEXT_CHUNK = 8192  # trtllm-build's default max_num_tokens: the most prompt tokens one iteration takes


@dataclass(frozen=True)
class BuildSizes:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_draft_len: int  # K; 0 without speculation


def derive_sizes(max_batch_size: int, max_draft_len: int, max_position_embeddings: int | None,
                 max_seq_len: int | None = None, max_input_len: int | None = None,
                 max_num_tokens: int | None = None) -> BuildSizes:
    """Fill in what the user left out and check the rest; raises ConfigError with the fix."""
    MAX_BATCH_SIZE.check(max_batch_size)
    NUM_DRAFT_TOKENS.check(max_draft_len, minimum=0)
    limit = max_position_embeddings or DEFAULT_MAX_SEQ_LEN
    seq = max_seq_len if max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, limit)
    if seq > limit:
        raise ConfigError(f"--max-seq-len {seq} is longer than the target's max_position_embeddings ({limit}); "
                          f"lower it")
    inp = max_input_len if max_input_len is not None else seq // 2
    if not 1 <= inp < seq:
        raise ConfigError(f"--max-input-len must be between 1 and --max-seq-len - 1 ({seq - 1}); got {inp}")
    # One iteration may hold a context chunk and the K+1 tokens of every other row; cover both.
    need = max_batch_size * (max_draft_len + 1)
    tokens = max_num_tokens if max_num_tokens is not None else need + min(inp, CONTEXT_CHUNK)
    if tokens < need:
        raise ConfigError(f"--max-num-tokens {tokens} can't hold a full batch's draft tokens "
                          f"(max batch {max_batch_size} x (K {max_draft_len} + 1) = {need}); raise it or lower "
                          f"--max-batch-size")
    return BuildSizes(max_batch_size, inp, seq, tokens, max_draft_len)


@dataclass(frozen=True)
class CompileJob:
    """What compile decided from the options and the checkpoints' config files."""

    options: CompileOptions
    output: Path  # absolute
    target: Checkpoint
    draft: DraftSpec
    draft_ckpt: Checkpoint | None
    route: Route
    sizes: BuildSizes
    kv_cache_dtype: str
    tp: int
    pp: int
    tensorrt_llm_version: str
    plan: dict | None = None  # the GPU memory plan (pipeline.plan), where a GPU was named or found
    device: str | None = None  # the portable engine's Device (the choice as read, for a dry run); None on TensorRT-LLM
    device_line: str = ""  # what was picked and why (DeviceChoice.choose)

    def script_header(self) -> str:
        """The first lines of the shell scripts a TensorRT-LLM route writes: which release, in which image."""
        where = (trtllm_version.for_version(self.tensorrt_llm_version).container
                 or "an image you build with it: no Triton container ships it")
        return f"#!/usr/bin/env bash\n# TensorRT-LLM {self.tensorrt_llm_version} ({where})\n"


def prepare(options: CompileOptions) -> CompileJob:
    """The job, checked (the output folder is checked as the route's steps get their staging folder)."""
    _check_options(options)
    device, device_line = _device(options)
    output = Path(options.output).expanduser().absolute()
    target, draft, draft_ckpt = read_pair(options.target, options.draft)
    job = resolve(options, output, target, draft, draft_ckpt)
    plan = _check_plan(job)
    if job.route.builds_engines and not options.dry_run and not trtllm_available():
        raise MissingDependencyError(
            f"trtllm-build is not installed here (TensorRT-LLM needs NVIDIA's own build); run this in "
            f"NVIDIA's TensorRT-LLM container {TRTLLM_CONTAINER}, or add --dry-run to write the commands only")
    return replace(job, plan=plan, device=device, device_line=device_line)


def resolve(options: CompileOptions, output: Path, target: Checkpoint, draft: DraftSpec,
            draft_ckpt: Checkpoint | None) -> CompileJob:
    """Route, sizes, KV dtype, parallelism and TensorRT-LLM version; raises a one-line error on a bad combination.
    Reads nothing but the installed TensorRT-LLM's version: `pipeline build --dry-run` calls it with checkpoints
    described from a preset's architecture, before they exist."""
    route = pick_route(options.backend, options.route, target, draft)
    if route.upstream_llmapi_model and draft.kind == EAGLE3:
        _check_llmapi_takes_eagle3(target)
    if draft_ckpt is not None and draft.kind == "model" and draft_ckpt.layout != target.layout:
        raise ConfigError(f"the draft is a {draft_ckpt.layout} checkpoint but the target a {target.layout} one; "
                          f"export both with the same `pipeline quantize --export`")
    _check_draft_len(draft, options.num_draft_tokens)
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
    return CompileJob(options, output, target, draft, draft_ckpt, route, sizes, kv_dtype, tp, pp, version)


def _check_llmapi_takes_eagle3(target: Checkpoint) -> None:
    support = upstream.LLMAPI_EAGLE3.get(target.model_type or "")
    if support is not None and not support.takes_head:
        raise ConfigError(f"TensorRT-LLM's LLM API can't feed an EAGLE-3 head from a {target.model_type} target "
                          f"({support.ref.path}: {support.ref.symbol}); use --draft ngram or a draft model of the "
                          f"same family, or --backend torch, whose engine serves the head")


def trtllm_available() -> bool:
    return shutil.which("trtllm-build") is not None or importlib.util.find_spec("tensorrt_llm") is not None


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
    if o.gate_batch_size is not None:
        GATE_BATCH_SIZE.check(o.gate_batch_size, fix="use --draft none to turn speculation off")
    for flag, value in (("--tp-size", o.tp_size), ("--pp-size", o.pp_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if not backend_named(o.backend).trtllm_release and o.trtllm_version is not None:
        raise ConfigError("--trtllm-version is for --backend trtllm; drop it for the portable engine")
    if o.dtype not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"unknown --dtype {o.dtype!r}; pick one of auto, fp32, bf16, fp16")


def _device(o: CompileOptions) -> tuple[str | None, str]:
    """(device, its line) where the portable engine loads to calibrate: chosen on this machine, but for a dry run
    (nothing loads; the choice as read). TensorRT-LLM places its engines by its own mapping: (None, "")."""
    backend = backend_named(o.backend)
    if not backend.places_device:
        backend.check_device(o.device, f"--backend {backend.name}")
        return None, ""
    return (o.device, "") if o.dry_run else o.device.choose()


def _check_draft_len(draft: DraftSpec, num_draft_tokens: int) -> None:
    # A target built with max_draft_len 0 fails at the first request with TensorRT-LLM's
    # "Number of draft tokens (56) is larger than maximum number of draft tokens (0)"; refuse it here.
    if draft.speculates and num_draft_tokens < 1:
        raise ConfigError(f"--num-draft-tokens must be at least 1 with --draft {draft.kind}: a target built with "
                          f"max_draft_len 0 fails with \"Number of draft tokens (56) is larger than maximum number "
                          f"of draft tokens (0)\"; pass --num-draft-tokens 4, or --draft none")


def _check_plan(job: CompileJob) -> dict | None:
    """The sizes within the GPU plan: the one call into pipeline.plan, for --gpu or else the GPU nvidia-smi
    reports. Skipped when neither names a GPU. A plan that doesn't fit is refused unless --force."""
    from pipeline.plan.gpus import detect_gpu, get_gpu
    from pipeline.plan.memory import PlanDraft, PlanInputs, check_fits, plan_memory

    gpu = get_gpu(job.options.gpu) if job.options.gpu is not None else detect_gpu()
    if gpu is None:
        return None
    draft, draft_ckpt = job.draft, job.draft_ckpt
    plan_draft = PlanDraft("none", "none")
    if draft.kind in ("ngram", "eagle3"):
        plan_draft = PlanDraft(draft.kind, draft.kind)
    elif draft_ckpt is not None:
        plan_draft = PlanDraft("model", draft_ckpt.path.name, draft_ckpt.read_shape())
    kv = "fp8" if job.kv_cache_dtype == "fp8" else "bf16"
    draft_kv = kv
    if job.route.kv_from_checkpoint and draft_ckpt is not None:  # a draft engine takes its own checkpoint's KV dtype
        draft_kv = "fp8" if (draft_ckpt.kv_cache_quant_algo or "").upper() == "FP8" else "bf16"
    plan = plan_memory(PlanInputs(
        target_name=job.target.path.name, target=job.target.read_shape(), gpu=gpu, tp=job.tp,
        target_qformat=job.target.qformat, draft=plan_draft,
        draft_qformat=draft_ckpt.qformat if draft_ckpt is not None and draft.kind == "model" else "none",
        kv_cache_dtype=kv, draft_kv_cache_dtype=draft_kv,
        max_batch_size=job.sizes.max_batch_size, max_seq_len=job.sizes.max_seq_len))
    if not job.options.force:
        check_fits(plan)
    return plan.to_dict()


def _kv_cache_dtype(requested: str, ckpt: Checkpoint, route: Route, role: str = "target") -> str:
    """The KV cache dtype for one checkpoint; on the engine route an FP8 KV cache needs an FP8 checkpoint."""
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

