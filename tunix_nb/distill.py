"""Logit distillation: a student learns from a frozen teacher's per-token distributions.

Tunix: `distillation.DistillationTrainer` with `strategies.LogitStrategy`. The teacher
runs inside the student's step, frozen (its parameters are the step's `frozen`
argument, so they are replicated or sharded like the student's). The loss is the
per-example `losses.kl_distillation_per_example` under `jax.vmap`, summed over
examples: the step all-reduces the sum and the example count and divides once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tunix_nb import checkpoint, data, losses
from tunix_nb import model as model_lib
from tunix_nb.precision import cast_floats, resolve_compute_dtype

TEACHER_DIR = data.DATA_DIR / "teacher"  # the teacher shipped with the kit


def load_teacher(ckpt_dir=TEACHER_DIR):
    """(graphdef, params) of a teacher checkpoint: the shipped teacher by default."""
    graphdef, params, _ = checkpoint.load_model(ckpt_dir)
    return graphdef, params


def objective(student_graphdef, teacher_graphdef, *, temperature=2.0, alpha=0.5, compute_dtype="auto"):
    """(student params, batch, teacher params) -> (sum of per-example losses, B, metrics).

    The teacher runs in the same step, frozen: no gradient flows into it. With
    `alpha=0` (hard labels only, through the same per-example reduction) it is skipped.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)

    def distill_objective(params, batch, teacher_params):
        student_logits_BxLxV = model_lib.apply(student_graphdef, cast_floats(params, compute_dtype),
                                               batch["inputs"], batch["attention_mask"])
        if alpha == 0.0:  # hard labels only: the soft term has weight 0, skip the teacher
            teacher_logits_BxLxV = lax.stop_gradient(student_logits_BxLxV)
        else:
            teacher_logits_BxLxV = lax.stop_gradient(model_lib.apply(
                teacher_graphdef, cast_floats(teacher_params, compute_dtype), batch["inputs"],
                batch["attention_mask"]))
        mean_loss, metrics = losses.distillation_loss(
            student_logits_BxLxV, teacher_logits_BxLxV, batch["targets"], batch["loss_mask"],
            temperature=temperature, alpha=alpha)
        n = batch["inputs"].shape[0]
        return mean_loss * n, jnp.float32(n), metrics

    return distill_objective
