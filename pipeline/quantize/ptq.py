"""Post-training quantization with NVIDIA ModelOpt: load, build the config, calibrate.

`mtq.quantize` inserts quantizers into every linear (and, for an FP8 KV cache, the attention's
k/v bmm), runs the forward loop over the calibration samples to set their scales (max, AWQ-lite or
SmoothQuant, per the config), and leaves the model fake-quantized: it still runs in floating
point but rounds as the real kernels would, which is what the quality numbers measure.
ModelOpt is imported here, lazily: `import modelopt.torch.quantization` takes about 10 s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.errors import MissingDependencyError
from pipeline.quantize.formats import QFormat


def _mtq():
    import warnings

    try:
        with warnings.catch_warnings():
            # "transformers 5.x is not tested with current version of modelopt": it works here (tests).
            warnings.simplefilter("ignore", UserWarning)
            import modelopt.torch.quantization as mtq
    except ImportError as err:
        raise MissingDependencyError(f"quantizing needs NVIDIA ModelOpt ({err}); "
                                     "pip install nvidia-modelopt==0.47.0") from None
    return mtq


def device_and_dtype():
    """CUDA in bf16 where present; else CPU in fp32 (ModelOpt's fake quant is plain PyTorch there)."""
    import torch

    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def load_model(path: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor "Loading weights" / "Writing model shards" bars
    device, dtype = device_and_dtype()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    if not getattr(model.config, "architectures", None):
        # export_hf_checkpoint fails inside is_multimodal_model without it.
        model.config.architectures = [type(model).__name__]
    return model


def quant_config(fmt: QFormat, kv_cache_dtype: str, block_size: int | None = None) -> dict:
    """The format's ModelOpt preset, with its weight block size set to `block_size` (when given), and
    FP8 KV-cache quantizers appended when asked (the `*[kv]_bmm_quantizer` entries of mtq.FP8_KV_CFG,
    merged as ModelOpt's hf_ptq example does)."""
    import copy

    mtq = _mtq()
    cfg = copy.deepcopy(getattr(mtq, fmt.modelopt_cfg))
    if block_size is not None:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                for sub in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                    if "block_sizes" in sub:
                        sub["block_sizes"] = {**sub["block_sizes"], -1: block_size}
    if kv_cache_dtype == "fp8":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


def forward_loop(samples, batch_size: int) -> Callable:
    """The calibration loop mtq.quantize calls: every sample once, in batches. samples: [N, L]."""
    import torch

    def loop(model) -> None:
        device = next(model.parameters()).device
        with torch.no_grad():
            for batch in samples.split(batch_size):  # batch: [B, L]
                model(input_ids=batch.to(device), use_cache=False)

    return loop


def quantize_model(model, fmt: QFormat, kv_cache_dtype: str, samples, batch_size: int,
                   block_size: int | None = None):
    """Calibrate and fake-quantize `model` in place (and return it)."""
    import contextlib
    import io

    mtq = _mtq()
    # ModelOpt prints the whole config and a line per inserted quantizer; keep the CLI's output clean.
    with contextlib.redirect_stdout(io.StringIO()):
        cfg = quant_config(fmt, kv_cache_dtype, block_size)
        return mtq.quantize(model, cfg, forward_loop(samples, batch_size))
