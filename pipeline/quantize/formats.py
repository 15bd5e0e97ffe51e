"""The quantization formats `pipeline quantize` offers, and which models each one fits. Pure: no torch.

Each format names its ModelOpt config (an attribute of `modelopt.torch.quantization`) and the
quant_algo TensorRT-LLM reads from a checkpoint. The shape rules are the kernels' rules, checked
before any weights load so a misfit fails in a second with a message that says what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import QuantizeError
from pipeline.models.families import FAMILIES, family_for
from pipeline.models.shape import ModelShape

KV_CACHE_DTYPES = ("fp8", "none")
EXPORTS = ("hf", "trtllm")


def trtllm_decoder_type(model_type: str) -> str | None:
    """The decoder type ModelOpt's TensorRT-LLM export takes for a model_type (its family module says), or None."""
    family = family_for(model_type)
    return family.trtllm_decoder if family else None


def trtllm_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for f in FAMILIES if f.trtllm_decoder for t in f.model_types))


@dataclass(frozen=True)
class QFormat:
    name: str
    modelopt_cfg: str | None  # attribute of modelopt.torch.quantization; None = no quantization
    trtllm_algo: str | None  # quant_algo in the exported checkpoint's config
    weight_bits: int
    act_bits: int
    block_sizes: tuple[int, ...]  # weight scale blocks along input features, preferred first (() = none)
    gemm_multiple: int  # low-precision GEMM kernels need in/out features that are multiples of this
    summary: str

    @property
    def quantized(self) -> bool:
        return self.modelopt_cfg is not None


FORMATS: dict[str, QFormat] = {f.name: f for f in (
    QFormat("fp8", "FP8_DEFAULT_CFG", "FP8", 8, 8, (), 16,
            "FP8 E4M3 weights and activations, per-tensor scales (Hopper/Ada and newer)"),
    # Block 64 is ModelOpt's and TensorRT-LLM's other W4A16 group size (and torch's CPU int4 kernel
    # takes it): it fits models like SmolLM2-135M (hidden 576 = 4.5 x 128) that 128 does not.
    QFormat("int4_awq", "INT4_AWQ_CFG", "W4A16_AWQ", 4, 16, (128, 64), 16,
            "INT4 weights in blocks of 128 (64 where 128 does not fit) with AWQ scaling, 16-bit activations"),
    QFormat("w4a8_awq", "W4A8_AWQ_BETA_CFG", "W4A8_AWQ", 4, 8, (128,), 16,
            "INT4 AWQ weights (blocks of 128) with FP8 activations"),
    QFormat("int8_sq", "INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", 8, 8, (), 16,
            "INT8 weights (per channel) and activations (per tensor) after SmoothQuant"),
    QFormat("none", None, None, 16, 16, (), 1, "no quantization: export as is (a baseline)"),
)}


def get_format(name: str, flag: str = "--qformat") -> QFormat:
    """flag: the option the name came from, for the message (build has --target-qformat and --draft-qformat)."""
    fmt = FORMATS.get(name.strip().lower())
    if fmt is None:
        raise QuantizeError(f"unknown {flag} {name!r}; pick one of {', '.join(FORMATS)}")
    return fmt


def check_request(fmt: QFormat, kv_cache_dtype: str, export: str, tp_size: int, pp_size: int) -> None:
    """Settings that are wrong whatever the model."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise QuantizeError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; pick one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype != "none" and not fmt.quantized:
        raise QuantizeError("--kv-cache-dtype fp8 needs a quantized --qformat (fp8, int4_awq, w4a8_awq, int8_sq); "
                            "drop it, or pick a format")
    if export not in EXPORTS:
        raise QuantizeError(f"unknown --export {export!r}; pick one of {', '.join(EXPORTS)}")
    if tp_size < 1 or pp_size < 1:
        raise QuantizeError(f"--tp-size and --pp-size must be >= 1 (got {tp_size} and {pp_size})")
    if export == "hf" and (tp_size, pp_size) != (1, 1):
        raise QuantizeError("--tp-size/--pp-size shard a TensorRT-LLM checkpoint; add --export trtllm, "
                            "or drop them (an HF checkpoint is not sharded)")


def block_size_for(fmt: QFormat, shape: ModelShape, export: str = "hf", tp_size: int = 1) -> int | None:
    """The first of the format's block sizes that every linear's input features split into whole blocks,
    per tensor-parallel shard: row-parallel layers (o_proj, down_proj) split their input features tp
    ways. ModelOpt's exports refuse partial blocks. None when the format has no blocks."""
    if not fmt.block_sizes:
        return None
    tp = tp_size if export == "trtllm" else 1
    for block in fmt.block_sizes:
        if all(value % (block * tp) == 0 for value in shape.in_features.values()):
            return block
    name, value = next((n, v) for n, v in shape.in_features.items() if v % (fmt.block_sizes[-1] * tp))
    sizes = " or ".join(str(b) for b in fmt.block_sizes)
    per_shard = f" split {tp} ways (--tp-size)" if tp > 1 else ""
    raise QuantizeError(
        f"{fmt.name} quantizes weights in blocks of {sizes} input features, but the model's {name} ({value}){per_shard} "
        f"is not a multiple of {' or '.join(str(b * tp) for b in fmt.block_sizes)}; use --qformat fp8 or int8_sq "
        "(no blocks)" + (" or a smaller --tp-size" if tp > 1 else "")
        + (" or int4_awq (blocks of 64 too)" if fmt.name == "w4a8_awq" else ""))


def check_model_fits(fmt: QFormat, shape: ModelShape, export: str = "hf", tp_size: int = 1, pp_size: int = 1) -> None:
    """Raise QuantizeError when `fmt` (exported as `export`, split tp x pp) can't take this model's shapes."""
    if export == "trtllm":
        if trtllm_decoder_type(shape.model_type) is None:
            raise QuantizeError(f"--export trtllm supports model types {', '.join(trtllm_model_types())}, "
                                f"not {shape.model_type!r}; use --export hf")
        for name, value in (("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads),
                            ("intermediate_size", shape.intermediate_size)):
            if value % tp_size:
                raise QuantizeError(f"--tp-size {tp_size} does not divide {name} ({value}); "
                                    "pick a tp size that divides the heads, kv heads and intermediate size")
        if pp_size > shape.num_layers:
            raise QuantizeError(f"--pp-size {pp_size} is more than the model's {shape.num_layers} layers; "
                                "pick a smaller pp size")
    block_size_for(fmt, shape, export, tp_size)
    if fmt.gemm_multiple > 1:
        dims = {**shape.in_features, "num_key_value_heads*head_dim": shape.num_kv_heads * shape.head_dim}
        for name, value in dims.items():
            if value % fmt.gemm_multiple:
                raise QuantizeError(
                    f"{fmt.name} GEMM kernels need feature sizes that are multiples of {fmt.gemm_multiple}, but the "
                    f"model's {name} is {value}; keep this model unquantized (--qformat none)")
