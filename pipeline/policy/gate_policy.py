"""The speculation gate's policy: a plain typed config, free of torch so the Triton configs can use it."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ConfigError


# The portable engine's default ceiling (build's --gate-batch-size on torch, and generate's): on a 2-core CPU
# n-gram drafts paid at batch 4 and not at 16. `pipeline bench --apply` fits it on the machine that serves.
PORTABLE_CEILING = 4


@dataclass(frozen=True)
class GatePolicy:
    """When the engine speculates, decided afresh every iteration.

    Speculation pays only while decoding is memory-bound: verifying k+1 tokens costs about one
    target step at small batch, but at large batch the target is compute-bound and the draft is
    pure overhead. Only decoding requests count toward the batch (not prefills), so a burst of
    arrivals doesn't flap the gate.
    """

    max_batch_size: int = 32  # speculate while the running batch is at or below this
    hysteresis: int = 4  # once off, turn back on only at or below max_batch_size - hysteresis
    min_tokens: int = 50  # requests asking for fewer new tokens never speculate: they can't pay back

    def __post_init__(self):
        if self.max_batch_size < 0:
            raise ConfigError("gate max_batch_size must be >= 0 (0 turns speculation off)")
        if not 0 <= self.hysteresis <= max(self.max_batch_size, 0):
            raise ConfigError("gate hysteresis must be between 0 and max_batch_size")
        if self.min_tokens < 0:
            raise ConfigError("gate min_tokens must be >= 0")

    @classmethod
    def with_ceiling(cls, max_batch_size: int, hysteresis: int | None = None, min_tokens: int = 50) -> GatePolicy:
        """The one rule for a ceiling's hysteresis: the one given (at most the ceiling), or the default."""
        band = default_hysteresis(max_batch_size) if hysteresis is None else hysteresis
        return cls(max_batch_size, min(band, max(max_batch_size, 0)), min_tokens)


def default_hysteresis(max_batch_size: int) -> int:
    """4 at the default ceiling of 32; 1 at a CPU's 4, where 4 would wait for an empty server. At most the ceiling."""
    return min(max(1, max_batch_size // 8), max(max_batch_size, 0))
