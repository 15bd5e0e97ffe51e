"""Acceptance of a draft head on held-out prompts: per position, and the mean acceptance length at K.

Greedy chain drafting makes the first K drafts of a K=6 proposal the very drafts a K proposal would
make from the same state, so one K=6 run also gives, for every K <= 6, the expected tokens per
target forward at the states it visits: 1 + sum_{j<=K} P(drafts 1..j all accepted).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.draft import budget
from pipeline.engine.stats import cost_line


def acceptance_from_stats(stats) -> dict:
    """P(the first j drafts are all accepted), j = 1..K, and the derived mean acceptance length per K."""
    cum = stats.acceptance_per_position  # accepted_per_position[j] counts rows with > j accepted
    return {
        "verify_steps": stats.verified_rows,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "accepted_through_position": [round(x, 4) for x in cum],
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "mean_acceptance_length_at_k": {k: round(1 + sum(cum[:k]), 4) for k in range(1, len(cum) + 1)},
        # the head's proposals against the target's steps, as timed in the same run (EngineStats.draft_cost)
        "draft_cost": stats.draft_cost(),
    }


def measure_acceptance(target: Path, head_dir: Path, prompt_ids: list[list[int]], ks=(6,),
                       max_new_tokens: int = 64, eos_token_ids: tuple[int, ...] = (), dtype: str = "fp32",
                       batch_size: int = 8, deadline: float | None = None) -> dict:
    """Run the engine with the head at each K over the prompts (greedy); JSON-ready per K.

    With a deadline (budget.now()), decoding stops at the first step past it and a K reports what was
    verified by then (`finished_prompts` of `prompts`), or None if nothing was.
    """
    from pipeline.draft_spec import DraftSpec
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.sampling import SamplingParams

    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + 8
    out = {"prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "by_k": {}}
    for k in ks:
        out["by_k"][k] = None
        if deadline is not None and budget.now() > deadline:
            continue
        config = EngineConfig(max_batch_size=batch_size, max_seq_len=max_len, dtype=dtype, num_draft_tokens=k,
                              gate=GatePolicy(max_batch_size=batch_size, hysteresis=0, min_tokens=0))
        engine = LLMEngine.load(target, config, draft=DraftSpec("eagle3", str(head_dir)), eos_token_ids=eos_token_ids)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=max_new_tokens)) for p in prompt_ids]
        while engine.has_unfinished() and (deadline is None or budget.now() <= deadline):
            engine.step()
        done = sum(r.finished for r in reqs)
        if engine.stats.verified_rows or done == len(reqs):
            out["by_k"][k] = {**acceptance_from_stats(engine.stats), "finished_prompts": done}
    return out


def acceptance_table(acc: dict | None) -> str:
    """A markdown table: K, measured mean acceptance length, and P(first j accepted) per position."""
    rows = ["| K run | accepted through position 1..K | mean acceptance length | derived mean length at K=1..K |",
            "|---|---|---|---|"]
    for k, a in (acc or {}).get("by_k", {}).items():
        if a is None:
            rows.append(f"| {k} | not measured: the budget ran out | | |")
            continue
        pos = " ".join(f"{x:.2f}" for x in a["accepted_through_position"])
        derived = " ".join(f"{v:.2f}" for v in a["mean_acceptance_length_at_k"].values())
        rows.append(f"| {k} | {pos} | {a['mean_acceptance_length']:.2f} | {derived} |")
    return "\n".join(rows)


def train_summary(result) -> str:
    """The text `pipeline draft train` prints for a TrainResult; a metric the run didn't get reads "none"."""
    loss = "none" if result.final_loss is None else f"{result.final_loss:.3f}"
    trained = (f"  {result.train_prompts} prompts, {result.answers} answers and {result.text_samples} text samples "
               f"({result.train_tokens} tokens), {result.steps} steps ({result.epochs} epochs, "
               f"{result.train_precision}) in {result.train_seconds:.0f} s, stopped by {result.stopped_by}; "
               f"loss {loss}, train accuracy per step {result.train_acc or 'none'}")
    lines = [f"trained {result.method} head for {result.target} -> {result.output}", trained,
             f"  {result.total_seconds:.0f} s in all, budget {result.budget_minutes:g} min"]
    if result.acceptance:
        lines += [f"  acceptance on {result.heldout_prompts} held-out prompts (greedy):",
                  acceptance_table(result.acceptance)]
        lines += [f"  draft cost at K={k}: {cost_line(a['draft_cost'])}" for k, a in result.acceptance["by_k"].items()
                  if a and a.get("draft_cost")]
    else:
        lines.append("  acceptance: not measured")
    return "\n".join(lines)
