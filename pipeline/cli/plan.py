"""`pipeline plan`: will the target, its draft and their KV cache fit on N GPUs, and what's the smallest N?"""

from __future__ import annotations

import json

import click

from pipeline.cli.aliased import Aliased
from pipeline.cli.draft_spec import DraftType
from pipeline.cli.setting import setting_option
from pipeline.plan.gpus import GPUS
from pipeline.plan.weights import WEIGHT_FORMATS
from pipeline.routes import BACKEND_NAMES
from pipeline.setting import MAX_BATCH_SIZE, MAX_SEQ_LEN


@click.command()
@click.option("--target", "-t", cls=Aliased, hidden=("-m",), required=True,
              help="Target model: a preset (e.g. llama-70b) or a local folder.")
@click.option("--draft", "-d", default="none", show_default=True, type=DraftType(),
              help="eagle3 (the target's EAGLE-3 head), ngram (no weights), none, or a draft model (preset/folder).")
@click.option("--gpu", "-g", required=True, help=f"GPU kind: {', '.join(GPUS)}.")
@click.option("tp", "--tp-size", cls=Aliased, hidden=("--tp",), type=int, default=1, show_default=True,
              help="Tensor parallel size (GPUs).")
@click.option("target_qformat", "--target-qformat", default="none", show_default=True,
              help=f"Target weight format: {', '.join(WEIGHT_FORMATS)}.")
@click.option("draft_qformat", "--draft-qformat", default="none", show_default=True,
              help=f"Draft weight format: {', '.join(WEIGHT_FORMATS)}.")
@click.option("kv_cache_dtype", "--kv-cache-dtype", default="bf16", show_default=True, help="KV cache: bf16 or fp8.")
@setting_option(MAX_BATCH_SIZE, 16)
@setting_option(MAX_SEQ_LEN, 4096)
@click.option("--backend", "-b", default="trtllm", show_default=True, type=click.Choice(BACKEND_NAMES),
              help="trtllm: TensorRT-LLM's engines on tp GPUs; torch: the portable engine on one GPU (--device "
                   "cuda): its weights, the KV pool it sizes from the free memory, and the --max-seq-len requests it "
                   "holds.")
@click.option("free_gpu_memory_fraction", "--free-gpu-memory-fraction", type=float, default=None,
              help="torch: the share of the memory free after the weights the KV pool may take, as `pipeline "
                   "compile`'s [default: 0.9].")
@click.option("json_", "--json", is_flag=True, help="Print the plan as JSON (bytes).")
def plan(target, draft, gpu, tp, target_qformat, draft_qformat, kv_cache_dtype, max_batch_size, max_seq_len, backend,
         free_gpu_memory_fraction, json_):
    """Plan GPU memory: weights per format, KV cache per dtype, reserve, headroom, verdict and smallest TP.

    Needs no GPU and no weights: presets carry their architecture. Exits 1 when the verdict is DOES NOT FIT.
    With --backend torch it plans the portable engine on one GPU instead: bf16 weights, then the KV pool the
    engine sizes as it loads, and how many requests of --max-seq-len that pool holds at once.

    \b
    Examples:
      pipeline plan --target llama-70b --draft eagle3 --gpu h100-80gb --target-qformat fp8
      pipeline plan --target llama-3.1-8b --draft ngram --gpu h200 --backend torch
    """
    from pipeline.errors import PlanError
    from pipeline.plan import plan_inputs, plan_memory, plan_portable, render_portable, render_table
    from pipeline.routes import backend_named

    inputs = plan_inputs(
        target=target, gpu=gpu, draft=draft, tp=tp, target_qformat=target_qformat, draft_qformat=draft_qformat,
        kv_cache_dtype=kv_cache_dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    if not backend_named(backend).plans_gpu_memory:  # the portable engine sizes its KV pool from what is left
        result = plan_portable(inputs, 0.9 if free_gpu_memory_fraction is None else free_gpu_memory_fraction)
        click.echo(json.dumps(result.to_dict(), indent=2) if json_ else render_portable(result))
    else:
        if free_gpu_memory_fraction is not None:
            raise PlanError("--free-gpu-memory-fraction plans the portable engine's KV pool (--backend torch); the "
                            "TensorRT-LLM plan reserves max(2 GiB, 10%) per GPU: drop it")
        result = plan_memory(inputs)
        click.echo(json.dumps(result.to_dict(), indent=2) if json_ else render_table(result))
    if not result.fits:  # scripts can branch on it: 1, as a failed check
        raise click.exceptions.Exit(1)
