"""The flags that say what to build, shared by `pipeline build` and `pipeline deploy kubernetes` (which plans the
same build and has it run in the cluster), so both read and default them alike."""

from __future__ import annotations

import click

from pipeline.cli.draft_spec import DraftType
from pipeline.cli.setting import setting_option
from pipeline.models.presets import DEFAULT_MODEL
from pipeline.routes import BACKEND_NAMES
from pipeline.setting import GATE_BATCH_SIZE, MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS

BUILD_FLAGS = (
    click.option("--target", "-t", default=DEFAULT_MODEL, show_default=True,
                 help="Target model: a preset (smollm2-135m is embedded; llama-70b, ...), a folder, a .gguf or a hub id."),
    click.option("--draft", "-d", default="auto", show_default=True, type=DraftType(allow_auto=True),
                 help="eagle3 (the preset's published head on TensorRT-LLM; on the portable engine the build trains "
                      "one with ModelOpt, see --draft-budget-minutes; eagle3:DIR for your own), ngram, none, or a "
                      "draft model. auto: eagle3 on TensorRT-LLM where the target has a head, else ngram (no weights)."),
    click.option("draft_budget_minutes", "--draft-budget-minutes", type=float, default=10.0, show_default=True,
                 help="--draft eagle3 on the portable engine: the most minutes training the head may take "
                      "(once: later builds reuse it)."),
    click.option("target_qformat", "--target-qformat", default="auto", show_default=True,
                 help="fp8, int4_awq, w4a8_awq, int8_sq or none. auto: fp8 on an FP8 GPU with TensorRT-LLM (halves "
                      "the weight reads, for a small perplexity cost); none (bf16) on the portable engine, the fastest "
                      "on CPU (fp8 is dequantized at load there). Measured costs: docs/benchmarks.md."),
    click.option("draft_qformat", "--draft-qformat", default="auto", show_default=True,
                 help="Same formats. auto: int4_awq for a draft model (memory-bound, and its quality never changes "
                      "the output); an EAGLE-3 head stays bf16; ngram has no weights."),
    click.option("kv_cache_dtype", "--kv-cache-dtype", default="auto", show_default=True,
                 type=click.Choice(["auto", "bf16", "fp8"]), help="auto: bf16. fp8 needs TensorRT-LLM."),
    setting_option(NUM_DRAFT_TOKENS, 4, minimum=0),  # 0 with --draft none (check_options)
    setting_option(GATE_BATCH_SIZE, None, "[default: 4 on the portable engine, 32 on TensorRT-LLM]. `pipeline bench "
                                          "--apply` fits it on this machine."),
    click.option("--backend", "-b", default="auto", show_default=True, type=click.Choice(["auto", *BACKEND_NAMES]),
                 help="auto: TensorRT-LLM where it is importable and a GPU is present (or the target is too big for "
                      "this machine's memory), else the portable engine (torch)."),
    setting_option(MAX_BATCH_SIZE, None, "[default: 8 on torch, 16 on trtllm]."),
    click.option("max_input_len", "--max-input-len", type=int, help="Longest prompt [default: max-seq-len / 2]."),
    setting_option(MAX_SEQ_LEN, None, "[default: 2048 on torch, 4096 on trtllm, at most the model's limit]."),
    click.option("tp_size", "--tp-size", type=int,
                 help="Tensor parallel GPUs [default: the smallest the memory plan fits; 1 on torch]."),
    click.option("--gpu", help="Plan for this GPU kind (see `pipeline plan`) [default: the one here, else h100-80gb]."),
    click.option("trtllm_version", "--trtllm-version",
                 help="TensorRT-LLM release to write for: 1.2.1, or the 1.4 pre-release (LLM-API route only; its "
                      "one-model EAGLE-3 gates by batch size) [default: the installed one, else 1.2.1, the newest "
                      "stable]."),
)


def build_flags(command):
    """Decorate a Click command with BUILD_FLAGS (its function takes them as keyword arguments)."""
    for option in reversed(BUILD_FLAGS):
        command = option(command)
    return command


def build_options(**flags):
    """BuildOptions from the flags' values (extra keyword arguments are the command's own, and ignored)."""
    from pipeline.build import BuildOptions

    names = ("target", "draft", "target_qformat", "draft_qformat", "kv_cache_dtype", "num_draft_tokens",
             "gate_batch_size", "backend", "max_batch_size", "max_input_len", "max_seq_len", "tp_size", "gpu",
             "draft_budget_minutes", "trtllm_version")
    # The command's own flags that BuildOptions takes (build's --device: deploy's pods pick theirs when they load).
    where = {n: flags[n] for n in ("engines_dir", "repo", "device") if flags.get(n) is not None}
    return BuildOptions(**{n: flags[n] for n in names}, **where, force=flags.get("force", False))
