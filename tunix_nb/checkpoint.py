"""Orbax checkpoints: save and resume training state, load parameters anywhere.

A checkpoint at step k is a directory `<ckpt_dir>/<k>` written by an Orbax
`CheckpointManager` (Tunix wraps the same manager in its own `CheckpointManager`). It
holds these Orbax items:
- `params`: the parameters as a plain nested dict of arrays (what `load_params` returns);
- `opt_state`: the optimizer state (including its step count, which drives the
  learning-rate schedule), restored into the structure of a fresh `opt.init`;
- `rng` (optional): the raw data (`jax.random.key_data`) of a JAX key, see below;
- `meta`: JSON with the step, the caller's run config and data seed, and a checksum of
  each array item (`checksum`: per array, a sum of position-keyed element hashes that each
  device takes over the shards it holds, so nothing is gathered to checksum it).

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
array data). A restore verifies each array as it was read, on whatever mesh it was read
onto; checkpoints from before carry a CRC32 of each whole array, still verified as such. `restore`, `load_params`, `load_meta` and `load_model` then warn with the
step and the error and fall back to the previous checkpoint (`newest_readable`, the one
place that does this). Nothing here deletes a checkpoint except Orbax's retention of the
newest `keep`; `set_aside` renames a damaged step out of Orbax's sight instead.

**Logging.** Importing this module changes no logging setting or hook. Orbax logs
through absl; the kit quiets it only around its own calls that would otherwise warn
(opening a checkpoint read-only), and the noise a failed read leaves behind only while
`newest_readable` runs.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
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

from tunix_nb import layer_stack, model, parallel


class DamagedCheckpointError(RuntimeError):
    """A checkpoint's files could not be read back, or hold other numbers than were saved."""


class LayoutError(ValueError):
    """A checkpoint in the other layout of the blocks (`layer_stack`) that the caller gave no way to read."""


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


CHECKSUM_PREFIX = "mix32:"  # the per-shard checksum's values; plain 8 hex digits: the older whole-array CRC32


def checksum(tree) -> str:
    """A checksum of every leaf's path, dtype, shape and values ('mix32:' and 8 hex digits), the
    same wherever the arrays live: on one device, sharded over a mesh, on the host.

    Each array's value is a sum, modulo 2**32, of a hash of each element's bits and its
    position in the whole array. A sum does not depend on the order it is taken in, so each
    device hashes the shards it holds and the devices add their partial sums (one number an
    array crosses devices or processes, never the array): a save checksums what each process
    writes without gathering the model, and a restore onto another mesh checks each array as
    it was read, whatever pieces each device read.
    """
    leaves = sorted((model.param_name(p), x) for p, x in jax.tree_util.tree_leaves_with_path(_pure(tree)))
    sums = _array_sums([x for _, x in leaves])
    crc = 0
    for (name, x), total in zip(leaves, sums):
        crc = zlib.crc32(f"{name}:{np.dtype(x.dtype).str}:{tuple(np.shape(x))}:{total};".encode(), crc)
    return f"{CHECKSUM_PREFIX}{crc:08x}"


def _array_sums(arrays) -> list[int]:
    """Each array's position-keyed hash sum (`_hash_sum`), computed where its shards are: one
    jitted call per set of devices the arrays live on (host arrays: the default device)."""
    groups: dict = {}
    for i, x in enumerate(arrays):
        devices = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None
        groups.setdefault(devices, []).append(i)
    sums = [0] * len(arrays)
    for indices in groups.values():
        group = [arrays[i] for i in indices]
        for i, total in zip(indices, _hash_sums(group, out_shardings=_replicated_like(group[0]))):
            sums[i] = int(total)
    return sums


def _replicated_like(x):
    """A sharding that gives every process the result: replicated over x's mesh (None: jit's default)."""
    if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    return None


def _hash_sums(arrays, out_shardings=None):
    return np.asarray(_hash_sums_program(out_shardings)(arrays)).tolist()


@functools.lru_cache(maxsize=None)
def _hash_sums_program(out_shardings):
    """One jitted function per output sharding, kept: a function made afresh at every save would
    be traced and lowered again at every save (about 0.4 s a save for lesson 05's arrays)."""
    return jax.jit(lambda xs: jax.numpy.stack([_hash_sum(x) for x in xs]), out_shardings=out_shardings)


def _hash_sum(x):
    """sum over elements of mix(bits ^ mix(position)), uint32 arithmetic (wraps): fused by XLA
    into one pass over each shard, with no array-sized temporaries."""
    jnp = jax.numpy
    bits = _as_uint32(jnp.asarray(x))
    position = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):  # the element's index in the whole array, row-major
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    mixed = _mix32(bits ^ _mix32(position * jnp.uint32(0x9E3779B9) + jnp.uint32(0x85EBCA6B)))
    return jnp.sum(mixed, dtype=jnp.uint32)


def _as_uint32(x):
    """The element bits as uint32 (64-bit elements: their two halves as a trailing axis of 2)."""
    jnp = jax.numpy
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _mix32(h):
    """MurmurHash3's 32-bit finaliser: every input bit moves about half the output bits."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _crc32_of_whole_arrays(tree) -> str:
    """The checksum of checkpoints written before the per-shard one: CRC32 of each whole array's
    bytes (gathered to the host), read only to verify those checkpoints."""
    leaves = sorted((model.param_name(p), parallel.to_host(x)) for p, x in jax.tree_util.tree_leaves_with_path(_pure(tree)))
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
    if layer_stack.is_stacked(params):  # the blocks on a layer axis (layer_stack); absent: one tree per block
        meta["stacked_blocks"] = True
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

    return hook


@contextlib.contextmanager
def _absl_quiet(level=logging.ERROR):
    """Orbax's absl logging below `level` is dropped for the duration, then the level is put back."""
    absl_logger = logging.getLogger("absl")
    before = absl_logger.level
    absl_logger.setLevel(max(level, before))
    try:
        yield
    finally:
        absl_logger.setLevel(before)


# A failed read's late callbacks (from TensorStore's threads, and futures collected later)
# arrive within about a second of the failure.
_LATE_NOISE_S = 1.0


@contextlib.contextmanager
def _quiet_reads():
    """Checkpoint reads that may fail, with the noise a failed read leaves dropped meanwhile.

    A failed TensorStore read leaves futures that log 'exception was never retrieved' when
    collected, callbacks that raise 'Event loop is closed' in other threads, and coroutines
    never awaited, all with the machine's paths in them; the caller's warning already
    reports the error. Yields `failed`, to call when an attempt fails: on leaving, the late
    noise is then collected and dropped for up to `_LATE_NOISE_S` after the failure. Then
    the absl level, the asyncio filter, the warning filters and `sys.unraisablehook` are
    all as they were.
    """
    asyncio_logger = logging.getLogger("asyncio")
    noise_filter = _DropReadNoise()
    previous_hook = sys.unraisablehook
    our_hook = _drop_closed_loop_noise(previous_hook)
    failures = []
    asyncio_logger.addFilter(noise_filter)
    sys.unraisablehook = our_hook
    try:
        with _absl_quiet(logging.CRITICAL), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            try:
                yield lambda: failures.append(time.monotonic())
            finally:
                if failures:
                    _collect_late_noise_until(failures[-1] + _LATE_NOISE_S)
    finally:
        if sys.unraisablehook is our_hook:  # unless someone replaced it meanwhile
            sys.unraisablehook = previous_hook
        asyncio_logger.removeFilter(noise_filter)


def _collect_late_noise_until(deadline: float) -> None:
    while time.monotonic() < deadline:
        gc.collect()  # the failed read's futures log when collected: now, while filtered
        time.sleep(0.05)


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
    if saved is None:
        return
    read = checksum(tree) if saved.startswith(CHECKSUM_PREFIX) else _crc32_of_whole_arrays(tree)
    if read != saved:
        raise DamagedCheckpointError(f"{name} read back with checksum {read}, but it was saved with {saved}")


def _caller_outside_this_module() -> int:
    """The `stacklevel` that makes a warning name the first line outside this module."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def newest_readable(manager_or_dir, read, *, step: int | None = None):
    """`read(manager, s)` for the newest step s it succeeds on: the fallback over damaged checkpoints.

    `manager_or_dir` is a CheckpointManager, or a checkpoint directory (opened read-only).
    Steps are tried newest first. A step that `read` raises on is reported with a
    `DamagedCheckpointWarning` (its step and the error, without the machine's paths) and
    left in place; the next older one is tried. With `step`, only that one is tried and a
    damaged one raises `DamagedCheckpointError`. Raises FileNotFoundError when there is no
    checkpoint (or none at `step`) and DamagedCheckpointError when none reads. The noise a
    failed read leaves behind is dropped while this runs, and only then.
    """
    if isinstance(manager_or_dir, ocp.CheckpointManager):
        manager, where = manager_or_dir, manager_or_dir.directory.name
    else:
        manager, where = _reader(manager_or_dir), str(manager_or_dir)
    name = manager.directory.name
    steps = _steps_to_try(manager, where, step)
    failures = []
    with _quiet_reads() as failed:
        for candidate in steps:
            try:
                return read(manager, candidate)
            except LayoutError:  # readable, but the caller must say how: not damage
                raise
            except Exception as err:  # a damaged checkpoint raises many kinds of errors
                failed()
                why = _describe(err, manager.directory)
                del err  # drop the traceback (and the failed read's futures) now
            if step is not None:
                raise DamagedCheckpointError(f"Checkpoint at step {candidate} in {name} is damaged: {why}")
            failures.append((candidate, why))
            older = [s for s in steps if s < candidate]
            warnings.warn(
                f"Checkpoint at step {candidate} in {name} could not be restored ({why}); "
                + (f"falling back to step {older[0]}." if older else "no older checkpoint to fall back to.")
                + " Its files were left in place.", DamagedCheckpointWarning,
                stacklevel=_caller_outside_this_module())
    raise DamagedCheckpointError(f"No checkpoint in {name} could be restored: "
                                 + "; ".join(f"step {s}: {why}" for s, why in failures))


def _steps_to_try(manager, where: str, step: int | None) -> list[int]:
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"No checkpoints in {where}; save one there first (checkpoint.save, "
                                f"or python -m tunix_nb.train sft --ckpt-dir {where}).")
    if step is None:
        return steps
    if step not in steps:
        raise FileNotFoundError(f"No checkpoint for step {step} in {where}; have {sorted(steps)}.")
    return [step]


def newest_readable_meta(manager) -> dict | None:
    """The meta of the newest checkpoint whose meta reads, or None: quietly.

    For a look before resuming (is this the same run?); `restore` then reports the damage.
    """
    if not manager.all_steps():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedCheckpointWarning)
        try:
            return newest_readable(manager, _read_meta)
        except DamagedCheckpointError:
            return None


def _restore_step(manager, step: int, params_like, opt_state_like, placement, plain_like=None):
    params_like = _pure(params_like)
    meta = _read_meta(manager, step)
    saved_stacked = meta.get("stacked_blocks", False)
    if saved_stacked != layer_stack.is_stacked(params_like):  # saved in the other layout: read it as saved
        return _restore_other_layout(manager, step, (params_like, opt_state_like), placement, plain_like,
                                     saved_stacked)
    shardings = (None, None) if placement is None else parallel.state_shardings(
        (params_like, opt_state_like), *placement)
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


def _restore_other_layout(manager, step: int, like, placement, plain_like, saved_stacked: bool):
    """A checkpoint saved with the blocks stacked read into a run that keeps them one tree per
    block, or the other way round (`layer_stack`): read as it was saved, then converted on the
    device. Reading one tree per block needs that layout's structure, `plain_like`."""
    if saved_stacked:
        read_like = layer_stack.abstract_in_layout(like, stacked=True)  # a stacked run's state: pure dicts
    elif plain_like is not None:
        read_like = plain_like
    else:
        raise LayoutError(f"Step {step} holds the blocks one tree per block and this run stacks them; "
                         "pass plain_like=(params_like, opt_state_like) in the model's own layout to convert it.")
    params, opt_state, meta = _restore_step(manager, step, *read_like, placement)
    return (*layer_stack.convert((params, opt_state), like), meta)


def restore(manager, *, params_like, opt_state_like, step: int | None = None, replicate_to: int | None = None,
            mesh=None, parallel_mode: str | None = None, plain_like=None):
    """Restore (params, opt_state, meta) at `step`, or the newest checkpoint that restores.

    `params_like`/`opt_state_like` give the structure (a fresh model's params and
    `opt.init` of them); the arrays come back on one device, replicated onto
    `replicate_to` devices for pmap, or placed on `mesh` as `parallel_mode` ("shard_map",
    "dp", "fsdp") wants them, each process reading only its own shards. `meta` is the saved JSON (with `step`), plus the
    saved key as `meta["rng"]` when there is one.

    A checkpoint saved in the other layout of the blocks (`layer_stack`: stacked on a layer axis,
    or one tree per block) is read as saved and converted; for a run that stacks them, reading
    the plain layout needs `plain_like`, (params_like, opt_state_like) in that layout.

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
    params, opt_state, meta = newest_readable(
        manager, lambda m, s: _restore_step(m, s, params_like, opt_state_like, placement, plain_like), step=step)
    if isinstance(params_like, nnx.State):
        params = _replace_pure(params_like, params)
    if replicate_to is not None:
        params, opt_state = parallel.replicate((params, opt_state), replicate_to)
    return params, opt_state, meta


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
    with _absl_quiet():  # a read-only manager warns that it is read-only, with the machine's path
        return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True),
                                     item_handlers={"params": ocp.StandardCheckpointHandler(),
                                                    "meta": ocp.JsonCheckpointHandler()})


def _read_params_and_meta(manager, step: int):
    """(params as host NumPy arrays, meta) of one step, checked against the saved checksum."""
    meta = _read_meta(manager, step)
    # shapes and dtypes from the checkpoint, onto this process's first device: it may
    # have been written by other devices or processes than the ones here
    saved = manager.item_metadata(step)["params"]
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(_targets(like))))
    params = jax.tree.map(np.asarray, restored["params"])
    _verify(meta, "params", params)
    # a run that trained with its blocks stacked (layer_stack) saved them so: one tree per block
    # again, as views of the host arrays
    return layer_stack.unstack(params, on_host=True), meta


def load_params(ckpt_dir, step: int | None = None):
    """The parameters of a checkpoint as a nested dict of host NumPy arrays.

    Works on a training run's directory (the newest step by default, falling back
    with a warning when it is damaged) without knowing the model or the optimizer.
    """
    return newest_readable(ckpt_dir, _read_params_and_meta, step=step)[0]


def load_params_and_meta(ckpt_dir, step: int | None = None):
    """(`load_params`, `load_meta`) of one and the same step (the newest readable by default)."""
    return newest_readable(ckpt_dir, _read_params_and_meta, step=step)


def load_meta(ckpt_dir, step: int | None = None) -> dict:
    """The JSON `meta` item of a checkpoint (the newest readable one by default)."""
    return newest_readable(ckpt_dir, _read_meta, step=step)


def model_preset(meta: dict, where="The checkpoint") -> str:
    """The model preset a checkpoint's meta names: `meta["model"]`, or its run config's."""
    preset = meta.get("model") or meta.get("config", {}).get("model")
    if preset is None:
        raise ValueError(f"{where} names no model preset (its meta has neither 'model' nor "
                         "'config': {'model': ...}). Build the model yourself and fill it with "
                         "checkpoint.params_into(params_like, checkpoint.load_params(ckpt_dir)).")
    if preset not in model.PRESETS:
        raise ValueError(f"{where} names the model {preset!r}, which is not a preset; "
                         f"the presets are {sorted(model.PRESETS)}. Build the model yourself and use "
                         "checkpoint.params_into(params_like, checkpoint.load_params(ckpt_dir)).")
    return preset


def load_model(ckpt_dir, step: int | None = None):
    """(graphdef, params, meta) of the model saved in `ckpt_dir`, ready for `model.apply`.

    The preset comes from the checkpoint's meta; params and meta from the same step (the
    newest readable one by default, see `load_params`). The structure comes from
    `nnx.eval_shape`: no random initialisation to run only to be overwritten.
    """
    params, meta = newest_readable(ckpt_dir, _read_params_and_meta, step=step)
    preset = model_preset(meta, ckpt_dir)
    graphdef, like = nnx.split(nnx.eval_shape(lambda: model.make_model(preset)))
    _check_fits(like, params, f"{ckpt_dir} (model {preset!r})")
    return graphdef, jax.device_put(params_into(like, params)), meta


def _check_fits(params_like, pure, what: str) -> None:
    want = {model.param_name(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(_pure(params_like))}
    got = {model.param_name(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(pure)}
    if want != got:
        differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        shown = "; ".join(f"{k}: saved {got.get(k)}, preset {want.get(k)}" for k in differ[:3])
        raise ValueError(f"The parameters in {what} do not fit that preset ({shown}"
                         f"{'; …' if len(differ) > 3 else ''}). Was the meta written for another model?")


def params_into(params_like, pure):
    """Put a pure dict (e.g. from `load_params`) into a model's parameter State."""
    return _replace_pure(params_like, jax.tree.map(np.asarray, pure))


def export_params(params, out_dir, *, step: int, meta: dict):
    """Write a parameters-only checkpoint (no optimizer state): small enough to ship.

    Orbax's `commit_success.txt` files are removed afterwards: they hold this machine's
    absolute path, and on a local filesystem the commit is the rename, so no reader needs them.
    """
    params = _pure(params)
    manager = ocp.CheckpointManager(Path(out_dir).absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=1, enable_async_checkpointing=False, create=True))
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave({**meta, "step": int(step), "checksums": {"params": checksum(params)}})))
    manager.wait_until_finished()
    manager.close()
    for marker in (Path(out_dir) / str(int(step))).rglob("commit_success.txt"):
        marker.unlink()
