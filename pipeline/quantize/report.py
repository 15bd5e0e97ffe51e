"""What a quantization run measured: quality against the unquantized model, sizes and times."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from tabulate import tabulate


@dataclass(frozen=True)
class Quality:
    """Next-token quality on the held-out samples. ppl: exp(mean NLL). argmax: [N, L-1] greedy picks."""

    perplexity: float
    argmax: object  # torch.Tensor [N, L-1], kept only to compare two models


def measure_quality(model, samples, batch_size: int) -> Quality:
    """Perplexity and the greedy next-token picks of `model` on samples [N, L]."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    nll_sum, count, picks = 0.0, 0, []
    with torch.no_grad():
        for batch in samples.split(batch_size):  # batch: [B, L]
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # [B, L-1, V]
            targets = batch[:, 1:]  # [B, L-1]
            nll_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       reduction="sum").item()
            count += targets.numel()
            picks.append(logits.argmax(-1).cpu())
    return Quality(perplexity=math.exp(nll_sum / count), argmax=torch.cat(picks))


def top1_agreement(a: Quality, b: Quality) -> float:
    """Fraction of positions where both models pick the same next token."""
    return (a.argmax == b.argmax).float().mean().item()


def safetensors_bytes(folder: Path) -> int:
    """Bytes of every tensor in the folder's *.safetensors files, read from their headers."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


@dataclass(frozen=True)
class QuantizeReport:
    model: str
    model_path: str
    output: str
    qformat: str
    kv_cache_dtype: str
    block_size: int | None  # weight scale block along input features (AWQ formats), else None
    export: str
    tp_size: int
    pp_size: int
    device: str
    quant_algo: str | None  # as the exported checkpoint's config names it
    bytes_before: int  # tensors in the source's safetensors
    bytes_after: int  # tensors in the exported safetensors (all ranks)
    calib_data: str
    calib_samples: int
    calib_seq_len: int
    calib_time_s: float  # mtq.quantize, calibration included (0 for none)
    export_time_s: float
    eval_data: str
    eval_samples: int
    eval_seq_len: int
    perplexity_before: float
    perplexity_after: float
    top1_agreement: float  # fraction of held-out positions where both models predict the same next token
    total_time_s: float

    @property
    def calib_tokens(self) -> int:
        return self.calib_samples * self.calib_seq_len

    @property
    def compression(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "calib_tokens": self.calib_tokens, "compression": round(self.compression, 3)}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def render_table(r: QuantizeReport) -> str:
    ppl_delta = (r.perplexity_after / r.perplexity_before - 1) * 100 if r.perplexity_before else 0.0
    rows = [
        ("model", f"{r.model} ({r.model_path})"),
        ("format", f"{r.qformat} (quant_algo {r.quant_algo or 'none'}"
                   + (f", blocks of {r.block_size}" if r.block_size else "") + ")"),
        ("kv cache", r.kv_cache_dtype),
        ("export", f"{r.export}" + (f" tp={r.tp_size} pp={r.pp_size}" if r.export == "trtllm" else "")
         + f" -> {r.output}"),
        ("weights", f"{_mb(r.bytes_before)} -> {_mb(r.bytes_after)} ({r.compression:.2f}x smaller)"),
        ("calibration", f"{r.calib_samples} x {r.calib_seq_len} = {r.calib_tokens} tokens of {r.calib_data}, "
                        f"{r.calib_time_s:.1f} s on {r.device}"),
        ("export time", f"{r.export_time_s:.1f} s"),
        ("perplexity", f"{r.perplexity_before:.3f} -> {r.perplexity_after:.3f} ({ppl_delta:+.1f}%) on "
                       f"{r.eval_samples} x {r.eval_seq_len} tokens of {r.eval_data}"),
        ("top-1 agreement", f"{r.top1_agreement:.4f}"),
        ("total time", f"{r.total_time_s:.1f} s"),
    ]
    return tabulate(rows, tablefmt="plain", disable_numparse=True)
