"""Orbax checkpoints: save and resume training state, load parameters anywhere.

A checkpoint at step k is a directory `<ckpt_dir>/<k>` written by an Orbax
`CheckpointManager` (Tunix wraps the same manager in its own `CheckpointManager`). It
holds these Orbax items:
- `params`: the parameters as a plain nested dict of arrays (what `load_params` returns);
- `opt_state`: the optimizer state (including its step count, which drives the
  learning-rate schedule), restored into the structure of a fresh `opt.init`;
- `rng` (optional): the raw data (`jax.random.key_data`) of a JAX key, see below;
- `meta`: JSON with the step, the caller's run config and data seed, and a CRC32
  checksum of each array item.

**RNG state.** Batches are a pure function of (seed, step) (`data.batch_at`) and the
steps draw no random numbers (no dropout), so the data seed in `meta` and the step
*are* the whole RNG state. A caller that does consume randomness passes its key as
`rng`; it is saved as key data and comes back as a typed key in `meta["rng"]`.

**Under pmap** the state is replicated, one copy per device. A checkpoint holds it once:
`save(..., replicated=True)` takes device 0's copy (and `train.run` already hands back
unreplicated state). `restore(..., replicate_to=n)` replicates it again onto n devices,
so a checkpoint written on 8 devices restores on 4, or on 1, bit for bit.

**On a mesh, from several processes.** State placed on a mesh (dp, fsdp) is saved as
the global arrays it is: with several processes (`tunix_nb.distributed`), every
process calls `save` and writes its own shards, and Orbax's primary process writes the
metadata. `restore(..., mesh=, parallel_mode=)` reads each array straight into the
shardings that strategy wants (`parallel.state_shardings`), each process only its own
shards; the checkpoint does not record how many processes or devices wrote it.

**Damaged checkpoints.** Orbax writes a step into `<k>.orbax-checkpoint-tmp` and renames
it to `<k>` only when complete, so a save killed midway never looks like a checkpoint
(Orbax replaces that temporary directory when it saves step k again). Files damaged
*after* the commit are caught by Orbax/TensorStore when they no longer parse, and by
the checksums when they still parse but hold other numbers (Orbax does not checksum
array data). `restore` then warns with the step and the error and falls back to the
previous checkpoint. Nothing here deletes a checkpoint except Orbax's retention of the
newest `keep`; `set_aside` renames a damaged step out of Orbax's sight instead.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import io
import logging
import re
import sys
import time
import warnings
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tunix_nb import parallel

# Orbax logs every save at INFO/WARNING level through absl; keep notebooks readable.
logging.getLogger("absl").setLevel(logging.ERROR)


class DamagedCheckpointError(RuntimeError):
    """A checkpoint's files could not be read back, or hold other numbers than were saved."""


class DamagedCheckpointWarning(UserWarning):
    """The newest checkpoint is damaged; an older one was restored instead."""


def make_manager(ckpt_dir, *, keep: int = 3, save_every: int = 1, async_save: bool = True):
    """A CheckpointManager keeping the newest `keep` checkpoints, saving every `save_every` steps.

    With `async_save` (the default) `save` returns once the arrays are copied off the
    devices, and a background thread writes the files while training goes on.
    """
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1 (the newest checkpoint).")
    if save_every < 1:
        raise ValueError(f"save_every={save_every} must be at least 1.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_every, enable_async_checkpointing=async_save,
        create=True)
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=options)


def _pure(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _path_name(path) -> str:
    """'blocks/0/attn/k/kernel': the same for int and str dict keys, attributes and indices."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def checksum(tree) -> str:
    """CRC32 over every leaf's path, dtype, shape and bytes, in path order (8 hex digits).

    Independent of dict-key types, of nnx.State against its pure dict, and of where the
    arrays live: a tree saved on 8 devices and read back on the host gives the same value
    when the numbers are equal.
    """
    # to_host all-gathers arrays split across processes: every process gets the same value
    leaves = sorted((_path_name(p), parallel.to_host(x)) for p, x in jax.tree_util.tree_leaves_with_path(_pure(tree)))
    crc = 0
    for name, a in leaves:
        crc = zlib.crc32(f"{name}:{a.dtype.str}:{a.shape};".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)
    return f"{crc:08x}"


def save(manager, step: int, *, params, opt_state, meta: dict, rng=None, replicated: bool = False,
         force: bool = False) -> bool:
    """Save the training state at `step` (in the background if the manager is async).

    `replicated=True`: params/opt_state are pmap-replicated ([n_devices, ...]); device
    0's copy is saved. `rng`: an optional JAX key to save with the state. Returns
    whether a save started (False when `step` is not on the manager's save interval
    and `force` is False).
    """
    step = int(step)
    latest = manager.latest_step()
    if latest is not None and step <= latest:  # Orbax would silently skip it, or refuse
        raise ValueError(
            f"Step {step} is not newer than the latest checkpoint ({latest}) in {manager.directory.name}. "
            "Resume from that checkpoint, or move newer steps aside with checkpoint.set_aside(manager, step).")
    if not force and not manager.should_save(step):  # off the save interval: skip the checksums too
        return False
    if replicated:
        params, opt_state = parallel.unreplicate((params, opt_state))
    params = _pure(params)
    items = {"params": ocp.args.StandardSave(params), "opt_state": ocp.args.StandardSave(opt_state)}
    sums = {"params": checksum(params), "opt_state": checksum(opt_state)}
    meta = {**meta, "step": step}
    if rng is not None:
        rng_data = {"key_data": np.asarray(jax.random.key_data(rng))}  # host data: the same in every process
        items["rng"] = ocp.args.StandardSave(rng_data)
        sums["rng"] = checksum(rng_data)
        meta["rng_impl"] = str(jax.random.key_impl(rng))
    meta["checksums"] = sums
    items["meta"] = ocp.args.JsonSave(meta)
    return manager.save(step, args=ocp.args.Composite(**items), force=force)


def _targets(tree, shardings=None):
    """Abstract arrays (shape, dtype, sharding) to restore into: `shardings`, or local device 0."""
    if shardings is None:
        device0 = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device0, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


def _is_read_noise(text: str) -> bool:
    return "exception was never retrieved" in text and any(
        word in text for word in ("orbax", "TensorStore", "OCDBT", "driver"))


class _DropReadNoise(logging.Filter):
    """Drops asyncio's 'exception was never retrieved' records of failed checkpoint reads."""

    def filter(self, record):
        return not _is_read_noise(record.getMessage())


def _drop_closed_loop_noise(previous_hook):
    """An unraisable-exception hook that drops 'Event loop is closed' from late read callbacks."""

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous_hook(unraisable)

    hook._drops_read_noise = True
    return hook


def _filter_read_noise_from_now_on():
    """After a failed read: late noise from it (possibly seconds later) is dropped for good.

    The filters are narrow: asyncio records about a failed TensorStore/Orbax read,
    RuntimeError('Event loop is closed') raised in a callback nobody can catch, and the
    RuntimeWarning about Orbax's metadata coroutine that the failed read never awaited.
    """
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropReadNoise) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DropReadNoise())
    if not getattr(sys.unraisablehook, "_drops_read_noise", False):
        sys.unraisablehook = _drop_closed_loop_noise(sys.unraisablehook)
    warnings.filterwarnings("ignore", message="coroutine 'Store._get_array_metadatas' was never awaited",
                            category=RuntimeWarning)


@contextlib.contextmanager
def _quiet_attempt():
    """Run one restore attempt; if it fails, swallow the noise it leaves behind.

    A failed TensorStore read can leave futures that log 'exception was never retrieved'
    when garbage-collected, and callbacks that raise 'Event loop is closed' in other
    threads a moment later, with the machine's paths in them. The error itself is
    reported by the caller's warning. After a successful attempt, whatever was written
    to stderr is passed on unchanged.
    """
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [lg.level for lg in loggers]
    buffer = io.StringIO()
    late = []
    failed = False
    hook = sys.unraisablehook
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with contextlib.redirect_stderr(buffer), warnings.catch_warnings():
            # a failed read also leaves coroutines that were never awaited
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            try:
                yield
            except BaseException:
                failed = True
                raise
            finally:
                if failed:  # let late callbacks of the failed read arrive, and collect them
                    sys.unraisablehook = late.append
                    deadline, seen = time.monotonic() + 1.0, None
                    while time.monotonic() < deadline and seen != (len(buffer.getvalue()), len(late)):
                        seen = (len(buffer.getvalue()), len(late))
                        gc.collect()
                        time.sleep(0.05)
    finally:
        sys.unraisablehook = hook
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if failed:
            _filter_read_noise_from_now_on()
        elif buffer.getvalue():
            sys.stderr.write(buffer.getvalue())


def _describe(err, directory) -> str:
    """'ValueError: <first line>' of the root cause, without the machine's paths."""
    while err.__cause__ is not None:  # Orbax wraps TensorStore's error: report the original
        err = err.__cause__
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = text.replace(str(directory) + "/", "").replace(str(directory), directory.name)
    text = re.sub(r"(?<![\w.…])(?:/[^/\s\"']+)+/([^/\s\"']+)", r"…/\1", text)  # any other absolute path
    return f"{type(err).__name__}: {text[:240]}{'…' if len(text) > 240 else ''}"


def _read_meta(manager, step: int) -> dict:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _verify(meta: dict, name: str, tree) -> None:
    saved = meta.get("checksums", {}).get(name)
    if saved is not None and checksum(tree) != saved:
        raise DamagedCheckpointError(
            f"{name} read back with checksum {checksum(tree)}, but it was saved with {saved}")


def _restore_step(manager, step: int, params_like, opt_state_like, placement):
    params_like = _pure(params_like)
    shardings = (None, None) if placement is None else parallel.state_shardings(
        (params_like, opt_state_like), *placement)
    with _quiet_attempt():
        meta = _read_meta(manager, step)
        items = {"params": ocp.args.StandardRestore(_targets(params_like, shardings[0])),
                 "opt_state": ocp.args.StandardRestore(_targets(opt_state_like, shardings[1]))}
        if "rng_impl" in meta:  # a host array: the same in every process
            key_like = jax.random.key_data(jax.random.key(0, impl=meta["rng_impl"]))
            items["rng"] = ocp.args.StandardRestore({"key_data": np.zeros(key_like.shape, key_like.dtype)})
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    for name in items:
        _verify(meta, name, restored[name])
    meta = dict(meta)
    if "rng_impl" in meta:
        meta["rng"] = jax.random.wrap_key_data(jax.numpy.asarray(restored["rng"]["key_data"]),
                                               impl=meta.pop("rng_impl"))
    return restored["params"], restored["opt_state"], meta


def restore(manager, *, params_like, opt_state_like, step: int | None = None, replicate_to: int | None = None,
            mesh=None, parallel_mode: str | None = None):
    """Restore (params, opt_state, meta) at `step`, or the newest checkpoint that restores.

    `params_like`/`opt_state_like` give the structure (a fresh model's params and
    `opt.init` of them); the arrays come back on one device, replicated onto
    `replicate_to` devices for pmap, or placed on `mesh` as `parallel_mode` ("shard_map",
    "dp", "fsdp") wants them, each process reading only its own shards. `meta` is the saved JSON (with `step`), plus the
    saved key as `meta["rng"]` when there is one.

    Without `step`: if the newest checkpoint is damaged, this warns
    (`DamagedCheckpointWarning`, with its step and the error) and tries the one before;
    nothing is deleted or moved. With `step`: a damaged checkpoint raises
    `DamagedCheckpointError`.
    """
    if (mesh is None) != (parallel_mode is None):
        raise ValueError("Give both mesh and parallel_mode (e.g. parallel.make_mesh(), 'fsdp'), or neither.")
    if mesh is not None and replicate_to is not None:
        raise ValueError("replicate_to (pmap) and mesh cannot be combined; choose one placement.")
    placement = None if mesh is None else (mesh, parallel_mode)
    steps = sorted(manager.all_steps(), reverse=True)
    name = manager.directory.name
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"No checkpoint for step {step} in {name}; have {sorted(steps)}.")
        steps = [step]
    if not steps:
        raise FileNotFoundError(f"No checkpoints in {name}.")
    failures = []
    for candidate in steps:
        try:
            params, opt_state, meta = _restore_step(manager, candidate, params_like, opt_state_like, placement)
        except Exception as err:  # a damaged checkpoint raises many kinds of errors
            why = _describe(err, manager.directory)
            del err  # drop the traceback (and the failed read's futures) now
            if step is not None:
                raise DamagedCheckpointError(f"Checkpoint at step {candidate} in {name} is damaged: {why}") from None
            failures.append((candidate, why))
            older = [s for s in steps if s < candidate]
            warnings.warn(
                f"Checkpoint at step {candidate} in {name} could not be restored ({why}); "
                + (f"falling back to step {older[0]}." if older else "no older checkpoint to fall back to.")
                + " Its files were left in place.", DamagedCheckpointWarning, stacklevel=2)
            continue
        if isinstance(params_like, nnx.State):
            params = _replace_pure(params_like, params)
        if replicate_to is not None:
            params, opt_state = parallel.replicate((params, opt_state), replicate_to)
        return params, opt_state, meta
    raise DamagedCheckpointError(f"No checkpoint in {name} could be restored: "
                                 + "; ".join(f"step {s}: {why}" for s, why in failures))


def set_aside(manager, step: int) -> Path:
    """Rename the (damaged) checkpoint `<step>` to `<step>.damaged-<time>`; returns the new path.

    Orbax no longer sees it, so training can save that step again, and retention never
    deletes it: the files stay for inspection until you remove them yourself.
    """
    src = Path(manager.directory) / str(step)
    if not src.is_dir():
        raise FileNotFoundError(f"No checkpoint directory for step {step} in {manager.directory.name}.")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    dst = src.with_name(f"{step}.damaged-{stamp}")
    n = 1
    while dst.exists():
        n += 1
        dst = src.with_name(f"{step}.damaged-{stamp}-{n}")
    src.rename(dst)
    manager.reload()
    return dst


def _replace_pure(state_like, pure):
    state = jax.tree.map(lambda x: x, state_like)  # a copy to fill in
    nnx.replace_by_pure_dict(state, pure)
    return state


def _reader(ckpt_dir):
    path = Path(ckpt_dir).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"No checkpoint directory {ckpt_dir}.")
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True),
                                 item_handlers={"params": ocp.StandardCheckpointHandler(),
                                                "meta": ocp.JsonCheckpointHandler()})


def _steps_to_try(manager, ckpt_dir, step):
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"No checkpoints in {ckpt_dir}; train with --ckpt-dir {ckpt_dir} first.")
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"No checkpoint for step {step} in {ckpt_dir}; have {sorted(steps)}.")
        return [step]
    return steps


def _first_readable(manager, ckpt_dir, step, read):
    steps = _steps_to_try(manager, ckpt_dir, step)
    name = Path(ckpt_dir).name
    for candidate in steps:
        try:
            return read(candidate)
        except Exception as err:
            why = _describe(err, manager.directory)
            del err
            if step is not None:
                raise DamagedCheckpointError(f"Checkpoint at step {candidate} in {name} is damaged: {why}") from None
            warnings.warn(f"Checkpoint at step {candidate} in {name} could not be read ({why}); "
                          "trying an older one. Its files were left in place.", DamagedCheckpointWarning,
                          stacklevel=3)
    raise DamagedCheckpointError(f"No checkpoint in {name} could be read.")


def load_params(ckpt_dir, step: int | None = None):
    """The parameters of a checkpoint as a nested dict of host NumPy arrays.

    Works on a training run's directory (the newest step by default, falling back
    with a warning when it is damaged) without knowing the model or the optimizer.
    """
    manager = _reader(ckpt_dir)

    def read(s):
        with _quiet_attempt():
            meta = _read_meta(manager, s)
            # shapes and dtypes from the checkpoint, onto this process's first device: it may
            # have been written by other devices or processes than the ones here
            saved = manager.item_metadata(s)["params"]
            like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)
            restored = manager.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(_targets(like))))
        params = jax.tree.map(np.asarray, restored["params"])
        _verify(meta, "params", params)
        return params

    return _first_readable(manager, ckpt_dir, step, read)


def load_meta(ckpt_dir, step: int | None = None) -> dict:
    """The JSON `meta` item of a checkpoint (the newest readable one by default)."""
    manager = _reader(ckpt_dir)

    def read(s):
        with _quiet_attempt():
            return _read_meta(manager, s)

    return _first_readable(manager, ckpt_dir, step, read)


def params_into(params_like, pure):
    """Put a pure dict (e.g. from `load_params`) into a model's parameter State."""
    return _replace_pure(params_like, jax.tree.map(np.asarray, pure))


def export_params(params, out_dir, *, step: int, meta: dict):
    """Write a parameters-only checkpoint (no optimizer state): small enough to ship."""
    params = _pure(params)
    manager = ocp.CheckpointManager(Path(out_dir).absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=1, enable_async_checkpointing=False, create=True))
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave({**meta, "step": int(step), "checksums": {"params": checksum(params)}})))
    manager.wait_until_finished()
    manager.close()
