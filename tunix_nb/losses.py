"""Losses: distillation divergences, SFT token NLL and DPO, as pure functions on arrays.

Every function takes logits or log-probs and a 0/1 `mask` (1 on the completion tokens
that count), and works under `jax.jit`, `jax.vmap` and `jax.grad`. `logits[t]`
predicts `targets[t]`: callers do the shift. The distillation functions come in a
per-example form (`[L, V]` logits, so a batch is one `jax.vmap` away, which is what
`distillation_loss` does); shape mistakes raise a `ValueError` at trace time that
names the shapes involved. Loss math runs in at least float32, whatever the logits'
dtype.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


# ----------------------------------------------------------------------------- helpers


def _as_float(x):
    """x as a float array of at least float32 (bf16 logits and int/bool masks alike)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _masked_mean(values_L, mask_L):
    """Mean of values over positions where mask is 1; exactly 0 for an all-zero mask."""
    mask_L = _as_float(mask_L)
    # max(count, 1) keeps an empty mask at 0/1 = 0 instead of 0/0 = NaN.
    return jnp.sum(values_L * mask_L) / jnp.maximum(jnp.sum(mask_L), 1.0)


def _log_probs(logits, temperature=1.0):
    """log softmax(logits / T) over the vocabulary; finite for any finite logits."""
    return jax.nn.log_softmax(_as_float(logits) / temperature, axis=-1)


def _kl(logp_p, logp_q):
    """KL(p || q) per position from log-probs [..., V] -> [...].

    Computed as sum p * (log p - log q) with p = exp(log p): both logs are finite, so
    a p that underflows to 0 gives 0 * finite = 0, never 0 * (-inf) = NaN.
    """
    # optax's argument order: (log_predictions=q, log_targets=p) gives KL(p || q).
    return optax.losses.kl_divergence_with_log_targets(logp_q, logp_p)


def _check_positive(name, value):
    # Only Python/NumPy numbers are checked: a traced value (e.g. a schedule) passes.
    if isinstance(value, numbers.Real) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_distill_shapes(student_logits, teacher_logits, targets, mask, *, batched):
    """Raise a ValueError naming both shapes when the arrays don't line up.

    Shapes are static, so these Python checks run once at trace time under jit.
    """
    ndim, layout = (3, "[B, L, V]") if batched else (2, "[L, V]")
    hint = (
        "for a single example use the *_per_example functions"
        if batched
        else "for a batch [B, L, V] use distillation_loss, or jax.vmap this function"
    )
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if x.ndim != ndim:
            raise ValueError(f"{name} has shape {x.shape} but must be {layout}: {hint}")
    s, t = student_logits.shape, teacher_logits.shape
    if s[-1] != t[-1]:
        raise ValueError(
            f"student_logits has shape {s} but teacher_logits has shape {t}: the "
            "vocabularies must match (use the same tokenizer for both models)"
        )
    if s != t:
        raise ValueError(
            f"student_logits has shape {s} but teacher_logits has shape {t}: both "
            "models must score the same positions"
        )
    for name, x in (("targets", targets), ("mask", mask)):
        if x.shape != s[:-1]:
            raise ValueError(
                f"{name} has shape {x.shape} but student_logits has shape {s}: {name} "
                f"needs one entry per position, shape {s[:-1]}"
            )


# ----------------------------------------------------------------------- distillation


def _soft_and_hard_per_example(student_logits, teacher_logits, targets, mask, temperature):
    """(soft, hard) for one example: T^2 * KL(teacher_T || student_T) and the T=1 CE."""
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=False)
    _check_positive("temperature", temperature)
    kl_L = _kl(_log_probs(teacher_logits, temperature), _log_probs(student_logits, temperature))
    # T^2 keeps the soft gradients' scale independent of T (Hinton et al. 2015).
    soft = temperature**2 * _masked_mean(kl_L, mask)
    hard = _masked_mean(-token_log_probs(student_logits, targets), mask)
    return soft, hard


def kl_distillation_per_example(
    student_logits, teacher_logits, targets, mask, *, temperature=2.0, alpha=0.5
):
    """Classic logit distillation loss for ONE example -> scalar.

    Shapes: student_logits_LxV, teacher_logits_LxV, targets_L (int), mask_L.

    soft = T^2 * KL(softmax(teacher/T) || softmax(student/T)), masked mean over positions
    hard = cross-entropy of the student at T=1 against targets, same positions
    loss = alpha * soft + (1 - alpha) * hard   (alpha weights distillation, as in
    Tunix's LogitStrategy). An all-zero mask gives exactly 0.
    """
    soft, hard = _soft_and_hard_per_example(
        student_logits, teacher_logits, targets, mask, temperature
    )
    return alpha * soft + (1 - alpha) * hard


def distillation_loss(
    student_logits, teacher_logits, targets, mask, *, temperature=2.0, alpha=0.5
):
    """`kl_distillation_per_example` vmapped over a batch, averaged over examples.

    Shapes: student_logits_BxLxV, teacher_logits_BxLxV, targets_BxL, mask_BxL.
    Each example is a token mean over its own mask, then examples are averaged, so
    an example with an all-zero mask adds 0 to the sum (but still counts in B).

    Returns (loss, metrics) with metrics {"distill/soft_loss", "distill/hard_loss"}:
    the batch means of the two terms before alpha weighting.
    """
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=True)
    soft_B, hard_B = jax.vmap(
        lambda s, t, y, m: _soft_and_hard_per_example(s, t, y, m, temperature)
    )(student_logits, teacher_logits, targets, mask)
    loss = jnp.mean(alpha * soft_B + (1 - alpha) * hard_B)
    return loss, {"distill/soft_loss": jnp.mean(soft_B), "distill/hard_loss": jnp.mean(hard_B)}


def reverse_kl_per_example(student_logits, teacher_logits, targets, mask, *, temperature=2.0):
    """T^2 * KL(student_T || teacher_T), masked mean over positions, for ONE example.

    Reverse KL is mode-seeking: the student is penalised for mass where the teacher
    has little, rather than for missing some of the teacher's modes. `targets` is
    unused (only shape-checked) so that all per-example losses share one signature.
    """
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=False)
    _check_positive("temperature", temperature)
    kl_L = _kl(_log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature))
    return temperature**2 * _masked_mean(kl_L, mask)


def generalized_jsd_per_example(
    student_logits, teacher_logits, targets, mask, *, beta=0.5, temperature=2.0
):
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), ONE example.

    With p_t, p_s the teacher and student distributions at temperature T and
    m = beta * p_t + (1 - beta) * p_s, per position:

        0 < beta < 1:  beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)
        beta == 0:     KL(p_t || p_s)   forward KL (= the soft term of kl_distillation)
        beta == 1:     KL(p_s || p_t)   reverse KL (= reverse_kl_per_example)

    times T^2, masked mean over positions. The endpoints are special cases: the
    mixture formula itself tends to 0 (about beta * KL(p_t || p_s) near 0), so the loss
    jumps at beta = 0 and 1. `beta` must be a Python float (it picks a branch at trace
    time). `targets` is only shape-checked.

    The divergence per position (beta's meaning, the endpoints) is that of TRL's
    `GKDTrainer.generalized_jsd_loss`; the value differs in two ways:
    - scale: the kit multiplies by T^2, as its other distillation losses do, and
      defaults to T = 2; TRL divides the logits by T without a T^2 factor and
      defaults to T = 1, which `GKDTrainer` keeps (its config's temperature is for
      sampling). At T = 1 the two agree.
    - reduction: the kit takes the mean over this example's masked positions (a batch
      is a `jax.vmap` and a mean over examples); TRL's "batchmean" (and its
      `num_items_in_batch`) divides the sum over all masked positions of the batch by
      their count: a token mean over the batch, where long completions weigh more.
      They agree for one example, or when every example has as many masked positions.
    """
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=False)
    _check_positive("temperature", temperature)
    if not isinstance(beta, numbers.Real) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a Python float in [0, 1], got {beta!r}")
    logp_t = _log_probs(teacher_logits, temperature)
    logp_s = _log_probs(student_logits, temperature)
    if beta == 0.0:
        jsd_L = _kl(logp_t, logp_s)
    elif beta == 1.0:
        jsd_L = _kl(logp_s, logp_t)
    else:
        # log m = log(beta p_t + (1-beta) p_s), mixed in probability space but
        # computed in log space so small probabilities don't underflow.
        logp_m = jnp.logaddexp(logp_t + np.log(beta), logp_s + np.log1p(-beta))
        jsd_L = beta * _kl(logp_t, logp_m) + (1 - beta) * _kl(logp_s, logp_m)
    return temperature**2 * _masked_mean(jsd_L, mask)


# ------------------------------------------------------------------------------- SFT


def token_log_probs(logits, targets):
    """log p(targets[..., t]) under softmax(logits): [..., L, V], [..., L] -> [..., L]."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits has shape {logits.shape} but targets has shape {targets.shape}: "
            f"targets must have shape {logits.shape[:-1]} (logits without the vocab axis)"
        )
    logp = _log_probs(logits)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def sequence_log_probs(logits, targets, mask):
    """Sum of log p(target) over masked tokens: [B, L, V], [B, L], [B, L] -> [B].

    DPO uses these per-sequence sums of completion-token log-probs.
    """
    if mask.shape != targets.shape:
        raise ValueError(
            f"mask has shape {mask.shape} but targets has shape {targets.shape}: "
            "they must match"
        )
    return jnp.sum(token_log_probs(logits, targets) * _as_float(mask), axis=-1)


def sft_loss(logits, targets, mask):
    """(nll_sum, token_count): summed NLL over mask == 1 tokens, and their count.

    The SFT loss is the token mean over the GLOBAL batch (as in Tunix's PeftTrainer
    and TRL), so callers divide only after summing both across devices:
    `psum(nll_sum) / psum(token_count)`. A per-device mean averaged across devices
    would over-weight devices holding short completions.
    """
    mask = _as_float(mask)
    if mask.shape != targets.shape:
        raise ValueError(
            f"mask has shape {mask.shape} but targets has shape {targets.shape}: "
            "they must match"
        )
    nll_sum = -jnp.sum(token_log_probs(logits, targets) * mask)
    return nll_sum, jnp.sum(mask).astype(jnp.float32)


# ------------------------------------------------------------------------------- DPO


def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
):
    """DPO loss over a batch of preference pairs -> (loss, metrics).

    Inputs are [B] per-sequence sums of completion-token log-probs (see
    `sequence_log_probs`). With h = (pi_c - pi_r) - (ref_c - ref_r):

        "sigmoid": -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
                   (DPO; eps = label_smoothing > 0 is conservative DPO)
        "ipo":     (h - 1/(2 beta))^2   (TRL feeds IPO length-averaged log-probs)
        "hinge":   relu(1 - beta h)     (SLiC)

    loss is the mean over pairs. metrics are batch means of the implicit rewards
    beta * (policy - ref): "rewards/chosen", "rewards/rejected", "rewards/margin"
    and "rewards/accuracy" (fraction of pairs with chosen > rejected; ties count 0).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    _check_positive("beta", beta)
    if isinstance(label_smoothing, numbers.Real) and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if loss_type != "sigmoid" and isinstance(label_smoothing, numbers.Real) and label_smoothing:
        raise ValueError(f"label_smoothing applies only to loss_type='sigmoid', not {loss_type!r}")
    logps = [policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps]
    shapes = [jnp.shape(x) for x in logps]
    if len(shapes[0]) != 1 or any(s != shapes[0] for s in shapes):
        raise ValueError(
            "policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, "
            f"ref_rejected_logps have shapes {', '.join(map(str, shapes))}: dpo_loss needs "
            "four [B] arrays with the same B, one summed log-prob per pair"
        )
    pi_c, pi_r, ref_c, ref_r = (_as_float(x) for x in logps)

    h_B = (pi_c - pi_r) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        eps = label_smoothing
        losses_B = -(1 - eps) * jax.nn.log_sigmoid(beta * h_B) - eps * jax.nn.log_sigmoid(
            -beta * h_B
        )
    elif loss_type == "ipo":
        losses_B = (h_B - 1 / (2 * beta)) ** 2
    else:
        losses_B = jax.nn.relu(1 - beta * h_B)

    # Metrics only report; stop_gradient keeps them out of any has_aux gradient.
    chosen_B = jax.lax.stop_gradient(beta * (pi_c - ref_c))
    rejected_B = jax.lax.stop_gradient(beta * (pi_r - ref_r))
    metrics = {
        "rewards/chosen": jnp.mean(chosen_B),
        "rewards/rejected": jnp.mean(rejected_B),
        "rewards/margin": jnp.mean(chosen_B - rejected_B),
        "rewards/accuracy": jnp.mean((chosen_B > rejected_B).astype(jnp.float32)),
    }
    return jnp.mean(losses_B), metrics


def check_nonempty_completions(mask_BxL, name):
    """Raise a ValueError naming the rows of a [B, L] completion mask with no tokens.

    Call on the host before training (needs concrete arrays, not tracers): a pair with
    an empty completion has a log-prob sum of 0 that silently distorts DPO.
    """
    mask_BxL = np.asarray(mask_BxL)
    if mask_BxL.ndim != 2:
        raise ValueError(f"{name} mask has shape {mask_BxL.shape} but must be [B, L]")
    empty = np.flatnonzero(~np.any(mask_BxL != 0, axis=-1))
    if empty.size:
        raise ValueError(
            f"pair(s) {[int(i) for i in empty]} have an empty {name} completion: every "
            "pair needs at least one completion token; drop them or check the data"
        )
