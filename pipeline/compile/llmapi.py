"""The LLM-API route (PyTorch backend): an extra_llm_api_options YAML plus the trtllm-serve line that uses it.

Keys follow TensorRT-LLM 1.2's tensorrt_llm/llmapi/llm_args.py (see reference.py). The batch-size gate
is TensorRT-LLM's own: speculative_config.max_concurrency turns speculation off above that batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.compile.draft import DraftSpec
from pipeline.compile.trtllm_build import BuildSizes

DECODING_TYPE = {"model": "Draft_Target", "eagle3": "Eagle3", "ngram": "NGram"}
OPTIONS_FILE = "extra_llm_api_options.yaml"


@dataclass(frozen=True)
class LlmApiSettings:
    gate_batch_size: int | None  # speculate while the batch is at or below this; None: always
    kv_cache_dtype: str  # "fp8" | "auto"
    free_gpu_memory_fraction: float
    tp_size: int = 1
    pp_size: int = 1


def llm_api_options(draft: DraftSpec, sizes: BuildSizes, settings: LlmApiSettings) -> dict:
    """The extra_llm_api_options mapping (written as YAML)."""
    kv: dict = {"free_gpu_memory_fraction": settings.free_gpu_memory_fraction,
                "enable_block_reuse": True}
    if settings.kv_cache_dtype == "fp8":
        kv["dtype"] = "fp8"
    options: dict = {"kv_cache_config": kv}
    if draft.speculates:
        spec: dict = {"decoding_type": DECODING_TYPE[draft.kind], "max_draft_len": sizes.max_draft_len}
        if draft.path is not None:
            spec["speculative_model_dir"] = str(draft.path)
        if draft.kind == "ngram":
            spec["max_matching_ngram_size"] = 2  # NGramDecodingConfig's default, written out
        if settings.gate_batch_size is not None:
            spec["max_concurrency"] = settings.gate_batch_size
        options["speculative_config"] = spec
    return options


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
