"""What a collective costs: the bytes each device sends on a ring, before anything is measured.

A ring all-reduce over n devices is a reduce-scatter followed by an all-gather. In the
reduce-scatter each device passes n - 1 chunks of size 1/n of the array to its
neighbour, summing as they go, and ends holding the sum of one chunk; the all-gather
passes the n - 1 summed chunks round again so every device holds all of them. Each
device therefore sends (n - 1)/n of the array per phase, 2(n - 1)/n for the all-reduce:
almost twice the array, whatever n is (the JAX scaling book's chapter on collectives,
and Patarasuk & Yuan 2009 for the bandwidth-optimality of the ring).

Lesson 03 predicts its all-reduce share from these. Lesson 06 adds the strategies' totals
per step (DP, FSDP), the time they take against a step's compute on a TPU v5e, and reads
the arrays a compiled program's collectives move, to check the prediction.
"""

from __future__ import annotations

import math
import re


def _check(n_bytes: float, n_devices: int) -> None:
    if n_devices < 1:
        raise ValueError(f"n_devices is the size of the ring, at least 1; got {n_devices}.")
    if n_bytes < 0:
        raise ValueError(f"n_bytes is the array's size in bytes, at least 0; got {n_bytes}.")


def reduce_scatter_bytes(n_bytes: float, n_devices: int) -> float:
    """Bytes each device sends to reduce-scatter an array of `n_bytes` on a ring of `n_devices`."""
    _check(n_bytes, n_devices)
    return (n_devices - 1) / n_devices * n_bytes


def all_gather_bytes(n_bytes: float, n_devices: int) -> float:
    """Bytes each device sends to all-gather an array of `n_bytes` (whole size) on a ring."""
    _check(n_bytes, n_devices)
    return (n_devices - 1) / n_devices * n_bytes


def all_reduce_bytes(n_bytes: float, n_devices: int) -> float:
    """Bytes each device sends to all-reduce `n_bytes` on a ring: reduce-scatter + all-gather,
    2(n - 1)/n * n_bytes."""
    return reduce_scatter_bytes(n_bytes, n_devices) + all_gather_bytes(n_bytes, n_devices)


# ------------------------------------------------------------------ per strategy, per step


def dp_step_bytes(param_bytes: float, n_devices: int) -> dict[str, float]:
    """Bytes each device sends in one data-parallel step, by collective.

    DP all-reduces the gradients, which have the parameters' size (`param_bytes`, e.g.
    4 * P for P float32 parameters): 2(n - 1)/n * param_bytes on a ring. Nothing else
    moves: the parameters and the optimizer state are replicated and updated alike.
    """
    return {"all-reduce": all_reduce_bytes(param_bytes, n_devices)}


def fsdp_step_bytes(param_bytes: float, n_devices: int, *, regather_in_backward: bool = True) -> dict[str, float]:
    """Bytes each device sends in one FSDP (ZeRO-3) step, by collective.

    The parameters are all-gathered before the forward pass and, unless the gathered
    weights are kept until the backward pass (`regather_in_backward=False`, PyTorch's
    `reshard_after_forward=False`), again before the backward pass; the gradients are
    reduce-scattered, so each device keeps the sum of its own slice. Kept weights make
    FSDP send what DP sends (an all-reduce *is* a reduce-scatter plus an all-gather);
    gathering twice sends 1.5 times as much.
    """
    gathers = 2 if regather_in_backward else 1
    return {"all-gather": gathers * all_gather_bytes(param_bytes, n_devices),
            "reduce-scatter": reduce_scatter_bytes(param_bytes, n_devices)}


# ------------------------------------------------------------------ time: compute against the links

# TPU v5e, one chip. bf16 peak and HBM bandwidth: the JAX scaling book's table ("How to Think
# About TPUs", jax-ml.github.io/scaling-book/tpus); Google Cloud's v5e page gives 197 TFLOP/s
# and 819 GB/s. ICI: the book gives 5e10 B/s per link one way, 1e11 both ways; Google Cloud
# gives 400 GB/s both ways per chip over 4 ports, the same 1e11 per link.
TPU_V5E = {"bf16_flops_per_s": 1.97e14, "hbm_bytes_per_s": 8.1e11,
           "ici_link_one_way_bytes_per_s": 5e10, "ici_link_bidi_bytes_per_s": 1e11}
FLOPS_PER_PARAM_PER_TOKEN = 6  # a training step: 2 forward (multiply-add), 4 backward (two products)


def train_step_flops(n_params: float, n_tokens: float) -> float:
    """FLOPs of one training step of a dense model: about 6 per parameter per token."""
    return FLOPS_PER_PARAM_PER_TOKEN * n_params * n_tokens


def tokens_to_hide_communication(bytes_per_param: float, flops_per_s: float, bytes_per_s: float) -> float:
    """Tokens per device above which a step's compute takes longer than its communication.

    Compute takes 6 * P * T / flops_per_s seconds, sending `bytes_per_param` * P bytes
    takes bytes_per_param * P / bytes_per_s: P cancels, and the two are equal at
    T = bytes_per_param * flops_per_s / (6 * bytes_per_s). Above it, communication that
    overlaps the compute costs no time; below it, the step waits for the links.
    """
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(f"flops_per_s and bytes_per_s must be positive; got {flops_per_s}, {bytes_per_s}.")
    return bytes_per_param * flops_per_s / (FLOPS_PER_PARAM_PER_TOKEN * bytes_per_s)


# ------------------------------------------------------------------ what a compiled program sends

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\w+\[[\d,]*\]\S*)\s+(all-reduce|all-gather|reduce-scatter|all-to-all)"
                         r"(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def hlo_collective_arrays(hlo_text: str) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The arrays each kind of collective returns in compiled HLO text (`compiled.as_text()`).

    {"all-reduce": [("f32", (32, 32)), ("f32", ()), ...], "all-gather": [...], ...}: one
    entry per array, so a combined all-reduce of 14 arrays gives 14. An all-gather returns
    the whole array, a reduce-scatter its 1/n slice. Of the asynchronous forms, an
    `all-gather-start` returns (its inputs, its results) and only the results are kept.
    """
    found: dict[str, list] = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        shape, kind, is_start = match.groups()
        arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)]
        if is_start and kind == "all-gather":
            arrays = arrays[len(arrays) // 2:]
        found.setdefault(kind, []).extend(arrays)
    return found


def array_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one HLO array, e.g. array_bytes("f32", (32, 64)) == 8192."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"Unknown HLO element type {dtype!r}; known: {sorted(DTYPE_BYTES)}.")
    return DTYPE_BYTES[dtype] * math.prod(shape)


def predicted_allreduce_share(grad_bytes: float, n_devices: int, bytes_per_s: float, compute_seconds: float) -> float:
    """The gradient all-reduce's share of a data-parallel step, t_comm / (t_compute + t_comm),
    if it sends its ring bytes at `bytes_per_s` after the compute, not during it (lesson 03).
    A lower bound on a real step's: it leaves out each collective's fixed cost."""
    if bytes_per_s <= 0 or compute_seconds < 0:
        raise ValueError(f"bytes_per_s must be > 0 and compute_seconds >= 0; got {bytes_per_s}, {compute_seconds}.")
    comm_seconds = all_reduce_bytes(grad_bytes, n_devices) / bytes_per_s
    return comm_seconds / (compute_seconds + comm_seconds) if comm_seconds else 0.0  # one device: none
