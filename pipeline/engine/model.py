"""A Llama-shaped decoder in plain PyTorch: Llama 2/3 (with llama3 rope scaling), SmolLM2, Mistral, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (experts: engine/moe.py), with GQA and tied embeddings, reading and
writing a preallocated KV cache. What a family changes comes as features of its config (pipeline.models.families),
never as its name.

Projections are fused (qkv, gate_up) so a decode step launches fewer ops: at batch 1 on a CPU the
per-op overhead is a large share of a step. For the same reason, and so that a row's bits never depend on
the batch (the lossless contract), in bf16 and fp32 on a CPU the small ops between the linears run as three
C kernels per layer where they could be built (RMSNorm with the residual add, rope + cache write +
attention, SiLU-and-multiply: pipeline/engine/cpu_kernels.py), and the linears on the engine's own C
kernels (pipeline/engine/linear.py); when all of them do, the whole layer stack is one C call (one per run of
layers between the hidden states an EAGLE-3 head captures). Elsewhere
rope is applied to q and k in one go, and RMSNorm uses torch's fused kernel where that is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine import gpu_kernels
from pipeline.engine.config import ModelConfig
from pipeline.engine.kernels import AUTO, KernelSet, for_device, use_kernels
from pipeline.engine.kv_cache import ForwardBatch, KVCache
from pipeline.engine.linear import Linear, pack_linears
from pipeline.engine.moe import SparseMoE
from pipeline.engine.quant import Int4Linear, QuantConfig, describe_model, stack_entry
from pipeline.engine.swiglu import SwiGLU
from pipeline.errors import ConfigError


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """local: a sliding-window layer's frequencies (Gemma 3's: a base of their own, never scaled)."""
    theta = cfg.features.window.rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    # Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the band
    # between is interpolated smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    kernels: KernelSet = AUTO  # the model's (choose_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as transformers does (bf16 variance loses too much), then round to the
        # model dtype *before* scaling by the weight, again as transformers does. An fp32 weight on a bf16 row
        # (Gemma's 1 + w, made at load: unit_offset_norm) scales in fp32 and rounds once, as Gemma's norm does.
        if self.kernels.triton(x):
            return gpu_kernels.rms_norm(x, self.weight, self.eps)[1]
        c = self.kernels.c(x) if self.weight.dtype in (x.dtype, torch.float32) else None
        if c is not None:
            return c.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.weight.dtype == torch.float32:
            return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * self.weight).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and the next norm, one kernel on a bf16 CPU or a GPU."""
        if self.kernels.triton(x):
            return gpu_kernels.rms_norm(x, self.weight, self.eps, delta)
        c = self.kernels.c(x) if self.weight.dtype in (x.dtype, torch.float32) and x.dtype == delta.dtype else None
        if c is not None:
            return c.rms_norm(x, self.weight, self.eps, delta)
        total = x + delta
        return total, self(total)


def unit_offset_norm(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm weight w as the engine holds it: 1 + w in fp32, whatever the model's dtype, so the norm
    scales by it in fp32 and rounds once (transformers' Gemma3RMSNorm: output * (1.0 + weight.float()))."""
    return 1.0 + weight.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, 1, D]. Rotate-half layout, as in Hugging Face Llama weights.

    `sin` carries the rotate-half sign: its first half is negated (see Transformer.rope_tables), so
    rotate_half(x) * sin_hf == roll(x, D/2) * sin. Three ops instead of six."""
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # round each product, as transformers does


KEY_BLOCK = 256  # keys per fp32 block of the attention's weighted sum (see grouped_attention)
SCORE_ALIGN = 32  # softmax rows are padded to a multiple of this many keys (see grouped_attention)


class Attention(nn.Module):
    kernels: KernelSet = AUTO  # the model's (choose_kernels)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.hd, bias=cfg.qkv_bias)
        self.o = Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
        # Qwen3: each head of q and of k through an RMSNorm of its own weights, before rope
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        feats = cfg.features
        self.scale = feats.query_scale or self.hd ** -0.5
        # A local layer (Gemma 3's): a token sees its last `window` keys; 0: every key before it
        self.window = feats.window.size if feats.window and layer in feats.window.layers else 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                fb: ForwardBatch) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv, self.hd)
        if self.q_norm is not None:  # the same norm kernel as the layers' (a row's bits are its own), per head
            nq, nk = self.n_heads, self.n_kv
            qkv = torch.cat([self.q_norm(qkv[:, :, :nq].contiguous()), self.k_norm(qkv[:, :, nq:nq + nk].contiguous()),
                             qkv[:, :, nq + nk:]], dim=2)
        ck, cv = cache.k[self.layer], cache.v[self.layer]  # [NB + 1, KV, BS, D]
        c = self.kernels.c(qkv) if ck.dtype == cos.dtype == qkv.dtype else None
        if c is not None:  # rope, the cache write and attention in one call (cpu_kernels.c)
            out = c.rope_attend(qkv, cos, sin, ck, cv, fb.block_table, fb.write_pos, self.n_heads, self.n_kv,
                                      self.scale, self.window)
            return self.o(out.view(B, T, self.n_heads * self.hd))
        if self.kernels.triton(qkv):  # each token against its own keys
            q = gpu_kernels.rope_and_write(qkv, cos, sin, ck, cv, fb.block_table, fb.write_pos, self.n_heads,
                                           self.n_kv)
            out = gpu_kernels.paged_attention(q, ck, cv, fb.block_table, fb.write_pos, self.scale, self.window)
            return self.o(out.view(B, T, self.n_heads * self.hd))
        nq = self.n_heads
        qk = apply_rope(qkv[:, :, : nq + self.n_kv], cos, sin)  # q and k in one go
        q, k, v = qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + self.n_kv:]
        # Advanced indices on dims 0 and 2 put [B, T] first: the value is [B, T, KV, D].
        block, offset = fb.write_index()
        ck[block, :, offset] = k
        cv[block, :, offset] = v
        q = q.transpose(1, 2)  # [B, H, T, D]
        if self.kernels.per_row(q):
            out = self.token_by_token_attention(q, ck, cv, fb)
        else:
            keys, values = fb.keys(ck, None, fb.kv_len), fb.keys(cv, None, fb.kv_len)
            mask = fb.attn_mask
            if self.window:  # [B, 1, T, L]: and only the window's keys
                pos = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (pos > fb.positions[:, None, :, None] - self.window)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.n_kv != self.n_heads)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))

    def token_by_token_attention(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                                 fb: ForwardBatch) -> torch.Tensor:
        """q: [B, H, T, D]; ck/cv: one layer's block pool [NB + 1, KV, BS, D] -> [B, H, T, D]. The torch ops'
        attention on a CPU (no C kernels): each query token alone, against its own keys only, so every op's shapes
        follow from the token's position and nothing else: not the batch, not a verify's width, not the longest
        row. torch's kernels pick their code path by shape, and a batched attention had moved SmolLM2's greedy
        output under speculation (3 of 16 soak prompts on an AMD EPYC). One call per token: slow, and lossless."""
        out = q.new_zeros(q.shape)
        for b, write_pos in enumerate(fb.write_pos.tolist()):
            for t, wp in enumerate(write_pos):
                if wp < 0:  # a pad: nothing reads its output
                    continue
                # Whole blocks of SCORE_ALIGN keys, the ones past the token's own masked: a new length is a new
                # matmul shape, which oneDNN builds a kernel for (1.0 against 0.2 ms a call).
                W = -(-(wp + 1) // SCORE_ALIGN) * SCORE_ALIGN
                keys, values = fb.keys(ck, b, W), fb.keys(cv, b, W)
                mask = None
                if self.window and wp + 1 > self.window:  # a local layer: the keys before its window, out
                    mask = (torch.arange(wp + 1) > wp - self.window).view(1, 1, 1, wp + 1)
                out[b, :, t] = self.grouped_attention(q[b:b + 1, :, t:t + 1], keys, values, mask, wp + 1)[0, :, 0]
        return out

    def grouped_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor | None, kv_len: int | None = None) -> torch.Tensor:
        """q: [B, H, T, D]; keys/values: [B, KV, W, D], of which the first kv_len (L, default W) are real;
        mask: [B, 1, T, L] or None -> [B, H, T, D].

        Query heads sharing a KV head are stacked along T, so GQA needs no repeated K/V.
        """
        B, H, T, D = q.shape
        G = H // self.n_kv
        L = keys.shape[-2] if kv_len is None else kv_len
        scores = (q.reshape(B, self.n_kv, G * T, D) @ keys.transpose(-1, -2)).float() * self.scale  # [B, KV, G*T, W]
        if mask is not None:
            scores[..., :L].masked_fill_(~mask.repeat(1, 1, G, 1), float("-inf"))
        scores[..., L:] = float("-inf")  # keys read past the real ones (see Attention.forward)
        # softmax's CPU kernel takes another code path for a row of fewer than 16 entries (other bits), so
        # a short row's probabilities depended on the L its batch padded it to: prompts of 3-15 tokens
        # moved when prefilled beside a longer one. Rows padded with -inf to a multiple of SCORE_ALIGN
        # keys always take the same path, and the padding adds exact zeros (checked for L = 1..139).
        W = scores.shape[-1]
        if W % SCORE_ALIGN:
            scores = F.pad(scores, (0, SCORE_ALIGN - W % SCORE_ALIGN), value=float("-inf"))
        probs = torch.softmax(scores, dim=-1)[..., :W]
        # probs @ values sums over the keys, and how many keys there are depends on the batch: the
        # longest row sets L, and a shorter row's extra keys are masked to probability 0. A bf16
        # matmul picks its kernel by L (SmolLM2's greedy output alone moved when speculation padded
        # a row from 41 to 44 keys), and an fp32 one changes its summation order past ~512 keys. So
        # the sum runs in fp32 over fixed blocks of KEY_BLOCK keys, added in order: a row's zero
        # probabilities past its own keys then add exact zeros, whatever L the batch has.
        # One query row (G*T = 1: no GQA, one token) would take a matrix-vector kernel of its own.
        rows = probs if G * T > 1 else torch.cat([probs, probs], dim=-2)
        out = None
        for a in range(0, W, KEY_BLOCK):
            part = rows[..., a:a + KEY_BLOCK] @ values[:, :, a:a + KEY_BLOCK].float()
            out = part if out is None else out.add_(part)
        return out[..., : G * T, :].to(q.dtype).reshape(B, H, T, D)


class MLP(SwiGLU):
    """A dense layer's MLP, at the model's intermediate size."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.features.activation)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # before the MLP
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe) if cfg.moe and layer in cfg.moe.layers else MLP(cfg)
        # Gemma's sandwich: attention's and the MLP's outputs normed before their residual adds
        sandwich = cfg.features.sandwich_norms
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None

    def forward(self, x, delta, cos, sin, cache, fb):
        """This layer's input is x + delta: the previous layer's MLP output (delta; None for none) arrives
        unadded, so the residual add runs in one kernel with this layer's norm. Returns the same pair for the
        next layer: the residual after attention and this layer's MLP output."""
        x, normed = (x, self.input_norm(x)) if delta is None else self.input_norm.add_forward(x, delta)
        attn = self.attn(normed, cos, sin, cache, fb)
        if self.attn_out_norm is not None:
            attn = self.attn_out_norm(attn)
        x, normed = self.post_norm.add_forward(x, attn)
        out = self.mlp(normed)
        return x, out if self.mlp_out_norm is None else self.mlp_out_norm(out)


def choose_kernels(model: nn.Module, choice: str = "invariant") -> None:
    """Choose model's kernel set once, for the device its weights are on, and hand it to every layer
    (pipeline.engine.kernels). choice: on a GPU, the engine's own Triton kernels ("invariant") or the vendor's
    ("vendor": cuBLAS and SDPA, whose bits move with the batch); a CPU ignores it. On a GPU, "invariant" first checks
    the one vendor reduction it keeps (greedy's argmax) on this GPU."""
    weight = next(model.parameters())
    if choice == "invariant" and weight.is_cuda:
        if (why := gpu_kernels.available()) is not None:
            raise ConfigError(why)
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", 32000)
        if not gpu_kernels.argmax_invariant(weight.device, vocab):
            raise ConfigError(f"torch's argmax on {torch.cuda.get_device_name(weight.device)} gave a row another "
                              "token in a batch than alone; greedy output can't be kept lossless here: load the engine with "
                              "EngineConfig(gpu_kernels='vendor') to accept that")
    use_kernels(model, for_device(weight.device, choice))


STACK_NORM_F32, STACK_GELU = 1, 2  # cpu_kernels.layers' flags (the C source's enum of the same names)


@dataclass(frozen=True)
class LayerStack:
    """What cpu_kernels.layers needs of the weights: per layer, the addresses of the norms' weights and of each
    projection's kind and tensors (see layers in cpu_kernels_layer.h); and the tensors behind them, held so the
    addresses stay valid."""

    table: torch.Tensor  # int64 [layers, 23]
    group_size: int  # the int4 projections' (0 when there are none)
    held: list[torch.Tensor]
    flags: int = 0  # STACK_NORM_F32, STACK_GELU


class StackRow(NamedTuple):
    """One layer's row of the C layer stack's table (its two norms' weights, then per projection its kind and its
    tensors' addresses, then its per-head q and k norms' weights, its attention-output and MLP-output norms'
    weights (each 0 for none) and its sliding window (0 for none)), the tensors behind the addresses, and its int4
    projections' group sizes."""

    addresses: list[int]
    held: list[torch.Tensor]
    groups: set[int]


def stack_row(norms: list[torch.Tensor], lins: tuple[nn.Module, ...], dtype: torch.dtype,
              qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
              out_norms: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0,
              norm_dtype: torch.dtype | None = None) -> StackRow | None:
    """A layer's row (norms: the two before attention and before the MLP; lins: qkv, o, gate_up, down, or qkv, o
    and a SparseMoE; qk_norms: the per-head q and k norms, Qwen3's and Gemma's; out_norms: attention's and the MLP's
    output norms, Gemma's; window: its sliding window) when every projection runs on the C kernels and each norm is
    a `norm_dtype` (default `dtype`) weight on the CPU, else None."""
    groups = {m.group_size for m in lins if isinstance(m, Int4Linear)}
    if isinstance(lins[-1], SparseMoE):  # its entry stands for gate_up, and down's is empty
        plan = lins[-1].c_plan(dtype)
        if plan is None:
            return None
        entries = [stack_entry(m, dtype) for m in lins[:-1]] + [plan.entry, [0, None, None, None]]
        groups |= {plan.group} - {0}
    else:
        entries = [stack_entry(m, dtype) for m in lins]
    if any(e is None for e in entries) or any(w.dtype != (norm_dtype or dtype) or w.device.type != "cpu"
                                              for w in [*norms, *(qk_norms or ()), *(out_norms or ())]):
        return None
    items = [*norms, *(item for e in entries for item in e), *(qk_norms or (None, None)),
             *(out_norms or (None, None)), window]
    return StackRow([t if isinstance(t, int) else 0 if t is None else t.data_ptr() for t in items],
                    [t for t in items if isinstance(t, torch.Tensor)], groups)


class Transformer(nn.Module):
    kernels: KernelSet = AUTO  # the model's (choose_kernels): the layer stack's C call

    def __init__(self, cfg: ModelConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.quant_config: QuantConfig | None = None  # set by the loader for a quantized checkpoint
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.set_rope_tables(max_seq_len, None)
        self._layer_stack: LayerStack | bool | None = None  # see layer_stack

    def set_rope_tables(self, max_seq_len: int, device: torch.device | str | None) -> None:
        """The rope tables (buffers [max_seq_len, D]), and the local layers' where a window has a base of its own;
        made again off the meta device after loading."""
        for suffix, local in (("", False), ("_local", True)):
            if local and self.cfg.features.window is None:
                continue
            for name, table in zip(("rope_cos", "rope_sin"), self.rope_tables(self.cfg, max_seq_len, local)):
                self.register_buffer(name + suffix, table if device is None else table.to(device), persistent=False)

    @staticmethod
    def rope_tables(cfg: ModelConfig, max_seq_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), rope_inv_freq(cfg, local))
            # sin's first half is negated: apply_rope's roll then yields rotate_half's sign.
            return torch.cat((freqs, freqs), -1).cos().float(), torch.cat((-freqs, freqs), -1).sin().float()

    def pack_weights(self, backend: str | None = None) -> "Transformer":
        """Lay the linear weights out for the device they are on (oneDNN-packed on a CPU). Call again
        after moving or casting the model; load_transformer does it once."""
        self._layer_stack = None  # planned again on the next forward, from the new layouts
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.replan()
        return pack_linears(self, backend)

    def describe(self) -> dict:
        """What runs: dtype, weight format, and per weight format the kernel that runs it (JSON-ready)."""
        return describe_model(self)

    def layer_stack(self) -> LayerStack | None:
        """When every layer's four projections run on the C kernels (int4, or the model's dtype on AMX or
        dense_linear; no biases), with one int4 group size and norms in the model's dtype: what cpu_kernels.layers
        reads; else None. Worked out on the first forward, after loading: the engine never changes a loaded
        model's weights."""
        if self._layer_stack is None:
            self._layer_stack = self._plan_layer_stack() or False
        return self._layer_stack or None

    def _plan_layer_stack(self) -> LayerStack | None:
        f = self.cfg.features
        rows, held, groups = [], [], set()
        dtype = self.embed.weight.dtype
        for layer in self.layers:
            qk = (layer.attn.q_norm.weight, layer.attn.k_norm.weight) if layer.attn.q_norm is not None else None
            outs = (layer.attn_out_norm.weight, layer.mlp_out_norm.weight) if f.sandwich_norms else None
            mlp = (layer.mlp,) if isinstance(layer.mlp, SparseMoE) else (layer.mlp.gate_up, layer.mlp.down)
            row = stack_row([layer.input_norm.weight, layer.post_norm.weight], (layer.attn.qkv, layer.attn.o, *mlp),
                            dtype, qk, outs, layer.attn.window, torch.float32 if f.norm_offset else dtype)
            if row is None:
                return None
            rows.append(row.addresses)
            held += row.held
            groups |= row.groups
        if len(groups) > 1:
            return None
        flags = (STACK_NORM_F32 if f.norm_offset and dtype != torch.float32 else 0) | \
            (STACK_GELU if f.activation == "gelu_tanh" else 0)
        return LayerStack(torch.tensor(rows, dtype=torch.int64), groups.pop() if groups else 0, held, flags)

    def new_cache(self, num_slots: int, max_seq_len: int, num_blocks: int | None = None) -> KVCache:
        """num_blocks: a pool of that many blocks; default one max_seq_len run per slot."""
        p = self.embed.weight
        return KVCache(self.cfg.num_layers, num_slots, max_seq_len, self.cfg.num_kv_heads, self.cfg.head_dim,
                       p.dtype, p.device, num_blocks=num_blocks)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings as the first layer reads them, and as an EAGLE-3 head reads them (ModelOpt
        trains a head on the base model's embed_tokens module, which for Gemma includes its scale)."""
        x = self.embed(input_ids)
        if self.cfg.features.embed_scale:  # Gemma: times sqrt(hidden), the factor rounded to the dtype first
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype)  # fp32, then the dtype: transformers'
        return x

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch, cache: KVCache,
                logits_index: torch.Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids: [B, T]. logits_index: [B, N] token positions whose logits are wanted (default all T).

        Returns logits [B, N, V] in fp32, plus the hidden states entering each layer in capture_layers
        (index num_layers means the final, pre-norm output) when that is non-empty.
        """
        x = self.embed_tokens(input_ids)
        dtype = x.dtype
        cos = self.rope_cos[fb.positions].to(dtype)[:, :, None, :]  # [B, T, 1, D]
        sin = self.rope_sin[fb.positions].to(dtype)[:, :, None, :]
        local = None  # a window's own rope (Gemma 3's local layers)
        if self.cfg.features.window is not None:
            local = (self.rope_cos_local[fb.positions].to(dtype)[:, :, None, :],
                     self.rope_sin_local[fb.positions].to(dtype)[:, :, None, :])
        captured, delta = [], None
        c = self.kernels.c(x) if cache.k.dtype == dtype else None
        stack = self.layer_stack() if c is not None else None
        if stack is not None:  # the layers in C calls: the same kernels and bits as the loop below
            # One call, or one per run of layers between captured inputs (EAGLE-3's), each captured input with its
            # residual added as the loop adds it.
            bounds = sorted({0, self.cfg.num_layers, *(i for i in capture_layers if i < self.cfg.num_layers)})
            for first, end in zip(bounds, bounds[1:]):
                if first in capture_layers:
                    if delta is not None:
                        x, delta = x + delta, None
                    captured.append(x)
                    x = x.clone()  # the C call overwrites its input
                x, delta = c.layers(x, stack.table, stack.group_size, self.cfg, cos, sin, cache, fb, first, end,
                                          stack.flags, self.cfg.features.query_scale, local)
        for i, layer in enumerate(self.layers if stack is None else ()):
            if i in capture_layers:
                if delta is not None:  # the layer's input, added here (the same bits as the fused add)
                    fused = layer.input_norm.kernels.triton(x)
                    # The GPU kernel's own add: the same rounding by construction, not by torch agreeing with it.
                    x, delta = (layer.input_norm.add_forward(x, delta)[0] if fused else x + delta), None
                captured.append(x)
            rope = local if local is not None and layer.attn.window else (cos, sin)
            x, delta = layer(x, delta, *rope, cache, fb)
        if delta is not None:
            x = x + delta
        if self.cfg.num_layers in capture_layers:
            captured.append(x)
        if logits_index is not None:
            x = x.gather(1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        return (logits, captured) if capture_layers else logits
