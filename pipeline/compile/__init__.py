"""`pipeline compile`: quantized checkpoints -> what TensorRT-LLM serves, or the portable engine folder."""

from pipeline.compile.run import CompileOptions, CompileResult, compile_model

__all__ = ["CompileOptions", "CompileResult", "compile_model"]
