"""Tests for the GRPO maths in tunix_nb.losses: group_advantages and grpo_loss.

The references are NumPy transcriptions, written here from the formulas of Tunix
(`tunix/rl/algo_core.py`: grpo_loss_fn and the advantage estimators;
`tunix/rl/common.py`: compute_kl_divergence, aggregate_loss) and TRL
(`trl/trainer/grpo_trainer.py`: GRPOTrainer._compute_loss), in float64, without
calling the kit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import losses

AGGREGATIONS = losses.GRPO_AGGREGATIONS
KL_ESTIMATORS = losses.KL_ESTIMATORS
RTOL, ATOL = 2e-5, 1e-6  # the kit in float32 against float64 transcriptions


# --------------------------------------------------------- Tunix, transcribed in NumPy


def tunix_kl(logps, ref, mode):
    """tunix.rl.common.compute_kl_divergence (no clamp)."""
    if mode == "kl":
        return logps - ref
    if mode == "mse_kl":
        return 0.5 * (logps - ref) ** 2
    diff = ref - logps
    return np.exp(diff) - diff - 1


def tunix_aggregate(per_token, mask, mode, norm=None):
    """tunix.rl.common.aggregate_loss, unpacked rows: (unreduced_sum, denominator)."""
    if mode == "token-mean":
        return (per_token * mask).sum(), mask.sum()
    if mode == "sequence-mean-token-mean":
        seq_mask = mask.sum(-1)
        seq_loss = (per_token * mask).sum(-1) / np.clip(seq_mask, 1.0, None)
        return seq_loss.sum(), (seq_mask > 0).sum()
    if mode == "sequence-mean-token-scale":
        norm = per_token.shape[-1] if norm is None else norm
        return ((per_token * mask).sum(-1) / norm).sum(), (mask.sum(-1) > 0).sum()
    assert mode == "sequence-mean-token-sum-norm"
    return (per_token * mask).sum(), per_token.shape[0]


def tunix_grpo(logps, old, ref, adv, mask, *, eps, eps_high, beta, kl_mode, agg, norm=None):
    """tunix grpo_loss_fn (loss_algo="grpo", no dual clip, no packing) on given log-probs.

    Returns (unreduced_sum, denominator, metrics) of its primary loss WeightedMetric.
    """
    log_ratio = np.clip(logps - old, -20.0, 20.0)
    is_ratio = np.exp(log_ratio)
    a = adv[:, None]
    pg_loss_1 = -a * is_ratio
    pg_loss_2 = -a * np.clip(is_ratio, 1 - eps, 1 + eps_high)
    per_token = np.maximum(pg_loss_1, pg_loss_2)
    pg_sum, denom = tunix_aggregate(per_token, mask, agg, norm)
    kl = tunix_kl(logps, ref, kl_mode)
    kl_sum, _ = tunix_aggregate(kl, mask, agg, norm)
    token_denom = mask.sum()
    metrics = {
        "kl": (kl * mask).sum() / max(token_denom, 1.0),
        "clip_ratio": ((pg_loss_2 > pg_loss_1) * mask).sum() / max(token_denom, 1.0),
        "is_ratio/mean": (is_ratio * mask).sum() / (token_denom + 1e-8),
    }
    total = pg_sum + beta * kl_sum if beta else pg_sum
    return total, denom, metrics


def tunix_advantages(rewards, g, estimator):
    """tunix algo_core compute_advantages / compute_rloo_advantages / compute_drgrpo_advantages."""
    r = rewards.reshape(-1, g)
    if estimator == "grpo":
        mean = r.mean(-1).repeat(g)
        std = r.std(-1, ddof=1).repeat(g)
        return (rewards - mean) / (std + 1e-6)
    if estimator == "rloo":
        return (r - (r.sum(-1, keepdims=True) - r) / (g - 1)).reshape(-1)
    return rewards - r.mean(1).repeat(g)


# ----------------------------------------------------------- TRL, transcribed in NumPy


def trl_grpo(logps, old, ref, adv, mask, *, eps, eps_high, beta, loss_type, max_completion_length):
    """TRL GRPOTrainer._compute_loss, importance_sampling_level="token", one process.

    Returns (loss, metrics). dapo's num_items_in_batch is the batch's token count.
    """
    coef_1 = np.exp(logps - old)  # TRL does not clamp the log-ratio
    per_token_kl = np.exp(ref - logps) - (ref - logps) - 1
    a = adv[:, None]
    coef_2 = np.clip(coef_1, 1 - eps, 1 + eps_high)
    per_token_loss = -np.minimum(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    B = logps.shape[0]
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / np.clip(mask.sum(-1), 1.0, None)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (B * max_completion_length)
    else:
        assert loss_type == "dapo"
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)

    def masked_mean(x):
        return (x * mask).sum() / max(mask.sum(), 1.0)

    low = (coef_1 < 1 - eps) & (a < 0)
    high = (coef_1 > 1 + eps_high) & (a > 0)
    metrics = {
        "clip_ratio/low_mean": masked_mean(low),
        "clip_ratio/high_mean": masked_mean(high),
        "clip_ratio/region_mean": masked_mean(low | high),
        "kl": masked_mean(per_token_kl),
    }
    return loss, metrics


TRL_LOSS_TYPES = {  # TRL loss_type -> the kit's aggregation
    "grpo": "sequence-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "sequence-mean-token-scale",
}


# ---------------------------------------------------------------------------- inputs


def random_batch(seed, B=8, L=6, *, clamped=True, empty_rows=(1, 5)):
    """Random masked GRPO inputs, rounded to float32 (what the kit sees) but held in float64.

    Rows in `empty_rows` have no completion tokens. With `clamped`, three masked tokens
    have |logps - old_logps| > 20: a high ratio with A < 0 (the unclipped term wins,
    clamped at e^20), a high ratio with A > 0 (clipped at 1 + eps_high) and a low ratio
    with A < 0 (clipped at 1 - eps).
    """
    rng = np.random.default_rng(seed)
    logps = -rng.exponential(1.5, (B, L))
    old = logps + 0.4 * rng.standard_normal((B, L))
    ref = logps + 0.6 * rng.standard_normal((B, L))
    adv = rng.standard_normal(B)
    adv[2] = 0.0  # a row that carries no policy signal
    lengths = rng.integers(1, L + 1, B)
    lengths[list(empty_rows)] = 0
    if clamped:
        lengths[[0, 3, 4]] = np.maximum(lengths[[0, 3, 4]], 1)
        old[0, 0], adv[0] = logps[0, 0] - 27.0, -1.3
        old[3, 0], adv[3] = logps[3, 0] - 25.0, 0.7
        old[4, 0], adv[4] = logps[4, 0] + 23.0, -0.9
    mask = (np.arange(L) < lengths[:, None]).astype(np.float64)
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # noqa: E731
    return f32(logps), f32(old), f32(ref), f32(adv), mask


def kit(batch, **kw):
    return losses.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in batch), **kw)


def close(got, want, **kw):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **{"rtol": RTOL, "atol": ATOL, **kw})


# ------------------------------------------------------------------ group_advantages


def test_group_advantages_hand_computed():
    # Group 1: one correct of 4: mean 1/4, sample std sqrt((3/4)^2 + 3 (1/4)^2) / 3) = 1/2.
    # Group 2: all equal: no signal under any estimator.
    rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    zeros = [0.0] * 4
    close(losses.group_advantages(rewards, 4),
          [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3 + zeros)
    close(losses.group_advantages(rewards, 4, estimator="rloo"), [1.0] + [-1 / 3] * 3 + zeros)
    close(losses.group_advantages(rewards, 4, estimator="drgrpo"), [0.75] + [-0.25] * 3 + zeros)


def test_group_advantages_group_of_two():
    # mean 1/2, sample std sqrt(2 * 1/4 / 1) = 1/sqrt(2); rloo: r minus the other one.
    rewards = jnp.asarray([1.0, 0.0, 0.5, 0.25])
    s1, s2 = 2**-0.5, 0.125 * 2**0.5
    close(losses.group_advantages(rewards, 2), [0.5 / (s1 + 1e-6), -0.5 / (s1 + 1e-6),
                                                0.125 / (s2 + 1e-6), -0.125 / (s2 + 1e-6)])
    close(losses.group_advantages(rewards, 2, estimator="rloo"), [1.0, -1.0, 0.25, -0.25])
    close(losses.group_advantages(rewards, 2, estimator="drgrpo"), [0.5, -0.5, 0.125, -0.125])


@pytest.mark.parametrize("estimator", losses.ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_group_advantages_match_tunix(estimator, group_size):
    # Small integer rewards: some groups are all equal (advantage 0 / (0 + 1e-6) = 0).
    rewards = np.random.default_rng(group_size).integers(0, 3, 6 * group_size).astype(float)
    got = losses.group_advantages(jnp.asarray(rewards, jnp.float32), group_size, estimator=estimator)
    close(got, tunix_advantages(rewards, group_size, estimator), rtol=1e-5, atol=1e-5)


def test_rloo_is_a_rescaled_drgrpo():
    rewards = jnp.asarray(np.random.default_rng(0).standard_normal(20), jnp.float32)
    close(losses.group_advantages(rewards, 5, estimator="rloo"),
          np.asarray(losses.group_advantages(rewards, 5, estimator="drgrpo")) * 5 / 4, rtol=1e-5)


def test_group_advantages_errors():
    r = jnp.zeros(6)
    for g in (1, 0, 2.0):
        with pytest.raises(ValueError, match="group_size must be an int >= 2.*at least 2 per prompt"):
            losses.group_advantages(r, g)
    with pytest.raises(ValueError, match=r"shape \(6,\).*\[N \* group_size\] with group_size=4"):
        losses.group_advantages(r, 4)
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        losses.group_advantages(r.reshape(3, 2), 2)
    with pytest.raises(ValueError, match="estimator must be one of"):
        losses.group_advantages(r, 2, estimator="ppo")


# ------------------------------------------------------------------ grpo_loss: values


def test_one_token_hand_computed():
    one = lambda x: jnp.asarray([[x]], jnp.float32)  # noqa: E731
    mask = one(1.0)
    # A = 1, ratio 1.5 > 1 + 0.2: the clipped term -1.2 is the larger; no KL (logps == ref).
    s, w, m = losses.grpo_loss(one(np.log(1.5)), one(0.0), one(np.log(1.5)), jnp.asarray([1.0]), mask)
    close(s, -1.2)
    assert float(w) == 1.0 and float(m["clip_ratio"]) == 1.0 and float(m["clip_ratio/high_mean"]) == 1.0
    close(m["is_ratio/mean"], 1.5)
    # A = -1, ratio 0.5 < 1 - 0.2: max(0.5, 0.8) = 0.8, clipped low.
    s, _, m = losses.grpo_loss(one(np.log(0.5)), one(0.0), None, jnp.asarray([-1.0]), mask, beta=0.0)
    close(s, 0.8)
    assert float(m["clip_ratio/low_mean"]) == 1.0 and float(m["kl"]) == 0.0
    # A = 2 on-policy (ratio 1), logps - ref = log 2, beta = 0.5, low_var_kl = 1/2 + log 2 - 1.
    s, _, m = losses.grpo_loss(one(np.log(0.5)), one(np.log(0.5)), one(np.log(0.25)),
                               jnp.asarray([2.0]), mask, beta=0.5)
    close(s, -2.0 + 0.5 * (0.5 + np.log(2.0) - 1.0))
    close(m["kl"], 0.5 + np.log(2.0) - 1.0)
    assert float(m["clip_ratio"]) == 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_matches_tunix_transcription(aggregation, kl_estimator, epsilon_high):
    """Random masks with empty rows, clamped log-ratios, negative advantages."""
    seed = 10 * AGGREGATIONS.index(aggregation) + 2 * KL_ESTIMATORS.index(kl_estimator) + (epsilon_high is None)
    batch = random_batch(seed=seed)
    eps_high = 0.2 if epsilon_high is None else epsilon_high
    s, w, m = kit(batch, epsilon=0.2, epsilon_high=epsilon_high, beta=0.04,
                  kl_estimator=kl_estimator, aggregation=aggregation)
    want_s, want_w, want_m = tunix_grpo(*batch, eps=0.2, eps_high=eps_high, beta=0.04,
                                        kl_mode=kl_estimator, agg=aggregation)
    close(s, want_s)
    assert float(w) == want_w
    for key in ("kl", "clip_ratio", "is_ratio/mean"):
        close(m[key], want_m[key], err_msg=key)


def test_clamped_ratios_are_what_the_loss_sees():
    """Without the +-20 clamp the batch's loss would be ~e^7 times larger."""
    batch = random_batch(seed=3)
    s, _, m = kit(batch, beta=0.0, aggregation="token-mean")
    assert np.isfinite(float(s))
    want_s, _, want_m = tunix_grpo(*batch, eps=0.2, eps_high=0.2, beta=0.0, kl_mode="kl", agg="token-mean")
    close(s, want_s)
    close(m["is_ratio/mean"], want_m["is_ratio/mean"])
    unclamped, _ = trl_grpo(*batch, eps=0.2, eps_high=0.2, beta=0.0, loss_type="bnpo", max_completion_length=6)
    assert abs(unclamped) > 100 * abs(want_s / batch[4].sum())


@pytest.mark.parametrize("max_completion_length", [None, 10])
def test_token_scale_divides_by_max_completion_length(max_completion_length):
    batch = random_batch(seed=7)
    s, w, _ = kit(batch, aggregation="sequence-mean-token-scale", max_completion_length=max_completion_length)
    want_s, want_w, _ = tunix_grpo(*batch, eps=0.2, eps_high=0.2, beta=0.04, kl_mode="low_var_kl",
                                   agg="sequence-mean-token-scale", norm=max_completion_length)
    close(s, want_s)
    assert float(w) == want_w == 6  # 8 rows, 2 empty


@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_matches_trl_transcription(loss_type, epsilon_high):
    """TRL's loss types, where TRL and the kit agree: no clamp needed, no empty rows."""
    batch = random_batch(seed=11, clamped=False, empty_rows=())
    eps_high = 0.2 if epsilon_high is None else epsilon_high
    s, w, m = kit(batch, epsilon_high=epsilon_high, beta=0.04, kl_estimator="low_var_kl",
                  aggregation=TRL_LOSS_TYPES[loss_type])
    want, want_m = trl_grpo(*batch, eps=0.2, eps_high=eps_high, beta=0.04, loss_type=loss_type,
                            max_completion_length=batch[0].shape[1])
    close(s / w, want)
    close(m["clip_ratio"], want_m["clip_ratio/region_mean"])
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "kl"):
        close(m[key], want_m[key], err_msg=key)
    assert 0 < float(m["clip_ratio"]) < 1  # the inputs do exercise clipping


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_trl_counts_empty_rows(loss_type):
    """TRL's grpo and dr_grpo divide by all B rows; the kit (as Tunix) by non-empty rows."""
    batch = random_batch(seed=5, clamped=False, empty_rows=(1, 5))
    s, w, _ = kit(batch, beta=0.04, aggregation=TRL_LOSS_TYPES[loss_type])
    want, _ = trl_grpo(*batch, eps=0.2, eps_high=0.2, beta=0.04, loss_type=loss_type,
                       max_completion_length=batch[0].shape[1])
    assert float(w) == 6
    close(s / w * 6 / 8, want)


def test_epsilon_high_none_means_epsilon():
    batch = random_batch(seed=2)
    a = kit(batch, epsilon=0.3)
    b = kit(batch, epsilon=0.3, epsilon_high=0.3)
    np.testing.assert_array_equal(a[0], b[0])


def test_ref_none_with_beta_zero_equals_any_ref():
    batch = random_batch(seed=4)
    logps, old, ref, adv, mask = (jnp.asarray(x, jnp.float32) for x in batch)
    s0, w0, m0 = losses.grpo_loss(logps, old, None, adv, mask, beta=0.0)
    s1, w1, m1 = losses.grpo_loss(logps, old, ref, adv, mask, beta=0.0)
    np.testing.assert_array_equal([s0, w0], [s1, w1])
    assert float(m0["kl"]) == 0.0 and float(m1["kl"]) > 0  # kl is reported whatever beta


def test_old_logps_none_is_on_policy():
    """old_logps=None: ratio 1 in value, and the gradient of -A * logps (Tunix's and TRL's mu = 1)."""
    logps, _, ref, adv, mask = (jnp.asarray(x, jnp.float32) for x in random_batch(seed=6))

    def loss(lp, old):
        s, w, m = losses.grpo_loss(lp, old, ref, adv, mask, aggregation="token-mean")
        return s / w, m

    (v_none, m_none), g_none = jax.value_and_grad(loss, has_aux=True)(logps, None)
    (v_same, m_same), g_same = jax.value_and_grad(loss, has_aux=True)(logps, logps)
    close(v_none, float(v_same), rtol=1e-6)
    assert float(m_none["is_ratio/mean"]) == 1.0 and float(m_none["clip_ratio"]) == 0.0
    close(g_none, np.asarray(g_same), rtol=1e-6)  # old == logps, held fixed: the same gradient


def test_jit_matches_eager():
    batch = [jnp.asarray(x, jnp.float32) for x in random_batch(seed=9)]
    f = functools.partial(losses.grpo_loss, epsilon_high=0.28, aggregation="token-mean", kl_estimator="kl")
    for got, want in zip(jax.tree.leaves(jax.jit(f)(*batch)), jax.tree.leaves(f(*batch))):
        np.testing.assert_allclose(got, want, rtol=1e-6)


# --------------------------------------------------------------- principle 8: shards


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("n_shards", [2, 4])
def test_shards_sum_to_the_whole_batch(aggregation, n_shards):
    """Sum the shards' loss sums and weights, divide once: the whole batch's loss.

    Rows 6 and 7 are empty, so with 4 shards the last shard has no tokens at all.
    """
    batch = [jnp.asarray(x, jnp.float32) for x in random_batch(seed=13, empty_rows=(6, 7))]
    kw = dict(aggregation=aggregation, epsilon_high=0.28, beta=0.04)
    s, w, _ = losses.grpo_loss(*batch, **kw)
    parts = [losses.grpo_loss(*(jnp.split(x, n_shards)[i] for x in batch), **kw) for i in range(n_shards)]
    s_sum, w_sum = sum(p[0] for p in parts), sum(p[1] for p in parts)
    close(s_sum, float(s), rtol=1e-6)
    assert float(w_sum) == float(w)
    close(s_sum / w_sum, float(s / w), rtol=1e-6)
    if n_shards == 4:
        assert float(parts[3][0]) == 0.0  # the empty shard adds nothing to the sum


# ------------------------------------------------------------------------- gradients


def test_gradients_flow_through_logps_only():
    batch = [jnp.asarray(x, jnp.float32) for x in random_batch(seed=17)]

    def loss(*args):
        s, w, _ = losses.grpo_loss(*args, epsilon_high=0.28, beta=0.1)
        return s / w

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*batch)
    assert np.any(np.asarray(grads[0]) != 0)
    for name, g in zip(("old_logps", "ref_logps", "advantages"), grads[1:]):
        assert np.all(np.asarray(g) == 0), name


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_gradient_matches_finite_differences(aggregation, kl_estimator):
    """jax.grad of the kit against central differences of the float64 transcription.

    Small log-ratios with mixed-sign advantages, and one token per side clipped: away
    from the clip's kinks, where both one-sided derivatives agree.
    """
    rng = np.random.default_rng(23)
    B, L = 3, 4
    logps = np.round(-rng.exponential(1.0, (B, L)), 3)
    old = logps + np.round(0.05 * rng.standard_normal((B, L)), 3)
    old[0, 0] = logps[0, 0] - 0.5  # ratio e^0.5, clipped for A > 0
    ref = logps + np.round(0.5 * rng.standard_normal((B, L)), 3)
    adv = np.array([0.8, -1.1, 0.4])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float64)
    kw = dict(eps=0.2, eps_high=0.28, beta=0.3, kl_mode=kl_estimator, agg=aggregation)

    def ref_loss(lp):
        s, w, _ = tunix_grpo(lp, old, ref, adv, mask, **kw)
        return s / max(w, 1.0)

    h = 1e-6
    fd = np.zeros((B, L))
    for i in range(B):
        for j in range(L):
            e = np.zeros((B, L))
            e[i, j] = h
            fd[i, j] = (ref_loss(logps + e) - ref_loss(logps - e)) / (2 * h)

    def kit_loss(lp):
        s, w, _ = losses.grpo_loss(lp, *(jnp.asarray(x, jnp.float32) for x in (old, ref, adv, mask)),
                                   epsilon_high=0.28, beta=0.3, kl_estimator=kl_estimator,
                                   aggregation=aggregation)
        return s / jnp.maximum(w, 1.0)

    got = jax.grad(kit_loss)(jnp.asarray(logps, jnp.float32))
    np.testing.assert_allclose(got, fd, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(got)[mask == 0] == 0)


# ---------------------------------------------------------------- empty and masked


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_empty_mask_is_zero_not_nan(aggregation):
    logps, old, ref, adv, _ = (jnp.asarray(x, jnp.float32) for x in random_batch(seed=1))
    mask = jnp.zeros_like(logps)

    def loss(lp):
        s, w, m = losses.grpo_loss(lp, old, ref, adv, mask, aggregation=aggregation, beta=0.04)
        return s / jnp.maximum(w, 1.0), (s, w, m)  # the division train.make_step does

    (value, (s, w, m)), g = jax.value_and_grad(loss, has_aux=True)(logps)
    assert float(value) == 0.0 and float(s) == 0.0
    assert float(w) == (8.0 if aggregation == "sequence-mean-token-sum-norm" else 0.0)
    assert all(float(v) == 0.0 for v in m.values())
    assert np.all(np.asarray(g) == 0)


def test_garbage_at_masked_positions_stays_out():
    """Padding positions may hold -inf or NaN: neither the loss nor its gradient sees them."""
    batch = [np.asarray(x, np.float32) for x in random_batch(seed=19)]
    logps, old, ref, adv, mask = batch
    dirty = [x.copy() for x in (logps, old, ref)]
    for x, v in zip(dirty, (-np.inf, np.nan, np.inf)):
        x[mask == 0] = v

    def loss(lp, old_, ref_):
        s, w, m = losses.grpo_loss(lp, old_, ref_, adv, mask, beta=0.04)
        return s / jnp.maximum(w, 1.0), m

    (clean_v, clean_m), clean_g = jax.value_and_grad(loss, has_aux=True)(logps, old, ref)
    (dirty_v, dirty_m), dirty_g = jax.value_and_grad(loss, has_aux=True)(*dirty)
    np.testing.assert_array_equal(dirty_v, clean_v)
    np.testing.assert_array_equal(dirty_g, clean_g)
    for key in clean_m:
        np.testing.assert_array_equal(dirty_m[key], clean_m[key], err_msg=key)


# --------------------------------------------------------------------------- errors


def test_shape_errors_name_the_shapes():
    logps, old, ref, adv, mask = (jnp.asarray(x, jnp.float32) for x in random_batch(seed=0))
    with pytest.raises(ValueError, match=r"old_logps \(8, 5\).*must all be \[B, L\]"):
        losses.grpo_loss(logps, old[:, :5], ref, adv, mask)
    with pytest.raises(ValueError, match=r"advantages \(8, 1\).*advantages \[B\]"):
        losses.grpo_loss(logps, old, ref, adv[:, None], mask)
    with pytest.raises(ValueError, match=r"logps \(48,\)"):
        losses.grpo_loss(logps.reshape(-1), old.reshape(-1), ref.reshape(-1), adv, mask.reshape(-1))
    with pytest.raises(ValueError, match=r"mask \(4, 6\)"):
        losses.grpo_loss(logps, old, ref, adv, mask[:4])


def test_argument_errors_name_the_fix():
    batch = [jnp.asarray(x, jnp.float32) for x in random_batch(seed=0)]
    logps, old, _, adv, mask = batch
    with pytest.raises(ValueError, match="ref_logps is None but beta=0.04.*pass ref_logps, or set beta=0"):
        losses.grpo_loss(logps, old, None, adv, mask)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        losses.grpo_loss(*batch, kl_estimator="k3")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        losses.grpo_loss(*batch, aggregation="dr_grpo")
    with pytest.raises(ValueError, match="max_completion_length applies only to"):
        losses.grpo_loss(*batch, max_completion_length=8)
    with pytest.raises(ValueError, match="max_completion_length must be > 0"):
        losses.grpo_loss(*batch, aggregation="sequence-mean-token-scale", max_completion_length=0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        losses.grpo_loss(*batch, epsilon=0.0)
    with pytest.raises(ValueError, match="epsilon_high must be > 0"):
        losses.grpo_loss(*batch, epsilon_high=-0.1)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        losses.grpo_loss(*batch, beta=-0.1)
