"""`pipeline assemble`: write the Triton model repository that serves an engine folder from `pipeline compile`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from pipeline.cli.device import device_option
from pipeline.cli.setting import setting_option
from pipeline.routes import BACKEND_NAMES
from pipeline.setting import GATE_BATCH_SIZE, MAX_QUEUE_SIZE


@click.command()
@click.option("--engine", "-e", required=True, type=click.Path(path_type=Path),
              help="Engine folder from `pipeline compile` (--backend torch, or trtllm: engine or llmapi route).")
@click.option("--repo", "-r", type=click.Path(path_type=Path), default=Path("triton_repo"), show_default=True,
              help="Model repository to write.")
@click.option("--backend", "-b", type=click.Choice(["auto", *BACKEND_NAMES]), default="auto", show_default=True,
              help="Which engine folder this is; auto: engine.json means torch, a TensorRT-LLM compile.json trtllm.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="trtllm: the target's Hugging Face tokenizer folder (default: the checkpoint compile.json names).")
@click.option("llmapi_model_dir", "--llmapi-model-dir", default=None,
              help="llmapi route: where TensorRT-LLM's llmapi model.py is when serving "
                   "[default: /app/all_models/llmapi/tensorrt_llm/1, as in NVIDIA's Triton TensorRT-LLM container].")
@setting_option(GATE_BATCH_SIZE, 32, "The llmapi route takes compile's speculative_config.max_concurrency "
                                    "instead.")
@click.option("gate_hysteresis", "--gate-hysteresis", type=int, default=None,
              help="Once off, speculation comes back only at --gate-batch-size minus this many in flight "
                   "[default: gate batch size / 8, at least 1].")
@click.option("min_spec_tokens", "--min-spec-tokens", type=int, default=50, show_default=True,
              help="Requests asking for fewer new tokens never speculate.")
@click.option("max_input_bytes", "--max-input-bytes", type=int, default=None,
              help="Refuse a text_input longer than this many bytes, before tokenizing it [default: the engine's "
                   "max sequence length x 32].")
@setting_option(MAX_QUEUE_SIZE, None, "Portable engine [default: 4 per slot].")
@device_option("Portable engine: where the served engine loads when tritonserver starts without `pipeline serve "
               "--device` (which decides for its own runs); picked as it loads.")
@click.option("--force", "-f", is_flag=True, help="Replace an existing repository.")
@click.option("json_", "--json", is_flag=True, help="Print the result as JSON.")
def assemble(engine, repo, backend, tokenizer, llmapi_model_dir, gate_batch_size, gate_hysteresis, min_spec_tokens,
             max_input_bytes, max_queue_size, device, force, json_):
    """Write a Triton model repository for an engine folder.

    \b
    torch (portable engine): ensemble, preprocessing, speculation_gate, torch_engine, postprocessing,
      stop_request (a client stops its request by id instead of cancelling its stream).
    trtllm, engine route: the same with tensorrt_llm + tensorrt_llm_draft (tensorrtllm backend); the
      gate runs the draft -> target loop, streaming, for greedy requests.
    trtllm, llmapi route: TensorRT-LLM's llmapi model with compile's YAML, behind an ensemble with the
      client's names. Speculation there is TensorRT-LLM's own: speculative_config.max_concurrency turns
      it off above that batch size, and a request's speculation on/off can't reach it.

    \b
    Example:
      pipeline assemble --engine engines/smollm2 --repo ./triton_repo
      pipeline serve --repo ./triton_repo
    """
    from pipeline.triton.assemble import AssembleOptions, assemble as run
    from pipeline.triton.config import LLMAPI_MODEL_DIR

    result = run(AssembleOptions(engine=engine, repo=repo, backend=backend, tokenizer=tokenizer,
                                 llmapi_model_dir=llmapi_model_dir or LLMAPI_MODEL_DIR,
                                 gate_batch_size=gate_batch_size, gate_hysteresis=gate_hysteresis,
                                 min_spec_tokens=min_spec_tokens,
                                 max_input_bytes=max_input_bytes,
                                 max_queue_size=max_queue_size, device=device, force=force))
    if json_:
        click.echo(json.dumps(asdict(result), indent=2))
    else:
        click.echo(f"Wrote {result.repo} ({result.backend}, {result.route} route): {', '.join(result.models)}")
        for note in result.notes:
            click.echo(f"Note: {note}")
        click.echo(f"Serve it with: pipeline serve --repo {result.repo}")
