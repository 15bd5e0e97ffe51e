"""`pipeline bench`: does speculation pay on this machine, and up to what concurrency?"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pipeline.errors import ConfigError


def _levels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of whole numbers",
                                 param_hint="--concurrency") from None


@click.command()
@click.option("engine", "--engine", type=click.Path(path_type=Path),
              help="A portable engine folder (`pipeline build` writes engines/<name>/engine), run in this process.")
@click.option("--url", help="Or a served repository's gRPC endpoint, HOST:PORT (`pipeline serve`).")
@click.option("sets", "--prompts", "-p", multiple=True, default=("code", "chat"), show_default=True,
              help="Prompt sets: code (edits that copy the prompt), chat (free answers), long (512 tokens), or a "
                   "JSONL/text file of prompts. Repeat for several.")
@click.option("concurrency", "--concurrency", "-c", default="1,2,4,8,16,32,64", show_default=True,
              help="Requests in flight, comma-separated.")
@click.option("modes", "--modes", default="off,on,gated", show_default=True,
              help="off (no drafts), on (always draft), gated (the gate and the per-request planner decide).")
@click.option("requests", "--requests", type=int, help="Requests per point [default: 2 x concurrency, at least 8].")
@click.option("max_tokens", "--max-tokens", type=int, help="New tokens per request [default: the set's own].")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Rounds per concurrency, modes interleaved; each point is its fastest round. Use 2 or more on a "
                   "shared or noisy machine, where single runs of identical work differ by more than the 3% target.")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="In process: measure the cost model for the largest concurrency when the engine's doesn't cover it.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=Path("bench.png"), show_default=True,
              help="Where to write the PNG of tokens/s against concurrency.")
@click.option("--apply", "apply_", is_flag=True,
              help="Write the fitted gate ceiling into --repo's speculation_gate and the engine folder's engine.json, "
                   "and the measured cost model into the engine folder.")
@click.option("--repo", type=click.Path(path_type=Path), help="The repository --apply updates.")
@click.option("json_", "--json", is_flag=True, help="Print the results as JSON (the table goes to stderr).")
def bench(engine, url, sets, concurrency, modes, requests, max_tokens, repeats, calibrate, plot_path, apply_, repo,
          json_):
    """Sweep concurrency with speculation off, always on and gated; report tokens/s, TTFT, ITL and acceptance;
    fit where speculation stops paying.

    \b
    Examples:
      pipeline bench --engine engines/smollm2-135m/engine
      pipeline bench --url 127.0.0.1:8001 -p chat -p my_prompts.jsonl -c 1,4,16
      pipeline bench --engine engines/smollm2-135m/engine --apply --repo triton_repo
    """
    from pipeline.bench.prompts import prompt_set
    from pipeline.bench.report import plot, render_table, to_json
    from pipeline.bench.sweep import BenchOptions, EngineTarget, ServedTarget
    from pipeline.engine.stats import cost_line, drafted_by

    options = BenchOptions(engine=engine, url=url, sets=tuple(sets), concurrency=_levels(concurrency),
                           modes=tuple(m.strip() for m in modes.split(",") if m.strip()), requests=requests,
                           max_tokens=max_tokens, repeats=repeats, calibrate=calibrate).validate()
    if apply_ and (engine is None and repo is None):
        raise ConfigError("--apply needs --repo (the gate ceiling) or --engine (the cost model) to write to")
    prompt_sets = [prompt_set(s, max_tokens) for s in options.sets]

    def say(line: str) -> None:
        click.echo(f"bench: {line}", err=True)

    min_tokens = _gate_min_tokens(repo)
    short = sorted({p.max_tokens for p in prompt_sets if p.max_tokens < min_tokens})
    if short and "gated" in options.modes:
        say(f"warning: {short[0]} new tokens per request is under the gate's min tokens ({min_tokens}), so gated "
            f"requests never speculate and the gated rows measure plain decoding; pass --max-tokens {min_tokens} or "
            "more, or serve a repository built with a lower --min-spec-tokens")
    target = (EngineTarget(engine, max(options.concurrency), options.calibrate, say) if engine is not None
              else ServedTarget(url))
    points = _sweep_with_progress(target, prompt_sets, options, say)
    table = render_table(points, target.name)
    written = plot(points, plot_path, f"pipeline bench: {target.name}")
    extra = {"plot": str(written), "options": {"sets": list(options.sets), "concurrency": list(options.concurrency),
                                              "modes": list(options.modes), "requests": options.requests,
                                              "max_tokens": options.max_tokens, "repeats": options.repeats}}
    calibration = getattr(target, "calibration", None)
    if calibration is not None:
        extra["cost_model"] = calibration.cost.to_json()
    # In process: what the proposer cost beside the target's steps over the whole sweep (EngineStats.draft_cost).
    cost = target.engine.stats.draft_cost() if isinstance(target, EngineTarget) else None
    if cost is not None:
        extra["draft_cost"] = cost
        table += f"\ndraft cost over the sweep: {cost_line(cost)}"
        sources = target.engine.describe().get("draft", {}).get("ngram_first")
        if sources:
            table += f" (rows drafted by {drafted_by(sources)})"
    applied = _apply(points, engine, repo, calibration) if apply_ else []
    if apply_:
        extra["applied"] = applied
    if json_:
        click.echo(table, err=True)
        click.echo(json.dumps(to_json(points, target.name, extra), indent=2))
    else:
        click.echo(table)
        click.echo(f"plot: {written}")
        for line in applied:
            click.echo(f"applied: {line}")


def _gate_min_tokens(repo: Path | None) -> int:
    """The gate's min tokens: --repo's speculation_gate setting, else the default every build starts from."""
    from pipeline.policy.gate_policy import GatePolicy

    from pipeline.triton.config import CONFIG_FILE, GATE, read_config

    if repo is not None and (repo / GATE / CONFIG_FILE).is_file():
        params = read_config(repo / GATE).parameters
        if "gate_min_tokens" in params:
            return int(params["gate_min_tokens"].string_value)
    return GatePolicy().min_tokens


def _sweep_with_progress(target, prompt_sets, options, say):
    from pipeline.bench.sweep import sweep

    total = len(prompt_sets) * len(options.concurrency) * len(options.modes)

    def shown(p):
        return p and f"{p.set} c={p.concurrency} {p.mode} {p.tokens_per_s:.1f} tok/s"

    if sys.stderr.isatty():
        with click.progressbar(length=total, label="bench", file=sys.stderr, item_show_func=shown) as bar:
            return sweep(target, prompt_sets, options, lambda p: bar.update(1, p))
    done = iter(range(1, total + 1))  # a log file: one line per point instead of a bar
    return sweep(target, prompt_sets, options, lambda p: say(f"[{next(done)}/{total}] {shown(p)}"))


def _apply(points, engine: Path | None, repo: Path | None, calibration) -> list[str]:
    """Write the fitted ceiling (repository and engine.json) and the measured cost model; one line per write."""
    from pipeline.bench import apply as applying
    from pipeline.bench.report import fitted_threshold

    applied = []
    threshold = fitted_threshold(points)
    if repo is not None and threshold is not None:
        applied.append(applying.apply_threshold(repo, threshold))
    if engine is not None and threshold is not None:
        applied.append(applying.apply_engine_threshold(engine, threshold))
    if engine is not None and calibration is not None:
        applied.append(applying.apply_cost_model(engine, calibration.cost))
    if threshold is not None:
        applied.append(f"a later `pipeline build` writes these again from its flags: pass --gate-batch-size "
                       f"{threshold} to keep the ceiling")
    return applied
