"""`pipeline build`: model names -> quantized checkpoints -> engine -> Triton repository, in one command."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.models.presets import DEFAULT_MODEL


@click.command()
@click.option("--target", "-t", default=DEFAULT_MODEL, show_default=True,
              help="Target model: a preset (smollm2-135m is embedded; llama-70b, ...), a folder, a .gguf or a hub id.")
@click.option("--draft", "-d", default="auto", show_default=True,
              help="eagle3 (the preset's published head on TensorRT-LLM; on the portable engine the build trains "
                   "one with ModelOpt, see --draft-budget-minutes; eagle3:DIR for your own), ngram, none, or a "
                   "draft model. auto: eagle3 on TensorRT-LLM where the target has a head, else ngram (no weights).")
@click.option("draft_budget_minutes", "--draft-budget-minutes", type=float, default=10.0, show_default=True,
              help="--draft eagle3 on the portable engine: the most minutes training the head may take "
                   "(once: later builds reuse it).")
@click.option("target_qformat", "--target-qformat", default="auto", show_default=True,
              help="fp8, int4_awq, w4a8_awq, int8_sq or none. auto: fp8 on an FP8 GPU with TensorRT-LLM (halves "
                   "the weight reads, for a small perplexity cost); none (bf16) on the portable engine, the fastest "
                   "on CPU (fp8 is dequantized at load there). Measured costs: docs/benchmarks.md.")
@click.option("draft_qformat", "--draft-qformat", default="auto", show_default=True,
              help="Same formats. auto: int4_awq for a draft model (memory-bound, and its quality never changes "
                   "the output); an EAGLE-3 head stays bf16; ngram has no weights.")
@click.option("kv_cache_dtype", "--kv-cache-dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bf16", "fp8"]), help="auto: bf16. fp8 needs TensorRT-LLM.")
@click.option("num_draft_tokens", "--num-draft-tokens", "-k", type=int, default=4, show_default=True,
              help="K: the most tokens drafted per step.")
@click.option("gate_batch_size", "--gate-batch-size", type=int,
              help="Speculate only while at most this many requests decode [default: 4 on the portable engine, "
                   "32 on TensorRT-LLM]. `pipeline bench --apply` fits it on this machine.")
@click.option("--backend", "-b", default="auto", show_default=True, type=click.Choice(["auto", "torch", "trtllm"]),
              help="auto: TensorRT-LLM where it is importable and a GPU is present (or the target is too big for "
                   "this machine's memory), else the portable engine (torch).")
@click.option("max_batch_size", "--max-batch-size", type=int,
              help="Requests decoding at once [default: 8 on torch, 16 on trtllm].")
@click.option("max_input_len", "--max-input-len", type=int, help="Longest prompt [default: max-seq-len / 2].")
@click.option("max_seq_len", "--max-seq-len", type=int,
              help="Prompt + output tokens [default: 2048 on torch, 4096 on trtllm, at most the model's limit].")
@click.option("tp_size", "--tp-size", type=int,
              help="Tensor parallel GPUs [default: the smallest the memory plan fits; 1 on torch].")
@click.option("--gpu", help="Plan for this GPU kind (see `pipeline plan`) [default: the one here, else h100-80gb].")
@click.option("engines_dir", "--engines-dir", type=click.Path(path_type=Path), default=Path("engines"),
              show_default=True, help="Builds go to ENGINES_DIR/<target>/ (build.json, checkpoints, engine/).")
@click.option("--repo", "-r", type=click.Path(path_type=Path), default=Path("triton_repo"), show_default=True,
              help="The Triton model repository to write.")
@click.option("dry_run", "--dry-run", is_flag=True, help="Print the plan (stages, commands, configs, memory plan); "
                                                          "touch nothing.")
@click.option("--force", "-f", is_flag=True, help="Rebuild every stage, replace outputs this build didn't write, "
                                                  "and build even if the memory plan doesn't fit.")
@click.option("json_", "--json", is_flag=True, help="Print the plan or the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (they show only when stderr is a terminal).")
def build(target, draft, draft_budget_minutes, target_qformat, draft_qformat, kv_cache_dtype, num_draft_tokens, gate_batch_size, backend,
          max_batch_size, max_input_len, max_seq_len, tp_size, gpu, engines_dir, repo, dry_run, force, json_, quiet):
    """Build everything `pipeline serve` needs: quantize -> compile -> assemble, for target and draft.

    A second run reuses every finished stage; a changed option reruns only the stages that depend on it
    (engines/<target>/build.json records inputs, file hashes, tool versions and each stage).

    \b
    Examples:
      pipeline build                                       # SmolLM2-135M, n-gram draft, portable engine
      pipeline build --target llama-70b --draft eagle3 --dry-run   # the H100 plan, on any machine
      pipeline serve --repo triton_repo
    """
    from pipeline.build import BuildOptions, detect_environment, plan_build, run_build
    from pipeline.build.render import render_plan, render_summary

    options = BuildOptions(
        target=target, draft=draft, target_qformat=target_qformat, draft_qformat=draft_qformat,
        kv_cache_dtype=kv_cache_dtype, num_draft_tokens=num_draft_tokens, gate_batch_size=gate_batch_size,
        backend=backend, max_batch_size=max_batch_size, max_input_len=max_input_len, max_seq_len=max_seq_len,
        tp_size=tp_size, gpu=gpu, engines_dir=engines_dir, repo=repo, draft_budget_minutes=draft_budget_minutes,
        force=force)
    env = detect_environment(options)
    if dry_run:
        plan = plan_build(options, env)
        click.echo(json.dumps(plan.to_dict(), indent=2) if json_ else render_plan(plan))
        return
    result = run_build(options, env, quiet=quiet)
    click.echo(json.dumps(result.to_dict(), indent=2) if json_ else render_summary(result))
