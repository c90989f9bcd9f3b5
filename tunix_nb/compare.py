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

**The precision policy, on every backend.** A check compares like with like: both sides at
the same compute dtype and the same matmul precision. An agreement check (several devices
== one, the KV cache == recomputation, the kit == transformers, merged == adapters, a
hand-built loss == the package's) runs float32 compute under `agreement_precision()`:
TPUs, and GPUs with TF32 (Colab's L4 and A100), otherwise multiply float32 matrices in
bfloat16 or TF32 passes, and "auto" computes in bfloat16 there. Its bound is
`float32_bound`, whose `transcendentals` term covers the backend's own exp, log, tanh and
sigmoid (`transcendental_error`: about 4 eps on a CPU, about 3,100 eps measured on a TPU
v5e, `results/precision/tpu_v5e.json`). A bfloat16 bound is some 30,000 times a float32 one
and can no longer tell right from wrong, so it is kept for checks of bfloat16 itself.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from tunix_nb import devices, precision

# float32's machine epsilon, 2**-23: the spacing of float32 numbers just above 1.
FLOAT32_EPS = float(np.finfo(np.float32).eps)

# The compute dtype every agreement check runs at (objectives' `compute_dtype`).
AGREEMENT_DTYPE = "float32"

# The largest relative error of a backend's float32 functions, in units of FLOAT32_EPS, rounded
# up to a power of 2 over what results/precision/probe.py measured against float64 (2**20
# samples a function): a CPU's (XLA's own polynomials) reach 3 eps for all of them; a TPU v5e's
# exp and sigmoid 53, tanh and expm1 999, log and log1p 3,103 (near 1), sin/cos 2
# (results/precision/tpu_v5e.json). GPUs run CUDA's libdevice (1 to 2 ulps) or the CPU's polynomials.
_ACCURATE = {"exp": 4, "sigmoid": 4, "tanh": 4, "log": 4, "sin_cos": 4}
TRANSCENDENTAL_EPS = {"cpu": _ACCURATE, "gpu": _ACCURATE, "cuda": _ACCURATE, "rocm": _ACCURATE,
                      "tpu": {"exp": 64, "sigmoid": 64, "tanh": 1024, "log": 4096, "sin_cos": 2}}


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


@contextlib.contextmanager
def agreement_precision():
    """Inside: float32 compute ("auto" means float32) and float32 matrix products at float32's
    precision, on every backend; the settings before are restored on leaving.

    A TPU multiplies float32 matrices in one bfloat16 pass by default (8 bits of mantissa, a
    relative error near 4e-3) and a TF32 GPU in 10 bits; "highest" asks for float32's 24 bits
    (on a TPU, six bfloat16 passes). Programs traced inside get the setting (it is part of
    jit's cache key); a CPU computes float32 products exactly either way.
    """
    previous = precision.set_auto_compute_dtype(AGREEMENT_DTYPE)
    try:
        with jax.default_matmul_precision("highest"):
            yield
    finally:
        precision.set_auto_compute_dtype(previous)


def use_agreement_precision() -> str:
    """`agreement_precision` for the rest of the session, for a lesson whose cells are checks
    (its models are small, so float32 costs nothing that matters). Returns a line saying
    what changed on this backend, for the lesson to print."""
    jax.config.update("jax_default_matmul_precision", "highest")
    precision.set_auto_compute_dtype(AGREEMENT_DTYPE)
    backend = jax.default_backend()
    default = devices.defaults_for(backend).compute_dtype
    return (f"precision: float32 compute, float32 matmuls at 'highest' (on {backend}, 'auto' would "
            f"compute in {default}{'' if backend == 'cpu' else ' and matmuls take bfloat16 passes'})")


def transcendental_error(function: str = "log", backend: str | None = None) -> float:
    """The relative error bound of `backend`'s float32 `function` ("exp", "sigmoid", "tanh",
    "log" or "sin_cos"; default backend: JAX's): what one evaluation adds to a float32
    computation's error. An unknown backend gets the largest bound measured (a TPU's)."""
    table = TRANSCENDENTAL_EPS.get(backend or jax.default_backend(), TRANSCENDENTAL_EPS["tpu"])
    if function not in table:
        raise ValueError(f"Unknown function {function!r}; choose one of {sorted(table)}.")
    return table[function] * FLOAT32_EPS


def greedy_slack(logits_BxTxV, tokens_BxT) -> float:
    """How far a chosen token's logit falls below its position's largest, the most over every
    position: 0 when each token is an argmax of these logits.

    Two float32 programs (a KV-cache decoder and a full forward pass) agree on logits only
    to rounding, so where two logits tie to within it, either token is a right greedy
    choice and the sequences may part. What holds at any precision is that each decoder's
    tokens are argmaxes of the other's logits up to that rounding: a slack within the
    forward pass's float32 bound."""
    logits = np.asarray(logits_BxTxV, np.float64)
    chosen = np.take_along_axis(logits, np.asarray(tokens_BxT)[..., None], axis=-1)[..., 0]
    return float((logits.max(axis=-1) - chosen).max(initial=0.0))


def float32_bound(n_terms: int, amplification: float = 1.0, transcendentals: dict | None = None,
                  backend: str | None = None) -> float:
    """The relative rounding error a float32 check can meet:
    (n_terms x eps + each function's count x its error on the backend) x amplification.

    Two programs that add the same n_terms numbers in another order (another device
    count, micro-batches, another processor's vector width) differ by at most about
    n_terms x eps/2 of the terms' magnitude (Higham, Accuracy and Stability of Numerical
    Algorithms, 2002, section 4.2); eps instead of eps/2 leaves a factor 2 of margin.
    `amplification` is what the computation after the sum adds, for example Adam
    dividing each gradient by its own running RMS where gradients are near zero.
    `transcendentals` ({"exp": 2, "log": 1}): how many evaluations of each function lie
    along the checked value's path, each adding `transcendental_error` (on a CPU a few eps,
    so the bound is the sums'; on a TPU up to 2**-11 for a log).
    """
    transcendentals = transcendentals or {}
    if n_terms < 1 or amplification < 1 or any(count < 0 for count in transcendentals.values()):
        raise ValueError(f"n_terms ({n_terms}) and amplification ({amplification}) must be at least 1, "
                         f"the transcendentals' counts ({transcendentals}) at least 0.")
    functions = sum(count * transcendental_error(f, backend) for f, count in transcendentals.items())
    return (n_terms * FLOAT32_EPS + functions) * amplification


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


def forward_pass_transcendentals(cfg) -> dict:
    """The functions evaluated along one logit's path: per block the attention softmax's exp
    and the SwiGLU's sigmoid, and RoPE's sin and cos (the norms' rsqrt is within 2 ulps
    everywhere). The `transcendentals` of `float32_bound` for a forward pass."""
    return {"exp": cfg.n_layers, "sigmoid": cfg.n_layers, "sin_cos": 1}


def log_softmax_transcendentals() -> dict:
    """A log-softmax (log-probs, cross-entropy, KL) adds one exp per entry and one log."""
    return {"exp": 1, "log": 1}
