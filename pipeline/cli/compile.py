"""`pipeline compile`: quantized checkpoints -> TensorRT-LLM engines/configs, or the portable engine folder."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.device import device_option
from pipeline.cli.draft_spec import DraftType
from pipeline.cli.setting import setting_option
from pipeline.routes import BACKEND_NAMES, ROUTE_CHOICES
from pipeline.setting import GATE_BATCH_SIZE, MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS


@click.command("compile")
@click.option("--backend", "-b", required=True, type=click.Choice(BACKEND_NAMES),
              help="trtllm: TensorRT-LLM engines or LLM-API config; torch: the portable engine folder.")
@click.option("--target", "-t", required=True, type=click.Path(path_type=Path),
              help="Target checkpoint folder from `pipeline quantize` (--export trtllm for --route engine).")
@click.option("--draft", "-d", default="none", show_default=True, type=DraftType(),
              help="none, ngram, a draft checkpoint folder, or eagle3:FOLDER (an EAGLE-3 head).")
@click.option("--route", default="auto", show_default=True, type=click.Choice(ROUTE_CHOICES),
              help="trtllm only. engine: trtllm-build; llmapi: PyTorch backend YAML. auto: from the checkpoint "
                   "layout (and llmapi for ngram/eagle3).")
@setting_option(NUM_DRAFT_TOKENS, 4, "(max_draft_len; 0 with --draft none)", minimum=0)
@setting_option(MAX_BATCH_SIZE, 64)
@click.option("max_input_len", "--max-input-len", type=int, help="Longest prompt [default: max-seq-len / 2].")
@setting_option(MAX_SEQ_LEN, None, "[default: min(4096, the target's max_position_embeddings)].")
@click.option("max_num_tokens", "--max-num-tokens", type=int,
              help="Tokens per iteration [default: max-batch-size x (K+1) + one context chunk].")
@setting_option(GATE_BATCH_SIZE, "32", "TensorRT-LLM: max_concurrency; EAGLE-3 is then written two-model, which 1.2 "
                                      "can gate. none: always speculate (one-model EAGLE-3).", allows_none=True)
@click.option("kv_cache_dtype", "--kv-cache-dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "fp8"]), help="auto: the checkpoint's.")
@click.option("free_gpu_memory_fraction", "--free-gpu-memory-fraction", type=float, default=0.9, show_default=True,
              help="The share of the GPU memory free after the weights load that the KV cache may take (TensorRT-LLM; "
                   "and the portable engine on a GPU without --kv-cache-bytes, up to max-batch-size x max-seq-len).")
@click.option("kv_cache_bytes", "--kv-cache-bytes", type=int,
              help="torch backend: the target's KV cache, a pool of 16-token blocks shared by all requests "
                   "[default: room for max-batch-size requests of max-seq-len tokens].")
@click.option("prefill_chunk", "--prefill-chunk", type=int, default=256, show_default=True,
              help="torch backend: prompt tokens prefilled per step; a longer prompt takes several, between the "
                   "running requests' decode steps.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="torch backend: reuse the KV blocks of a prompt prefix another request computed.")
@click.option("--ngram-first/--no-ngram-first", default=True, show_default=True,
              help="torch backend, EAGLE-3 heads: draft by n-gram lookup where the context has a 2+ token match, "
                   "by the head elsewhere.")
@click.option("tp_size", "--tp-size", type=int, help="llmapi route; the engine route reads the checkpoint's mapping.")
@click.option("pp_size", "--pp-size", type=int, help="llmapi route; the engine route reads the checkpoint's mapping.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp32", "bf16", "fp16"]),
              help="torch backend compute dtype (auto: the checkpoint's).")
@device_option("torch backend: where compile loads the engine to measure its step costs (--calibrate).")
@click.option("--gpu", help="Check the sizes fit this GPU's memory plan (see `pipeline plan`); default: the GPU nvidia-smi reports, if any.")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="torch backend with a draft: measure this machine's step costs (up to a minute) for the draft "
                   "planner, stored in the engine folder.")
@click.option("trtllm_version", "--trtllm-version",
              help="trtllm: the TensorRT-LLM release to write for: 1.2.1, or the 1.4 pre-release (LLM-API route only) "
                   "[default: the installed one, else 1.2.1, the newest stable].")
@click.option("dry_run", "--dry-run", is_flag=True, help="Write the configs and print the commands; build nothing.")
@click.option("--force", "-f", is_flag=True, help="Replace the output folder if it exists, and build even if the GPU plan doesn't fit.")
@click.option("json_", "--json", is_flag=True, help="Print the result as JSON.")
@click.option("output", "--output", "-o", type=click.Path(path_type=Path),
              help="Output folder [default: engines/<target folder name>-<backend>].")
def compile_command(backend, target, draft, route, num_draft_tokens, max_batch_size, max_input_len, max_seq_len,
            max_num_tokens, gate_batch_size, kv_cache_dtype, free_gpu_memory_fraction, kv_cache_bytes, prefill_chunk,
            prefix_caching, ngram_first, tp_size, pp_size, dtype, device, gpu, calibrate, trtllm_version, dry_run, force, json_,
            output):
    """Turn quantized checkpoints into what TensorRT-LLM serves, or the portable engine folder.

    Without TensorRT-LLM installed (it runs in NVIDIA's container), use --dry-run: it writes the
    configs and a build.sh/serve.sh, and prints the exact commands.

    \b
    Examples:
      pipeline compile -b trtllm -t ckpt/target-trt -d ckpt/draft-trt -k 4 --dry-run -o engines/dt
      pipeline compile -b trtllm -t ckpt/target-hf -d eagle3:heads/eagle3 -o engines/eagle3
      pipeline compile -b torch -t ckpt/target-hf -d ckpt/draft-hf -o engines/portable
    """
    from pipeline.compiler.compiler import compile_model
    from pipeline.compiler.options import DEFAULT_ENGINES_DIR, CompileOptions

    if output is None:
        output = DEFAULT_ENGINES_DIR / f"{Path(target).name}-{backend}"
    result = compile_model(CompileOptions(
        backend=backend, target=target, output=output, draft=draft, route=route, num_draft_tokens=num_draft_tokens,
        max_batch_size=max_batch_size, max_input_len=max_input_len, max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens, gate_batch_size=gate_batch_size, kv_cache_dtype=kv_cache_dtype,
        free_gpu_memory_fraction=free_gpu_memory_fraction, kv_cache_bytes=kv_cache_bytes, prefill_chunk=prefill_chunk,
        prefix_caching=prefix_caching, ngram_first=ngram_first, tp_size=tp_size, pp_size=pp_size, dtype=dtype, device=device, gpu=gpu,
        calibrate=calibrate, trtllm_version=trtllm_version, dry_run=dry_run, force=force))
    click.echo(json.dumps(result.to_dict(), indent=2) if json_ else result.render())
