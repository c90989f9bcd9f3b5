"""The optimizer every method shares: AdamW with warmup and cosine decay, after clipping.

Clipping runs on the gradients of the global batch: `step.make_step` divides the
all-reduced gradient sum by the all-reduced weight before the optimizer sees it.
"""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay, after global-norm clipping."""

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 500
    end_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0


def make_optimizer(cfg: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    if cfg.total_steps <= cfg.warmup_steps:
        raise ValueError(
            f"total_steps={cfg.total_steps} must exceed warmup_steps={cfg.warmup_steps}; "
            "train longer or warm up for fewer steps."
        )
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.learning_rate * cfg.end_learning_rate_fraction,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )
