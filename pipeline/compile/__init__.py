"""`pipeline compile`: quantized checkpoints -> what TensorRT-LLM serves, or the portable engine folder."""

from pipeline.compile.run import CompileOptions, CompileResult, compile_model
from pipeline.compile.torch_engine import load_engine

__all__ = ["CompileOptions", "CompileResult", "compile_model", "load_engine"]
