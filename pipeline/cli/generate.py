"""`pipeline generate`: decode prompts in process with the portable engine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.generate import DEFAULT_MODEL, GenerateOptions


@click.command()
@click.argument("prompt", required=False)
@click.option("prompts_file", "--prompts-file", "-f", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='More prompts: JSONL (one {"prompt": ...} per line) or plain text (one per line).')
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help="Target: a preset, a Hugging Face folder, a .gguf file or a hub id.")
@click.option("--draft", "-d", default="none", show_default=True,
              help="Proposer: none, ngram (prompt lookup), eagle3:DIR (an EAGLE-3 head), or a draft model "
                   "(preset, folder, .gguf, hub id).")
@click.option("num_draft_tokens", "--num-draft-tokens", "-k", type=int, default=4, show_default=True,
              help="Tokens drafted per speculative step.")
@click.option("max_tokens", "--max-tokens", "-n", type=int, default=128, show_default=True,
              help="New tokens per prompt, at most.")
@click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("top_p", "--top-p", type=float, default=1.0, show_default=True)
@click.option("top_k", "--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (temperature > 0).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="bf16", show_default=True)
@click.option("--raw", is_flag=True, help="Feed prompts as they are, without the chat template.")
@click.option("max_seq_len", "--max-seq-len", type=int, default=2048, show_default=True,
              help="Prompt + new tokens per request.")
@click.option("max_batch_size", "--max-batch-size", type=int, default=1, show_default=True,
              help="KV-cache slots; raised to the number of prompts, which decode as one batch.")
@click.option("gate_batch_size", "--gate-batch-size", type=int, default=32, show_default=True,
              help="Speculate only while the decoding batch is at or below this (0 = never).")
@click.option("min_spec_tokens", "--min-spec-tokens", type=int, default=50, show_default=True,
              help="Requests with --max-tokens below this never speculate.")
@click.option("json_", "--json", is_flag=True, help="Print outputs and stats as JSON.")
def generate(prompt, prompts_file, model, draft, num_draft_tokens, max_tokens, temperature, top_p, top_k, seed,
             dtype, raw, max_seq_len, max_batch_size, gate_batch_size, min_spec_tokens, json_):
    """Generate text for PROMPT (and/or every prompt in --prompts-file).

    Several prompts are decoded together as one in-flight batch. Greedy by default; with
    speculation (--draft ngram or a draft model) the output is the same as without it.

    \b
    Example:
      pipeline generate "Write a Python function that reverses a string." --draft ngram
    """
    from pipeline.generate import generate as run_generate, read_prompts_file, stats_line

    prompts = [prompt] if prompt is not None else []
    if prompts_file is not None:
        prompts += read_prompts_file(prompts_file)
    if not prompts:
        raise click.UsageError("give a PROMPT or --prompts-file FILE")

    result = run_generate(GenerateOptions(
        prompts=tuple(prompts), model=model, draft=draft, num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
        raw=raw, max_seq_len=max_seq_len, max_batch_size=max_batch_size, gate_batch_size=gate_batch_size,
        min_spec_tokens=min_spec_tokens,
    ))
    if json_:
        click.echo(json.dumps(result.to_json_dict(), indent=2))
        return
    many = len(result.outputs) > 1
    for i, out in enumerate(result.outputs, 1):
        if many:
            head = " ".join(out.prompt.split())
            click.echo(f"=== [{i}/{len(result.outputs)}] {head[:70]}{'...' if len(head) > 70 else ''}")
        click.echo(out.text)
        if many and i < len(result.outputs):
            click.echo()
    click.echo(stats_line(result), err=True)
