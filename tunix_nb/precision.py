"""Mixed precision: parameters stay float32, the forward/backward pass may run in bfloat16.

Every method's objective takes `compute_dtype` ("auto", "float32", "bfloat16" or a
dtype) and calls `resolve_compute_dtype` once, then `cast_floats` on each set of
parameters it applies: the policy, a frozen reference or a teacher alike, so that
they are all computed in the same precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunix_nb import devices


# What "auto" stands for when set (`set_auto_compute_dtype`); None: the backend's default.
_auto_override = None


def set_auto_compute_dtype(compute_dtype=None):
    """Make "auto" mean `compute_dtype` ("float32", "bfloat16") from now on; None restores the
    backend's default. Returns the previous setting. `compare.use_agreement_precision` sets
    float32, so that a lesson of checks computes alike on a CPU, a TPU and a GPU."""
    global _auto_override
    if compute_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or None, got {compute_dtype!r}.")
    previous, _auto_override = _auto_override, compute_dtype
    return previous


def auto_compute_dtype() -> tuple[str, str]:
    """(what "auto" stands for, why): `set_auto_compute_dtype`'s choice where one is set (a
    lesson of checks, in-process), else the backend's default (`devices.defaults_for`)."""
    if _auto_override is not None:
        return _auto_override, "precision.set_auto_compute_dtype chose it for this process"
    chosen = devices.defaults_for()
    return chosen.compute_dtype, chosen.reason


def resolve_compute_dtype(compute_dtype="auto"):
    """"auto": the backend's default (`devices.defaults_for`: bfloat16 on TPU and bf16-capable
    GPUs, float32 = None on CPU and older GPUs), unless `set_auto_compute_dtype` chose one."""
    if compute_dtype == "auto":
        compute_dtype = _auto_override or devices.defaults_for().compute_dtype
    return None if compute_dtype in (None, "float32", jnp.float32) else compute_dtype


def cast_floats(tree, dtype):
    """Mixed precision: a compute copy of the float leaves in `dtype` (None: unchanged).

    Gradients flow back through the cast, so they arrive in the parameters' float32.
    """
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
