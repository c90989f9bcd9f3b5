"""The memory plan of a training step: XLA's memory analysis of the kit's step for a real
model's shapes, compiled ahead of time (for one TPU v5e chip, a v5e-8, or the CPU) with
abstract parameters, before anyone trains it. `python -m tunix_nb.bench --only memory`
prints it for Qwen3-0.6B and Llama-3.2-1B, before and after the memory remedies.

    from tunix_nb import memory_plan
    memory_plan.plan("Qwen3-0.6B", memory_plan.PlanConfig(strategy="lora"), "v5e")

`analyse_step` gives the same analysis for a step about to train (a lesson's own), and
`stored_row` reads a real model's stored plan from results/memory.json beside it.
"""

from tunix_nb.memory_plan.config import STRATEGIES, PlanConfig, after, before
from tunix_nb.memory_plan.analysis import abstract_step, analyse, extrapolate, plan, read_model_config
from tunix_nb.memory_plan.fit import analyse_step, describe, device_memory_bytes, format_bytes, stored_row
from tunix_nb.memory_plan.targets import HBM_BYTES, TARGETS, libtpu_missing

__all__ = ["HBM_BYTES", "STRATEGIES", "TARGETS", "PlanConfig", "abstract_step", "after", "analyse", "analyse_step",
           "before", "describe", "device_memory_bytes", "extrapolate", "format_bytes", "libtpu_missing", "plan",
           "read_model_config", "stored_row"]
