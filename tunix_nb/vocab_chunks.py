"""Log-probs, cross-entropy and the distillation divergences from hidden states, in chunks.

A model's logits are [B, L, V] float32: 5 GB for Qwen3's V = 151,936 at 8 x 1024, and the
log-softmax and its gradient are as large again. The losses read few of them: only the
completion positions, and per position a normaliser (log-sum-exp), the target's logit,
or a divergence summed over the vocabulary. So the functions here take the final hidden
states [B, L, D] (`model.hidden_states`) and the output head (`model.output_head`) and
compute logits a chunk at a time:

- over the vocabulary, `vocab_chunk` entries at a time: one pass keeps each position's
  running max logit (the shift) and the sum of exp(logit - max), rescaled whenever the
  max rises (the online softmax), and picks the target's logit, so log p = (logit - max)
  - log(sum), `jax.nn.log_softmax`'s own formula and gradient; a second, for a divergence
  or the entropy, recomputes each chunk's log-probs from these normalisers and sums that
  chunk's terms. Each pass is a `lax.scan` whose body is under `jax.checkpoint`, so the
  backward pass recomputes each chunk's logits too: no array larger than [B, L or
  seq_chunk, vocab_chunk] exists, forward or backward. The price is compute: the head's
  product runs 1 (SFT) or 2 (distillation) times forward, and once more in the backward
  pass, instead of once.
- over positions, `seq_chunk` per row at a time (`None`: all at once). Each row's
  loss positions (mask != 0) are first gathered to the front of the row, in order,
  and a chunk where no row has a loss position left is skipped (`lax.cond`): the
  prompt and the padding get no logits at all, whatever their length in each row.
  Why a gather and not a fixed "keep the last K positions" (TRL's `logits_to_keep`):
  SFT and DPO rows put the completion after prompts of different lengths, so no static
  slice fits them, and a static maximum would be one more setting that cuts answers
  when wrong. The gather needs none; GRPO, whose completions are the last T positions
  of every row, also slices those first (`sampler.completion_log_probs`).

This is the idea of MaxText's vocabulary tiling (`num_vocab_tiling`), which tiles the
tokens and recomputes each tile's logits in the backward pass, with the vocabulary
chunked as well.

Where one chunk covers the vocabulary (the toy presets, V = 259) the math per chunk is
the reference functions' own (`tunix_nb.losses`, on that chunk's logits), and with
`seq_chunk=None` the losses and gradients are bitwise those of the unchunked path. Each
function returns per-position values in the [B, L] layout and the callers reduce them
as `tunix_nb.losses` does (sums and weights), with masked positions contributing 0.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from tunix_nb import losses

DIVERGENCES = ("kl", "rkl", "jsd", "entropy")


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How the losses chunk: `vocab_chunk` vocabulary entries and `seq_chunk` positions per
    row at a time (`seq_chunk=None`: every position in one chunk)."""

    vocab_chunk: int
    seq_chunk: int | None = None

    def __post_init__(self):
        _check_size("vocab_chunk", self.vocab_chunk)
        if self.seq_chunk is not None:
            _check_size("seq_chunk", self.seq_chunk)


def _check_size(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int (entries per chunk), got {value!r}: e.g. "
                         f"{name}=2048, or leave vocab_chunk=None for the unchunked path.")


def chunking(vocab_chunk: int | None = None, seq_chunk: int | None = None) -> Chunking | None:
    """The objectives' `vocab_chunk`/`seq_chunk` keywords as a `Chunking`; None (both None)
    is the unchunked reference path, full [B, L, V] logits."""
    if vocab_chunk is None:
        if seq_chunk is not None:
            raise ValueError(f"seq_chunk={seq_chunk!r} needs vocab_chunk: chunking the positions applies to "
                             "the chunked path; pass vocab_chunk too (e.g. vocab_chunk=2048), or drop seq_chunk.")
        return None
    return Chunking(int(vocab_chunk) if isinstance(vocab_chunk, np.integer) else vocab_chunk,
                    int(seq_chunk) if isinstance(seq_chunk, np.integer) else seq_chunk)


# ------------------------------------------------------------------ one chunk of positions


def _chunk_logits(h_XxD, head, start, size):
    """Logits [..., size] float32 of vocabulary entries [start, start + size), as the head computes them."""
    w_SxD = lax.dynamic_slice_in_dim(head.weight_VxD, start, size, axis=0)
    dtype = head.dtype or jnp.result_type(h_XxD, w_SxD)
    return jnp.dot(h_XxD.astype(dtype), w_SxD.astype(dtype).T).astype(jnp.float32)


def _vocab_chunk_at(c, vocab_size, size):
    """Chunk c's first entry, its entry ids, and which of them are new. The last chunk is
    moved back to end at V (no padded copy of the weight); the entries it repeats are masked."""
    start = jnp.minimum(c * size, vocab_size - size)
    ids_S = start + jnp.arange(size)
    return start, ids_S, ids_S >= c * size


def _scan_vocab(body, init, n_chunks):
    return lax.scan(jax.checkpoint(body, prevent_cse=False), init, jnp.arange(n_chunks))[0]


def _scaled_logits(h_s, head_s, h_t, head_t, with_t1, temperature, start, size):
    """One vocabulary chunk's {"student": z / T, "student_t1": z (for the target), "teacher": a / T}."""
    z = _chunk_logits(h_s, head_s, start, size)
    out = {"student": z / temperature}
    if with_t1:
        out["student_t1"] = z
    if h_t is not None:
        out["teacher"] = _chunk_logits(h_t, head_t, start, size) / temperature
    return out


def _log_normalisers(h_s, head_s, h_t, head_t, targets, temperature, size):
    """({name: (max, log of the sum of exp(x - max))} per position, the target's raw logit).

    One pass over the vocabulary, the online softmax of flash attention: each chunk raises
    the running max where its logits exceed it, and the running sum is rescaled to the new
    max, sum' = sum * exp(max - max') + the chunk's sum of exp(x - max'). The max is held
    without gradient: log p = (x - max) - log(sum) is the same for any shift, and its
    gradient, taken through the rescaled sums, is the softmax, as `jax.nn.log_softmax`'s.
    One pass, not a max pass and then a sum pass: the head's product runs once fewer.
    """
    V = head_s.weight_VxD.shape[0]
    n = -(-V // size)
    sg = lax.stop_gradient
    lead = h_s.shape[:-1]
    with_t1 = targets is not None
    names = ["student"] + (["student_t1"] if with_t1 else []) + (["teacher"] if h_t is not None else [])

    def body(carry, c):
        start, ids_S, valid_S = _vocab_chunk_at(c, V, size)
        x = _scaled_logits(h_s, head_s, h_t, head_t, with_t1, temperature, start, size)
        out = {}
        for k in names:
            max_, sum_ = carry[k]
            new_max = jnp.maximum(max_, sg(jnp.max(jnp.where(valid_S, x[k], -jnp.inf), axis=-1)))
            chunk_sum = jnp.sum(jnp.where(valid_S, jnp.exp(x[k] - new_max[..., None]), 0.0), axis=-1)
            out[k] = (new_max, sum_ * jnp.exp(max_ - new_max) + chunk_sum)
        if with_t1:
            hit = valid_S & (ids_S == targets[..., None])
            out["target"] = carry["target"] + jnp.sum(jnp.where(hit, x["student_t1"], 0.0), axis=-1)
        return out, None

    init = {k: (jnp.full(lead, -jnp.inf), jnp.zeros(lead)) for k in names}
    if with_t1:
        init["target"] = jnp.zeros(lead)
    stats = _scan_vocab(body, init, n)
    return {k: (stats[k][0], jnp.log(stats[k][1])) for k in names}, stats.get("target")


def _divergence(kind, logp_s, logp_t, beta, where=None):
    """Per position, summed over the vocabulary axis (`where`: the entries that count):
    the formulas of `losses.generalized_jsd_per_example` and GRPO's entropy."""
    kl = functools.partial(optax.losses.kl_divergence_with_log_targets, where=where)
    if kind == "kl":  # KL(teacher || student), losses._kl(logp_t, logp_s)
        return kl(logp_s, logp_t)
    if kind == "rkl":
        return kl(logp_t, logp_s)
    if kind == "jsd":
        logp_m = jnp.logaddexp(logp_t + np.log(beta), logp_s + np.log1p(-beta))
        return beta * kl(logp_m, logp_t) + (1 - beta) * kl(logp_m, logp_s)
    return -jnp.sum(jnp.exp(logp_s) * logp_s, axis=-1, where=where)


def _online_stats(h_s, head_s, targets, h_t, head_t, *, temperature, divergence, beta, size):
    """Per-position statistics over several vocabulary chunks (`_log_normalisers`); a
    divergence takes one more pass, with the normalisers known."""
    V = head_s.weight_VxD.shape[0]
    norm, target_logit = _log_normalisers(h_s, head_s, h_t, head_t, targets, temperature, size)
    out = {}
    if targets is not None:
        max_, log_sum = norm["student_t1"]
        out["target_logp"] = (target_logit - max_) - log_sum
    if divergence is None:
        return out

    def log_probs(x, name):
        max_, log_sum = norm[name]
        return (x - max_[..., None]) - log_sum[..., None]

    def body(total, c):
        start, _, valid_S = _vocab_chunk_at(c, V, size)
        x = _scaled_logits(h_s, head_s, h_t, head_t, False, temperature, start, size)
        logp_t = None if h_t is None else log_probs(x["teacher"], "teacher")
        return total + _divergence(divergence, log_probs(x["student"], "student"), logp_t, beta, where=valid_S), None

    out["divergence"] = _scan_vocab(body, jnp.zeros(h_s.shape[:-1]), -(-V // size))
    return out


def _one_chunk_stats(h_s, head_s, targets, h_t, head_t, *, temperature, divergence, beta):
    """The same statistics when one chunk covers the vocabulary: the reference functions'
    own math on the chunk's logits, so the toy presets train bit for bit as unchunked."""
    logits_s = head_s.project(h_s)
    out = {}
    if targets is not None:
        out["target_logp"] = losses.token_log_probs(logits_s, targets)
    if divergence == "entropy":  # as sampler.completion_log_probs computes it
        logp = jax.nn.log_softmax(logits_s.astype(jnp.float32), axis=-1)
        out["divergence"] = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    elif divergence is not None:
        logp_t = losses._log_probs(lax.stop_gradient(head_t.project(h_t)), temperature)
        logp_s = losses._log_probs(logits_s, temperature)
        if divergence == "kl":
            out["divergence"] = losses._kl(logp_t, logp_s)
        elif divergence == "rkl":
            out["divergence"] = losses._kl(logp_s, logp_t)
        else:
            out["divergence"] = _divergence("jsd", logp_s, logp_t, beta)
    return out


# ------------------------------------------------------------------ chunks of positions


def _stats(h_s, targets, h_t, *, chunks: Chunking, head_s, head_t, **kwargs):
    if head_s.weight_VxD.shape[0] <= chunks.vocab_chunk:
        return _one_chunk_stats(h_s, head_s, targets, h_t, head_t, **kwargs)
    return _online_stats(h_s, head_s, targets, h_t, head_t, size=chunks.vocab_chunk, **kwargs)


def _over_positions(stats, live_BxL, seq_chunk, rows):
    """`stats` on chunks of `seq_chunk` positions per row, loss positions gathered first and
    chunks without any skipped; the results back in the [B, L] layout (0 where skipped)."""
    B, L = live_BxL.shape
    n = -(-L // seq_chunk)
    order_BxL = jnp.argsort(~live_BxL, axis=-1, stable=True)  # each row's loss positions first, in order

    def compact(x):  # [B, L, ...] -> [n, B, seq_chunk, ...]
        idx = order_BxL.reshape(B, L, *([1] * (x.ndim - 2)))
        x = jnp.take_along_axis(x, idx, axis=1)
        x = jnp.pad(x, [(0, 0), (0, n * seq_chunk - L)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, seq_chunk, *x.shape[2:]), 1, 0)

    xs = {k: compact(v) for k, v in {**rows, "live": live_BxL}.items() if v is not None}

    def body(_, x):
        def run(x):
            return stats(x["h_s"], x.get("targets"), x.get("h_t"))

        def skip(x):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run, x))

        return None, lax.cond(jnp.any(x["live"]), run, skip, x)

    _, out = lax.scan(jax.checkpoint(body, prevent_cse=False), None, xs)
    inverse_BxL = jnp.argsort(order_BxL, axis=-1)
    return {k: jnp.take_along_axis(jnp.moveaxis(v, 0, 1).reshape(B, -1)[:, :L], inverse_BxL, axis=1)
            for k, v in out.items()}


def _check_shapes(hidden_BxLxD, head, targets_BxL, mask_BxL, teacher_hidden, teacher_head):
    if hidden_BxLxD.ndim != 3:
        raise ValueError(f"hidden states have shape {hidden_BxLxD.shape} but must be [B, L, D] "
                         "(model.hidden_states gives them)")
    for name, x in (("targets", targets_BxL), ("mask", mask_BxL)):
        if x is not None and x.shape != hidden_BxLxD.shape[:2]:
            raise ValueError(f"{name} has shape {x.shape} but the hidden states have shape {hidden_BxLxD.shape}: "
                             f"{name} needs one entry per position, shape {hidden_BxLxD.shape[:2]}")
    if teacher_hidden is not None:
        if teacher_hidden.shape[:2] != hidden_BxLxD.shape[:2]:
            raise ValueError(f"teacher hidden states have shape {teacher_hidden.shape} but the student's "
                             f"{hidden_BxLxD.shape}: both models must score the same positions")
        Vs, Vt = head.weight_VxD.shape[0], teacher_head.weight_VxD.shape[0]
        if Vs != Vt:
            raise ValueError(f"the student's vocabulary has {Vs} entries but the teacher's {Vt}: the "
                             "vocabularies must match (use the same tokenizer for both models)")


def per_position(hidden_BxLxD, head, targets_BxL, mask_BxL, *, chunks: Chunking, temperature=1.0,
                 divergence: str | None = None, beta: float = 0.5, teacher_hidden_BxLxD=None,
                 teacher_head=None) -> dict:
    """Per-position statistics [B, L] from hidden states and the head, chunked by `chunks`.

    "target_logp": log p(target) at temperature 1 (when `targets_BxL` is given);
    "divergence" (when `divergence` is given), at `temperature`, per position:
    "kl" KL(teacher || student), "rkl" KL(student || teacher), "jsd" the generalized JSD
    with `beta` in (0, 1) (`losses.generalized_jsd_per_example`), "entropy" the student's
    entropy (T = 1). Positions where `mask_BxL` is 0 may get no logits (their values
    are then 0): multiply by the mask, as every loss does. No gradient reaches the teacher.
    """
    _check_shapes(hidden_BxLxD, head, targets_BxL, mask_BxL, teacher_hidden_BxLxD, teacher_head)
    if divergence is not None and divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES} or None, got {divergence!r}")
    if divergence in ("kl", "rkl", "jsd") and teacher_hidden_BxLxD is None:
        raise ValueError(f"divergence={divergence!r} compares with a teacher: pass teacher_hidden_BxLxD and "
                         "teacher_head")
    if divergence == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"divergence='jsd' needs beta strictly between 0 and 1, got {beta!r}: use 'kl' for 0, "
                         "'rkl' for 1")
    losses._check_positive("temperature", temperature)
    if teacher_hidden_BxLxD is not None:
        teacher_hidden_BxLxD = lax.stop_gradient(teacher_hidden_BxLxD)
        teacher_head = teacher_head._replace(weight_VxD=lax.stop_gradient(teacher_head.weight_VxD))
    stats = functools.partial(_stats, chunks=chunks, head_s=head, head_t=teacher_head, temperature=temperature,
                              divergence=divergence, beta=beta)
    L = hidden_BxLxD.shape[1]
    if chunks.seq_chunk is None or L <= chunks.seq_chunk:
        return stats(hidden_BxLxD, targets_BxL, teacher_hidden_BxLxD)
    rows = {"h_s": hidden_BxLxD, "targets": targets_BxL, "h_t": teacher_hidden_BxLxD}
    return _over_positions(stats, jnp.asarray(mask_BxL) != 0, chunks.seq_chunk, rows)


# ------------------------------------------------------------------ the losses


def token_log_probs(hidden_BxLxD, head, targets_BxL, mask_BxL, *, chunks: Chunking):
    """log p(targets) [B, L], as `losses.token_log_probs`; 0 where the mask is 0 and a chunk was skipped."""
    return per_position(hidden_BxLxD, head, targets_BxL, mask_BxL, chunks=chunks)["target_logp"]


def sequence_log_probs(hidden_BxLxD, head, targets_BxL, mask_BxL, *, chunks: Chunking):
    """Sum of log p(target) over masked tokens [B], as `losses.sequence_log_probs`."""
    logp_BxL = token_log_probs(hidden_BxLxD, head, targets_BxL, mask_BxL, chunks=chunks)
    return jnp.sum(logp_BxL * losses._as_float(mask_BxL), axis=-1)


def sft_loss(hidden_BxLxD, head, targets_BxL, mask_BxL, *, chunks: Chunking):
    """(nll_sum, token_count), as `losses.sft_loss`."""
    mask_BxL = losses._as_float(mask_BxL)
    logp_BxL = token_log_probs(hidden_BxLxD, head, targets_BxL, mask_BxL, chunks=chunks)
    return -jnp.sum(logp_BxL * mask_BxL), jnp.sum(mask_BxL).astype(jnp.float32)


def log_probs_and_entropy(hidden_BxLxD, head, targets_BxL, mask_BxL, *, chunks: Chunking):
    """(log p(targets) [B, L], the policy's entropy [B, L]), as GRPO reads them."""
    out = per_position(hidden_BxLxD, head, targets_BxL, mask_BxL, chunks=chunks, divergence="entropy")
    return out["target_logp"], out["divergence"]


def divergence_for(beta: float) -> str:
    """`per_position`'s divergence for the generalized JSD's `beta`: 0 forward KL, 1 reverse KL."""
    return "kl" if beta == 0.0 else "rkl" if beta == 1.0 else "jsd"


def distillation_loss(student_hidden_BxLxD, student_head, teacher_hidden_BxLxD, teacher_head, targets_BxL,
                      mask_BxL, *, chunks: Chunking, temperature=2.0, alpha=0.5, beta=0.0, alpha_B=None):
    """(loss, metrics) as `losses.distillation_loss`, from both models' hidden states and heads.

    Per example: soft = T^2 x the masked mean of the divergence (`beta` 0: KL(teacher ||
    student), 1: KL(student || teacher), between: the generalized JSD), hard = the masked
    mean NLL at T = 1; loss = mean over examples of alpha * soft + (1 - alpha) * hard
    (`alpha_B` [B] replaces alpha row by row).
    """
    if not isinstance(beta, numbers.Real) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a Python float in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    out = per_position(student_hidden_BxLxD, student_head, targets_BxL, mask_BxL, chunks=chunks,
                       temperature=temperature, divergence=divergence_for(beta), beta=beta,
                       teacher_hidden_BxLxD=teacher_hidden_BxLxD,
                       teacher_head=teacher_head)

    def soft_and_hard(divergence_L, logp_L, mask_L):  # losses._soft_and_hard_per_example's reductions
        return temperature**2 * losses._masked_mean(divergence_L, mask_L), losses._masked_mean(-logp_L, mask_L)

    soft_B, hard_B = jax.vmap(soft_and_hard)(out["divergence"], out["target_logp"], mask_BxL)
    weight = alpha if alpha_B is None else alpha_B
    loss = jnp.mean(weight * soft_B + (1 - weight) * hard_B)
    return loss, {"distill/soft_loss": jnp.mean(soft_B), "distill/hard_loss": jnp.mean(hard_B)}
