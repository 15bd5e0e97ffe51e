"""`pipeline generate`: decode prompts in process with the portable engine, or call a server with --url."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.cli.aliased import Aliased
from pipeline.cli.device import device_option
from pipeline.cli.draft_spec import DraftType
from pipeline.cli.setting import setting_option
from pipeline.errors import RequestError
from pipeline.generate import GenerateOptions
from pipeline.models.presets import DEFAULT_MODEL
from pipeline.policy.gate_policy import PORTABLE_CEILING
from pipeline.setting import GATE_BATCH_SIZE, MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_DRAFT_TOKENS

# Settings of the in-process engine: a served repository fixes them at `pipeline compile` / `assemble`.
IN_PROCESS_ONLY = ("model", "draft", "dtype", "device", "raw", "max_seq_len", "max_batch_size", "gate_batch_size",
                   "min_spec_tokens", "ngram_first")
URL_ONLY = ("speculation", "no_stream", "timeout", "wait")


@click.command()
@click.argument("prompt", required=False)
@click.option("prompts_file", "--prompts-file", cls=Aliased, hidden=("-f",), type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='More prompts: JSONL (one {"prompt": ...} per line) or plain text (one per line).')
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
              help="Target: a preset, a Hugging Face folder, a .gguf file or a hub id.")
@click.option("--draft", "-d", default=None, type=DraftType(),
              help="Proposer: none, ngram (prompt lookup), eagle3:DIR (an EAGLE-3 head), or a draft model "
                   "(preset, folder, .gguf, hub id). Default: none, or an engine folder's own (--model DIR).")
@setting_option(NUM_DRAFT_TOKENS, 4)
@click.option("--ngram-first/--no-ngram-first", default=None,
              help="With an EAGLE-3 head: draft by n-gram lookup where the context has a 2+ token match, by the head "
                   "elsewhere. Default: on, or an engine folder's own setting.")
@click.option("max_tokens", "--max-tokens", "-n", type=int, default=128, show_default=True,
              help="New tokens per prompt, at most.")
@click.option("--temperature", cls=Aliased, hidden=("-t",), type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("top_p", "--top-p", type=float, default=1.0, show_default=True)
@click.option("top_k", "--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (temperature > 0).")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="auto: the fastest lossless dtype on this CPU (bf16 on the engine's C kernels), bf16 on a GPU; said "
                   "in one line.")
@device_option("Where the engine runs in process (a served repository runs where `pipeline serve --device` says).")
@click.option("--raw", is_flag=True, help="Feed prompts as they are, without the chat template.")
@setting_option(MAX_SEQ_LEN, 2048)
@setting_option(MAX_BATCH_SIZE, 1, "Its KV-cache slots; raised to the number of prompts, which decode as one batch.")
@setting_option(GATE_BATCH_SIZE, PORTABLE_CEILING, "0 = never; build's default for the portable engine. An engine "
                                                   "folder (--model DIR) brings its own.", minimum=0)
@click.option("min_spec_tokens", "--min-spec-tokens", type=int, default=50, show_default=True,
              help="Requests with --max-tokens below this never speculate.")
@click.option("--url", "-u", metavar="HOST:PORT", default=None,
              help="Call tritonserver's gRPC endpoint (`pipeline serve`) instead of running the engine in process.")
@click.option("--speculation", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="With --url: auto lets the server's gate decide; on/off override it for these requests.")
@click.option("no_stream", "--no-stream", is_flag=True,
              help="With --url: get each answer as one response instead of streaming it.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="With --url: seconds to wait for the server's next response.")
@click.option("--wait", type=float, default=0.0, show_default=True,
              help="With --url: keep retrying this many seconds while the server starts and loads its models.")
@click.option("json_", "--json", is_flag=True, help="Print outputs and stats as JSON.")
@click.pass_context
def generate(ctx, prompt, prompts_file, model, draft, num_draft_tokens, ngram_first, max_tokens, temperature, top_p,
             top_k, seed, dtype, device, raw, max_seq_len, max_batch_size, gate_batch_size, min_spec_tokens, url,
             speculation, no_stream, timeout, wait, json_):
    """Generate text for PROMPT (and/or every prompt in --prompts-file).

    Several prompts are decoded together as one in-flight batch. Greedy by default; with
    speculation (--draft ngram or a draft model) the output is the same as without it.

    With --url HOST:PORT the prompts go to a served repository over gRPC instead, all at once. One
    prompt streams: its text prints as it arrives. The served engine fixes the model, draft, dtype,
    chat template, sizes, gate and device, so --model, --draft, --dtype, --device, --raw, --max-seq-len,
    --max-batch-size, --gate-batch-size and --min-spec-tokens are refused with --url; -k is sent
    only when given (else the repository's own). --speculation, --no-stream and --timeout need --url.

    \b
    Examples:
      pipeline generate "Write a Python function that reverses a string." --draft ngram
      pipeline generate "Write a Python function that reverses a string." --url 127.0.0.1:8001
    """
    from pipeline.generate import read_prompts_file

    prompts = [prompt] if prompt is not None else []
    if prompts_file is not None:
        prompts += read_prompts_file(prompts_file)
    if not prompts:
        raise click.UsageError("give a PROMPT or --prompts-file FILE")

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if url is not None:
        if refused := [flag(n) for n in IN_PROCESS_ONLY if given(n)]:
            raise RequestError(f"with --url the served repository fixes {', '.join(refused)}; drop it, or rebuild "
                               "the engine with `pipeline compile` and `pipeline assemble`")
        _generate_remote(prompts, url, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed, speculation=speculation,
                         num_draft_tokens=num_draft_tokens if given("num_draft_tokens") else None,
                         stream=not no_stream, timeout=timeout, wait=wait, json_=json_)
        return
    if misplaced := [flag(n) for n in URL_ONLY if given(n)]:
        raise RequestError(f"{', '.join(misplaced)} only apply with --url HOST:PORT; add --url, or drop them "
                           "(in process, --draft picks the proposer)")
    _generate_in_process(prompts, model=model, draft=draft, num_draft_tokens=num_draft_tokens, ngram_first=ngram_first,
                         max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                         dtype=dtype, device=device, raw=raw, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                         gate_batch_size=gate_batch_size, min_spec_tokens=min_spec_tokens, json_=json_)


def _generate_in_process(prompts, *, model, draft, num_draft_tokens, ngram_first, max_tokens, temperature, top_p,
                         top_k, seed, dtype, device, raw, max_seq_len, max_batch_size, gate_batch_size, min_spec_tokens,
                         json_):
    from pipeline.generate import dtype_line, generate as run_generate, stats_line

    result = run_generate(GenerateOptions(
        prompts=tuple(prompts), model=model, draft=draft, num_draft_tokens=num_draft_tokens, ngram_first=ngram_first,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype,
        device=device, raw=raw, max_seq_len=max_seq_len, max_batch_size=max_batch_size, gate_batch_size=gate_batch_size,
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
    click.echo(result.info.device_line, err=True)
    click.echo(dtype_line(result), err=True)
    click.echo(stats_line(result), err=True)


def _generate_remote(prompts, url, *, max_tokens, temperature, top_p, top_k, seed, speculation, num_draft_tokens,
                     stream, timeout, wait, json_):
    from pipeline.client.ensemble import ClientOptions, RequestOptions, generate_many, remote_stats_line, run_request

    client = ClientOptions(url=url, response_timeout_s=timeout, wait_s=wait)
    options = RequestOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                             speculation=speculation, num_draft_tokens=num_draft_tokens, stream=stream)
    if len(prompts) == 1 and not json_:
        # One prompt: print each response's text as it arrives (click.echo flushes).
        result = run_request(client, prompts[0], options, on_chunk=lambda chunk: click.echo(chunk.text, nl=False))
        click.echo()
        click.echo(remote_stats_line([result], result.total_s, url), err=True)
        return
    batch = generate_many(client, prompts, options)
    if json_:
        click.echo(json.dumps(batch.to_json_dict(), indent=2))
        return
    for i, out in enumerate(batch.results, 1):
        head = " ".join(out.prompt.split())
        click.echo(f"=== [{i}/{len(batch.results)}] {head[:70]}{'...' if len(head) > 70 else ''}")
        click.echo(out.text)
        if i < len(batch.results):
            click.echo()
    click.echo(remote_stats_line(batch.results, batch.wall_s, url), err=True)
