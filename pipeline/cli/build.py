"""`pipeline build`: model names -> quantized checkpoints -> engine -> Triton repository, in one command."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.build_flags import build_flags, build_options
from pipeline.cli.device import device_option


@click.command()
@build_flags
@click.option("engines_dir", "--engines-dir", type=click.Path(path_type=Path), default=Path("engines"),
              show_default=True, help="Builds go to ENGINES_DIR/<target>/ (build.json, checkpoints, engine/).")
@click.option("--repo", "-r", type=click.Path(path_type=Path), default=Path("triton_repo"), show_default=True,
              help="The Triton model repository to write.")
@device_option("Portable engine: where compile measures its step costs and the repository's engine loads (`pipeline "
               "serve --device` decides for its own runs).")
@click.option("dry_run", "--dry-run", is_flag=True, help="Print the plan (stages, commands, configs, memory plan); "
                                                          "touch nothing.")
@click.option("--force", "-f", is_flag=True, help="Rebuild every stage, replace outputs this build didn't write, "
                                                  "and build even if the memory plan doesn't fit.")
@click.option("json_", "--json", is_flag=True, help="Print the plan or the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (they show only when stderr is a terminal).")
def build(target, draft, draft_budget_minutes, target_qformat, draft_qformat, kv_cache_dtype, num_draft_tokens, gate_batch_size, backend,
          max_batch_size, max_input_len, max_seq_len, tp_size, gpu, trtllm_version, engines_dir, repo, device, dry_run,
          force, json_, quiet):
    """Build everything `pipeline serve` needs: quantize -> compile -> assemble, for target and draft.

    A second run reuses every finished stage; a changed option reruns only the stages that depend on it
    (engines/<target>/build.json records inputs, file hashes, tool versions and each stage).

    \b
    Examples:
      pipeline build                                       # SmolLM2-135M, n-gram draft, portable engine
      pipeline build --target llama-70b --draft eagle3 --dry-run   # the H100 plan, on any machine
      pipeline serve --repo triton_repo
    """
    from pipeline.build import detect_environment, plan_build, run_build
    from pipeline.build.render import render_plan, render_summary

    options = build_options(**locals())  # the parameters, as Click passed them
    env = detect_environment(options)
    if dry_run:
        plan = plan_build(options, env)
        click.echo(json.dumps(plan.to_dict(), indent=2) if json_ else render_plan(plan))
        return
    result = run_build(options, env, quiet=quiet)
    click.echo(json.dumps(result.to_dict(), indent=2) if json_ else render_summary(result))
