"""Generate text with the portable engine: the library behind `pipeline generate`.

`generate(options)` resolves the target (and draft), validates every setting before any weights
load, decodes all prompts as one in-flight batch, and returns typed results. Heavy imports (torch,
transformers, the engine) happen inside the functions that need them, so importing this module is
instant and `pipeline --help` stays fast.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.engine.draft_plan import speculation_summary
from pipeline.errors import RequestError

DEFAULT_MODEL = "smollm2-135m"
NO_DRAFT = "none"
NGRAM_DRAFT = "ngram"


@dataclass(frozen=True)
class GenerateOptions:
    prompts: tuple[str, ...]
    model: str = DEFAULT_MODEL  # preset, HF folder, .gguf file, hub id, or a `pipeline compile --backend torch` folder
    draft: str = NO_DRAFT  # "none", "ngram", or a draft model reference like `model`
    num_draft_tokens: int = 4  # k
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    dtype: str = "bf16"
    raw: bool = False  # skip the chat template
    max_seq_len: int = 2048
    max_batch_size: int = 1  # raised to the number of prompts: all of them decode as one batch
    gate_batch_size: int = 32  # speculate while the decoding batch is at or below this
    gate_hysteresis: int = 4
    min_spec_tokens: int = 50  # requests asking for fewer new tokens never speculate

    @property
    def draft_kind(self) -> str:
        """"none", "ngram", "eagle3" (eagle3:DIR, an EAGLE-3 head) or "model"."""
        d = self.draft.strip().lower()
        if d.startswith("eagle3:"):
            return "eagle3"
        return d if d in (NO_DRAFT, NGRAM_DRAFT) else "model"


@dataclass(frozen=True)
class Output:
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    # Its decode steps that drafted, and those that didn't by reason (engine/draft_plan.py).
    draft_steps: int = 0
    skipped_steps: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInfo:
    """What actually ran: resolved models and the effective engine settings."""

    model: str
    model_path: str
    draft: str  # "none", "ngram" or the draft's name
    draft_path: str | None
    dtype: str
    num_draft_tokens: int
    max_batch_size: int
    max_seq_len: int
    gate_batch_size: int
    min_spec_tokens: int
    chat_template: bool
    load_time_s: float
    engine: dict  # LLMEngine.describe(): weight formats and the kernels that run them


@dataclass(frozen=True)
class GenerateResult:
    outputs: list[Output]
    stats: dict  # EngineStats.to_dict(): decode-time counters, loading excluded
    info: RunInfo

    def to_json_dict(self) -> dict:
        return {
            "outputs": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                         "speculation": {"draft_steps": o.draft_steps, "skipped_steps": o.skipped_steps}}
                        for o in self.outputs],
            "stats": self.stats,
            "config": asdict(self.info),
        }


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL (one {"prompt": ...} object per line) or plain text (one per line).

    A `.jsonl`/`.json` file must be JSONL. Any other file is JSONL when every non-blank line is a
    JSON object with a "prompt"; otherwise each non-blank line is a prompt.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RequestError(f"can't read prompts file {path} ({type(err).__name__}); pass a readable UTF-8 text "
                           "or JSONL file") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise RequestError(f"prompts file {path} is empty; put one prompt per line, or one "
                           '{"prompt": ...} object per line')
    if path.suffix.lower() in (".jsonl", ".json"):
        return [_jsonl_prompt(path, n, line) for n, line in lines]
    try:
        return [_jsonl_prompt(path, n, line) for n, line in lines]
    except RequestError:
        return [line for _, line in lines]


def _jsonl_prompt(path: Path, n: int, line: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise RequestError(f'{path}:{n} is not a JSON object with a string "prompt"; '
                           'write one {"prompt": "..."} per line')
    return obj["prompt"]


def generate(options: GenerateOptions) -> GenerateResult:
    """Resolve, validate, load, then decode every prompt in one engine.generate call."""
    from pipeline.engine.config import EngineConfig, GatePolicy, ModelConfig
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.resolve import ResolvedModel, resolve_model
    from pipeline.models.tokenizer import (check_draft_compatible, encode_prompt, load_tokenizer,
                                           stop_token_ids, uses_chat_template)

    prompts = list(options.prompts)
    if not prompts:
        raise RequestError("no prompt given; pass PROMPT or --prompts-file FILE")

    # Cheap checks first: a bad setting fails before any weights load.
    config = EngineConfig(
        max_batch_size=max(len(prompts), options.max_batch_size),
        max_seq_len=options.max_seq_len,
        dtype=options.dtype,
        num_draft_tokens=options.num_draft_tokens,
        gate=GatePolicy(max_batch_size=options.gate_batch_size,
                        hysteresis=min(options.gate_hysteresis, max(options.gate_batch_size, 0)),
                        min_tokens=options.min_spec_tokens),
    )
    SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
                   top_k=options.top_k, seed=options.seed)

    engine_dir = Path(options.model).expanduser()
    draft_kind, draft_ref = options.draft_kind, options.draft
    if (engine_dir / "engine.json").is_file():
        # A `pipeline compile --backend torch` folder brings its own limits, dtype, gate and draft;
        # --draft other than none still picks another draft.
        from pipeline.compile.torch_engine import engine_config, read_engine_manifest

        manifest = read_engine_manifest(engine_dir)
        built = engine_config(manifest)
        config = replace(built, max_batch_size=max(len(prompts), built.max_batch_size))
        target = ResolvedModel(options.model, engine_dir.resolve().name, engine_dir / manifest["target"]["path"],
                               "engine")
        if draft_kind == NO_DRAFT and manifest["draft"]["kind"] != NO_DRAFT:
            draft_kind = manifest["draft"]["kind"]
            draft_ref = str(engine_dir / manifest["draft"]["path"]) if draft_kind in ("model", "eagle3") else draft_kind
    else:
        target = resolve_model(options.model)
    draft_arg: str | Path | None = None
    draft_name, draft_path = draft_kind, None
    if draft_kind == NGRAM_DRAFT:
        draft_arg = NGRAM_DRAFT
    elif draft_kind == "model":
        draft = resolve_model(draft_ref)
        check_draft_compatible(target.path, draft.path)
        draft_arg = draft_path = draft.path
        draft_name = draft.name
    elif draft_kind == "eagle3":
        draft_path = Path(draft_ref.split(":", 1)[1] if draft_ref.lower().startswith("eagle3:") else draft_ref)
        draft_path = draft_path.expanduser().absolute()
        draft_arg = f"eagle3:{draft_path}"

    tokenizer = load_tokenizer(target.path)
    chat = uses_chat_template(tokenizer, options.raw)
    prompt_ids = [encode_prompt(tokenizer, p, options.raw) for p in prompts]
    for i, ids in enumerate(prompt_ids):
        if len(ids) >= config.max_seq_len:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            raise RequestError(f"{which} is {len(ids)} tokens but --max-seq-len is {config.max_seq_len}; "
                               "shorten the prompt or raise --max-seq-len")
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(target.path).eos_token_ids, chat=chat)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
                            top_k=options.top_k, seed=options.seed, stop_token_ids=stops)

    t0 = time.perf_counter()
    engine = LLMEngine.load(target.path, config, draft=draft_arg, eos_token_ids=stops)
    load_time = time.perf_counter() - t0

    requests = engine.generate(prompt_ids, params)
    for i, r in enumerate(requests):
        if r.error is not None:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            raise RequestError(f"{which} failed in the engine: {r.error}")
    outputs = [
        Output(prompt=p, text=tokenizer.decode(r.output_ids, skip_special_tokens=True),
               token_ids=list(r.output_ids), finish_reason=r.finish_reason.value, draft_steps=r.num_verify_steps,
               skipped_steps=dict(sorted(r.skip_reasons.items())))
        for p, r in zip(prompts, requests)
    ]
    info = RunInfo(
        model=target.name, model_path=str(target.path), draft=draft_name,
        draft_path=str(draft_path) if draft_path else None, dtype=config.dtype,
        num_draft_tokens=config.num_draft_tokens, max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len, gate_batch_size=config.gate.max_batch_size,
        min_spec_tokens=config.gate.min_tokens, chat_template=chat, load_time_s=round(load_time, 3),
        engine=engine.describe(),
    )
    return GenerateResult(outputs=outputs, stats=engine.stats.to_dict(), info=info)


def stats_line(result: GenerateResult) -> str:
    """One human line: what ran and how fast (decode time only)."""
    s, info = result.stats, result.info
    draft = info.draft if info.draft == NO_DRAFT else f"{info.draft} k={info.num_draft_tokens}"
    weights = info.engine.get("target", {}).get("weights", "dense")
    fmt = info.dtype if weights == "dense" else f"{info.dtype}, {weights} weights"
    line = (f"[{info.model}, draft {draft}, {fmt}] {s['generated_tokens']} tokens, "
            f"{s['tokens_per_s']} tok/s (decode only; load {info.load_time_s:.1f} s), {s['steps']} steps")
    if s["drafted_tokens"]:
        line += (f", acceptance {s['acceptance_rate']:.2f}, mean acceptance length "
                 f"{s['mean_acceptance_length']:.2f}")
    if info.draft != NO_DRAFT:
        line += f"; {speculation_summary(s['verified_rows'], s['skip_reasons'])}"
    return line
