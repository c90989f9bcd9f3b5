"""The memory plan of a training step: XLA's memory analysis of the kit's step for a real
model's shapes, compiled ahead of time (for one TPU v5e chip, a v5e-8, or the CPU) with
abstract parameters, before anyone trains it. `python -m tunix_nb.bench --only memory`
prints it for Qwen3-0.6B and Llama-3.2-1B, before and after the memory remedies.

    from tunix_nb import memory_plan
    memory_plan.plan("Qwen3-0.6B", memory_plan.PlanConfig(strategy="lora"), "v5e")
"""

from tunix_nb.memory_plan.config import STRATEGIES, PlanConfig, after, before
from tunix_nb.memory_plan.analysis import abstract_step, analyse, extrapolate, plan, read_model_config
from tunix_nb.memory_plan.targets import TARGETS, libtpu_missing

__all__ = ["STRATEGIES", "TARGETS", "PlanConfig", "abstract_step", "after", "analyse", "before", "extrapolate",
           "libtpu_missing", "plan", "read_model_config"]
