"""`quantize(options)`: the one function behind `pipeline quantize` (and, later, `pipeline build`).

Order: validate everything cheap (format, flags, output folder, the model's shapes, calibration
text) before any weights load; then load in full precision, measure the unquantized model on
held-out text, calibrate and fake-quantize with ModelOpt, measure again, and export into a staging
folder that is renamed into place only once the checkpoint, tokenizer and report.json are all written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import QuantizeError
from pipeline.models.shape import ModelShape
from pipeline.quantize.calib import BUILTIN
from pipeline.quantize.formats import (block_size_for, check_model_fits, check_request, get_format,
                                      trtllm_decoder_type)
from pipeline.quantize.report import QuantizeReport

REPORT_FILE = "report.json"


@dataclass(frozen=True)
class QuantizeOptions:
    model: str  # preset, HF folder, .gguf file or hub id
    output: Path
    qformat: str = "fp8"  # fp8 | int4_awq | w4a8_awq | int8_sq | none
    kv_cache_dtype: str = "none"  # fp8 | none
    calib_size: int = 32  # samples
    calib_seq_len: int = 256  # tokens per sample (evaluation samples too)
    calib_data: str = BUILTIN  # "builtin" or a .txt / .jsonl file
    eval_size: int = 8  # held-out samples for perplexity and top-1 agreement
    export: str = "hf"  # hf | trtllm
    tp_size: int = 1  # trtllm only
    pp_size: int = 1  # trtllm only
    force: bool = False  # replace an existing output folder
    batch_size: int = 8  # samples per forward, calibration and evaluation

    def validate(self):
        """The chosen QFormat, once every setting that is wrong whatever the model is refused."""
        fmt = get_format(self.qformat)
        check_request(fmt, self.kv_cache_dtype, self.export, self.tp_size, self.pp_size)
        for flag, value in (("--calib-size", self.calib_size), ("--eval-size", self.eval_size),
                            ("batch size", self.batch_size)):
            if value < 1:
                raise QuantizeError(f"{flag} must be at least 1 (got {value})")
        if self.calib_seq_len < 2:
            raise QuantizeError(f"--calib-seq-len must be at least 2 (got {self.calib_seq_len})")
        return fmt


def quantize(options: QuantizeOptions) -> QuantizeReport:
    import torch

    # PTQ needs no gradients; no_grad restores the caller's mode after (a trainer may run next).
    with torch.no_grad():
        return _quantize(options)


def _quantize(options: QuantizeOptions) -> QuantizeReport:
    from pipeline.models.resolve import resolve_model
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.quantize.calib import calibration_text, evaluation_text, make_samples
    from pipeline.staging import check_output

    t_start = time.perf_counter()
    fmt = options.validate()
    output = Path(options.output).expanduser().absolute()
    check_output(output, options.force, QuantizeError, "-o")
    source = resolve_model(options.model)
    config = json.loads((source.path / "config.json").read_text())
    shape, block_size = _check_model(options, fmt, config)

    tokenizer = load_tokenizer(source.path)
    calib_text = calibration_text(options.calib_data) if fmt.quantized else None
    calib = (make_samples(tokenizer, calib_text, options.calib_size, options.calib_seq_len)
             if calib_text else None)
    eval_text = evaluation_text()
    held_out = make_samples(tokenizer, eval_text, options.eval_size, options.calib_seq_len, what="evaluation")

    from pipeline.quantize.ptq import device_and_dtype, load_model, quantize_model
    from pipeline.quantize.report import measure_quality, safetensors_bytes, top1_agreement

    model = load_model(source.path)
    before = measure_quality(model, held_out, options.batch_size)
    t0 = time.perf_counter()
    if fmt.quantized:
        model = quantize_model(model, fmt, options.kv_cache_dtype, calib, options.batch_size, block_size)
    calib_time = time.perf_counter() - t0
    after = measure_quality(model, held_out, options.batch_size) if fmt.quantized else before

    from pipeline.quantize.export import copy_tokenizer_files, exported_quant_algo
    from pipeline.staging import staged_output

    with staged_output(output, options.force, QuantizeError, "-o") as stage:
        t0 = time.perf_counter()
        _export(model, stage, options, shape, _torch_dtype(config))
        copy_tokenizer_files(source.path, stage)
        export_time = time.perf_counter() - t0
        report = QuantizeReport(
            model=source.name, model_path=str(source.path), output=str(output), qformat=fmt.name,
            kv_cache_dtype=options.kv_cache_dtype, block_size=block_size, export=options.export,
            tp_size=options.tp_size, pp_size=options.pp_size, device=device_and_dtype()[0],
            quant_algo=exported_quant_algo(stage, options.export),
            bytes_before=safetensors_bytes(source.path), bytes_after=safetensors_bytes(stage),
            calib_data=calib_text.source if calib_text else "none",
            calib_samples=options.calib_size if calib is not None else 0,
            calib_seq_len=options.calib_seq_len if calib is not None else 0,
            calib_time_s=round(calib_time, 3), export_time_s=round(export_time, 3),
            eval_data=eval_text.source, eval_samples=options.eval_size, eval_seq_len=options.calib_seq_len,
            perplexity_before=round(before.perplexity, 4), perplexity_after=round(after.perplexity, 4),
            top1_agreement=round(top1_agreement(before, after), 4),
            total_time_s=round(time.perf_counter() - t_start, 3),
        )
        (stage / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def _check_model(options: QuantizeOptions, fmt, config: dict) -> tuple[ModelShape, int | None]:
    """The model's shape and the format's block size for it, once the format and sequence length fit it."""
    shape = ModelShape.from_hf_config(config)
    check_model_fits(fmt, shape, options.export, options.tp_size, options.pp_size)
    max_pos = config.get("max_position_embeddings")
    if max_pos and options.calib_seq_len > max_pos:
        raise QuantizeError(f"--calib-seq-len {options.calib_seq_len} is longer than the model's "
                            f"max_position_embeddings ({max_pos}); lower it")
    return shape, block_size_for(fmt, shape, options.export, options.tp_size)


def _export(model, stage: Path, options: QuantizeOptions, shape: ModelShape, source_dtype) -> None:
    import torch

    from pipeline.quantize.export import export_hf, export_trtllm

    if options.export == "hf":
        export_hf(model, stage, source_dtype)
        return
    # TensorRT-LLM's quantized kernels run in 16-bit: a 32-bit source exports as bf16.
    dtype = source_dtype if source_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    export_trtllm(model, stage, trtllm_decoder_type(shape.model_type), dtype, options.tp_size, options.pp_size)


def _torch_dtype(config: dict):
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, torch.float32)
