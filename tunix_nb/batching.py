"""Run a function over many rows in chunks of one shape, as if it saw them all at once.

Scoring a data set (a frozen reference's log-probs, a teacher's logits, greedy answers)
does not fit one batch, and a jitted function compiles once per input shape. So the rows
go through in chunks of one size, the last chunk padded with rows from the start, and
the padding's outputs are dropped: one compiled program serves every chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


def map_in_chunks(fn: Callable[[Any], Any], inputs, chunk_size: int):
    """`fn(inputs)`, computed `chunk_size` rows at a time, as host NumPy arrays.

    `inputs`: a dict (or other pytree) of arrays sharing their leading axis N, one array,
    or a list/tuple of N items (e.g. prompt strings). `fn` takes a chunk of the same kind
    and returns an array, or a pytree of arrays, with the chunk's rows on the leading
    axis. Every chunk has min(chunk_size, N) rows: the last one is padded with rows from
    the start, so one compiled shape serves them all, and the padding's outputs are
    dropped before the chunks' outputs are concatenated.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    n = _num_rows(inputs)
    size = min(int(chunk_size), n)
    outputs = []
    for start in range(0, n, size):
        rows = np.arange(start, start + size) % n  # the last chunk wraps around: the same shape
        real = min(size, n - start)
        outputs.append(jax.tree.map(lambda x: np.asarray(x)[:real], fn(_take(inputs, rows))))
    return jax.tree.map(lambda *chunks: np.concatenate(chunks), *outputs)


def _is_items(inputs) -> bool:
    return isinstance(inputs, (list, tuple))


def _num_rows(inputs) -> int:
    if _is_items(inputs):
        n = len(inputs)
    else:
        lengths = {k: np.shape(x)[0] if np.ndim(x) else None
                   for k, x in jax.tree_util.tree_leaves_with_path(inputs)}
        if not lengths or None in lengths.values():
            raise ValueError("map_in_chunks needs arrays with a leading axis of rows (or a list of items); "
                             f"got {type(inputs).__name__} with leaves of shapes "
                             f"{[np.shape(x) for x in jax.tree.leaves(inputs)]}.")
        if len(set(lengths.values())) > 1:
            sizes = {jax.tree_util.keystr(k): v for k, v in lengths.items()}
            raise ValueError(f"the inputs have different numbers of rows {sizes}; "
                             "give every array the same leading axis.")
        n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError("map_in_chunks got no rows: pass at least one row (there is nothing to compute on "
                         "an empty input, and no shape to compile for).")
    return n


def _take(inputs, rows: np.ndarray):
    if _is_items(inputs):
        return [inputs[i] for i in rows]
    return jax.tree.map(lambda x: x[rows], inputs)
