"""Lesson 01 (a per-example KL distillation loss, lifted with vmap): the four exercises.

`example_batch` rebuilds the lesson's inputs: targets and masks of 8 real rows of the
task (L=24, V=259) and random logits, the teacher's scaled by 3.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tunix_nb import data, losses
from tunix_nb.tokenizer import ByteTokenizer


@functools.lru_cache(maxsize=2)
def example_batch(batch_size: int = 8, seed: int = 0):
    """The lesson's (student_BxLxV, teacher_BxLxV, targets_BxL, mask_BxL), B=8, L=24, V=259."""
    tok = ByteTokenizer()
    rows = data.sft_arrays(data.load_sft()[:batch_size], tok, seq_len=data.DEFAULT_SEQ_LEN)
    targets_BxL, mask_BxL = jnp.asarray(rows["targets"]), jnp.asarray(rows["loss_mask"])
    B, L, V = *targets_BxL.shape, tok.vocab_size
    k_student, k_teacher = jax.random.split(jax.random.key(seed))
    student_BxLxV = jax.random.normal(k_student, (B, L, V))
    teacher_BxLxV = 3.0 * jax.random.normal(k_teacher, (B, L, V))
    return student_BxLxV, teacher_BxLxV, targets_BxL, mask_BxL


def kd_loss_one(s_LxV, t_LxV, y_L, m_L, T=2.0, alpha=0.5):
    """The lesson's one-example loss (positional T and alpha, so vmap's in_axes can name them)."""
    return losses.kl_distillation_per_example(s_LxV, t_LxV, y_L, m_L, temperature=T, alpha=alpha)


# ------------------------------------------------------------------------- exercise 1


def per_example_alpha_loss(alpha_B=None, T: float = 2.0):
    """Lesson 01, exercise 1: `kd_loss_one` vmapped with a batched alpha [B] and a shared T.

    Returns (per_alpha_B, loss_B): the losses with one alpha per example (default: all
    0.5) and the lesson's `loss_B` (alpha=0.5 for every example), both [B].
    """
    args = example_batch()
    B = args[0].shape[0]
    alpha_B = jnp.full((B,), 0.5) if alpha_B is None else jnp.asarray(alpha_B, jnp.float32)
    per_alpha_B = jax.jit(jax.vmap(kd_loss_one, in_axes=(0, 0, 0, 0, None, 0)))(*args, T, alpha_B)
    loss_B = jax.jit(jax.vmap(kd_loss_one, in_axes=(0, 0, 0, 0, None, None)))(*args, T, 0.5)
    return per_alpha_B, loss_B


# ------------------------------------------------------------------------- exercise 2


def _linear_student_grads(D: int = 16):
    """Per-example gradients [B, D, V] of the lesson's linear student, and W_DxV."""
    student_BxLxV, teacher_BxLxV, targets_BxL, mask_BxL = example_batch()
    rows = data.sft_arrays(data.load_sft()[:8], ByteTokenizer(), seq_len=data.DEFAULT_SEQ_LEN)
    V = student_BxLxV.shape[-1]
    embed_VxD = jax.random.normal(jax.random.key(1), (V, D)) / np.sqrt(D)
    x_BxLxD = embed_VxD[jnp.asarray(rows["inputs"])]
    W_DxV = 0.1 * jax.random.normal(jax.random.key(2), (D, V))

    def example_loss(W_DxV, x_LxD, t_LxV, y_L, m_L):
        return kd_loss_one(x_LxD @ W_DxV, t_LxV, y_L, m_L)

    grads_BxDxV = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0, 0, 0)))(
        W_DxV, x_BxLxD, teacher_BxLxV, targets_BxL, mask_BxL)
    return grads_BxDxV, W_DxV


def _cosine(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


def clipping_bounds_one_example(outlier_scale: float = 100.0) -> dict[str, float]:
    """Lesson 01, exercise 2: per-example clipping to C2 = C/2 against clipping the mean to C2.

    The lesson's per-example gradients [B, D, V] of the linear student, with example 0's
    gradient scaled by `outlier_scale` (one huge example: a wrong label, say). Returns
    the largest contribution of one example to each update (its share of the mean,
    norm), the bound C2 / B, and the cosine between each update and example 0's gradient.
    """
    grads_BxDxV, W_DxV = _linear_student_grads()
    return {k: float(v) for k, v in _clip_both_ways(grads_BxDxV, W_DxV, outlier_scale).items()}


@jax.jit
def _clip_both_ways(grads_BxDxV, W_DxV, outlier_scale):
    grads_BxDxV = grads_BxDxV.at[0].multiply(outlier_scale)
    B = grads_BxDxV.shape[0]
    norms_B = jnp.linalg.norm(grads_BxDxV.reshape(B, -1), axis=-1)
    C2 = 0.5 * jnp.median(norms_B)
    clipped_BxDxV = grads_BxDxV * jnp.minimum(1.0, C2 / norms_B)[:, None, None]
    per_example = clipped_BxDxV.mean(0)
    global_clip = optax.clip_by_global_norm(C2)
    mean_clipped, _ = global_clip.update(grads_BxDxV.mean(0), global_clip.init(W_DxV))
    # Global clipping scales every example by the same factor, so example i contributes
    # factor * g_i / B; the factor is the ratio of the clipped to the unclipped mean.
    factor = jnp.linalg.norm(mean_clipped) / jnp.linalg.norm(grads_BxDxV.mean(0))
    return {
        "bound": C2 / B,
        "per_example_largest_contribution": jnp.linalg.norm(clipped_BxDxV.reshape(B, -1), axis=-1).max() / B,
        "global_largest_contribution": factor * norms_B.max() / B,
        "per_example_cosine_with_outlier": _cosine(per_example, grads_BxDxV[0]),
        "global_cosine_with_outlier": _cosine(mean_clipped, grads_BxDxV[0]),
    }


# ------------------------------------------------------------------------- exercise 3

_BINS_V = jnp.arange(64.0)


def _bump_logits(mu, sigma):
    return -0.5 * ((_BINS_V - mu) / sigma) ** 2


def _teacher_logits_1xV():
    probs_V = 0.55 * jax.nn.softmax(_bump_logits(18.0, 3.0)) + 0.45 * jax.nn.softmax(_bump_logits(45.0, 4.0))
    return jnp.log(probs_V)[None]


@functools.partial(jax.jit, static_argnames=("divergence", "steps"))
def _fit(divergence, mu0=26.0, steps=400):
    """The lesson's fit: a one-bump student (mu, sigma) by `steps` Adam steps -> (mu, sigma)."""
    opt, params = optax.adam(0.3), {"mu": jnp.asarray(mu0), "log_sigma": jnp.log(3.0)}
    teacher_1xV = _teacher_logits_1xV()
    loss_fn = lambda p: divergence(_bump_logits(p["mu"], jnp.exp(p["log_sigma"]))[None], teacher_1xV)  # noqa: E731

    def step(carry, _):
        params, opt_state = carry
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state)
        return (optax.apply_updates(params, updates), opt_state), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), length=steps)
    return params["mu"], jnp.exp(params["log_sigma"])


def _reverse_kl(s, t):
    return losses.reverse_kl_per_example(s, t, jnp.zeros((1,), jnp.int32), jnp.ones((1,)), temperature=1.0)


@functools.lru_cache(maxsize=None)
def _jsd(beta):
    def divergence(s, t):
        return losses.generalized_jsd_per_example(s, t, jnp.zeros((1,), jnp.int32), jnp.ones((1,)),
                                                  beta=beta, temperature=1.0)
    return divergence


def mode_seeking_fits(mu0: float = 38.0, betas=(0.1, 0.9, 0.99), steps: int = 400) -> dict[str, tuple]:
    """Lesson 01, exercise 3: the one-bump student fitted to the two-mode teacher (V=64 bins).

    Returns {name: (mu, sigma)} for "reverse KL" started at `mu0`, and for the JSD at
    each beta in `betas` (keys "JSD, beta=0.1", ...) from the lesson's start, mu=26.
    The teacher's modes are at 18 (sigma 3) and 45 (sigma 4).
    """
    out = {"reverse KL": _fit(_reverse_kl, mu0=mu0, steps=steps)}
    for beta in betas:
        out[f"JSD, beta={beta}"] = _fit(_jsd(float(beta)), steps=steps)
    return {k: (float(mu), float(sigma)) for k, (mu, sigma) in out.items()}


# ------------------------------------------------------------------------- exercise 4


def topk_distillation_soft_one(s_LxV, t_LxV, m_L, k: int, T: float = 2.0):
    """Lesson 01, exercise 4: the soft term over the teacher's top k tokens, for ONE example.

    s_LxV, t_LxV: student and teacher logits; m_L: the mask. At each position keep the
    teacher's k largest logits and the student's at the same ids ([L, k] each),
    renormalise both over those k, and take T² times the masked-mean KL -> scalar.
    `k` must be a Python int (it sets a shape), so vmap it with `None` in in_axes;
    k = V gives the full soft term (`kl_distillation_per_example` with alpha=1).
    """
    t_LxK, ids_LxK = jax.lax.top_k(t_LxV, k)
    s_LxK = jnp.take_along_axis(s_LxV, ids_LxK, axis=-1)
    logq, logp = jax.nn.log_softmax(s_LxK / T), jax.nn.log_softmax(t_LxK / T)
    kl_L = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    return T**2 * jnp.sum(kl_L * m_L) / jnp.maximum(m_L.sum(), 1.0)
