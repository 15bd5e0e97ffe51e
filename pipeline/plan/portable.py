"""The portable engine's memory on one GPU (`pipeline plan --backend torch`): its weights in the compute dtype, the
KV pool it sizes as it loads, and how many requests of max_seq_len that pool holds at once.

Pure, as memory.py. The engine sizes its pool from what torch.cuda.mem_get_info reports once the weights are in
(pipeline.engine.llm_engine: kv_pool_blocks); the plan stands the GPU's memory less the CUDA context and what
loads before the pool in for that, and calls the same function.

Assumptions (also in `PortablePlan.assumptions`):
- The engine computes in bf16 on a GPU, and dequantizes a quantized checkpoint at load (quant.py: no int4, fp8
  or int8 GEMM of its own on a GPU), so the weights are 2 bytes a parameter whatever the checkpoint's format; a
  tied lm_head shares the embedding.
- A draft model, or an EAGLE-3 head, keeps its own cache: a max_seq_len run per slot, allocated before the pool.
- With an EAGLE-3 head each target KV block also keeps its 16 tokens' hidden states from the head's 3 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.engine.device import DEFAULT_GPU_MEMORY_FRACTION, check_fraction, kv_pool_blocks
from pipeline.errors import ConfigError, PlanError
from pipeline.plan.memory import CUDA_CONTEXT_BYTES, PlanInputs
from pipeline.plan.weights import eagle3_weight_bytes, kv_bytes_per_token

KV_BLOCK_TOKENS = 16  # pipeline.engine.kv_cache.BLOCK_SIZE (a test pins it): importing it would import torch
ENGINE_DTYPE_BYTES = 2  # bf16, the engine's dtype on a GPU
EAGLE3_CAPTURED_LAYERS = 3  # target layers whose hidden states an EAGLE-3 head fuses (its aux_layer_ids)
ASSUMPTIONS = (
    "GB = 1e9 bytes; one GPU (the portable engine has no tensor parallelism)",
    "weights in bf16: a quantized checkpoint is dequantized at load on a GPU; a tied lm_head shares the embedding",
    "reserve = 1 GiB CUDA context; the KV pool then takes the fraction of the memory left free (as "
    "TensorRT-LLM's free_gpu_memory_fraction), the rest is left for activations",
    "the pool is capped at max batch size x max seq len tokens; a draft model or EAGLE-3 head keeps its own "
    "max_seq_len run per slot, loaded before the pool",
)


@dataclass(frozen=True)
class PortablePlan:
    """Bytes on the one GPU the portable engine runs on."""

    inputs: PlanInputs
    fraction: float  # of the memory free after the weights, for the KV pool
    target_weights: int
    draft_weights: int
    draft_cache: int  # a draft model's or EAGLE-3 head's own KV cache
    kv_bytes_per_block: int  # the target's K/V of one block, every layer (+ an EAGLE-3 head's states)
    cuda_context: int

    @property
    def blocks_per_request(self) -> int:
        return -(-self.inputs.max_seq_len // KV_BLOCK_TOKENS)

    @property
    def free_for_kv(self) -> int:
        """What mem_get_info would report once the weights and a draft's cache are in: the engine's starting point."""
        return (self.inputs.gpu.memory_bytes - self.cuda_context - self.target_weights - self.draft_weights
                - self.draft_cache)

    @property
    def blocks_free_memory_holds(self) -> int:
        """The blocks the fraction of the free memory holds, before the cap."""
        return int(max(self.free_for_kv, 0) * self.fraction) // self.kv_bytes_per_block

    @property
    def fits(self) -> bool:
        return self.blocks_free_memory_holds >= self.blocks_per_request

    @property
    def kv_blocks(self) -> int:
        """The pool the engine sizes (kv_pool_blocks); when not one request fits, what the fraction holds."""
        if not self.fits:
            return self.blocks_free_memory_holds
        i = self.inputs
        return kv_pool_blocks(self.free_for_kv, self.kv_bytes_per_block, block_size=KV_BLOCK_TOKENS,
                              max_batch_size=i.max_batch_size, max_seq_len=i.max_seq_len, fraction=self.fraction)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_blocks * self.kv_bytes_per_block

    @property
    def capped(self) -> bool:
        """Whether max_batch_size x max_seq_len, not the memory, sets the pool."""
        return self.fits and self.kv_blocks < self.blocks_free_memory_holds

    @property
    def requests_that_fit(self) -> int:
        """Requests of max_seq_len tokens the pool holds at once (shorter ones share it by the block)."""
        return self.kv_blocks // self.blocks_per_request

    @property
    def used(self) -> int:
        return self.cuda_context + self.target_weights + self.draft_weights + self.draft_cache + self.kv_pool_bytes

    @property
    def assumptions(self) -> tuple[str, ...]:
        return ASSUMPTIONS

    def fixes(self) -> list[str]:
        if self.fits:
            return []
        if self.free_for_kv <= 0:  # the weights alone don't fit
            return ["--backend trtllm (tensor parallel over several GPUs)", "a GPU with more memory"]
        out = []
        if self.fraction < 1 and self.free_for_kv // self.kv_bytes_per_block >= self.blocks_per_request:
            out.append("--free-gpu-memory-fraction 1")
        longest = self.blocks_free_memory_holds * KV_BLOCK_TOKENS
        if longest >= KV_BLOCK_TOKENS:
            out.append(f"--max-seq-len {longest}")
        return out + ["a GPU with more memory"]

    def to_dict(self) -> dict:
        i = self.inputs
        return {
            "backend": "torch", "device": "cuda", "target": i.target_name, "draft": i.draft.name,
            "draft_kind": i.draft.kind, "gpu": i.gpu.key, "gpu_name": i.gpu.name,
            "gpu_memory_bytes": i.gpu.memory_bytes, "dtype": "bf16", "max_batch_size": i.max_batch_size,
            "max_seq_len": i.max_seq_len, "free_gpu_memory_fraction": self.fraction,
            "target_weight_bytes": self.target_weights, "draft_weight_bytes": self.draft_weights,
            "draft_cache_bytes": self.draft_cache, "cuda_context_bytes": self.cuda_context,
            "free_after_weights_bytes": self.free_for_kv, "kv_block_tokens": KV_BLOCK_TOKENS,
            "kv_bytes_per_block": self.kv_bytes_per_block, "kv_blocks": self.kv_blocks,
            "kv_cache_bytes": self.kv_pool_bytes, "kv_capped_at_max_batch": self.capped,
            "blocks_free_memory_holds": self.blocks_free_memory_holds,
            "requests_of_max_seq_len": self.requests_that_fit, "used_bytes": self.used, "fits": self.fits,
            "fixes": self.fixes(), "assumptions": list(self.assumptions),
        }


def plan_portable(inputs: PlanInputs, fraction: float = DEFAULT_GPU_MEMORY_FRACTION) -> PortablePlan:
    """The portable engine's plan on one inputs.gpu, its KV pool taking `fraction` of the memory left free."""
    try:
        check_fraction(fraction, "--free-gpu-memory-fraction")
    except ConfigError as err:
        raise PlanError(str(err)) from None
    if inputs.tp != 1:
        raise PlanError(f"the portable engine runs on one GPU; drop --tp-size {inputs.tp} (or plan --backend trtllm)")
    if inputs.kv_cache_dtype != "bf16":
        raise PlanError("the portable engine keeps its KV cache in the compute dtype (bf16); drop --kv-cache-dtype "
                        f"{inputs.kv_cache_dtype}")
    target, draft, m = inputs.target, inputs.draft, inputs.max_batch_size
    run = -(-inputs.max_seq_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS  # a slot's fixed run, in tokens
    block = KV_BLOCK_TOKENS * kv_bytes_per_token(target, target.num_layers, "bf16")
    if draft.kind == "model":
        draft_weights = draft.shape.param_count * ENGINE_DTYPE_BYTES
        draft_cache = kv_bytes_per_token(draft.shape, draft.shape.num_layers, "bf16") * m * run
    elif draft.kind == "eagle3":
        draft_weights = eagle3_weight_bytes(target, "none").total
        draft_cache = kv_bytes_per_token(target, 1, "bf16") * m * run
        block += KV_BLOCK_TOKENS * EAGLE3_CAPTURED_LAYERS * target.hidden_size * ENGINE_DTYPE_BYTES
    else:
        draft_weights = draft_cache = 0
    return PortablePlan(inputs, fraction, target.param_count * ENGINE_DTYPE_BYTES, draft_weights, draft_cache, block,
                        CUDA_CONTEXT_BYTES)
