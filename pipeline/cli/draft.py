"""`pipeline draft`: draft heads for speculative decoding (train one for a target)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.models.presets import DEFAULT_MODEL


@click.group()
def draft():
    """Draft heads for speculative decoding."""


@draft.command()
@click.option("--target", "-t", default=DEFAULT_MODEL, show_default=True,
              help="Target model: a preset, a Hugging Face folder, a .gguf file or a hub id.")
@click.option("--method", default="eagle3", show_default=True, help="Head type: eagle3 (ModelOpt EAGLE-3).")
@click.option("--data", default="builtin", show_default=True,
              help='"builtin" (the shipped prompt set) or a file: one prompt per line, or JSONL with "prompt".')
@click.option("budget_minutes", "--budget-minutes", type=float, default=10.0, show_default=True,
              help="Wall-clock budget for the whole run (answers, hidden states, training, export, acceptance); "
                   "training gets at least half. Too short to train a head: an error, and nothing is exported.")
@click.option("draft_vocab_size", "--draft-vocab-size", type=int, default=None,
              help="Reduced draft vocabulary (most frequent tokens of the answers). Default: the largest power of "
                   "two, 1024 to 32768, whose lm_head has at most 0.6 of the head layer's weights (SmolLM2: 4096, "
                   "Llama-3-8B: 32768).")
@click.option("max_new_tokens", "--max-new-tokens", type=int, default=128, show_default=True,
              help="Length of the target's answer to each prompt (the training text).")
@click.option("text_samples", "--text-samples", type=int, default=128, show_default=True,
              help="Also distil on this many 256-token samples of the built-in prose/code text (one target "
                   "forward each, no generation); 0 trains on the answers only.")
@click.option("answer_rounds", "--answer-rounds", type=int, default=None,
              help="Answers per prompt: the first greedy, the rest sampled (temperature 0.8). Default: as many as "
                   "35% of the budget allows, up to 24 and one per 2 minutes of budget; a rerun with a larger "
                   "budget adds rounds.")
@click.option("max_epochs", "--epochs", type=int, default=50, show_default=True, help="At most this many epochs.")
@click.option("--force", "-f", is_flag=True, help="Replace the output folder if it exists.")
@click.option("json_", "--json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (they show only when stderr is a terminal).")
@click.option("output", "--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Output folder for the exported head (must not exist unless --force).")
def train(target, method, data, budget_minutes, draft_vocab_size, max_new_tokens, text_samples, answer_rounds,
          max_epochs, force, json_, quiet, output):
    """Train a draft head for TARGET by self-distillation, and export it to -o DIR.

    The target answers the prompts (this project's engine), its hidden states are cached, and
    ModelOpt trains the head on them until --epochs or the budget runs out. A rerun with the same
    settings resumes from the last checkpoint. Run the head with `--draft eagle3:DIR`.

    \b
    Example:
      pipeline draft train --target smollm2-135m --budget-minutes 10 -o heads/smol-eagle3
      pipeline generate "Write a Python function that reverses a string." --draft eagle3:heads/smol-eagle3
    """
    from pipeline.draft.report import train_summary
    from pipeline.draft.train import TrainOptions, train_draft

    result = train_draft(TrainOptions(
        target=target, output=output, method=method.strip().lower(), data=data, budget_minutes=budget_minutes,
        draft_vocab_size=draft_vocab_size, max_new_tokens=max_new_tokens, text_samples=text_samples,
        answer_rounds=answer_rounds, max_epochs=max_epochs, force=force,
        progress=not (json_ or quiet)))
    click.echo(json.dumps(result.to_dict(), indent=2) if json_ else train_summary(result))
