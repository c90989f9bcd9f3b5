"""Lesson 06 (beyond pmap): check_vma=True, an indivisible batch, FSDP's minimum size, DP vs FSDP.

The lesson's setting: the `tiny` model, AdamW at 1e-2 with 2 warmup steps, lesson 03's
batches whose devices hold different numbers of answer tokens, and a 1-D mesh named
"data" over all devices.
"""

from __future__ import annotations

import collections
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from tunix_nb import compare, losses, model, parallel, sft, train
from solutions import lesson03
from solutions.lesson03 import uneven_batch




# ------------------------------------------------------------------------- exercise 1


def check_vma_step(steps: int = 3, preset: str = "tiny") -> dict[str, float]:
    """Lesson 06, exercise 1: the shard_map SFT step under the default check_vma=True.

    The gradient psum goes, the psum of (nll_sum, count) stays. Trains `steps` steps on
    the lesson's uneven batches [4n, 24] with that step and with the single-device jit
    step (lesson 03's), from the same state: "vma_step_vs_jit" is the largest parameter
    difference. The step also reports, at its first batch, the norm of the gradient of
    the NLL sum that the per-device code sees, and of its psum; over the true gradient's
    norm (from the jit run) they give "grad_ratio" (1: already summed over the devices)
    and "grad_ratio_with_psum" (n: a psum would count it n times).
    """
    mesh = parallel.make_mesh()
    n = mesh.shape[parallel.MESH_AXIS]
    graphdef, params0 = model.split(model.make_model(preset, seed=0))
    optimizer = lesson03.lesson_optimizer()

    def vma_step(params, opt_state, batch):
        def nll_sum_fn(p):
            logits = model.apply(graphdef, p, batch["inputs"], batch["attention_mask"])
            return losses.sft_loss(logits, batch["targets"], batch["loss_mask"])
        (nll_sum, count), grads = jax.value_and_grad(nll_sum_fn, has_aux=True)(params)  # grads already summed
        nll_sum, count = lax.psum((nll_sum, count), "data")
        # reported only, to show the summing: the gradient's norm, and what a psum would make of it
        norms = optax.tree.norm(grads), optax.tree.norm(lax.psum(grads, "data"))
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, nll_sum / count, norms

    f = jax.jit(jax.shard_map(vma_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()))
    params, opt_state = parallel.place_state((params0, optimizer.init(params0)), mesh, "dp")
    for s in range(steps):
        params, opt_state, _, norms = f(params, opt_state, parallel.place_batch(uneven_batch(s, n), mesh))
        if s == 0:
            first_norms = [float(x) for x in norms]
    ref_params, _, history = lesson03.train_sft(preset, "float32", "jit", lambda s: uneven_batch(s, n), steps)
    # the jit step's grad_norm is that of the token-mean gradient: times the tokens, the NLL sum's
    true = history[0]["grad_norm"] * float(uneven_batch(0, n)["loss_mask"].sum())
    return {"vma_step_vs_jit": compare.max_abs_diff(params, ref_params), "grad_ratio": first_norms[0] / true,
            "grad_ratio_with_psum": first_norms[1] / true, "devices": n}


# ------------------------------------------------------------------------- exercise 2


def pad_to_device_multiple(batch, n: int):
    """Rows of zeros (pad tokens, all-zero loss_mask and attention_mask) up to a multiple of n."""
    rows = len(next(iter(batch.values())))
    extra = -rows % n
    return {k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}


@functools.lru_cache(maxsize=4)
def mesh_step(preset: str, mode: str):
    """(initial params, optimizer, `train.make_step` for `mode` on all devices), built once per process."""
    graphdef, params0 = model.split(model.make_model(preset, seed=0))
    optimizer = lesson03.lesson_optimizer()
    objective = sft.objective(graphdef, compute_dtype=jnp.float32)
    return params0, optimizer, train.make_step(objective, optimizer, parallel_mode=mode, mesh=parallel.make_mesh())


def padded_batch_keeps_the_sft_loss(rows: int = 12, preset: str = "tiny") -> dict:
    """Lesson 06, exercise 2: train on `rows` rows over n devices by padding with empty rows.

    `parallel.place_batch` refuses [12, 24] on 8 devices ("refused": its message). Padded
    to [16, 24] with rows whose masks are all zero, the package's "dp" step trains on all
    devices; its first step's loss and gradient norm ("loss_padded", "grad_norm_padded")
    against those of the 12 rows on one device ("loss_jit", "grad_norm_jit"). For DPO the
    weight counts rows: `losses.dpo_loss` of 12 pairs ("dpo_loss") against that of the 16
    with the padded pairs' log-probs 0 ("dpo_loss_padded").
    """
    params0, optimizer, dp_step = mesh_step(preset, "dp")
    graphdef, _ = model.split(model.make_model(preset, seed=0))
    mesh = dp_step.mesh
    n = mesh.shape[parallel.MESH_AXIS]
    batch = {k: v[:rows] for k, v in uneven_batch(0, n, per_device=2).items()}
    out = {}
    try:
        parallel.place_batch(batch, mesh)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    padded = pad_to_device_multiple(batch, n)
    # one device, the 12 rows: the token-mean loss and its gradient's norm
    objective = sft.objective(graphdef, compute_dtype=jnp.float32)

    @jax.jit
    def loss_and_grad_norm(params, batch):
        (nll_sum, count), grads = jax.value_and_grad(lambda p: objective(p, batch)[:2], has_aux=True)(params)
        return nll_sum / count, optax.tree.norm(grads) / count

    loss, grad_norm = loss_and_grad_norm(params0, batch)
    # all devices, the 16 padded rows: one step of the package's "dp" step reports the same two
    _, _, history = train.run(dp_step, params0, optimizer.init(params0), lambda s: padded, steps=1,
                              parallel_mode="dp", progress=False)
    out.update(loss_jit=float(loss), loss_padded=history[0]["loss"], grad_norm_jit=float(grad_norm),
               grad_norm_padded=history[0]["grad_norm"], padded_rows=len(padded["inputs"]))
    # DPO: a policy's and the reference's summed log-probs [rows] (here random), padded
    # pairs holding zeros (an empty answer sums to 0): h = 0 there, a loss of ln 2 each.
    logps = np.random.default_rng(0).normal(-10.0, 3.0, (4, rows)).astype(np.float32)
    padded_logps = np.concatenate([logps, np.zeros((4, -rows % n), np.float32)], axis=1)
    out["dpo_loss"] = float(losses.dpo_loss(*logps)[0])
    out["dpo_loss_padded"] = float(losses.dpo_loss(*padded_logps)[0])
    return out


# ------------------------------------------------------------------------- exercise 3


def fsdp_spec_min(shape, n: int, min_size: int = 1024) -> P:
    """`parallel.fsdp_spec`, but arrays with fewer than `min_size` elements stay replicated."""
    return parallel.fsdp_spec(shape, n) if np.prod(shape) >= min_size else P()


def fsdp_min_size_bytes(min_size: int = 1024, preset: str = "student") -> dict:
    """Lesson 06, exercise 3: an FSDP rule with a minimum size, against `parallel.fsdp_spec`.

    Places the `preset` model's params and AdamW state (zeros of their shapes) on the
    mesh by each rule. Returns the most bytes any device holds, "fsdp" and "fsdp_min",
    their "difference", and "kept_whole": the shapes of the arrays the minimum size
    leaves replicated that `fsdp_spec` splits (one entry per params/mu/nu array).
    """
    mesh = parallel.make_mesh()
    n = mesh.shape[parallel.MESH_AXIS]
    optimizer = train.make_optimizer(train.OptimizerConfig())
    shapes = jax.eval_shape(lambda: (lambda p: (p, optimizer.init(p)))(model.split(model.make_model(preset))[1]))
    state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)

    def most_bytes(rule):
        shardings = jax.tree.map(lambda x: NamedSharding(mesh, rule(np.shape(x), n)), state)
        return max(parallel.bytes_per_device(jax.device_put(state, shardings)).values())

    fsdp, fsdp_min = most_bytes(parallel.fsdp_spec), most_bytes(lambda s, n: fsdp_spec_min(s, n, min_size))
    kept_whole = [tuple(x.shape) for x in jax.tree.leaves(state)
                  if fsdp_spec_min(x.shape, n, min_size) != parallel.fsdp_spec(x.shape, n)]
    return {"fsdp": fsdp, "fsdp_min": fsdp_min, "difference": fsdp_min - fsdp, "kept_whole": kept_whole,
            "devices": n}


# ------------------------------------------------------------------------- exercise 4


def collectives(compiled_text: str) -> dict[str, int]:
    """Counts of the collective operations in a compiled program's HLO text (the lesson's `collectives`)."""
    ops = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", compiled_text)
    return dict(collections.Counter(ops))


def dp_against_fsdp(preset: str = "student", repeats: int = 5) -> dict:
    """Lesson 06, exercise 4: the package's "dp" and "fsdp" SFT steps with the `preset` model.

    For each mode, on a batch [2n, 24] of the lesson's uneven rows: "collectives"
    (counts in the compiled program) and "seconds" (median step time over `repeats`,
    after a warm-up call); "param_arrays" is the number of parameter arrays of the model.
    """
    out = {}
    for mode in ("dp", "fsdp"):
        params0, optimizer, step = mesh_step(preset, mode)
        n = step.mesh.shape[parallel.MESH_AXIS]
        batch = parallel.place_batch(uneven_batch(0, n, per_device=2), step.mesh)
        params, opt_state = parallel.place_state((params0, optimizer.init(params0)), step.mesh, mode)
        jax.block_until_ready(step(params, opt_state, batch))  # compiles (or reuses) the step
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, opt_state, batch))
            times.append(time.perf_counter() - t0)
        hlo = step.jitted(params, opt_state).lower(params, opt_state, batch, None).compile().as_text()
        out[mode] = {"collectives": collectives(hlo), "seconds": float(np.median(times))}
        out.update(param_arrays=len(jax.tree.leaves(params0)), devices=n)
    return out
