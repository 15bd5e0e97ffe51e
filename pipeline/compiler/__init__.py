"""`pipeline compile`: quantized checkpoints -> what TensorRT-LLM serves, or the portable engine folder."""

from pipeline.compiler.compiler import CompileOptions, CompileResult, compile_model

__all__ = ["CompileOptions", "CompileResult", "compile_model"]
