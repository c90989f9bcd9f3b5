"""Losses: distillation divergences, SFT token NLL, DPO and GRPO, as pure functions on arrays.

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


def _soft_and_hard_per_example(student_logits, teacher_logits, targets, mask, temperature, beta=0.0):
    """(soft, hard) for one example: T^2 * KL(teacher_T || student_T) (with beta > 0, the
    generalized JSD of `generalized_jsd_per_example` instead) and the T=1 CE."""
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=False)
    _check_positive("temperature", temperature)
    if beta == 0.0:
        kl_L = _kl(_log_probs(teacher_logits, temperature), _log_probs(student_logits, temperature))
        # T^2 keeps the soft gradients' scale independent of T (Hinton et al. 2015).
        soft = temperature**2 * _masked_mean(kl_L, mask)
    else:
        soft = generalized_jsd_per_example(student_logits, teacher_logits, targets, mask, beta=beta,
                                           temperature=temperature)
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
    student_logits, teacher_logits, targets, mask, *, temperature=2.0, alpha=0.5, beta=0.0, alpha_B=None
):
    """`kl_distillation_per_example` vmapped over a batch, averaged over examples.

    Shapes: student_logits_BxLxV, teacher_logits_BxLxV, targets_BxL, mask_BxL.
    Each example is a token mean over its own mask, then examples are averaged, so
    an example with an all-zero mask adds 0 to the sum (but still counts in B).

    `beta` > 0 makes the soft term the generalized JSD (`generalized_jsd_per_example`;
    0 is the forward KL, 1 the reverse KL). `alpha_B` [B], when given, replaces `alpha`
    row by row (GKD: 1 on rows the student sampled itself, where no target is right).

    Returns (loss, metrics) with metrics {"distill/soft_loss", "distill/hard_loss"}:
    the batch means of the two terms before alpha weighting.
    """
    _check_distill_shapes(student_logits, teacher_logits, targets, mask, batched=True)
    if not isinstance(beta, numbers.Real) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a Python float in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    soft_B, hard_B = jax.vmap(
        lambda s, t, y, m: _soft_and_hard_per_example(s, t, y, m, temperature, beta)
    )(student_logits, teacher_logits, targets, mask)
    if alpha_B is None:
        loss = jnp.mean(alpha * soft_B + (1 - alpha) * hard_B)
    else:
        loss = jnp.mean(alpha_B * soft_B + (1 - alpha_B) * hard_B)
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


# ------------------------------------------------------------------------------ GRPO

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "drgrpo")
KL_ESTIMATORS = ("kl", "mse_kl", "low_var_kl")
GRPO_AGGREGATIONS = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "sequence-mean-token-sum-norm",
)
# Bound on |logps - old_logps| before exp, as Tunix's grpo_loss_fn: exp(20) ~ 5e8 is
# finite in float32, exp of a stale or garbage log-ratio might not be.
GRPO_LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards, group_size, *, estimator="grpo"):
    """Each completion's advantage over the other completions of its prompt: [N*G] -> [N*G].

    `rewards_NG` holds G = `group_size` completions per prompt, consecutive (prompt 0's
    G, then prompt 1's, ...). Per group, with mean m and sample std s (ddof=1):

        "grpo":   (r - m) / (s + 1e-6)         GRPO (Shao et al. 2024)
        "rloo":   r - mean of the OTHER G-1    REINFORCE leave-one-out; = G/(G-1) * (r - m)
        "drgrpo": r - m                        Dr. GRPO (Liu et al. 2025): no std division

    A group whose rewards are all equal gets advantage 0 under every estimator: it
    carries no learning signal (the `frac_reward_zero_std` metric counts such groups).

    These are Tunix's registered estimators "grpo", "rloo" and "drgrpo" (algo_core.py),
    epsilon included. TRL's GRPOTrainer adds 1e-4, not 1e-6, to the std
    (`scale_rewards="group"`; "none" is Dr. GRPO's r - m), and its RLOOTrainer computes
    the same leave-one-out baseline. Tunix's "rloo" returns zeros for G < 2; here G < 2
    is an error, as GRPOConfig's `num_generations > 1` check is in Tunix.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if not isinstance(group_size, numbers.Integral) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2, got {group_size!r}: an advantage compares a "
            "completion with the other completions of its prompt, so sample at least 2 per prompt"
        )
    rewards_NG = _as_float(rewards)
    if rewards_NG.ndim != 1 or rewards_NG.shape[0] % group_size:
        raise ValueError(
            f"rewards has shape {rewards_NG.shape} but must be [N * group_size] with "
            f"group_size={group_size}: one reward per completion, each prompt's "
            f"{group_size} completions consecutive"
        )
    r_NxG = rewards_NG.reshape(-1, group_size)
    mean_Nx1 = jnp.mean(r_NxG, axis=1, keepdims=True)
    if estimator == "grpo":
        std_Nx1 = jnp.std(r_NxG, axis=1, ddof=1, keepdims=True)
        adv_NxG = (r_NxG - mean_Nx1) / (std_Nx1 + 1e-6)
    elif estimator == "rloo":
        others_mean_NxG = (jnp.sum(r_NxG, axis=1, keepdims=True) - r_NxG) / (group_size - 1)
        adv_NxG = r_NxG - others_mean_NxG
    else:
        adv_NxG = r_NxG - mean_Nx1
    return adv_NxG.reshape(-1)


def _check_grpo_args(ref_logps, epsilon, epsilon_high, beta, kl_estimator, aggregation,
                     max_completion_length):
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if aggregation not in GRPO_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {GRPO_AGGREGATIONS}, got {aggregation!r}")
    _check_positive("epsilon", epsilon)
    if epsilon_high is not None:
        _check_positive("epsilon_high", epsilon_high)
    if isinstance(beta, numbers.Real) and beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if ref_logps is None and not (isinstance(beta, numbers.Real) and beta == 0):
        raise ValueError(
            f"ref_logps is None but beta={beta!r}: the KL penalty needs the reference "
            "model's per-token log-probs; pass ref_logps, or set beta=0 to train without it"
        )
    if max_completion_length is not None:
        if aggregation != "sequence-mean-token-scale":
            raise ValueError(
                "max_completion_length applies only to aggregation='sequence-mean-token-scale', "
                f"not {aggregation!r}: drop it, or choose that aggregation"
            )
        _check_positive("max_completion_length", max_completion_length)


def _check_grpo_shapes(logps, old_logps, ref_logps, advantages, mask):
    """Shapes are static: a ValueError at trace time naming every shape involved."""
    named = {"logps": logps, "old_logps": old_logps, "ref_logps": ref_logps, "mask": mask}
    shapes = {k: jnp.shape(v) for k, v in named.items() if v is not None}
    adv_shape = jnp.shape(advantages)
    token_shape = shapes["logps"]
    same = all(s == token_shape for s in shapes.values())
    if len(token_shape) != 2 or not same or adv_shape != token_shape[:1]:
        listed = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(
            f"grpo_loss got {listed}, advantages {adv_shape}: logps, old_logps, ref_logps and "
            "mask must all be [B, L] (one entry per completion token) and advantages [B] "
            "(one per completion)"
        )


def _per_token_kl(logps_BxL, ref_logps_BxL, kl_estimator):
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    "kl" is k1 = log(pi/ref) (unbiased, high variance, can be negative); "mse_kl" is
    k2 = (log(pi/ref))^2 / 2 (biased, low variance); "low_var_kl" is k3 = ref/pi -
    log(ref/pi) - 1 (unbiased, low variance, >= 0). Schulman, "Approximating KL
    divergence" (2020).
    """
    d_BxL = logps_BxL - ref_logps_BxL
    if kl_estimator == "kl":
        return d_BxL
    if kl_estimator == "mse_kl":
        return 0.5 * d_BxL**2
    return jnp.exp(-d_BxL) + d_BxL - 1.0


def _aggregate(per_token_BxL, mask_BxL, aggregation, max_completion_length):
    """(sum, weight) of a per-token loss, so that shards' sums and weights add up."""
    tokens_B = jnp.sum(mask_BxL, axis=-1)
    row_sums_B = jnp.sum(per_token_BxL * mask_BxL, axis=-1)
    nonempty_rows = jnp.sum(tokens_B > 0).astype(jnp.float32)
    if aggregation == "token-mean":
        return jnp.sum(row_sums_B), jnp.sum(tokens_B)
    if aggregation == "sequence-mean-token-mean":
        # max(count, 1): an empty row adds 0 to the sum and 0 to the weight.
        return jnp.sum(row_sums_B / jnp.maximum(tokens_B, 1.0)), nonempty_rows
    if aggregation == "sequence-mean-token-scale":
        # A fixed divisor for every row, so a long answer is not down-weighted per token.
        scale = max_completion_length or per_token_BxL.shape[-1]
        return jnp.sum(row_sums_B) / scale, nonempty_rows
    return jnp.sum(row_sums_B), jnp.float32(per_token_BxL.shape[0])


def grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    epsilon=0.2,
    epsilon_high=None,
    beta=0.04,
    kl_estimator="low_var_kl",
    aggregation="sequence-mean-token-mean",
    max_completion_length=None,
):
    """The clipped GRPO objective with a KL penalty -> (loss_sum, weight, metrics).

    Shapes: logps_BxL (the policy being trained; gradients flow through it only),
    old_logps_BxL (the policy that sampled the completions; None means the policy
    itself, ratio = 1 with its gradient, as Tunix and TRL do when num_iterations == 1),
    ref_logps_BxL (the frozen reference; may be None when beta == 0), advantages_B
    (`group_advantages`), mask_BxL (1 on completion tokens). The loss is
    `loss_sum / weight`; callers psum both across devices and micro-batches and divide
    once, by max(weight, 1) as `train.make_step` does, so an all-empty mask gives
    loss 0. Per token, with A the row's advantage:

        log_ratio = clip(logps - old_logps, -20, 20);  ratio = exp(log_ratio)
        policy    = max(-A * ratio, -A * clip(ratio, 1 - epsilon, 1 + epsilon_high))
        loss      = policy + beta * kl(logps, ref_logps)      (kl_estimator, see _per_token_kl)

    `epsilon_high=None` means `epsilon` (DAPO's clip-higher sets it larger). Positions
    where mask == 0 may hold anything (padding, -inf): they are set to 0 before any
    arithmetic, so they reach neither the loss nor its gradient.

    aggregation -> (loss_sum, weight):
        "token-mean":                   sum over masked tokens, number of masked tokens
        "sequence-mean-token-mean":     sum of each row's token mean, number of non-empty rows
        "sequence-mean-token-scale":    sum over masked tokens / max_completion_length
                                        (default L), number of non-empty rows
        "sequence-mean-token-sum-norm": sum over masked tokens, B

    metrics (means over this call's masked tokens; 0 when there are none):
        "kl": the per-token KL estimate whatever beta (0 when ref_logps is None);
        "clip_ratio": fraction of tokens where the clipped term is the larger (the
            gradient is cut); "clip_ratio/low_mean", "clip_ratio/high_mean" split it
            into ratio < 1 - epsilon with A < 0, and ratio > 1 + epsilon_high with A > 0;
        "is_ratio/mean": mean of ratio (1 on-policy).

    Against the references (Tunix `rl/algo_core.py` grpo_loss_fn + `rl/common.py`
    aggregate_loss; TRL `GRPOTrainer._compute_loss`):
    - Tunix: the same per-token terms, the +-20 clamp, the same KL estimators and the
      same four aggregations with the same sums and denominators (Tunix's loss_agg_mode
      names; its fifth, "seq-mean-token-sum", is left out). Tunix aggregates the policy
      and KL terms separately and adds the sums, which is the same by linearity; its
      WeightedMetric divides by max(denominator, min_denom) at the end. Its GRPOConfig
      defaults to kl_loss_mode="kl"; this function defaults to "low_var_kl", TRL's only estimator.
      Not here: Tunix's dual-clip (epsilon_c), gspo-token, kl_clamp_value, and the
      sampler importance weights.
    - TRL: TRL does not clamp the log-ratio, and always uses "low_var_kl". Its loss
      types map to aggregations: "grpo" -> "sequence-mean-token-mean", but TRL averages
      row means over all B rows, empty ones included (here: non-empty rows, as Tunix);
      "bnpo" and "dapo" -> "token-mean" (dapo's weight is the global token count, which
      is what the psum of weights gives); "dr_grpo" -> "sequence-mean-token-scale", but
      TRL divides by B * max_completion_length with every row counted (here: non-empty
      rows). With no empty rows they agree. TRL's "clip_ratio/region_mean" is
      "clip_ratio" here (the same tokens), and TRL logs "kl" only when beta != 0.
      Not here: importance_sampling_level="sequence" (GSPO), two-sided clipping (delta),
      cispo/sapo/vespo/luspo, use_bias_correction_kl.
    """
    _check_grpo_args(ref_logps, epsilon, epsilon_high, beta, kl_estimator, aggregation,
                     max_completion_length)
    _check_grpo_shapes(logps, old_logps, ref_logps, advantages, mask)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    sg = jax.lax.stop_gradient  # rollouts, the reference and advantages are data, not parameters
    mask_BxL = sg(_as_float(mask))
    live_BxL = mask_BxL != 0

    def clean(x):  # the double-where: masked garbage gives neither NaN values nor NaN grads
        return jnp.where(live_BxL, _as_float(x), 0.0)

    logps_BxL = clean(logps)
    old_BxL = sg(logps_BxL if old_logps is None else clean(old_logps))
    adv_Bx1 = sg(_as_float(advantages))[:, None]

    log_ratio_BxL = jnp.clip(logps_BxL - old_BxL, -GRPO_LOG_RATIO_CLAMP, GRPO_LOG_RATIO_CLAMP)
    ratio_BxL = jnp.exp(log_ratio_BxL)
    unclipped_BxL = -adv_Bx1 * ratio_BxL
    clipped_BxL = -adv_Bx1 * jnp.clip(ratio_BxL, 1.0 - epsilon, 1.0 + eps_high)
    per_token_BxL = jnp.maximum(unclipped_BxL, clipped_BxL)

    if ref_logps is None:
        kl_BxL = jnp.zeros_like(logps_BxL)
    else:
        kl_BxL = _per_token_kl(logps_BxL, sg(clean(ref_logps)), kl_estimator)
        if not (isinstance(beta, numbers.Real) and beta == 0):
            per_token_BxL = per_token_BxL + beta * kl_BxL

    loss_sum, weight = _aggregate(per_token_BxL, mask_BxL, aggregation, max_completion_length)

    def token_mean(x_BxL):
        return sg(_masked_mean(x_BxL.astype(jnp.float32), mask_BxL))

    metrics = {
        "kl": token_mean(kl_BxL),
        "clip_ratio": token_mean(clipped_BxL > unclipped_BxL),
        "clip_ratio/low_mean": token_mean((ratio_BxL < 1.0 - epsilon) & (adv_Bx1 < 0)),
        "clip_ratio/high_mean": token_mean((ratio_BxL > 1.0 + eps_high) & (adv_Bx1 > 0)),
        "is_ratio/mean": token_mean(ratio_BxL),
    }
    return loss_sum, weight.astype(jnp.float32), metrics
