"""tunix_nb.batching: chunked computation equals the whole, with one shape per chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb.batching import map_in_chunks


def rows(n=10):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    return {"x": x, "y": np.arange(n, dtype=np.int32)}


def score(batch):
    """Row-wise outputs of two shapes, as a tuple (like chosen and rejected log-probs)."""
    return batch["x"].sum(axis=1) * batch["y"], 2 * batch["x"]


def recording(fn):
    shapes = []

    def wrapped(batch):
        shapes.append(len(batch) if isinstance(batch, list) else jax.tree.leaves(batch)[0].shape[0])
        return fn(batch)

    return wrapped, shapes


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 10])
def test_chunked_outputs_equal_fn_on_the_whole_input_with_one_chunk_shape(chunk_size):
    fn, shapes = recording(score)
    got = map_in_chunks(fn, rows(10), chunk_size)
    want = score(rows(10))
    assert isinstance(got, tuple) and all(isinstance(g, np.ndarray) for g in got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert set(shapes) == {chunk_size} and len(shapes) == -(-10 // chunk_size)


def test_a_jitted_fn_compiles_once():
    traces = []

    @jax.jit
    def double(batch):
        traces.append(1)
        return {"out": batch["x"] * 2}

    got = map_in_chunks(double, {"x": jnp.arange(7.0)}, 3)  # chunks 3, 3 and 1 padded to 3
    np.testing.assert_array_equal(got["out"], np.arange(7.0) * 2)
    assert len(traces) == 1


def test_a_list_of_items_and_a_single_array():
    fn, shapes = recording(lambda words: np.array([len(w) for w in words]))
    words = ["a", "bb", "ccc", "dddd", "eeeee"]
    np.testing.assert_array_equal(map_in_chunks(fn, words, 2), [1, 2, 3, 4, 5])
    assert shapes == [2, 2, 2]
    np.testing.assert_array_equal(map_in_chunks(lambda x: x**2, np.arange(5), 4), np.arange(5) ** 2)


def test_a_chunk_larger_than_the_input_is_one_call_on_the_input():
    fn, shapes = recording(score)
    got = map_in_chunks(fn, rows(6), 256)
    np.testing.assert_array_equal(got[1], score(rows(6))[1])
    assert shapes == [6]


@pytest.mark.parametrize("inputs, chunk_size, message", [
    ({"x": np.zeros((0, 3))}, 4, "got no rows"),
    ([], 4, "got no rows"),
    (rows(4), 0, "chunk_size must be a positive int, got 0"),
    ({"x": np.zeros(3), "y": np.zeros(4)}, 2, "different numbers of rows"),
    ({"x": np.float32(1.0)}, 2, "leading axis of rows"),
])
def test_bad_input_raises_a_clear_error(inputs, chunk_size, message):
    with pytest.raises(ValueError, match=message):
        map_in_chunks(score, inputs, chunk_size)
