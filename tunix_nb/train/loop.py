"""The training loop every method shares: place the state, feed step-indexed batches, record metrics."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from tunix_nb import parallel
from tunix_nb.train.step import PARALLEL_MODES


def run(step_fn, params, opt_state, batch_fn: Callable[[int], dict], *, steps: int, start_step: int = 0,
        parallel_mode: str = "jit", frozen=None, desc: str = "train", progress: bool = True,
        on_step: Callable[[int, dict], None] | None = None,
        eval_fn: Callable[[object], dict] | None = None, eval_every: int = 0, keep_placement: bool = False):
    """Run `steps` steps from `start_step`; returns (params, opt_state, history).

    `batch_fn(step)` gives the step's batch rows that this process loads: the whole
    global batch with one process; with several processes (`tunix_nb.distributed`), this
    process's `parallel.process_rows` of it. Under pmap the state is replicated once
    and the batches sharded here; under shard_map/dp/fsdp they are placed on the step's
    mesh (`step_fn.mesh`, else all devices). Whatever the strategy, the returned state
    is whole on one device, so checkpoints and evaluation need not know which strategy
    ran; `keep_placement=True` (mesh strategies) returns it as it lies on the mesh
    instead, e.g. to save it with Orbax from several processes at once. `history` is a
    list of per-step metric dicts of Python floats; every `eval_every` steps,
    `eval_fn(params)` (params on one device) adds its metrics (e.g. "eval/loss") to
    that step's dict. A tqdm progress bar shows the loss.
    """
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"Unknown parallel mode {parallel_mode!r}; choose one of {PARALLEL_MODES}.")
    built_for = getattr(step_fn, "parallel_mode", parallel_mode)
    if built_for != parallel_mode:
        raise ValueError(f"The step was built for parallel_mode={built_for!r} but run() was given "
                         f"{parallel_mode!r}; pass the same mode to make_step and run.")
    on_mesh = parallel_mode in parallel.MESH_MODES
    if jax.process_count() > 1 and not on_mesh:
        raise ValueError(f"parallel_mode={parallel_mode!r} runs within one process, but this is process "
                         f"{jax.process_index()} of {jax.process_count()}; use one of {parallel.MESH_MODES}.")
    if keep_placement and not on_mesh:
        raise ValueError(f"keep_placement=True applies to the mesh strategies {parallel.MESH_MODES}, "
                         f"not {parallel_mode!r}.")
    mesh = (getattr(step_fn, "mesh", None) or parallel.make_mesh()) if on_mesh else None
    n_devices = jax.local_device_count() if parallel_mode == "pmap" else 1
    if parallel_mode == "pmap":
        params, opt_state, frozen = parallel.replicate((params, opt_state, frozen), n_devices)
    elif on_mesh:  # copies, placed as the strategy wants them
        params, opt_state, frozen = parallel.place_state((params, opt_state, frozen), mesh, parallel_mode)
    else:  # a donating step deletes its inputs: keep the caller's arrays alive
        params, opt_state = jax.tree.map(jnp.copy, (params, opt_state))

    def on_one_device(tree):
        if parallel_mode == "pmap":
            return parallel.unreplicate(tree)
        return parallel.gather(tree) if on_mesh else tree

    history = []
    bar = tqdm(range(start_step, start_step + steps), desc=desc, disable=not progress)
    for step in bar:
        batch = batch_fn(step)
        if parallel_mode == "pmap":
            batch = parallel.shard_batch(batch, n_devices)
        elif on_mesh:
            batch = parallel.place_batch(batch, mesh)
        params, opt_state, metrics = step_fn(params, opt_state, batch, frozen)
        if parallel_mode == "pmap":
            metrics = parallel.unreplicate(metrics)
        record = {"step": step + 1, **{k: float(v) for k, v in metrics.items()}}
        if not np.isfinite(record["loss"]):
            raise FloatingPointError(
                f"Loss became {record['loss']} at step {step + 1}; lower the learning rate "
                "or check the batch (every row needs completion tokens)."
            )
        if eval_fn is not None and eval_every and (step + 1) % eval_every == 0:
            record.update(eval_fn(on_one_device(params)))
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        if on_step is not None:
            on_step(step + 1, record)
    if not keep_placement:
        params, opt_state = on_one_device((params, opt_state))
    return params, opt_state, history
