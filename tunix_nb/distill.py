"""Logit distillation: a student learns from a frozen teacher's per-token distributions.

Tunix: `distillation.DistillationTrainer` with `strategies.LogitStrategy`. The teacher
runs inside the student's step, frozen (its parameters are the step's `frozen`
argument, so they are replicated or sharded like the student's). The loss is the
per-example `losses.kl_distillation_per_example` under `jax.vmap`, summed over
examples: the step all-reduces the sum and the example count and divides once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax import lax

from tunix_nb import checkpoint, data, losses, vocab_chunks
from tunix_nb import model as model_lib
from tunix_nb.config_flags import in_unit_interval, option
from tunix_nb.precision import cast_floats, resolve_compute_dtype

TEACHER_DIR = data.DATA_DIR / "teacher"  # the teacher shipped with the kit


_divergence = in_unit_interval("must be in [0, 1] for distill (0 forward KL, 1 reverse KL)")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """`python -m tunix_nb.train distill`'s own options (Tunix's DistillationTrainer); its on-policy
    options are `gkd.GKDConfig`. beta None (offline, forward KL) is recorded as before GKD existed."""

    DEFAULT_LEARNING_RATE: ClassVar[float] = 3e-3
    SUMMARY: ClassVar[str] = "logit distillation from a teacher (offline, or on-policy with --lmbda: GKD)"

    teacher: str | None = option(help="the teacher's checkpoint directory (default: the teacher shipped in "
                                 "data/teacher)")
    init_from: str | None = option(help="the checkpoint the student starts from (default: a fresh model)")
    beta: float | None = option(type=_divergence, help="the divergence, 0 forward KL, 1 reverse KL, between the "
                                "generalized JSD (default: 0)")


def load_teacher(ckpt_dir=TEACHER_DIR):
    """(graphdef, params) of a teacher checkpoint: the shipped teacher by default."""
    graphdef, params, _ = checkpoint.load_model(ckpt_dir)
    return graphdef, params


def objective(student_graphdef, teacher_graphdef, *, temperature=2.0, alpha=0.5, beta=0.0,
              compute_dtype="auto", vocab_chunk=None, seq_chunk=None):
    """(student params, batch, teacher params) -> (sum of per-example losses, B, metrics).

    The teacher runs in the same step, frozen: no gradient flows into it. With
    `alpha=0` (hard labels only, through the same per-example reduction) it is skipped.
    `beta` picks the divergence of the soft term (`losses.generalized_jsd_per_example`:
    0 forward KL, today's default; 1 reverse KL). A batch may carry `own_sample` [B]
    (GKD's on-policy rows, `tunix_nb.gkd`): 1 where the student sampled the completion
    itself. Its own tokens are no right answer, so such rows train on the divergence
    alone (alpha 1, as TRL's GKDTrainer does on every row).

    `vocab_chunk` (and `seq_chunk`): both models' logits in chunks, only at the loss
    positions (`tunix_nb.vocab_chunks`); None, the default, is the full-logits reference.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)

    def distill_objective(params, batch, teacher_params):
        if chunks is not None:
            return _chunked(params, batch, teacher_params)
        student_logits_BxLxV = model_lib.apply(student_graphdef, cast_floats(params, compute_dtype),
                                               batch["inputs"], batch["attention_mask"])
        if alpha == 0.0 and "own_sample" not in batch:  # hard labels only: no soft term, skip the teacher
            teacher_logits_BxLxV = lax.stop_gradient(student_logits_BxLxV)
        else:
            teacher_logits_BxLxV = lax.stop_gradient(model_lib.apply(
                teacher_graphdef, cast_floats(teacher_params, compute_dtype), batch["inputs"],
                batch["attention_mask"]))
        alpha_B = None
        if "own_sample" in batch:  # GKD: the divergence alone on the student's own samples
            alpha_B = jnp.where(batch["own_sample"] > 0, 1.0, alpha)
        mean_loss, metrics = losses.distillation_loss(
            student_logits_BxLxV, teacher_logits_BxLxV, batch["targets"], batch["loss_mask"],
            temperature=temperature, alpha=alpha, beta=beta, alpha_B=alpha_B)
        n = batch["inputs"].shape[0]
        return mean_loss * n, jnp.float32(n), metrics

    def _chunked(params, batch, teacher_params):
        """The same loss from hidden states and heads, the teacher's logits chunked alike."""
        params = cast_floats(params, compute_dtype)
        hidden_BxLxD = model_lib.hidden_states(student_graphdef, params, batch["inputs"], batch["attention_mask"])
        head = model_lib.output_head(student_graphdef, params)
        if alpha == 0.0 and "own_sample" not in batch:  # hard labels only: no soft term, skip the teacher
            teacher_hidden, teacher_head = hidden_BxLxD, head
        else:
            teacher_params = cast_floats(teacher_params, compute_dtype)
            teacher_hidden = model_lib.hidden_states(teacher_graphdef, teacher_params, batch["inputs"],
                                                     batch["attention_mask"])
            teacher_head = model_lib.output_head(teacher_graphdef, teacher_params)
        alpha_B = jnp.where(batch["own_sample"] > 0, 1.0, alpha) if "own_sample" in batch else None
        mean_loss, metrics = vocab_chunks.distillation_loss(
            hidden_BxLxD, head, lax.stop_gradient(teacher_hidden), teacher_head, batch["targets"],
            batch["loss_mask"], chunks=chunks, temperature=temperature, alpha=alpha, beta=beta, alpha_B=alpha_B)
        n = batch["inputs"].shape[0]
        return mean_loss * n, jnp.float32(n), metrics

    return distill_objective
