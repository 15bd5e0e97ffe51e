"""Sampling parameters and the logits -> probabilities transform shared by target and draft.

Speculation is lossless only if the draft's q and the target's p are processed the same way
(temperature, then top-k, then top-p), so both go through `probs_from_logits`. Penalties
(pipeline/engine/penalties.py) come first and only on the target: they read the sequence, which a
draft row's logits don't know, and the draft's q needn't match p for rejection sampling to be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engine.guide import GuideSpec
from pipeline.errors import RequestError
from pipeline.policy.sampling_limits import (check_logit_bias, check_logprobs, check_min_tokens, check_penalty_values,
                                             check_sampling_values, check_stop_strings)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Text that ends the answer wherever it appears, across token boundaries; the answer's text is cut just
    # before it (OpenAI's and vLLM's `stop`). Needs an engine with a detokenizer (LLMEngine.detokenize).
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0  # CTRL's: logits of tokens seen in the prompt or output / p (x p if < 0)
    presence_penalty: float = 0.0  # OpenAI's: - p for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: - p x its count in the output
    logprobs: int | None = None  # None: none; N: the chosen token's log prob and the top N (0..20)
    # What the output must match (guide.py): a JSON schema, any JSON, a regex or a grammar. Needs an engine with
    # a tokenizer (LLMEngine.tokenizer). Log probs are the masked distribution's.
    guide: GuideSpec | None = None
    # (token id, bias) pairs added to the logits after the penalties (OpenAI's logit_bias: -100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # No stop token or stop string ends the answer before it has this many tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # The model's end tokens don't end the answer (stop_token_ids and stop strings still do): load tools use it
    # to fix output lengths.
    ignore_eos: bool = False
    # Each prompt token's log prob under the target (raw logits: no penalty, bias or temperature), with the N most
    # likely alternatives (vLLM's prompt_logprobs, OpenAI's `echo` with `logprobs`): what evaluators score answers
    # with. None: not computed. The first prompt token has none.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        check_sampling_values(self.temperature, self.top_p, self.top_k)
        check_penalty_values(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs)
        check_stop_strings(self.stop)
        check_logit_bias(self.logit_bias)
        check_min_tokens(self.min_tokens, self.max_tokens)
        if self.guide is not None and self.min_tokens > 1:
            raise RequestError("min_tokens with a guide: the grammar decides where the answer ends; send one of them")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusted(self) -> bool:
        """Whether the target's logits change before sampling (logit_rules.adjust): greedy then takes its argmax
        from the adjusted logits, on the CPU."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] fp32 -> probabilities [..., V] after temperature, top-k and top-p."""
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one token id: the cumulative distribution, in float64, inverted at one uniform draw. Exact as
    torch.multinomial is, and 13x quicker: multinomial took 1 ms a row on a 49k vocabulary on the CPU, a third of
    a sampled step at batch 8. Zero-probability tokens are never drawn (searchsorted right: the first cumulative
    value above the draw)."""
    cdf = probs.detach().to("cpu", torch.float64).cumsum(0)
    total = cdf[-1]
    if not bool(torch.isfinite(total)) or total <= 0:
        raise ValueError("probabilities must be finite with a positive sum")
    u = torch.rand((1,), dtype=torch.float64, generator=generator) * total
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


# ---- sampling keyed by (seed, position) -------------------------------------------------------------------------
# A seeded request's token at sequence position i is a function of its distribution there, its seed and i alone:
# the Gumbel-max trick, argmax_j(log p_j + g_j), with the noise g drawn from a counter-based hash of (seed, i).
# Its draft samples position i with the same noise, and a draft is accepted where it equals the target's token.
# So the output is exactly p's sample whatever drafted it, however rows were batched or verified, and a request
# continued from its prompt plus the tokens it already had (after a restart) goes on exactly as it would have.
# The price: the shared-noise coupling accepts a sampled draft a little less often than rejection sampling's
# maximal coupling (about 0.69 against 0.75 at TV 0.25); a one-hot (n-gram) draft is accepted with probability
# p(d) either way. Unseeded requests keep rejection sampling (speculative.accept_sampled).
#
# The noise comes in two levels, so a token costs a few hundred draws, not one per vocabulary entry: a block's
# best Gumbel score is Gumbel(log of the block's mass), independent of which token in it holds it, and that token
# is p's within the block. So: pick a block by Gumbel-max over the blocks' masses, then a token by Gumbel-max
# within it, each with its own noise: P(token) = P(block) x P(token | block) = p.
KEY_BLOCK = 256
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x):
    """splitmix64's finalizer (Steele, Lea, Flood 2014) on uint64 numpy values (wrapping, as C's unsigned is)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def noise_key(*parts: int) -> int:
    """One 64-bit key from whole numbers (a seed, a position, a block), each mixed in turn: distinct inputs give
    unrelated noise."""
    key = 0
    for part in parts:
        key = int(_mix(np.array([(key * _GOLDEN + (part & _M64) + 1) & _M64], dtype=np.uint64))[0])
    return key


def gumbel_noise(key: int, n: int) -> np.ndarray:
    """n standard Gumbel draws, a pure function of key: the same on every machine, whatever else ran."""
    x = _mix(np.uint64(key) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # in (0, 1): both logs finite
    return -np.log(-np.log(u))


def sample_keyed(probs: torch.Tensor, seed: int, position: int) -> int:
    """probs: [V] -> the token at sequence position `position` of a request seeded `seed` (the block comment above).
    Zero-probability tokens are never drawn."""
    p = probs.detach().to("cpu", torch.float64).numpy()
    blocks = -(-p.size // KEY_BLOCK)
    padded = np.zeros(blocks * KEY_BLOCK)
    padded[: p.size] = p
    padded = padded.reshape(blocks, KEY_BLOCK)
    mass = padded.sum(1)
    total = mass.sum()
    if not np.isfinite(total) or total <= 0:
        raise ValueError("probabilities must be finite with a positive sum")
    key = noise_key(seed, position)
    with np.errstate(divide="ignore"):  # log(0) = -inf: an empty block, or token, never wins
        block = int(np.argmax(np.log(mass) + gumbel_noise(key, blocks)))
        token = int(np.argmax(np.log(padded[block]) + gumbel_noise(noise_key(key, block), KEY_BLOCK)))
    return block * KEY_BLOCK + token
