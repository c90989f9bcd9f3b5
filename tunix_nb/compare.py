"""Comparing two pytrees of arrays: how the lessons and tests check one run against another.

Parallel runs are checked against one device with `max_abs_diff` or
`relative_distance` (rounding differs, so the figure is a small number, not 0); resumed
runs against uninterrupted ones with `bitwise_equal`. All work on host NumPy copies, so
they compile no small programs and accept arrays from any device, sharding or checkpoint.

A rounding figure differs from processor to processor (XLA's CPU code, vectorisation,
summation order), so a check compares it with a tolerance from an error analysis,
`float32_bound`, never with one machine's figure; and a tolerance is only worth having
if the known-wrong version of the computation fails it by far (the checks assert that
too, at least 100x).
"""

from __future__ import annotations

import jax
import numpy as np

# float32's machine epsilon, 2**-23: the spacing of float32 numbers just above 1.
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def _leaf_pairs(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(leaves_a) != len(leaves_b) or not leaves_a:
        raise ValueError(f"The trees hold {len(leaves_a)} and {len(leaves_b)} arrays; compare two non-empty "
                         "trees of the same structure (e.g. the params of two runs of one model).")
    return [(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)]


def max_abs_diff(a, b) -> float:
    """The largest |a - b| over every array of two trees of the same structure."""
    pairs = _leaf_pairs(a, b)
    for x, y in pairs:
        if x.shape != y.shape:
            raise ValueError(f"Arrays of shapes {x.shape} and {y.shape} cannot be compared element by element.")
    return max(float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0.0)) for x, y in pairs)


def bitwise_equal(a, b) -> bool:
    """True when both trees hold the same arrays, dtype and bits alike."""
    try:
        pairs = _leaf_pairs(a, b)
    except ValueError:
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) for x, y in pairs)


def relative_distance(a, b, start) -> float:
    """||a - b|| / ||b - start|| over whole trees: how far apart two runs from `start`
    ended, as a share of how far `b` moved. Unlike `max_abs_diff`, one entry whose
    gradient sits at the rounding level (and which Adam turns into a full-size step)
    cannot dominate it, while a wrong gradient, which moves every entry, does."""
    apart = _tree_norm(_leaf_pairs(a, b))
    moved = _tree_norm(_leaf_pairs(b, start))
    if moved == 0.0:
        raise ValueError("`b` equals `start`: the run did not move, so there is no distance to compare against.")
    return apart / moved


def _tree_norm(pairs) -> float:
    """The float64 L2 norm of the differences of every pair of arrays."""
    for x, y in pairs:
        if x.shape != y.shape:
            raise ValueError(f"Arrays of shapes {x.shape} and {y.shape} cannot be compared element by element.")
    return float(np.sqrt(sum(np.sum((x.astype(np.float64) - y.astype(np.float64)) ** 2) for x, y in pairs)))


def float32_bound(n_terms: int, amplification: float = 1.0) -> float:
    """The relative rounding error a float32 check can meet: n_terms x eps x amplification.

    Two programs that add the same n_terms numbers in another order (another device
    count, micro-batches, another processor's vector width) differ by at most about
    n_terms x eps/2 of the terms' magnitude (Higham, Accuracy and Stability of Numerical
    Algorithms, 2002, section 4.2); eps instead of eps/2 leaves a factor 2 of margin.
    `amplification` is what the computation after the sum adds, for example Adam
    dividing each gradient by its own running RMS where gradients are near zero.
    """
    if n_terms < 1 or amplification < 1:
        raise ValueError(f"n_terms ({n_terms}) and amplification ({amplification}) must be at least 1.")
    return n_terms * FLOAT32_EPS * amplification


def forward_pass_terms(cfg, seq_len: int) -> int:
    """How many terms the sums along one logit's path add up, the whole depth through:
    per block two norms and the projections' inputs (3 x d_model), the attention scores
    (head_dim), the softmax and the weighted values (2 x seq_len), the output
    projection's input (heads x head_dim) and the MLP's down projection (d_ff); then the
    final norm and the head (2 x d_model). `float32_bound` of it, times the logits'
    magnitude, bounds how far two float32 forward passes of one model may differ.
    `cfg` is a `tunix_nb.model.ModelConfig`."""
    per_block = 3 * cfg.d_model + cfg.head_size + 2 * seq_len + cfg.n_heads * cfg.head_size + cfg.d_ff
    return cfg.n_layers * per_block + 2 * cfg.d_model
