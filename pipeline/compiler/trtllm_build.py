"""trtllm-build command lines for the engine route: pure functions from sizes and checkpoints to argv lists.

Draft-target (examples/draft_target_model/README.md, TensorRT-LLM 1.2): the target is built with
`--speculative_decoding_mode draft_tokens_external --max_draft_len K`, the draft plainly; both with
`--use_paged_context_fmha enable`, because the runtime reuses the KV cache of accepted tokens and runs long prompts
in chunks, and neither works without it (reference.FEATURE_SETTINGS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.compiler.checkpoint import Checkpoint
from pipeline.errors import ConfigError
from pipeline.trtllm.reference import combination, refusal_notes

DEFAULT_MAX_SEQ_LEN = 4096
CONTEXT_CHUNK = 8192  # trtllm-build's default max_num_tokens: the most prompt tokens one iteration takes
SHARED_KV_FRACTION = 0.5  # examples/draft_target_model/README.md: "--kv_cache_free_gpu_memory_fraction=0.5"
# The runtime settings turned on beside speculation where TensorRT-LLM runs them (reference.SPECULATION_COMBINATIONS),
# by their tensorrtllm backend names: the Triton config and run.py's flags follow the same entries.
FEATURES = ("enable_chunked_context", "enable_kv_cache_reuse")


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
    if max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be at least 1 (got {max_batch_size})")
    if max_draft_len < 0:
        raise ConfigError(f"--num-draft-tokens must be >= 0 (got {max_draft_len})")
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
