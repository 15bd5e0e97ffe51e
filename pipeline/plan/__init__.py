"""Memory planning: will a target, its draft and their KV cache fit on N GPUs? Pure, no GPU needed."""

from pipeline.plan.gpus import GPU, GPUS, get_gpu
from pipeline.plan.memory import MemoryPlan, PlanDraft, PlanInputs, check_fits, plan_memory
from pipeline.plan.portable import PortablePlan, plan_portable
from pipeline.plan.render import render_portable, render_table
from pipeline.plan.resolve import plan_inputs

__all__ = ["GPU", "GPUS", "MemoryPlan", "PlanDraft", "PlanInputs", "PortablePlan", "check_fits", "get_gpu",
           "plan_inputs", "plan_memory", "plan_portable", "render_portable", "render_table"]
