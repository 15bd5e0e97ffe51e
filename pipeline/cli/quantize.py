"""`pipeline quantize`: post-training quantization with NVIDIA ModelOpt, exported as HF or TensorRT-LLM."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.aliased import Aliased
from pipeline.models.presets import DEFAULT_MODEL
from pipeline.quantize.formats import EXPORTS, FORMATS, KV_CACHE_DTYPES


@click.command()
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help="Model to quantize: a preset, a Hugging Face folder, a .gguf file or a hub id.")
@click.option("--qformat", cls=Aliased, hidden=("-q",), required=True, help=f"Format: {', '.join(FORMATS)}.")
@click.option("kv_cache_dtype", "--kv-cache-dtype", default="none", show_default=True,
              help=f"KV-cache quantization: {', '.join(KV_CACHE_DTYPES)}.")
@click.option("calib_size", "--calib-size", type=int, default=32, show_default=True, help="Calibration samples.")
@click.option("calib_seq_len", "--calib-seq-len", type=int, default=256, show_default=True,
              help="Tokens per calibration (and evaluation) sample.")
@click.option("calib_data", "--calib-data", default="builtin", show_default=True,
              help='"builtin" (offline prose + Python code) or a file: .txt (samples separated by blank lines) '
                   'or .jsonl (one {"text": ...} per line).')
@click.option("eval_size", "--eval-size", type=int, default=8, show_default=True,
              help="Held-out samples for perplexity and top-1 agreement.")
@click.option("--export", "export", default="hf", show_default=True,
              help=f"Checkpoint: {' or '.join(EXPORTS)} (unified Hugging Face, or TensorRT-LLM).")
@click.option("tp_size", "--tp-size", type=int, default=1, show_default=True, help="TensorRT-LLM tensor parallel.")
@click.option("pp_size", "--pp-size", type=int, default=1, show_default=True, help="TensorRT-LLM pipeline parallel.")
@click.option("--force", "-f", is_flag=True, help="Replace the output folder if it exists.")
@click.option("json_", "--json", is_flag=True, help="Print the report as JSON.")
@click.option("output", "--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Output folder (must not exist unless --force).")
def quantize(model, qformat, kv_cache_dtype, calib_size, calib_seq_len, calib_data, eval_size, export, tp_size,
             pp_size, force, json_, output):
    """Quantize one model with NVIDIA ModelOpt and export a checkpoint to -o DIR.

    Calibrates on --calib-size x --calib-seq-len tokens, measures perplexity and top-1 agreement
    against the unquantized model on held-out text, and writes DIR/report.json. Target and draft
    are quantized separately, each with its own format.

    \b
    Example:
      pipeline quantize --model smollm2-135m --qformat fp8 -o out/smol-fp8
    """
    from pipeline.quantize import QuantizeOptions, quantize as run_quantize, render_table

    report = run_quantize(QuantizeOptions(
        model=model, output=output, qformat=qformat, kv_cache_dtype=kv_cache_dtype.strip().lower(),
        calib_size=calib_size, calib_seq_len=calib_seq_len, calib_data=calib_data, eval_size=eval_size,
        export=export.strip().lower(), tp_size=tp_size, pp_size=pp_size, force=force,
    ))
    click.echo(json.dumps(report.to_dict(), indent=2) if json_ else render_table(report))
