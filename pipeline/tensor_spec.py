"""A tensor of a Triton model's interface, as config.pbtxt declares it (shared by our tables and upstream's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # tritonclient's name: "BYTES", "INT32", "FP32", "BOOL", "UINT64", ...
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch: rows of different lengths in one batch (tensorrtllm inputs)
    squeeze: bool = False  # reshape [1] -> [] as the tensorrtllm backend expects for per-request scalars

    @property
    def config_dtype(self) -> str:
        """The DataType enum name in config.pbtxt; BYTES is TYPE_STRING there."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"


def names(specs: tuple[TensorSpec, ...]) -> tuple[str, ...]:
    return tuple(s.name for s in specs)


def required(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    return tuple(s for s in specs if not s.optional)
