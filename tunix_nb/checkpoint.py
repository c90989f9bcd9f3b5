"""Orbax checkpoints: save and resume training state, load parameters anywhere.

A checkpoint at step k holds three Orbax items:
- `params`: the parameters as a plain nested dict of arrays (what `load_params` returns);
- `opt_state`: the optimizer state, restored into the structure of a fresh `opt.init`;
- `meta`: JSON with the step, the run config and the data seed. Batches are a pure
  function of (seed, step), so the seed *is* the data-order RNG state.

State is saved from one device: under pmap the caller unreplicates first, so a
checkpoint restores onto any device count.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

# Orbax logs every save at INFO/WARNING level through absl; keep notebooks readable.
logging.getLogger("absl").setLevel(logging.ERROR)


def make_manager(ckpt_dir, *, keep: int = 3, save_every: int = 1, async_save: bool = True):
    """A CheckpointManager keeping the newest `keep` checkpoints, saving every `save_every` steps."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1 (the newest checkpoint).")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_every, enable_async_checkpointing=async_save,
        create=True)
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=options)


def _pure(params):
    return params.to_pure_dict() if isinstance(params, nnx.State) else params


def save(manager, step: int, *, params, opt_state, meta: dict, force: bool = False) -> bool:
    """Save (asynchronously if the manager is async). Returns whether a save started."""
    return manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(_pure(params)),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave({**meta, "step": int(step)})), force=force)


def _on_one_device(tree):
    """Abstract arrays (shape, dtype, sharding on local device 0) for a restore target."""
    device0 = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=device0), tree)


def restore(manager, *, params_like, opt_state_like, step: int | None = None):
    """Restore (params, opt_state, meta) at `step`, or the newest one that restores.

    `params_like`/`opt_state_like` give the structure (a fresh model's params and
    `opt.init` of them). If the newest checkpoint is damaged, this warns with its step
    and the error and falls back to the one before; nothing is deleted.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"No checkpoint for step {step} in {manager.directory.name}; have {sorted(steps)}.")
        steps = [step]
    if not steps:
        raise FileNotFoundError(f"No checkpoints in {manager.directory.name}.")
    errors = []
    for candidate in steps:
        try:
            restored = manager.restore(candidate, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_on_one_device(_pure(params_like))),
                opt_state=ocp.args.StandardRestore(_on_one_device(opt_state_like)),
                meta=ocp.args.JsonRestore()))
        except Exception as err:  # a damaged checkpoint raises many kinds of errors
            warnings.warn(f"Checkpoint at step {candidate} could not be restored "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); trying an older one.")
            errors.append((candidate, err))
            continue
        params = restored["params"]
        if isinstance(params_like, nnx.State):
            params = _replace_pure(params_like, params)
        return params, restored["opt_state"], restored["meta"]
    raise RuntimeError(f"No checkpoint in {manager.directory.name} could be restored: "
                       + "; ".join(f"step {s}: {type(e).__name__}" for s, e in errors))


def _replace_pure(state_like, pure):
    state = jax.tree.map(lambda x: x, state_like)  # a copy to fill in
    nnx.replace_by_pure_dict(state, pure)
    return state


def load_params(ckpt_dir, step: int | None = None):
    """The parameters of a checkpoint as a nested dict of host NumPy arrays.

    Works on a training run's directory (the newest step by default) without knowing
    the model or the optimizer.
    """
    manager = ocp.CheckpointManager(Path(ckpt_dir).absolute(),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    steps = manager.all_steps()
    if not steps:
        raise FileNotFoundError(f"No checkpoints in {ckpt_dir}; train with --ckpt-dir {ckpt_dir} first.")
    step = max(steps) if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"No checkpoint for step {step} in {ckpt_dir}; have {sorted(steps)}.")
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    return jax.tree.map(np.asarray, restored["params"])


def load_meta(ckpt_dir, step: int | None = None) -> dict:
    manager = ocp.CheckpointManager(Path(ckpt_dir).absolute(),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    step = max(manager.all_steps()) if step is None else step
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def params_into(params_like, pure):
    """Put a pure dict (e.g. from `load_params`) into a model's parameter State."""
    return _replace_pure(params_like, jax.tree.map(np.asarray, pure))


def export_params(params, out_dir, *, step: int, meta: dict):
    """Write a parameters-only checkpoint (no optimizer state): small enough to ship."""
    manager = ocp.CheckpointManager(Path(out_dir).absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=1, enable_async_checkpointing=False, create=True))
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(_pure(params)),
                                               meta=ocp.args.JsonSave({**meta, "step": int(step)})))
    manager.wait_until_finished()
    manager.close()
