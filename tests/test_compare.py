"""tunix_nb.compare: the checks every lesson and test runs on two trees of arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare


def test_max_abs_diff_is_the_largest_difference_anywhere():
    a = {"w": np.zeros((2, 3), np.float32), "b": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.zeros((2, 3), np.float32), "b": np.array([1.0, 2.5], np.float32)}
    b["w"][1, 2] = -0.75
    assert compare.max_abs_diff(a, b) == 0.75
    assert compare.max_abs_diff(a, a) == 0.0


def test_max_abs_diff_accepts_jax_arrays_and_bfloat16():
    a = {"w": jnp.ones(4, jnp.bfloat16)}
    assert compare.max_abs_diff(a, {"w": jnp.full(4, 1.5, jnp.bfloat16)}) == 0.5


def test_bitwise_equal_needs_the_same_dtype_and_bits():
    x = np.array([0.1, 0.2], np.float32)
    assert compare.bitwise_equal({"x": x}, {"x": x.copy()})
    assert not compare.bitwise_equal({"x": x}, {"x": x.astype(np.float64)})  # equal values, other dtype
    assert not compare.bitwise_equal({"x": x}, {"x": np.nextafter(x, 1.0)})  # one ulp apart
    assert not compare.bitwise_equal({"x": x}, {"x": x, "y": x})


def test_mismatched_trees_get_a_clear_error():
    with pytest.raises(ValueError, match="same structure"):
        compare.max_abs_diff({"a": np.zeros(2)}, {"a": np.zeros(2), "b": np.zeros(2)})
    with pytest.raises(ValueError, match="shapes"):
        compare.max_abs_diff({"a": np.zeros(2)}, {"a": np.zeros(3)})
