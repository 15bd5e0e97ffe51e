"""Generate text with the portable engine: the library behind `pipeline generate`.

`generate(options)` resolves the target (and draft), validates every setting before any weights
load, decodes all prompts as one in-flight batch, and returns typed results. Heavy imports (torch,
transformers, the engine) happen inside the functions that need them, so importing this module is
instant and `pipeline --help` stays fast.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.draft_spec import NONE, DraftField, DraftSpec
from pipeline.engine.stats import cost_line, drafted_by
from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ConfigError, RequestError
from pipeline.models.presets import DEFAULT_MODEL
from pipeline.models.tokenizer import answer_text
from pipeline.policy.draft_plan import speculation_summary
from pipeline.policy.gate_policy import PORTABLE_CEILING
from pipeline.records import read_records


@dataclass(frozen=True)
class GenerateOptions:
    prompts: tuple[str, ...]
    model: str = DEFAULT_MODEL  # preset, HF folder, .gguf file, hub id, or a `pipeline compile --backend torch` folder
    # --draft: none, ngram, eagle3:DIR or a draft model (pipeline/draft_spec.py); None: an engine folder's own, else
    # none. An explicit "none" runs an engine folder's target alone.
    draft: DraftSpec | None = DraftField(None)
    num_draft_tokens: int = 4  # k
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    dtype: str = "auto"  # auto: the fastest lossless one on this CPU (cpu_kernels.fast_lossless_dtype), bf16 on a GPU
    device: DeviceChoice = DeviceField()  # auto | cpu | cuda | cuda:N
    raw: bool = False  # skip the chat template
    max_seq_len: int = 2048
    max_batch_size: int = 1  # raised to the number of prompts: all of them decode as one batch
    gate_batch_size: int = PORTABLE_CEILING  # speculate while the decoding batch is at or below this
    gate_hysteresis: int | None = None  # None: the default for the ceiling (gate_policy.default_hysteresis)
    min_spec_tokens: int = 50  # requests asking for fewer new tokens never speculate
    # An EAGLE-3 head drafts only where n-gram lookup finds no match (EngineConfig.ngram_first); None: an engine
    # folder's own, else True.
    ngram_first: bool | None = None


@dataclass(frozen=True)
class Output:
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    # Its decode steps that drafted, and those that didn't by reason (policy/draft_plan.py).
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
    dtype_reason: str  # why this dtype: asked for, the engine folder's, or --dtype auto's pick and its reason
    device: str  # cpu or cuda:N
    device_line: str  # what --device picked and why: "device: cpu (auto: torch sees no GPU)"
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
    """Prompts from a file: JSONL (one {"prompt": ...} object per line) or plain text (one per line), by the
    rule every command's files follow (pipeline/records.py)."""
    return read_records(path, "prompt", "prompts file", error=RequestError)


def generate(options: GenerateOptions) -> GenerateResult:
    """Resolve, validate, load, then decode every prompt in one engine.generate call."""
    from pipeline.engine.llm_engine import LLMEngine

    prompts = list(options.prompts)
    if not prompts:
        raise RequestError("no prompt given; pass PROMPT or --prompts-file FILE")
    config, dtype_reason, device_line = _checked_config(options, len(prompts))  # cheap checks: before any load
    target, draft, draft_name, built = _models(options, config, len(prompts))
    if built is not config:
        config, dtype_reason = built, "the engine folder's (engine.json)"
    tokenizer, chat, prompt_ids, params = _requests(options, prompts, target.path, config)

    t0 = time.perf_counter()
    engine = LLMEngine.load(target.path, config, draft=draft, eos_token_ids=params.stop_token_ids)
    load_time = time.perf_counter() - t0

    requests = engine.generate(prompt_ids, params)
    for i, r in enumerate(requests):
        if r.error is not None:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            raise RequestError(f"{which} failed in the engine: {r.error}")
    outputs = [
        Output(prompt=p, text=answer_text(tokenizer, r.output_ids),
               token_ids=list(r.output_ids), finish_reason=r.finish_reason.value, draft_steps=r.num_verify_steps,
               skipped_steps=dict(sorted(r.skip_reasons.items())))
        for p, r in zip(prompts, requests)
    ]
    info = RunInfo(
        model=target.name, model_path=str(target.path), draft=draft_name,
        draft_path=str(draft.path) if draft.path else None, dtype=config.dtype, dtype_reason=dtype_reason,
        device=config.device, device_line=device_line,
        num_draft_tokens=config.num_draft_tokens, max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len, gate_batch_size=config.gate.max_batch_size,
        min_spec_tokens=config.gate.min_tokens, chat_template=chat, load_time_s=round(load_time, 3),
        engine=engine.describe(),
    )
    return GenerateResult(outputs=outputs, stats=engine.stats.to_dict(), info=info)


def _checked_config(options: GenerateOptions, n_prompts: int):
    """(the engine's config from the options, why its dtype, the device's line), and the sampling settings checked,
    before anything loads."""
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.device import is_cuda
    from pipeline.engine.sampling import SamplingParams

    device, device_line = options.device.choose()
    dtype, dtype_reason = options.dtype, "asked for (--dtype)"
    if dtype == "auto" and is_cuda(device):
        dtype, dtype_reason = "bf16", "auto: bf16 on a GPU (its tensor cores' dtype)"
    elif dtype == "auto":
        from pipeline.engine.cpu_kernels import fast_lossless_dtype

        dtype, dtype_reason = fast_lossless_dtype()
    config = EngineConfig(
        max_batch_size=max(n_prompts, options.max_batch_size),
        max_seq_len=options.max_seq_len,
        dtype=dtype,
        device=device,
        num_draft_tokens=options.num_draft_tokens,
        gate=GatePolicy.with_ceiling(options.gate_batch_size, options.gate_hysteresis, options.min_spec_tokens),
        ngram_first=True if options.ngram_first is None else options.ngram_first,
    )
    SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
                   top_k=options.top_k, seed=options.seed)
    return config, dtype_reason, device_line


def _models(options: GenerateOptions, config, n_prompts: int):
    """(target, draft, the draft's name, config): --model resolved, or an engine folder with its own limits, dtype,
    gate and draft (unless --draft names one: none runs its target alone); a draft model resolved to its folder."""
    from pipeline.models.resolve import ResolvedModel, resolve_model
    from pipeline.models.tokenizer import check_draft_compatible

    engine_dir = Path(options.model).expanduser()
    draft = options.draft or DraftSpec(NONE)
    if (engine_dir / "engine.json").is_file():
        from pipeline.engine.folder import engine_config, manifest_draft, read_engine_manifest

        manifest = read_engine_manifest(engine_dir)
        built = engine_config(manifest, device=config.device)
        config = replace(built, max_batch_size=max(n_prompts, built.max_batch_size),
                         ngram_first=built.ngram_first if options.ngram_first is None else options.ngram_first)
        target = ResolvedModel(options.model, engine_dir.resolve().name, engine_dir / manifest["target"]["path"],
                               "engine")
        if options.draft is None:
            draft = manifest_draft(engine_dir, manifest)
    else:
        target = resolve_model(options.model)
    if draft.kind == "eagle3" and not draft.ref:
        raise ConfigError("--draft eagle3 needs the head's folder here: --draft eagle3:DIR (`pipeline build "
                          "--draft eagle3` trains one, or `pipeline draft train`)")
    if draft.kind != "model":
        return target, draft, draft.kind, config
    resolved = resolve_model(draft.ref)  # a preset or hub id: its local folder
    check_draft_compatible(target.path, resolved.path)
    return target, DraftSpec("model", str(resolved.path)), resolved.name, config


def _requests(options: GenerateOptions, prompts: list[str], target_path: Path, config):
    """(tokenizer, whether the chat template applies, prompt ids, sampling params with the stop tokens)."""
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids, uses_chat_template

    tokenizer = load_tokenizer(target_path)
    chat = uses_chat_template(tokenizer, options.raw)
    prompt_ids = [encode_prompt(tokenizer, p, options.raw) for p in prompts]
    for i, ids in enumerate(prompt_ids):
        if len(ids) >= config.max_seq_len:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            raise RequestError(f"{which} is {len(ids)} tokens but --max-seq-len is {config.max_seq_len}; "
                               "shorten the prompt or raise --max-seq-len")
    stops = stop_token_ids(tokenizer, ModelConfig.from_folder(target_path).eos_token_ids, chat=chat)
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
                            top_k=options.top_k, seed=options.seed, stop_token_ids=stops)
    return tokenizer, chat, prompt_ids, params


def dtype_line(result: GenerateResult) -> str:
    """One line: the compute dtype and why."""
    return f"dtype {result.info.dtype}: {result.info.dtype_reason}"


def stats_line(result: GenerateResult) -> str:
    """One human line: what ran and how fast (decode time only)."""
    s, info = result.stats, result.info
    draft = info.draft if info.draft == "none" else f"{info.draft} k={info.num_draft_tokens}"
    weights = info.engine.get("target", {}).get("weights", "dense")
    fmt = info.dtype if weights == "dense" else f"{info.dtype}, {weights} weights"
    line = (f"[{info.model}, draft {draft}, {fmt}] {s['generated_tokens']} tokens, "
            f"{s['tokens_per_s']} tok/s (prefill and decode; load {info.load_time_s:.1f} s), {s['steps']} steps")
    if s["drafted_tokens"]:
        line += (f", acceptance {s['acceptance_rate']:.2f}, mean acceptance length "
                 f"{s['mean_acceptance_length']:.2f}")
    if cost := s.get("draft_cost"):
        line += f", {cost_line(cost)}"
    if sources := info.engine.get("draft", {}).get("ngram_first"):  # an EAGLE-3 head behind n-gram lookup
        line += f", drafted by {drafted_by(sources)}"
    if info.draft != "none":
        line += f"; {speculation_summary(s['verified_rows'], s['skip_reasons'])}"
    return line
