"""`pipeline compile`: quantized checkpoints -> what TensorRT-LLM serves, or the portable engine folder."""

from pipeline.compiler.compiler import compile_model
from pipeline.compiler.options import CompileOptions, CompileResult

__all__ = ["CompileOptions", "CompileResult", "compile_model"]
