"""The portable PyTorch engine: a Llama-family decoder with in-flight batching and speculative decoding.

    from pipeline.engine import SamplingParams, load_engine

    engine = load_engine("engines/smollm2-135m/engine")   # a `pipeline compile --backend torch` folder
    [req] = engine.generate([prompt_ids], SamplingParams(max_tokens=64))

The names below load on first use, so the torch-free module here (device: a --device's spelling), which the
routes and the Triton configs import, doesn't pull torch in through this package. The speculation policy the
engine runs (the gate, the draft planner, the cost model) is pipeline.policy's.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "LLMEngine": "pipeline.engine.llm_engine",
    "EngineConfig": "pipeline.engine.config",
    "SamplingParams": "pipeline.engine.sampling",
    "load_engine": "pipeline.engine.folder",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
