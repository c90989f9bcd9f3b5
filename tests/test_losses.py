"""Tests for tunix_nb.losses: closed-form values, masking, stability and shape errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, losses

# A closed form against float32: one rounding, plus an exp and a log at the backend's own
# accuracy (tunix_nb.compare: within 4 eps on a CPU, so about 1e-6 there; a TPU v5e's float32
# log is within some 3,100 eps, so about 5e-4 there).
RTOL = compare.float32_bound(1, transcendentals={"exp": 1, "log": 1})
DIVERGENCES = {
    "forward": lambda s, t, y, m, T: losses.kl_distillation_per_example(
        s, t, y, m, temperature=T, alpha=1.0
    ),
    "reverse": lambda s, t, y, m, T: losses.reverse_kl_per_example(s, t, y, m, temperature=T),
    "jsd": lambda s, t, y, m, T: losses.generalized_jsd_per_example(
        s, t, y, m, beta=0.3, temperature=T
    ),
}


def _py_log_softmax(xs):
    top = max(xs)
    lse = top + math.log(sum(math.exp(x - top) for x in xs))
    return [x - lse for x in xs]


def _py_kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def _random_example(seed, L=5, V=11, scale=3.0):
    rng = np.random.default_rng(seed)
    student = jnp.asarray(scale * rng.standard_normal((L, V)), jnp.float32)
    teacher = jnp.asarray(scale * rng.standard_normal((L, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, L), jnp.int32)
    mask = jnp.asarray([0, 1, 1, 1, 0][:L] + [1] * max(L - 5, 0), jnp.float32)
    return student, teacher, targets, mask


# Two classes at T=1: teacher [0.5, 0.5], student [0.9, 0.1].
TEACHER_2 = jnp.asarray([[0.0, 0.0]])
STUDENT_2 = jnp.asarray([[math.log(0.9), math.log(0.1)]])
TARGET_2 = jnp.asarray([1])
MASK_2 = jnp.asarray([1.0])


# ------------------------------------------------------------------ distillation values


def test_kl_two_class_closed_form():
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    got = losses.kl_distillation_per_example(
        STUDENT_2, TEACHER_2, TARGET_2, MASK_2, temperature=1.0, alpha=1.0
    )
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def test_kl_at_temperature_2_includes_t_squared():
    s, t = [0.3, 0.0, -1.0], [1.0, -0.5, 2.0]
    p_t = [math.exp(x) for x in _py_log_softmax([x / 2 for x in t])]
    p_s = [math.exp(x) for x in _py_log_softmax([x / 2 for x in s])]
    expected = 4.0 * _py_kl(p_t, p_s)
    got = losses.kl_distillation_per_example(
        jnp.asarray([s]), jnp.asarray([t]), jnp.asarray([0]), jnp.asarray([1.0]),
        temperature=2.0, alpha=1.0,
    )
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def test_alpha_zero_is_hard_ce_and_mask_excludes_positions():
    # Position 1 is masked out and has a very different student: it must not count.
    student = jnp.asarray([[math.log(0.9), math.log(0.1)], [9.0, -9.0], [0.0, math.log(3.0)]])
    teacher = jnp.zeros((3, 2))
    targets = jnp.asarray([1, 1, 0])
    mask = jnp.asarray([1.0, 0.0, 1.0])
    expected_hard = (-math.log(0.1) - math.log(0.25)) / 2
    expected_soft = (
        _py_kl([0.5, 0.5], [0.9, 0.1]) + _py_kl([0.5, 0.5], [0.25, 0.75])
    ) / 2
    kw = dict(temperature=1.0)
    hard = losses.kl_distillation_per_example(student, teacher, targets, mask, alpha=0.0, **kw)
    soft = losses.kl_distillation_per_example(student, teacher, targets, mask, alpha=1.0, **kw)
    mixed = losses.kl_distillation_per_example(student, teacher, targets, mask, alpha=0.25, **kw)
    np.testing.assert_allclose(hard, expected_hard, rtol=RTOL)
    np.testing.assert_allclose(soft, expected_soft, rtol=RTOL)
    np.testing.assert_allclose(mixed, 0.25 * expected_soft + 0.75 * expected_hard, rtol=RTOL)


def test_identical_logits_give_zero_divergences():
    s, _, y, m = _random_example(0)
    # each position sums V terms p (log p - log q) of size below 1, each with an exp and up to
    # two logs (the JSD's mixture), times T^2 = 4
    bound = compare.float32_bound(s.shape[-1], transcendentals={"exp": 1, "log": 2}) * 4.0
    for name, fn in DIVERGENCES.items():
        assert abs(float(fn(s, s, y, m, 2.0))) <= bound, name


def test_reverse_kl_two_class_closed_form():
    expected = _py_kl([0.9, 0.1], [0.5, 0.5])
    got = losses.reverse_kl_per_example(STUDENT_2, TEACHER_2, TARGET_2, MASK_2, temperature=1.0)
    np.testing.assert_allclose(got, expected, rtol=RTOL)


@pytest.mark.parametrize("beta", [0.5, 0.25])
def test_jsd_two_class_closed_form(beta):
    # beta weights the teacher in the mixture AND its KL term (TRL's convention);
    # beta=0.25 tells this apart from the swapped-weights variant.
    p_t, p_s = [0.5, 0.5], [0.9, 0.1]
    m = [beta * a + (1 - beta) * b for a, b in zip(p_t, p_s)]
    expected = beta * _py_kl(p_t, m) + (1 - beta) * _py_kl(p_s, m)
    got = losses.generalized_jsd_per_example(
        STUDENT_2, TEACHER_2, TARGET_2, MASK_2, beta=beta, temperature=1.0
    )
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def test_jsd_endpoints_are_forward_and_reverse_kl():
    s, t, y, m = _random_example(1)
    forward = losses.kl_distillation_per_example(s, t, y, m, temperature=2.0, alpha=1.0)
    reverse = losses.reverse_kl_per_example(s, t, y, m, temperature=2.0)
    jsd0 = losses.generalized_jsd_per_example(s, t, y, m, beta=0.0, temperature=2.0)
    jsd1 = losses.generalized_jsd_per_example(s, t, y, m, beta=1.0, temperature=2.0)
    np.testing.assert_allclose(jsd0, forward, rtol=RTOL)
    np.testing.assert_allclose(jsd1, reverse, rtol=RTOL)
    assert abs(float(forward) - float(reverse)) > 1e-2  # the two directions differ here


def test_jsd_interior_vanishes_near_the_endpoints():
    # Documented discontinuity: near beta=0 the mixture formula is ~ beta * forward KL.
    s, t, y, m = _random_example(2)
    forward = float(losses.generalized_jsd_per_example(s, t, y, m, beta=0.0))
    near = float(losses.generalized_jsd_per_example(s, t, y, m, beta=1e-3))
    assert 0 < near < 2e-3 * forward


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _trl_generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature=1.0):
    """TRL's `GKDTrainer.generalized_jsd_loss` (reduction="batchmean"), transcribed to numpy.

    torch's `F.kl_div(input, target, log_target=True)` is exp(target) * (target - input).
    """
    kl_div = lambda inp, target: np.exp(target) * (target - inp)  # noqa: E731
    s = _np_log_softmax(np.asarray(student_logits, np.float64) / temperature)
    t = _np_log_softmax(np.asarray(teacher_logits, np.float64) / temperature)
    if beta == 0:
        jsd = kl_div(s, t)
    elif beta == 1:
        jsd = kl_div(t, s)
    else:
        mix = np.logaddexp(s + np.log1p(-beta), t + np.log(beta))
        jsd = beta * kl_div(mix, t) + (1 - beta) * kl_div(mix, s)
    mask = labels != -100
    return jsd[mask].sum() / max(mask.sum(), 1)  # "batchmean" with labels: over all valid tokens


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_at_temperature_1_equals_trls_loss_for_one_full_example(beta):
    s, t, y, _ = _random_example(4, L=6)
    full = jnp.ones(6)
    trl = _trl_generalized_jsd_loss(s[None], t[None], np.asarray(y)[None], beta)
    got = losses.generalized_jsd_per_example(s, t, y, full, beta=beta, temperature=1.0)
    # the sum of 6 x 11 terms, each with its exp and logs (1e-5 on a CPU)
    rtol = compare.float32_bound(64, transcendentals={"exp": 2, "log": 2})
    np.testing.assert_allclose(got, trl, rtol=rtol)
    # At T != 1 the kit multiplies by T^2 (TRL does not).
    got = losses.generalized_jsd_per_example(s, t, y, full, beta=beta, temperature=2.0)
    trl = _trl_generalized_jsd_loss(s[None], t[None], np.asarray(y)[None], beta, temperature=2.0)
    np.testing.assert_allclose(got, 4.0 * trl, rtol=rtol)


# -------------------------------------------------------------- masking and stability


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_all_zero_mask_gives_exact_zero_and_zero_grads(name):
    s, t, y, _ = _random_example(3)
    zeros = jnp.zeros(y.shape)
    fn = DIVERGENCES[name]
    assert float(fn(s, t, y, zeros, 2.0)) == 0.0
    grads = jax.jit(jax.grad(fn), static_argnums=4)(s, t, y, zeros, 2.0)
    assert np.all(np.asarray(grads) == 0.0)


def test_all_zero_mask_hard_term_is_zero():
    s, t, y, _ = _random_example(3)
    assert float(losses.kl_distillation_per_example(s, t, y, jnp.zeros(y.shape), alpha=0.0)) == 0.0


def test_int_and_bool_masks_match_float_mask():
    s, t, y, m = _random_example(4)
    want = losses.kl_distillation_per_example(s, t, y, m)
    for mask in (m.astype(jnp.int32), m.astype(bool)):
        got = losses.kl_distillation_per_example(s, t, y, mask)
        np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.parametrize("name", list(DIVERGENCES))
def test_huge_logits_give_finite_values_and_grads(name):
    rng = np.random.default_rng(5)
    s = jnp.asarray(np.sign(rng.standard_normal((4, 9))) * 1e4, jnp.float32)
    t = jnp.asarray(np.sign(rng.standard_normal((4, 9))) * 1e4, jnp.float32)
    y, m = jnp.asarray([0, 3, 5, 8]), jnp.ones(4)

    def full(s, t):  # the divergence plus the hard CE term
        return DIVERGENCES[name](s, t, y, m, 2.0) + losses.kl_distillation_per_example(
            s, t, y, m, alpha=0.0
        )

    value, (gs, gt) = jax.jit(jax.value_and_grad(full, argnums=(0, 1)))(s, t)
    assert np.isfinite(float(value)) and float(value) > 0
    assert np.all(np.isfinite(gs)) and np.all(np.isfinite(gt))


# ------------------------------------------------------------------- batched loss


def _batch(seed, B=3, L=6, V=7):
    rng = np.random.default_rng(seed)
    s = jnp.asarray(2 * rng.standard_normal((B, L, V)), jnp.float32)
    t = jnp.asarray(2 * rng.standard_normal((B, L, V)), jnp.float32)
    y = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
    m = jnp.asarray(rng.integers(0, 2, (B, L)), jnp.float32).at[:, -1].set(1.0)
    return s, t, y, m


def test_distillation_loss_equals_python_loop():
    s, t, y, m = _batch(6)
    kw = dict(temperature=1.5, alpha=0.3)
    loss, metrics = jax.jit(lambda *a: losses.distillation_loss(*a, **kw))(s, t, y, m)
    per = [losses.kl_distillation_per_example(s[b], t[b], y[b], m[b], **kw) for b in range(3)]
    soft = [
        losses.kl_distillation_per_example(s[b], t[b], y[b], m[b], temperature=1.5, alpha=1.0)
        for b in range(3)
    ]
    hard = [
        losses.kl_distillation_per_example(s[b], t[b], y[b], m[b], alpha=0.0)
        for b in range(3)
    ]
    np.testing.assert_allclose(loss, np.mean(per), rtol=RTOL)
    np.testing.assert_allclose(metrics["distill/soft_loss"], np.mean(soft), rtol=RTOL)
    np.testing.assert_allclose(metrics["distill/hard_loss"], np.mean(hard), rtol=RTOL)


def test_distillation_loss_all_zero_mask_example_adds_zero():
    s, t, y, m = _batch(7, B=2)
    m = m.at[1].set(0.0)
    loss, _ = losses.distillation_loss(s, t, y, m)
    only = losses.kl_distillation_per_example(s[0], t[0], y[0], m[0])
    np.testing.assert_allclose(loss, (only + 0.0) / 2, rtol=RTOL)
    grads = jax.jit(jax.grad(lambda s: losses.distillation_loss(s, t, y, m)[0]))(s)
    assert np.all(np.asarray(grads[1]) == 0.0) and np.any(np.asarray(grads[0]) != 0.0)


# ------------------------------------------------------------------- shape errors


def _raises(fn, *parts):
    with pytest.raises(ValueError, match=".*".join(re.escape(p) for p in parts)):
        fn()


def test_vocab_mismatch_names_both_shapes():
    s, t = jnp.zeros((7, 259)), jnp.zeros((7, 300))
    y, m = jnp.zeros(7, jnp.int32), jnp.ones(7)
    for fn in (
        losses.kl_distillation_per_example,
        losses.reverse_kl_per_example,
        losses.generalized_jsd_per_example,
    ):
        _raises(lambda: fn(s, t, y, m), "(7, 259)", "(7, 300)", "vocabularies must match")
    _raises(
        lambda: losses.distillation_loss(s[None], t[None], y[None], m[None]),
        "(1, 7, 259)", "(1, 7, 300)", "same tokenizer",
    )


def test_length_mismatches_name_both_shapes():
    s, y, m = jnp.zeros((7, 5)), jnp.zeros(7, jnp.int32), jnp.ones(7)
    f = losses.kl_distillation_per_example
    _raises(lambda: f(s, jnp.zeros((8, 5)), y, m), "(7, 5)", "(8, 5)", "same positions")
    _raises(lambda: f(s, s, jnp.zeros(6, jnp.int32), m), "targets has shape (6,)", "(7, 5)")
    _raises(lambda: f(s, s, y, jnp.ones(8)), "mask has shape (8,)", "(7, 5)")
    _raises(
        lambda: losses.distillation_loss(s[None], s[None], y[None], jnp.ones((2, 7))),
        "mask has shape (2, 7)", "(1, 7, 5)",
    )


def test_wrong_rank_points_to_the_right_function():
    s, y, m = jnp.zeros((2, 7, 5)), jnp.zeros((2, 7), jnp.int32), jnp.ones((2, 7))
    per_example = losses.kl_distillation_per_example
    _raises(lambda: per_example(s, s, y, m), "(2, 7, 5)", "distillation_loss")
    _raises(lambda: losses.distillation_loss(s[0], s[0], y[0], m[0]), "(7, 5)", "[B, L, V]")


def test_bad_beta_and_temperature():
    s, t, y, m = _random_example(8)
    for beta in (-0.1, 1.5):
        _raises(lambda: losses.generalized_jsd_per_example(s, t, y, m, beta=beta), "beta")
    _raises(lambda: losses.reverse_kl_per_example(s, t, y, m, temperature=0.0), "temperature")


# ---------------------------------------------------------------------------- SFT


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_sft_functions_match_numpy():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2, 4, 6))
    targets = rng.integers(0, 6, (2, 4))
    mask = np.array([[0, 1, 1, 0], [1, 1, 1, 1]])
    want_tok = np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]

    tok = losses.token_log_probs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
    seq = losses.sequence_log_probs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), mask)
    nll, count = losses.sft_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), mask)

    np.testing.assert_allclose(tok, want_tok, rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(seq, (want_tok * mask).sum(-1), rtol=RTOL)
    np.testing.assert_allclose(nll, -(want_tok * mask).sum(), rtol=RTOL)
    assert count.dtype == jnp.float32 and float(count) == mask.sum() == 6
    # Any leading dims: one [L, V] example gives [L].
    np.testing.assert_allclose(
        losses.token_log_probs(jnp.asarray(logits[1], jnp.float32), jnp.asarray(targets[1])),
        want_tok[1], rtol=RTOL, atol=1e-6,
    )


def test_uniform_logits_give_log_v_per_token():
    V = 13
    nll, count = losses.sft_loss(
        jnp.zeros((3, 5, V)), jnp.ones((3, 5), jnp.int32), jnp.ones((3, 5), bool)
    )
    assert float(count) == 15
    np.testing.assert_allclose(nll / count, math.log(V), rtol=RTOL)


def test_token_log_probs_shape_error():
    _raises(
        lambda: losses.token_log_probs(jnp.zeros((2, 4, 6)), jnp.zeros((2, 5), jnp.int32)),
        "(2, 4, 6)", "(2, 5)",
    )


# ---------------------------------------------------------------------------- DPO


def _logps(pc, pr, rc, rr):
    return [jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)]


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_sigmoid_at_zero_margin_is_ln2(eps):
    args = _logps([-3.0, -7.0], [-5.0, -2.0], [-4.0, -6.0], [-6.0, -1.0])  # h = 0 for both
    loss, _ = losses.dpo_loss(*args, beta=0.2, label_smoothing=eps)
    np.testing.assert_allclose(loss, math.log(2), rtol=RTOL)


def test_dpo_sigmoid_matches_hand_value():
    # h = (-10 + 12) - (-11 + 11.5) = 1.5 and h = (-4 + 3) - (-4 + 4) = -1
    args = _logps([-10.0, -4.0], [-12.0, -3.0], [-11.0, -4.0], [-11.5, -4.0])
    beta, eps = 0.1, 0.1

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    expected = np.mean(
        [-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h) for h in (1.5, -1.0)]
    )
    loss, _ = jax.jit(lambda *a: losses.dpo_loss(*a, beta=beta, label_smoothing=eps))(*args)
    np.testing.assert_allclose(loss, expected, rtol=RTOL)


def test_dpo_ipo_and_hinge_closed_forms():
    zero = _logps([-1.0], [-1.0], [-2.0], [-2.0])  # h = 0
    np.testing.assert_allclose(losses.dpo_loss(*zero, loss_type="hinge")[0], 1.0, rtol=RTOL)
    ipo_at_zero = losses.dpo_loss(*zero, beta=0.5, loss_type="ipo")[0]
    np.testing.assert_allclose(ipo_at_zero, 1.0, rtol=RTOL)  # (0 - 1)^2
    at_target = _logps([-1.0], [-6.0], [-2.0], [-2.0])  # h = 5 = 1 / (2 * 0.1)
    assert float(losses.dpo_loss(*at_target, beta=0.1, loss_type="ipo")[0]) == 0.0
    assert float(losses.dpo_loss(*at_target, beta=0.5, loss_type="hinge")[0]) == 0.0
    np.testing.assert_allclose(
        losses.dpo_loss(*at_target, beta=0.1, loss_type="hinge")[0], 0.5, rtol=RTOL
    )


def test_dpo_metrics_by_hand_with_a_tie():
    # beta=0.5; rewards (chosen, rejected): (0.5, 0.0) right, (0, 0) tie, (-0.5, 0.5) wrong.
    args = _logps([-1.0, -2.0, -5.0], [-3.0, -4.0, -1.0], [-2.0, -2.0, -4.0], [-3.0, -4.0, -2.0])
    _, metrics = losses.dpo_loss(*args, beta=0.5)
    np.testing.assert_allclose(metrics["rewards/chosen"], 0.0, atol=1e-7)
    np.testing.assert_allclose(metrics["rewards/rejected"], 0.5 / 3, rtol=RTOL)
    np.testing.assert_allclose(metrics["rewards/margin"], -1.0 / 6, rtol=RTOL)
    np.testing.assert_allclose(metrics["rewards/accuracy"], 1.0 / 3, rtol=RTOL)


@pytest.mark.parametrize("loss_type", losses.DPO_LOSS_TYPES)
def test_dpo_gradients_finite(loss_type):
    args = _logps([-1e4, -3.0], [-2.0, -1e4], [-5.0, -3.5], [-1.0, -2.0])
    grads = jax.grad(lambda *a: losses.dpo_loss(*a, loss_type=loss_type)[0], argnums=(0, 1))(
        *args
    )
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_dpo_sigmoid_gradient_closed_form():
    # d/d pi_c of mean(-log sigmoid(beta h)) = -beta * sigmoid(-beta h) / B
    args = _logps([-2.0, -1.0], [-3.0, -1.0], [-2.5, -1.0], [-2.0, -2.0])  # h = 1.5, -1
    beta = 0.3
    g = jax.grad(lambda pc: losses.dpo_loss(pc, *args[1:], beta=beta)[0])(args[0])
    want = [-beta / (1 + math.exp(beta * h)) / 2 for h in (1.5, -1.0)]
    np.testing.assert_allclose(g, want, rtol=RTOL)


def test_dpo_errors():
    args = _logps([-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0])
    _raises(lambda: losses.dpo_loss(*args, loss_type="kto"), "'sigmoid', 'ipo', 'hinge'", "'kto'")
    for beta in (0.0, -1.0):
        _raises(lambda: losses.dpo_loss(*args, beta=beta), "beta must be > 0")
    for eps in (-0.1, 0.5):
        _raises(lambda: losses.dpo_loss(*args, label_smoothing=eps), "label_smoothing")
    _raises(lambda: losses.dpo_loss(*args, loss_type="ipo", label_smoothing=0.1), "sigmoid")
    bad = [args[0], args[1][:1], args[2], args[3]]
    _raises(lambda: losses.dpo_loss(*bad), "(2,), (1,), (2,), (2,)")
    _raises(lambda: losses.dpo_loss(*[a[None] for a in args]), "(1, 2), (1, 2)")


def test_check_nonempty_completions():
    mask = np.ones((9, 4), np.int32)
    mask[[3, 7]] = 0
    _raises(
        lambda: losses.check_nonempty_completions(jnp.asarray(mask), "chosen"),
        "pair(s) [3, 7] have an empty chosen completion",
    )
    mask[[3, 7], 2] = 1
    assert losses.check_nonempty_completions(mask.astype(bool), "chosen") is None
