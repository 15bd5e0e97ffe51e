"""Write a quantized model: a unified Hugging Face checkpoint or a TensorRT-LLM checkpoint.

The caller writes into a staging folder (pipeline.staging) that is renamed into place at the end, so an
interrupted or failed run never leaves a half-written model where a later step would load it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from pipeline.errors import QuantizeError

WEIGHT_AND_CONFIG_FILES = ("config.json", "generation_config.json", "hf_quant_config.json")


def copy_tokenizer_files(source: Path, dest: Path) -> None:
    """Everything in the source folder but weights and configs: tokenizer, chat template, special tokens."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in WEIGHT_AND_CONFIG_FILES and not f.name.endswith(
                (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")):
            if not (dest / f.name).exists():
                shutil.copy2(f, dest / f.name)


def _quiet():
    """ModelOpt's exports print progress and warn about things we handle (no tensorrt_llm, dtype)."""
    import io
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def export_hf(model, folder: Path, dtype) -> None:
    """Unified HF checkpoint: config.json (+ quantization_config), hf_quant_config.json, *.safetensors."""
    from modelopt.torch.export import export_hf_checkpoint

    # The export's dtype= only warns: unquantized tensors keep the model's dtype, so cast the model.
    if next(model.parameters()).dtype != dtype:
        model.to(dtype)
    with _quiet():
        export_hf_checkpoint(model, dtype=dtype, export_dir=str(folder))


def export_trtllm(model, folder: Path, decoder_type: str, dtype, tp_size: int, pp_size: int) -> None:
    """TensorRT-LLM checkpoint: config.json + rank{N}.safetensors for N < tp*pp. Needs no tensorrt_llm."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_theta") is not None:
        # transformers 5 keeps rope_theta in rope_parameters; the export reads config.rope_theta and
        # silently drops rotary_base otherwise (TensorRT-LLM then assumes 10000).
        config.rope_theta = rope["rope_theta"]
    with _quiet():
        export_tensorrt_llm_checkpoint(model, decoder_type, dtype=dtype, export_dir=str(folder),
                                       inference_tensor_parallel=tp_size, inference_pipeline_parallel=pp_size)
    written = json.loads((folder / "config.json").read_text())
    if rope.get("rope_theta") is not None and written.get("rotary_base") != rope["rope_theta"]:
        raise QuantizeError(f"the TensorRT-LLM export wrote rotary_base {written.get('rotary_base')} instead of "
                            f"{rope['rope_theta']}; report this (ModelOpt changed how it reads rope_theta)")


def exported_quant_algo(folder: Path, export: str) -> str | None:
    if export == "hf":
        qfile = folder / "hf_quant_config.json"
        if not qfile.is_file():
            return None
        return json.loads(qfile.read_text()).get("quantization", {}).get("quant_algo")
    return (json.loads((folder / "config.json").read_text()).get("quantization") or {}).get("quant_algo")
