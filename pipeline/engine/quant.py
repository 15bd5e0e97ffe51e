"""Quantized checkpoints in the portable engine: ModelOpt's unified HF export, read and run.

`export_hf_checkpoint` writes hf_quant_config.json next to config.json and model.safetensors, and
stores each quantized linear as its weight plus scales. The layouts (modelopt/torch/export/
quant_utils.py: pack_int4_in_uint8, to_quantized_weight; unified_export_hf.py):

- INT4 (W4A16_AWQ, W4A8_AWQ): `weight` uint8 [out/2, in], two signed int4 values in [-8, 7] per byte
  along the OUTPUT dim: row 2j in the low nibble, row 2j+1 in the high one. `weight_scale` fp32
  [out, in/group]; w = q * weight_scale. AWQ's `pre_quant_scale` [in] multiplies the activation
  (only where it could not be folded into the preceding norm: o_proj, down_proj). W4A8 adds a
  per-tensor `weight_scale_2` (the weight's fp8 step, ModelOpt fake-quantizes it to fp8 on top of
  int4) and an fp8 `input_scale`.
- FP8: `weight` float8_e4m3fn [out, in], `weight_scale` per tensor; w = w8 * weight_scale;
  `input_scale` per tensor for the activations.
- INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL): `weight` int8, `weight_scale` [out]; `pre_quant_scale`
  [in] on every linear (the smoothing), `input_scale` per tensor.

On a CPU, INT4 runs on the engine's C kernel (cpu_kernels.quant_linear): weights re-laid in blocks of
16 output features, fp32 scales, activations in the engine's dtype, fp32 accumulation. A block is
decoded once for up to 4 rows, so a verify's k+1 rows cost about 1.5x a decode's one where torch's
int4 kernel costs 3x. Without a C compiler, INT4 runs on torch's kernel
(`aten._weight_int4pack_mm_for_cpu`) with bf16 activations (with fp32 ones it is ~10x slower). That
kernel takes uint4 (q + 8) packed by `_convert_weight_to_int4pack_for_cpu(w [N, K] int32, tiles)` and
scales_and_zeros [K/group, N, 2] in bf16, and computes (q_u4 - 8) * scale + zero; the symmetric int4
of ModelOpt is then q_u4 = q + 8 with zero = 0.

An INT4 checkpoint's lm_head, which ModelOpt leaves in bf16, becomes int8 at load (Int8Head;
EngineConfig.lm_head says when).

FP8 and INT8 have no GEMM on this CPU (and `_weight_int8pack_mm` is slower than dense bf16), so
their weights are dequantized once at load to the engine dtype and run on the dense (oneDNN) path.
Dequantizing per forward would keep them 2x smaller in memory but costs far more than the matmul
(a full conversion of the weight every step). Activations are fake-quantized with `input_scale` as
ModelOpt's calibrated model does, so the engine reproduces the quality ModelOpt measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.engine import cpu_kernels, gpu_kernels, row_invariance
from pipeline.engine.kernels import AUTO, KernelSet
from pipeline.engine.linear import OWN_LAYOUTS, Linear
from pipeline.errors import ModelFormatError

# ModelOpt quant_algo -> our name for it.
SUPPORTED_ALGOS = {"W4A16_AWQ": "int4_awq", "W4A8_AWQ": "w4a8_awq", "FP8": "fp8",
                   "W8A8_SQ_PER_CHANNEL": "int8_sq"}
SUPPORTED_KV_ALGOS = {None, "FP8"}
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs out_features % 16 == 0
TORCH_INT4_ROWS = (1, 32)  # rows per call of torch's int4 kernel, where row_invariance finds that safe
FP8_MAX = 448.0


@dataclass(frozen=True)
class QuantConfig:
    """What hf_quant_config.json (or config.json's quantization_config) says about a checkpoint."""

    quant_algo: str | None  # ModelOpt's name, e.g. "W4A16_AWQ"; None: weights not quantized
    kv_cache_quant_algo: str | None
    group_size: int | None

    @property
    def weights(self) -> str:
        return SUPPORTED_ALGOS[self.quant_algo] if self.quant_algo else "dense"


def read_quant_config(folder: str | Path, tensors: dict[str, torch.Tensor]) -> QuantConfig | None:
    """The checkpoint's quantization, or None for a plain checkpoint. Unsupported ones raise."""
    folder = Path(folder)
    hf_quant = folder / "hf_quant_config.json"
    if hf_quant.is_file():
        source, q = hf_quant, json.loads(hf_quant.read_text()).get("quantization", {})
    else:
        source = folder / "config.json"
        q = json.loads(source.read_text()).get("quantization_config") if source.is_file() else None
        if not q:
            return None
        method = q.get("quant_method", "modelopt")
        # A checkpoint that transformers dequantized on load (a GGUF, say) and saved keeps the
        # source's quantization_config, but its weights are plain floats.
        if method != "modelopt" and all(t.is_floating_point() and t.element_size() > 1 for t in tensors.values()):
            return None
        if method != "modelopt":
            raise ModelFormatError(f"quant_method {method!r} in {source} is not supported by the portable engine; "
                                   "use a ModelOpt export (pipeline quantize) or an unquantized checkpoint")
    algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo is not None and algo not in SUPPORTED_ALGOS:
        raise ModelFormatError(f"quant_algo {algo!r} in {source} is not supported by the portable engine; "
                               f"supported: {', '.join(SUPPORTED_ALGOS)}")
    if kv not in SUPPORTED_KV_ALGOS:
        raise ModelFormatError(f"kv_cache_quant_algo {kv!r} in {source} is not supported by the portable engine; "
                               "supported: FP8, or none")
    if algo is None and kv is None:
        return None
    return QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv, group_size=q.get("group_size"))


# ---- format conversions ---------------------------------------------------------------------------


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's uint8 [out/2, in] -> int8 [out, in] in [-8, 7] (row 2j low nibble, 2j+1 high)."""
    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    q = torch.stack((lo, hi), dim=1).reshape(-1, packed.shape[-1])  # interleave rows
    return (q ^ 8) - 8  # sign-extend a 4-bit two's complement value


@dataclass
class QuantizedWeight:
    """One checkpoint linear as stored: its weight and whatever scales the export wrote for it."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    weight_scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None

    @classmethod
    def take(cls, tensors: dict[str, torch.Tensor], name: str) -> "QuantizedWeight":
        return cls(**{field: tensors.get(f"{name}.{field}") for field in
                      ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")})

    @property
    def kind(self) -> str:
        """"dense", "int4", "w4a8", "fp8" or "int8"."""
        if self.weight_scale is None:
            return "dense"
        if self.weight.dtype == torch.uint8:
            return "w4a8" if self.weight_scale_2 is not None else "int4"
        if self.weight.dtype == torch.float8_e4m3fn:
            return "fp8"
        if self.weight.dtype == torch.int8:
            return "int8"
        raise ModelFormatError(f"quantized weight of dtype {self.weight.dtype} with a weight_scale is not a "
                               "format the engine knows (int4 as uint8, fp8 e4m3, int8)")

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] * (2 if self.kind in ("int4", "w4a8") else 1)

    def int4(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [out, in] in [-8, 7], scale fp32 [out, in/group])."""
        return unpack_int4(self.weight), self.weight_scale.float()

    def dequantize(self) -> torch.Tensor:
        """The weight as ModelOpt's calibrated (fake-quant) model used it, in fp32 [out, in]."""
        kind = self.kind
        if kind == "dense":
            return self.weight.float()
        if kind in ("int4", "w4a8"):
            q, s = self.int4()
            w = q.float() * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
            if kind == "w4a8":  # W4A8's weight quantizer is int4 then fp8 (per tensor) on the result
                s2 = self.weight_scale_2.float()
                w = (w / s2).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s2
            return w
        scale = self.weight_scale.float()
        return self.weight.float() * (scale[:, None] if scale.dim() == 1 else scale)


# ---- modules --------------------------------------------------------------------------------------


class ActivationQuant(nn.Module):
    """What a quantized linear does to its input before the matmul: AWQ/SmoothQuant's per-channel
    pre_quant_scale, then (FP8, W4A8, INT8-SQ) per-tensor fake quantization with input_scale."""

    def __init__(self, pre_quant_scale: torch.Tensor | None, act_format: str | None,
                 input_scale: torch.Tensor | None):
        super().__init__()
        self.register_buffer("pre_quant_scale", pre_quant_scale)
        self.register_buffer("input_scale", input_scale)
        # ModelOpt's fake quant multiplies by maxbound / amax rather than dividing by the scale; a
        # one-ulp difference can flip an fp8 rounding, so the engine multiplies by a reciprocal too.
        self.register_buffer("inv_input_scale", None if input_scale is None else 1 / input_scale)
        self.act_format = act_format  # None, "fp8" or "int8"
        self.identity = pre_quant_scale is None and act_format is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        s, inv = self.input_scale, self.inv_input_scale
        if self.act_format == "fp8":
            return (x * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s
        if self.act_format == "int8":
            return (x * inv).round_().clamp_(-128, 127) * s
        return x


class DequantizedLinear(Linear):
    """A quantized checkpoint linear dequantized at load: the dense (oneDNN-packed) path, after the
    input transform the checkpoint asks for."""

    def __init__(self, in_features: int, out_features: int, bias: bool, act: ActivationQuant, kind: str,
                 kernel: str):
        super().__init__(in_features, out_features, bias)
        self.act, self.kind, self.kernel = act, kind, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x if self.act.identity else self.act(x))


class Int4Linear(nn.Module):
    """Symmetric group-wise int4 weights. On a CPU with the C kernels (cpu_kernels.quant_linear), in the
    activation's dtype with AWQ's pre_quant_scale applied in fp32; without them, on torch's int4 kernel
    with bf16 activations, its packed copy made on first use."""

    kernels: KernelSet = AUTO  # the model's (model.choose_kernels)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, act: ActivationQuant,
                 kind: str, pre_quant_scale: torch.Tensor | None = None):
        """q: int8 [N, K] in [-8, 7]; scale: [N, K/group]; pre_quant_scale: [K] as the checkpoint stores it (the
        C kernel multiplies by it in fp32; act holds it in the engine's dtype for the torch path)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        self.kind, self.act = kind, act
        self.register_buffer("bias", bias)
        self.c_kernel = (cpu_kernels.usable()
                         and cpu_kernels.quant_layout_reason(*q.shape, self.group_size) is None)
        self._torch_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's int4 layout, where it runs
        self._torch_kernel: row_invariance.CheckedKernel | None = None
        if self.c_kernel:
            self.register_buffer("blocks", cpu_kernels.block_weights(q, 4))
            self.register_buffer("scales", cpu_kernels.block_scales(scale))
            self.register_buffer("pre_scale", None if pre_quant_scale is None else
                                 pre_quant_scale.float().contiguous())
        else:
            self._torch_kernel = self._checked_torch_kernel(q, scale)

    @property
    def kernel(self) -> str:
        if self.c_kernel and cpu_kernels.usable():
            return "cpu_kernels.quant_linear (fused C, fp32 accumulation: row-invariant by construction)"
        checked = self._torch_kernel
        how = ("checked on its first call" if checked is None  # the kernels switched off after loading (tests)
               else "its rows' bits held in 1-32-row calls on this CPU (checked at load)" if checked.invariant
               else "one row a call: its results changed with the row count on this CPU (checked at load)")
        return f"aten._weight_int4pack_mm_for_cpu (bf16 activations), {how}"

    def _checked_torch_kernel(self, q: torch.Tensor, scale: torch.Tensor) -> row_invariance.CheckedKernel:
        """torch's int4 kernel on this weight, called as row_invariance found safe on this CPU."""
        # The kernel reads unsigned nibbles and computes (u - 8) * scale + zero: u = q + 8, zero = 0.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 2)
        sz = torch.stack((scale.t(), torch.zeros_like(scale.t())), dim=-1).to(torch.bfloat16).contiguous()
        self._torch_pack = (packed, sz)  # [N, K/2] uint8, [K/group, N, 2]
        group = self.group_size

        def fn(x: torch.Tensor) -> torch.Tensor:  # x [rows, K] bf16 -> [rows, N] bf16
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)

        key = ("int4", self.out_features, group)
        return row_invariance.CheckedKernel(fn, key, self.in_features, torch.bfloat16, TORCH_INT4_ROWS)

    @staticmethod
    def unsupported_reason(out_features: int, in_features: int, group_size: int, device: torch.device) -> str | None:
        if device.type != "cpu" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return "the int4 kernel used here is CPU-only"
        if cpu_kernels.usable() and cpu_kernels.quant_layout_reason(out_features, in_features, group_size) is None:
            return None
        if group_size not in INT4_GROUP_SIZES or in_features % group_size:
            return f"group size {group_size} (the CPU int4 kernel takes {INT4_GROUP_SIZES})"
        if out_features % INT4_N_MULTIPLE:
            return f"out_features {out_features} is not a multiple of {INT4_N_MULTIPLE}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.kernels.c(x) if self.c_kernel else None
        lead = x.shape[:-1]
        if c is not None:
            y = c.quant_linear(x, self.blocks, 4, self.scales, self.pre_scale)
        else:
            if not self.act.identity:  # skipping the call saves ~5% of an int4 decode step
                x = self.act(x)
            if self._torch_kernel is None:  # the kernels switched off (tests compare the two)
                q = cpu_kernels.unblock_weights(self.blocks, 4)
                scale = cpu_kernels.unblock_scales(self.scales)
                self._torch_kernel = self._checked_torch_kernel(q, scale)
            y = self._torch_kernel(x.reshape(-1, self.in_features).to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        if self.c_kernel:
            return self.blocks.nbytes + self.scales.nbytes
        return sum(t.nbytes for t in self._torch_pack)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Head(nn.Module):
    """The output projection as int8 with one fp32 scale per `group` inputs (symmetric, round to nearest),
    quantized by the engine at load from the checkpoint's head, on cpu_kernels.quant_linear. Logits come out
    in fp32 straight from the kernel's accumulators.

    Why: ModelOpt's INT4 export keeps the tied embedding/head in bf16, 57 of the 108 MB a SmolLM2 decode step
    reads; int8 halves that (llama.cpp's Q4_1 GGUF holds its head as Q8_0, per 32). The error is an int8
    rounding per weight (at most scale/2, under 0.4% of its group's largest), far under INT4's."""

    group = 64
    kernels: KernelSet = AUTO  # the model's (model.choose_kernels)

    def __init__(self, weight: torch.Tensor):
        """weight: [vocab, hidden], quantized 4096 rows at a time so no fp32 copy of the whole head is made."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        G = self.group_for(self.in_features)
        blocks = torch.empty(self.out_features // 16, self.in_features, 16, dtype=torch.int8)
        scales = torch.empty(self.out_features // 16, self.in_features // G, 16)
        for r in range(0, self.out_features, 4096):
            w = weight[r:r + 4096].float().reshape(-1, self.in_features // G, G)
            scale = w.abs().amax(-1) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: q = 0 either way
            q = (w / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8).reshape(-1, self.in_features)
            blocks[r // 16:(r + len(q)) // 16] = cpu_kernels.block_weights(q, 8)
            scales[r // 16:(r + len(q)) // 16] = cpu_kernels.block_scales(scale)
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.kernel = f"int8, one fp32 scale per {G} inputs, quantized at load; cpu_kernels.quant_linear"

    @classmethod
    def group_for(cls, in_features: int) -> int:
        """Inputs per scale: `group`, or the whole row where `group` doesn't divide it."""
        return cls.group if in_features % cls.group == 0 else in_features

    @classmethod
    def unsupported_reason(cls, out_features: int, in_features: int) -> str | None:
        return cpu_kernels.quant_layout_reason(out_features, in_features, cls.group_for(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.kernels.c(x)
        if c is not None:
            y = c.quant_linear(x, self.blocks, 8, self.scales, out_dtype=torch.float32)
            return y.view(*x.shape[:-1], self.out_features)
        # The kernels switched off (tests): the same weights dequantized, in fp32.
        q = cpu_kernels.unblock_weights(self.blocks, 8).float()
        scale = cpu_kernels.unblock_scales(self.scales)
        w = q * scale.repeat_interleave(self.in_features // scale.shape[1], dim=1)
        return torch.nn.functional.linear(x.float(), w)

    def weight_bytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes


# ---- building the engine's fused linears ---------------------------------------------------------

ACT_FORMAT = {"fp8": "fp8", "w4a8": "fp8", "int8": "int8"}
DEQUANT_REASON = {
    "fp8": "no fp8 GEMM on CPU",
    "int8": "aten._weight_int8pack_mm is slower than dense bf16 on CPU",
    "w4a8": "W4A8's fp8 weight rounding is not int4",
}


def build_quantized_linear(pieces: list[QuantizedWeight], bias: torch.Tensor | None, dtype: torch.dtype,
                           device: torch.device) -> nn.Module | None:
    """One engine linear from checkpoint linears fused along the output dim (q,k,v or gate,up), or
    None when none of them is quantized (the dense loader handles it)."""
    kinds = {p.kind for p in pieces}
    if kinds == {"dense"}:
        return None
    if len(kinds) > 1:
        raise ModelFormatError(f"fused projections mix quantization formats ({', '.join(sorted(kinds))}); "
                               "quantize q/k/v and gate/up alike")
    kind = kinds.pop()
    in_features = pieces[0].weight.shape[1]
    out_features = sum(p.out_features for p in pieces)
    # Fused pieces share one input. ModelOpt's export unifies their input_scale and pre_quant_scale
    # (preprocess_linear_fusion); should they still differ, the largest input_scale is used, and
    # the pre_quant_scale ratio is folded into the weights (which then must be dequantized).
    pqs = [p.pre_quant_scale for p in pieces]
    common_pqs = pqs[0]
    same_pqs = all(s is None for s in pqs) or all(s is not None and torch.equal(s, pqs[0]) for s in pqs)
    if not same_pqs:
        pqs = [torch.ones(in_features) if s is None else s.float() for s in pqs]
        common_pqs = torch.stack(pqs).amax(0)
    in_scales = [p.input_scale for p in pieces if p.input_scale is not None]
    input_scale = torch.stack([s.float().reshape(()) for s in in_scales]).amax() if in_scales else None
    act_format = ACT_FORMAT.get(kind) if input_scale is not None else None
    act = ActivationQuant(None if common_pqs is None else common_pqs.to(device=device, dtype=dtype), act_format,
                          None if input_scale is None else input_scale.to(device=device, dtype=dtype))
    if kind == "int4" and same_pqs:
        group = in_features // pieces[0].weight_scale.shape[1]
        reason = Int4Linear.unsupported_reason(out_features, in_features, group, torch.device(device))
        if reason is None:
            qs, scales = zip(*(p.int4() for p in pieces))
            b = None if bias is None else bias.to(device=device, dtype=dtype)
            return Int4Linear(torch.cat(qs), torch.cat(scales), b, act, kind, common_pqs)
    else:
        reason = DEQUANT_REASON.get(kind, "fused pieces have different pre_quant_scales")
    weights = [p.dequantize() if same_pqs else p.dequantize() * (s / common_pqs) for p, s in zip(pieces, pqs)]
    with torch.device("meta"):  # the placeholder parameters are replaced just below
        lin = DequantizedLinear(in_features, out_features, bias is not None, act, kind,
                                kernel=f"dequantized to {dtype_name(dtype)} at load: {reason}")
    lin.weight = nn.Parameter(torch.cat(weights).to(device=device, dtype=dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return lin


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Int4Linear, DequantizedLinear))]


def activation_description(act: ActivationQuant) -> str:
    if act.act_format == "fp8":
        return "fake-quantized to fp8 per tensor with input_scale, as in ModelOpt's calibrated model"
    if act.act_format == "int8":
        return "fake-quantized to int8 per tensor with input_scale, as in ModelOpt's calibrated model"
    return "unquantized"


def layer_weight_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' projection weights as held in memory (embedding and lm_head,
    which ModelOpt leaves unquantized, are not counted; nor are oneDNN's packed copies)."""
    total = 0
    for m in model.layers.modules():
        if isinstance(m, Int4Linear):
            total += m.weight_bytes()
        elif isinstance(m, Linear):
            total += m.weight.nbytes
    return total


def describe_model(model: nn.Module) -> dict:
    """The engine's description of a loaded Transformer (see Transformer.describe)."""
    qc: QuantConfig | None = model.quant_config
    desc = {"dtype": dtype_name(model.embed.weight.dtype), "weights": qc.weights if qc else "dense",
            "kernels": {}}
    if qc is not None:
        desc["quant_algo"] = qc.quant_algo
        if qc.group_size:
            desc["group_size"] = qc.group_size
    mods = quantized_modules(model)
    dense = [m for m in model.modules() if type(m) is Linear]
    if dense:  # each kernel the dense linears run on, and why it was chosen (Linear.pack)
        counts: dict[str, int] = {}
        for m in dense:
            name = m.kernel_name() + (f": {m.why}" if m.why else "")
            counts[name] = counts.get(name, 0) + 1
        desc["kernels"]["dense"] = "; ".join(f"{name} ({n} of {len(dense)})" if n < len(dense) else name
                                             for name, n in counts.items())
    for m in mods:
        desc["kernels"].setdefault(m.kind, m.kernel)
    if isinstance(model.lm_head, Int8Head):
        desc["kernels"]["lm_head"] = model.lm_head.kernel
    if model.layer_stack() is not None:
        desc["kernels"]["decoder layers"] = "all in one C call a forward (cpu_kernels.layers)"
    w = model.embed.weight
    if w.dtype in cpu_kernels.DTYPES and w.device.type == "cpu":
        desc["kernels"]["norm, rope, attention, silu"] = cpu_kernels.status()
    if gpu_kernels.runs_here(w):
        # "invariant" (the engine's Triton kernels) or "vendor" (cuBLAS and SDPA: an explicit opt-out, whose
        # greedy output moves with the batch): named wherever the engine describes itself.
        choice = "vendor" if model.norm.kernels.name == "vendor" else "invariant"
        desc["gpu_kernels"] = choice
        desc["kernels"]["norm, attention"] = (
            "gpu_kernels.rms_norm and gpu_kernels.paged_attention (Triton): a row's bits are its own"
            if choice == "invariant" else
            "torch rms_norm and SDPA (vendor: a row's bits move with the batch, a verify's width and a prefix hit)")
        if choice == "invariant":
            desc["kernels"]["linear tilings"] = gpu_kernels.tilings_source(w.device)
    acts = {activation_description(m.act) for m in mods if m.act.act_format}
    if acts:
        desc["activations"] = acts.pop() if len(acts) == 1 else sorted(acts)
    desc["quantized_linears"] = f"{len(mods)} of {len(mods) + len(dense)}"
    if qc is not None and qc.kv_cache_quant_algo:
        desc["kv_cache"] = (f"{qc.kv_cache_quant_algo} in the checkpoint; its k/v scales are ignored and the cache "
                            f"is kept in {desc['dtype']}")
    desc["layer_weight_bytes"] = layer_weight_bytes(model)
    return desc


def stack_entry(lin: nn.Module, dtype: torch.dtype) -> list[torch.Tensor | int] | None:
    """[kind, weights, scales, pre_quant_scale] of a projection the C layer stack (or the C experts) runs in a
    `dtype` model, or None."""
    if isinstance(lin, Int4Linear) and lin.c_kernel and lin.bias is None:
        return [cpu_kernels.STACK_KINDS["int4"], lin.blocks, lin.scales, lin.pre_scale]
    if type(lin) is Linear and lin.layout in OWN_LAYOUTS and lin.dtype == dtype and lin.bias is None:
        return [cpu_kernels.STACK_KINDS[lin.layout], lin.packed, None, None]
    return None
