"""A mixture-of-experts MLP (pipeline.models.families.base.Moe): a router picks each token's top_k experts, and
their SwiGLU outputs are summed, weighted by the router's probabilities. Qwen3-MoE's block, step for step as
transformers' Qwen3MoeSparseMoeBlock runs it.

Where the C kernels run every projection (a CPU), one C call does the routing and the experts (moe in
cpu_kernels_layer.h; the layer stack makes the same call): its softmax is the engine's own (exp_poly, fixed sums),
so its probabilities may differ from torch's in the last bits, alike on every CPU. Elsewhere (a GPU, the kernels
off) torch runs it expert by expert, below.

A row's routing and output are its own (the lossless contract): its router logits come from the engine's
row-invariant linear, its softmax and top-k read that row alone, each expert runs on the engine's linears over the
tokens that picked it (whose result for a row doesn't depend on which other rows ride along), and each token's
expert outputs are added in expert order, one rounding each in the model's dtype, as transformers adds them. So a
token's experts and its output never depend on the other tokens of the step: the batch, a verify's width, a
prefix-cache hit or a prefill chunk's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.engine import cpu_kernels
from pipeline.engine.kernels import AUTO, KernelSet
from pipeline.engine.linear import Linear
from pipeline.engine.quant import Int4Linear, stack_entry
from pipeline.engine.swiglu import SwiGLU
from pipeline.models.families import Moe


@dataclass(frozen=True)
class CPlan:
    """What the C experts (moe in cpu_kernels_layer.h) read: the description `desc` (int64: E, top_k,
    norm_topk_prob, the experts' intermediate size, then the router's and each expert's gate_up and down entries,
    each [kind, weights, scales, pre_quant_scale] as addresses), the int4 group size (0 for none), and the tensors
    behind the addresses, held so they stay valid."""

    desc: torch.Tensor
    group: int
    held: list[torch.Tensor]

    @property
    def entry(self) -> list:
        """The layer stack's entry for the block, in gate_up's place."""
        return [cpu_kernels.STACK_KINDS["moe"], self.desc, None, None]


class SparseMoE(nn.Module):
    kernels: KernelSet = AUTO  # the model's (model.choose_kernels)

    def __init__(self, hidden: int, moe: Moe):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.inter = moe.top_k, moe.norm_topk_prob, moe.intermediate_size
        self.router = Linear(hidden, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, moe.intermediate_size) for _ in range(moe.num_experts))
        self._plan: CPlan | bool | None = None  # see c_plan

    def replan(self) -> None:
        """Forget the C plan: the projections were packed again (Transformer.pack_weights)."""
        self._plan = None

    def c_plan(self, dtype: torch.dtype) -> CPlan | None:
        """The C experts' plan when the router and every expert's projections run on the C kernels in `dtype`
        (dense, AMX or int4 of one group size; no biases), else None. Worked out on the first call: the engine never
        changes a loaded model's weights."""
        if self._plan is None:
            self._plan = self._make_plan(dtype) or False
        return self._plan or None

    def _make_plan(self, dtype: torch.dtype) -> CPlan | None:
        lins = [self.router, *(lin for e in self.experts for lin in (e.gate_up, e.down))]
        entries = [stack_entry(lin, dtype) for lin in lins]
        groups = {lin.group_size for lin in lins if isinstance(lin, Int4Linear)}
        if any(e is None for e in entries) or len(groups) > 1:  # (the C layouts are a CPU's)
            return None
        items = [item for e in entries for item in e]
        head = [len(self.experts), self.top_k, int(self.norm_topk_prob), self.inter]
        desc = torch.tensor(head + [t if isinstance(t, int) else 0 if t is None else t.data_ptr() for t in items],
                            dtype=torch.int64)
        return CPlan(desc, groups.pop() if groups else 0, [t for t in items if isinstance(t, torch.Tensor)])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, top_k] in x's dtype, experts [N, top_k]): the softmax in fp32 over the
        router's logits, its top_k (renormalized where norm_topk_prob), as transformers' Qwen3MoeTopKRouter."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.kernels.c(x)
        plan = self.c_plan(x.dtype) if c is not None else None
        if plan is not None:  # routing and experts in one C call (the same one the layer stack makes)
            return c.moe(x, plan.desc, plan.group)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # Expert by expert in index order, as transformers runs them: each token's outputs land in that order.
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)  # a token picks an expert at most once
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out.reshape(shape)
