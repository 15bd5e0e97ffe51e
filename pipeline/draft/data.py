"""Training data for a draft head: prompts, the target's own answers (self-distillation), the target's
hidden states for them (computed once, then cached), and the reduced draft vocabulary.

The built-in prompts (data/prompts.jsonl, see data/NOTICE) ship with the package, so training never
needs the network. Every HELDOUT_EVERY-th prompt is held out for measuring acceptance.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from pipeline.draft import budget
from pipeline.errors import ConfigError
from pipeline.records import read_records

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).parent / "data" / "prompts.jsonl"
HELDOUT_EVERY = 10


def load_prompts(data: str = BUILTIN) -> list[str]:
    """--data: "builtin", or a file of prompts (JSONL with a "prompt" field, or one per line: pipeline/records.py)."""
    path = BUILTIN_FILE if data == BUILTIN else Path(data).expanduser()
    prompts = read_records(path, "prompt", "--data prompts file")
    if len(prompts) < 2:
        raise ConfigError(f"--data {path} has {len(prompts)} prompt(s); training needs at least 2 (one is held out)")
    return prompts


def split_prompts(prompts: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): deterministic, by position; at least one of each."""
    held = [p for i, p in enumerate(prompts) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1] or prompts[-1:]
    train = [p for p in prompts if p not in held] if len(held) < len(prompts) else prompts
    return train, held


class StateRecorder:
    """A proposer that never drafts (its requests run with speculation off): the engine hands it the target's
    captured states of every token it settles (prefill chunks, prefix-cache hits, decode steps), as it does an
    EAGLE-3 head. So an answer's hidden states come from the forwards that generated it, and training needs no
    second pass of the target over its answers (that pass took about a quarter of a 10-minute run's data phase)."""

    name = "recorder"

    def __init__(self, capture_layers: tuple[int, ...]):
        self.capture_layers = capture_layers
        self.states: dict[int, list[torch.Tensor]] = {}
        self.restart: set[int] = set()  # released (finished, cancelled or preempted): a new prefill starts over

    def on_target_hidden(self, req, states: torch.Tensor) -> None:
        if req.id in self.restart:  # preempted, now recomputed from its first token
            self.restart.discard(req.id)
            self.states.pop(req.id, None)
        self.states.setdefault(req.id, []).append(states.to(torch.bfloat16, copy=True))

    def take(self, req) -> torch.Tensor | None:
        """[T, A]: the states of the request's first T tokens (all but its last, never fed), or None."""
        self.restart.discard(req.id)
        parts = self.states.pop(req.id, None)
        return torch.cat(parts) if parts else None

    def propose(self, reqs, ks):
        raise AssertionError("the recorder's requests never draft")

    def on_verified(self, req, prev_len, drafted, accepted) -> None:
        pass

    def release(self, req) -> None:
        self.restart.add(req.id)


def head_inputs(aux_layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs a head trains on (the model's capture_layers): each aux layer's output, which
    is the next layer's input, then the final pre-norm state."""
    return tuple(i + 1 for i in aux_layers) + (num_layers,)


def answer_engine(model, config, eos_token_ids, aux_layers: tuple[int, ...]):
    """An engine that generates answers and records their hidden states (StateRecorder)."""
    from pipeline.engine.llm_engine import LLMEngine

    recorder = StateRecorder(head_inputs(aux_layers, model.cfg.num_layers))
    return LLMEngine(model, config, recorder, eos_token_ids=eos_token_ids)


def generate_answers(engine, prompt_ids: list[list[int]], max_new_tokens: int, deadline: float | None = None,
                     temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """The target's own answers, through this project's engine (answer_engine), with their hidden states:
    (prompt + answer ids, {"aux": [T, 3H], "final": [T, H]}) per prompt. All prompts join one in-flight batch
    (the engine's max_batch_size at a time), so rows that finish early make room. Greedy, or sampled at
    `temperature` with prompt i's request seeded seed + i.

    With a deadline (budget.now()), decoding stops at the first step past it and the answers in flight are kept
    cut short (a cut answer is still the target's own text; on a loaded machine one batch can outlast the whole
    share of the budget that answers get). Requests admit in order, so what comes back is a prefix of the
    prompts: those that reached the target at all. Each sequence is cut to the tokens with states.
    """
    from pipeline.engine.sampling import SamplingParams

    recorder = engine.proposer
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                 seed=seed + i if temperature else None), speculation="off")
            for i, p in enumerate(prompt_ids)]
    while not all(r.finished for r in reqs):
        if deadline is not None and budget.now() > deadline:
            for r in reqs:
                engine.cancel(r)
            break
        engine.step()
    seqs, feats = [], []
    width = engine.model.cfg.hidden_size
    for r in reqs:
        states = recorder.take(r)
        if states is None or len(states) < 2:
            break
        seqs.append(r.all_ids[:len(states)])
        feats.append({"aux": states[:, :-width], "final": states[:, -width:]})
    for r in reqs[len(seqs):]:
        recorder.take(r)
    return seqs, feats


@torch.inference_mode()
def target_features(model, seqs: list[list[int]], aux_layers: tuple[int, ...], dtype=torch.bfloat16,
                    on_seq=None, deadline: float | None = None) -> list[dict[str, torch.Tensor]]:
    """Per sequence: the outputs of the aux layers, concatenated ([T, 3H]), and the final pre-norm hidden
    state ([T, H]), from one target forward each, stored in `dtype` (bf16 halves the cache). With a
    deadline (budget.now()), only the sequences started before it: a prefix of `seqs`."""
    from pipeline.engine.kv_cache import ForwardBatch

    capture = head_inputs(aux_layers, model.cfg.num_layers)
    cache = model.new_cache(1, max(len(s) for s in seqs) + 1)
    out = []
    for s in seqs:
        if deadline is not None and budget.now() > deadline:
            break
        fb = ForwardBatch.build([0], [0], [len(s)], cache)
        last = torch.tensor([[len(s) - 1]])
        _, captured = model(torch.tensor([s]), fb, cache, logits_index=last, capture_layers=capture)
        out.append({"aux": torch.cat(captured[:-1], -1)[0].to(dtype), "final": captured[-1][0].to(dtype)})
        if on_seq:
            on_seq()
    return out


def text_samples(tokenizer, num_samples: int, seq_len: int = 256) -> list[list[int]]:
    """Token samples of the built-in calibration text (prose and Python code; its held-out part is left
    out). EAGLE's loss distils the target's own distribution at every position, so any text teaches the
    head; this text needs only one target forward per sample, no generation."""
    from pipeline.quantize.calib import calibration_text, make_samples

    return make_samples(tokenizer, calibration_text("builtin"), num_samples, seq_len).tolist()


# The default draft vocabulary: the largest power of two whose lm_head has at most LM_HEAD_SHARE of the weights of
# the head's decoder layer, within [DRAFT_VOCAB_MIN, DRAFT_VOCAB_MAX] and the target's vocabulary. A head drafts by
# streaming its weights once per token, so past that the lm_head is most of a proposal's cost; the rarer tokens it
# would add are seldom drafted right. Measured on SmolLM2 (576 wide, 49k vocabulary), same data and training time:
# see docs/benchmarks.md. For Llama-3-8B the rule gives 32768, the published EAGLE-3 heads' 32000.
LM_HEAD_SHARE = 0.6
DRAFT_VOCAB_MIN, DRAFT_VOCAB_MAX = 1024, 32768


def default_draft_vocab_size(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                             vocab_size: int) -> int:
    """--draft-vocab-size's default for a head sized like the target (train.head_architecture): see LM_HEAD_SHARE."""
    layer = 2 * hidden * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden \
        + 3 * hidden * intermediate  # q/k/v read [embedding | fused state], o, and the gated MLP
    size = DRAFT_VOCAB_MIN
    while size * 2 <= DRAFT_VOCAB_MAX and size * 2 * hidden <= LM_HEAD_SHARE * layer:
        size *= 2
    return min(size, vocab_size)


def draft_vocab(seqs: list[list[int]], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """EAGLE-3's reduced vocabulary: the draft_vocab_size tokens most frequent in the training data
    (then the lowest ids, to fill), in target-id order. Returns d2t: target_id = draft_id + d2t[draft_id]."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ConfigError(f"--draft-vocab-size must be between 1 and the target's vocabulary ({vocab_size})")
    counts = Counter(t for s in seqs for t in s)
    chosen = [t for t, _ in counts.most_common(draft_vocab_size)]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][: draft_vocab_size - len(chosen)]
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    return ids - torch.arange(draft_vocab_size)
