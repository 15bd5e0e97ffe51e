"""`pipeline assemble`: write the Triton model repository that serves a portable engine folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click


@click.command()
@click.option("--engine", "-e", required=True, type=click.Path(path_type=Path),
              help="Portable engine folder from `pipeline compile --backend torch`.")
@click.option("--repo", "-r", type=click.Path(path_type=Path), default=Path("triton_repo"), show_default=True,
              help="Model repository to write.")
@click.option("gate_batch_size", "--gate-batch-size", type=int, default=32, show_default=True,
              help="Speculate while at most this many requests are in flight.")
@click.option("min_spec_tokens", "--min-spec-tokens", type=int, default=50, show_default=True,
              help="Requests asking for fewer new tokens never speculate.")
@click.option("acceptance_floor", "--acceptance-floor", type=float, default=0.5, show_default=True,
              help="Auto requests stop speculating while the rolling draft acceptance rate is below this "
                   "(every 8th still speculates, to measure); 0 turns the floor off.")
@click.option("--force", "-f", is_flag=True, help="Replace an existing repository.")
@click.option("json_", "--json", is_flag=True, help="Print the result as JSON.")
def assemble(engine, repo, gate_batch_size, min_spec_tokens, acceptance_floor, force, json_):
    """Write a Triton model repository (ensemble, preprocessing, speculation_gate, torch_engine,
    postprocessing) for a portable engine folder.

    \b
    Example:
      pipeline assemble --engine engines/smollm2 --repo ./triton_repo
      pipeline serve --repo ./triton_repo
    """
    from pipeline.triton.assemble import AssembleOptions, assemble as run

    result = run(AssembleOptions(engine=engine, repo=repo, gate_batch_size=gate_batch_size,
                                 min_spec_tokens=min_spec_tokens, acceptance_floor=acceptance_floor, force=force))
    if json_:
        click.echo(json.dumps(asdict(result), indent=2))
    else:
        click.echo(f"Wrote {result.repo}: {', '.join(result.models)}")
        click.echo(f"Serve it with: pipeline serve --repo {result.repo}")
