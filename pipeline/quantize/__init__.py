"""Post-training quantization with NVIDIA ModelOpt: `quantize(QuantizeOptions(...)) -> QuantizeReport`.

formats (the format table and shape rules, pure), calib (built-in/user text -> token samples),
ptq (load, ModelOpt config, calibrate), report (quality, bytes, the report), export (HF or
TensorRT-LLM checkpoints, staged and renamed into place), run (the orchestration).
Importing this package is instant; torch, transformers and modelopt load inside the functions.
"""

from pipeline.quantize.formats import FORMATS, KV_CACHE_DTYPES, QFormat
from pipeline.quantize.report import QuantizeReport, render_table
from pipeline.quantize.quantizer import QuantizeOptions, quantize

__all__ = ["FORMATS", "KV_CACHE_DTYPES", "QFormat", "QuantizeOptions", "QuantizeReport", "quantize", "render_table"]
