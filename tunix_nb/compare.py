"""Comparing two pytrees of arrays: how the lessons and tests check one run against another.

Parallel runs are checked against one device with `max_abs_diff` (rounding differs,
so the figure is a small number, not 0); resumed runs against uninterrupted ones with
`bitwise_equal`. Both work on host NumPy copies, so they compile no small programs and
accept arrays from any device, sharding or checkpoint.
"""

from __future__ import annotations

import jax
import numpy as np


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
