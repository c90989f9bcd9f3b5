"""Attention as one fused kernel on a TPU: Pallas's splash attention.

`model.attend` computes attention as two matrix products around a softmax over a
[B, H, L, L] array: the array goes to memory and back, and the half of it above the causal
diagonal is computed and then masked. On a TPU v5e at Qwen3-0.6B's shapes (8 x 1024 tokens,
16 query heads, 8 key/value heads of 128) that ran at 15 TFLOP/s of useful work, a fifth of
the step's time (results/tpu_v5e_training/README.md). Splash attention (JAX's
`jax.experimental.pallas.ops.tpu.splash_attention`) keeps each block of scores on the chip,
runs the softmax online (the flash-attention recurrence), and skips the blocks the causal
mask removes whole: 26 TFLOP/s there with blocks of 512, 32 with its fused backward kernel
and one multi-query kernel per key/value head, which this module runs (`attention_bench.py`).

What it computes is `model.attend`'s causal attention with a segment mask: a query sees the
keys not after it that carry its segment id. Real tokens carry ids > 0 (1 for an unpacked
row), padding 0, so real queries never see padding and their outputs are `attend`'s. A
padding query sees the padding before it (the kernel needs one key per row), where `attend`
sees nothing; the losses never read those positions.

Used where it applies: one device (a kernel is one device's program; XLA does not split it
over a mesh), the training pass (decoding against a cache stays `attend`'s), a length that a
block size divides, and head sizes of a multiple of 128 (the chip's lane width). On a CPU it
runs in Pallas's interpreter, for tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

CHOICES = ("auto", "xla", "splash")
# the name the kernel gives its output and softmax statistics (`jax.ad_checkpoint.checkpoint_name`),
# what remat's "save_attention" policy keeps (`model.checkpoint_policy`)
RESIDUALS = "splash_attention_residuals"
BLOCK_SIZES = (512, 256, 128)  # largest first: 512 ran 3x faster than 128 on the v5e (attention_bench.py)
LANES = 128


def block_size(length: int) -> int | None:
    """The largest block size that divides `length`, None when none does."""
    return next((size for size in BLOCK_SIZES if length % size == 0), None)


def applies(q_BxLxHxD, k_BxSxKxD) -> bool:
    """Whether the kernel takes these shapes: self-attention (S = L) over a length a block size
    divides, with a head size of whole lanes."""
    length, head_size = q_BxLxHxD.shape[1], q_BxLxHxD.shape[-1]
    return k_BxSxKxD.shape[1] == length and block_size(length) is not None and head_size % LANES == 0


def choose(requested: str, *, compute_dtype: str | None, one_device: bool, backend: str | None = None
           ) -> tuple[str, str]:
    """(the attention a run uses, why) for `requested` ("auto", "xla" or "splash"). "auto" picks
    splash on a TPU computing in bfloat16 on one device, where it was measured faster, and XLA's
    einsums elsewhere. `backend` None: JAX's, asked only when the rest says splash. Raises
    ValueError for splash where it cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"attention must be one of {CHOICES}, got {requested!r}")
    if requested == "splash" and not one_device:
        raise ValueError("splash attention runs on one device (a Pallas kernel is one device's program): "
                         "use --parallel jit, or --attention xla")
    if requested != "auto":
        return requested, "asked for"
    if not one_device:
        return "xla", "several devices: XLA splits its einsums over the mesh, not a Pallas kernel"
    if compute_dtype != "bfloat16":
        return "xla", "float32 compute, which the einsums keep exact to float32"
    backend = backend or jax.default_backend()
    if backend != "tpu":
        return "xla", f"splash attention is a TPU kernel; this backend is {backend}"
    return "splash", "a TPU computing in bfloat16 on one device"


_lowering_platform = contextvars.ContextVar("lowering_platform", default=None)


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace the kernel for `platform` ("tpu": compiled; else Pallas's interpreter) rather than for
    this process's backend: a memory plan lowers a TPU's step on a CPU (`tunix_nb.memory_plan`).
    JAX caches a function's trace: one traced before, outside this block, is not traced again."""
    token = _lowering_platform.set(platform)
    try:
        yield
    finally:
        _lowering_platform.reset(token)


@functools.lru_cache(maxsize=None)
def _kernel(length: int, group: int, interpret: bool):
    """Splash's multi-query kernel over one key/value head and the `group` query heads that share it."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    size = block_size(length)
    # the fused backward kernel (dq, dk and dv in one pass over the blocks): 0.85 of the two-kernel
    # backward's forward-and-backward time on the v5e (results/tpu_v5e_training/README.md, "The
    # fused backward and the online softmax")
    blocks = splash.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
                               block_kv_dkv=size, block_kv_dkv_compute=size, use_fused_bwd_kernel=True)
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * group)
    with jax.ensure_compile_time_eval():  # its block tables as constants: the cache outlives the trace
        return splash.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret,
                                                    residual_checkpoint_name=RESIDUALS)


def attend(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL):
    """Causal attention within segments (`model.attend`'s for real queries) -> [B, L, H, D],
    in the inputs' dtype. Grouped-query heads: each key/value head serves H / K query heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, L, H, D = q_BxLxHxD.shape
    if not applies(q_BxLxHxD, k_BxLxKxD):
        raise ValueError(f"splash attention needs a length divisible by one of {BLOCK_SIZES} and a head size "
                         f"divisible by {LANES}; got queries {q_BxLxHxD.shape} and keys {k_BxLxKxD.shape}")
    K = k_BxLxKxD.shape[2]
    group = H // K
    # the kernel does not scale the scores; per example and key/value head: its group's queries
    # [G, L, D] against one [L, D] of keys and values, so no head is repeated in memory
    q_BxKxGxLxD = (q_BxLxHxD / jnp.sqrt(D).astype(q_BxLxHxD.dtype)).reshape(B, L, K, group, D).transpose(0, 2, 3, 1, 4)
    k_BxKxLxD, v_BxKxLxD = (jnp.swapaxes(x, 1, 2) for x in (k_BxLxKxD, v_BxLxKxD))
    kernel = _kernel(L, group, (_lowering_platform.get() or jax.default_backend()) != "tpu")
    ids = jax.vmap(lambda s: splash.SegmentIds(q=s, kv=s))(segment_ids_BxL.astype(jnp.int32))
    per_kv_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))
    out_BxKxGxLxD = jax.vmap(per_kv_head)(q_BxKxGxLxD, k_BxKxLxD, v_BxKxLxD, ids)
    return out_BxKxGxLxD.transpose(0, 3, 1, 2, 4).reshape(B, L, H, D)
