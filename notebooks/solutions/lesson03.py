"""Lesson 03 (data-parallel SFT with pmap): equal token counts, a token metric, bfloat16.

The lesson's setting with the `tiny` model by default: the first 512 SFT examples
sorted by answer length, global batches of 4 rows per device, AdamW at 1e-2 with 2
warmup steps (the lesson's `run_10_steps`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunix_nb import data, model, parallel, sft, train
from tunix_nb.tokenizer import ByteTokenizer


@functools.lru_cache(maxsize=1)
def length_sorted_rows():
    """The SFT arrays [512, 24] of the first 512 examples, sorted by answer length."""
    by_length = sorted(data.load_sft()[:512], key=lambda e: len(e["completion"]))
    return data.sft_arrays(by_length, ByteTokenizer(), data.DEFAULT_SEQ_LEN)


def uneven_batch(step: int, n: int, per_device: int = 4):
    """The lesson's batch [n * per_device, 24]: device i's rows from the i-th slice by length."""
    return data.uneven_batch(length_sorted_rows(), step, n, per_device)


def equal_tokens_batch(step: int, n: int, per_device: int = 4):
    """A batch [n * per_device, 24] in which every device holds the same number of answer tokens.

    Slot j of every device takes an answer of the j-th most common length, so the rows
    of one device differ in length but each device holds the same lengths.
    """
    rows = length_sorted_rows()
    lengths = rows["loss_mask"].sum(-1).astype(int)
    common = np.argsort(np.bincount(lengths))[::-1][:per_device]
    groups = [np.flatnonzero(lengths == c) for c in common]
    idx = np.array([[g[(step * n + i) % len(g)] for g in groups] for i in range(n)]).reshape(-1)
    return {k: v[idx] for k, v in rows.items()}


def tokens_per_device(batch, n: int) -> list[int]:
    """Answer tokens each of n devices holds of a global batch (its rows split in n slices)."""
    return batch["loss_mask"].reshape(n, -1).sum(axis=1).astype(int).tolist()


def lesson_optimizer():
    """The optimizer of the lesson's 10-step runs (lessons 03 and 06 share it)."""
    return train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))


@functools.lru_cache(maxsize=8)
def sft_step(preset: str, objective: str, parallel_mode: str = "jit"):
    """(initial params, optimizer, step) for one of the objectives below, built once per process.

    "float32"/"bfloat16": `sft.objective` computing in that dtype; "mean_per_device":
    the lesson's trap, each device's own token mean with weight 1. The optimizer is the
    lesson's `run_10_steps` one. Built once, a step compiles once per batch shape, and
    lessons 05 and 06 reuse it.
    """
    graphdef, params0 = model.split(model.make_model(preset, seed=0))
    dtype = jnp.bfloat16 if objective == "bfloat16" else jnp.float32
    sft_objective = sft.objective(graphdef, compute_dtype=dtype)

    def mean_per_device(params, batch, frozen=None):
        nll_sum, count, _ = sft_objective(params, batch)
        return nll_sum / count, jnp.float32(1.0), {}  # each device's own mean, weight 1

    fn = {"float32": sft_objective, "bfloat16": sft_objective, "mean_per_device": mean_per_device}[objective]
    opt = lesson_optimizer()
    return params0, opt, train.make_step(fn, opt, parallel_mode=parallel_mode)


def train_sft(preset: str, objective: str, parallel_mode: str, batch_fn, steps: int):
    """`train.run` of `steps` steps of one of `sft_step`'s objectives, from the seed-0 model."""
    params0, opt, step_fn = sft_step(preset, objective, parallel_mode)
    return train.run(step_fn, params0, opt.init(params0), batch_fn, steps=steps, parallel_mode=parallel_mode,
                     progress=False)


def _max_param_diff(a, b) -> float:  # in NumPy: no small programs to compile
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)


# ------------------------------------------------------------------------- exercise 1


def equal_token_counts_drift(steps: int = 3, preset: str = "tiny") -> dict:
    """Lesson 03, exercise 1: does the per-device-mean objective drift when token counts are equal?

    Trains `steps` steps on all n devices with the lesson's `mean_per_device_objective`
    (each device's own token mean, weight 1) and on one device with the token-mean SFT
    step, from the same parameters, once on equal-token batches and once on the
    lesson's uneven ones (each [4n, 24]). Returns the largest parameter difference
    after the steps, "equal" and "uneven", and the first batch's answer tokens per
    device, "tokens_equal" and "tokens_uneven" (lists of n).
    """
    n = jax.local_device_count()
    out = {}
    for name, batch_fn in (("equal", equal_tokens_batch), ("uneven", uneven_batch)):
        runs = {mode: train_sft(preset, objective, mode, lambda s: batch_fn(s, n), steps)[0]
                for mode, objective in (("jit", "float32"), ("pmap", "mean_per_device"))}
        out[name] = _max_param_diff(runs["jit"], runs["pmap"])
        out[f"tokens_{name}"] = tokens_per_device(batch_fn(0, n), n)
    return out


# ------------------------------------------------------------------------- exercise 2


def global_token_count_metric() -> dict[str, float]:
    """Lesson 03, exercise 2: a "tokens" metric, the global number of answer tokens.

    On the lesson's uneven batch [4n, 24] over n devices: "global" counts its answer
    tokens on one device; "psum" and "pmean" reduce each device's own count with
    `lax.psum` and `lax.pmean` inside pmap (what every device then holds). The package's
    step (`train.make_step`) pmeans the objective's metrics, so a count must be psum'd
    in the step itself, like `weight`.
    """
    n = jax.local_device_count()
    batch = uneven_batch(0, n)
    count = lambda b: jnp.sum(b["loss_mask"])  # noqa: E731  one device's answer tokens
    psum_N, pmean_N = jax.pmap(lambda b: (lax.psum(count(b), "devices"), lax.pmean(count(b), "devices")),
                               axis_name="devices")(parallel.shard_batch(batch))
    return {"global": float(batch["loss_mask"].sum()), "psum": float(psum_N[0]), "pmean": float(pmean_N[0]),
            "devices": n}


# ------------------------------------------------------------------------- exercise 3


def bfloat16_against_float32(steps: int = 10, preset: str = "tiny") -> dict:
    """Lesson 03, exercise 3: `sft.objective(graphdef, compute_dtype=jnp.bfloat16)` against float32.

    The same `steps` single-device steps on the lesson's uneven batches [32, 24], once
    computing in bfloat16 and once in float32 (the lesson's `run_10_steps` optimizer).
    Returns "loss_bfloat16" and "loss_float32" (each step's loss, lists of `steps`),
    "max_rel_loss_diff", the largest over the steps of |bfloat16 - float32| / |float32|,
    and the dtypes of the parameters after the bfloat16 run, "param_dtypes" (a set of names).
    """
    out = {}
    for name in ("bfloat16", "float32"):
        params, _, history = train_sft(preset, name, "jit", lambda s: uneven_batch(s, 8), steps)
        out[f"loss_{name}"] = [h["loss"] for h in history]
        if name == "bfloat16":
            out["param_dtypes"] = {str(x.dtype) for x in jax.tree.leaves(params)}
    bf16, f32 = np.array(out["loss_bfloat16"]), np.array(out["loss_float32"])
    out["max_rel_loss_diff"] = float(np.max(np.abs(bf16 - f32) / np.abs(f32)))
    return out
