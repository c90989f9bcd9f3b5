"""The training loops every method shares: place the state, feed batches (step-indexed, or sampled
by the policy itself: `run_on_policy`), record metrics.

Recording does not stall the device: `run` reads a step's metrics once the next step is
queued (`StepLog`), so on an accelerator the host loads the next batch while the device
computes. Every step is still logged, in order, with the values a `float()` per step gives."""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np
from tunix_nb import parallel
from tunix_nb import progress as progress_bars
from tunix_nb.train.step import PARALLEL_MODES


def run(step_fn, params, opt_state, batch_fn: Callable[[int], dict], *, steps: int, start_step: int = 0,
        parallel_mode: str = "jit", frozen=None, desc: str = "train", progress: bool = True,
        on_step: Callable[[int, dict], None] | None = None,
        eval_fn: Callable[[object], dict] | None = None, eval_every: int = 0, keep_placement: bool = False,
        hand_over: bool = False, should_stop: Callable[[], bool] | None = None):
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

    `on_step(step, record)` gets every step's record, in order, one step late: while step
    k + 1 runs (`StepLog`), or at once at an eval step and after the last step. A
    non-finite loss raises FloatingPointError naming its step, before any eval of it.

    The state is copied when placed, so that a donating step cannot delete the caller's
    arrays; `hand_over=True` is for a caller that gives them up (the training command):
    arrays already placed are used as they are, so the state lives once, and a donating
    step deletes them.

    `should_stop()`, asked after each step is queued, ends the run after that step when
    True (a stop signal): `history` then holds the steps that ran.
    """
    place = Placement(step_fn, parallel_mode, keep_placement, caller="run()")
    params, opt_state, frozen = place.state(params, opt_state, frozen, copy=not hand_over)

    with StepLog(place.metrics, on_step, progress_bars.bar(total=steps, desc=desc, disable=not progress)) as log:
        for step in range(start_step, start_step + steps):
            params, opt_state, metrics = step_fn(params, opt_state, place.batch(batch_fn(step)), frozen)
            log.push(step + 1, metrics)  # logs the step before, whose metrics are ready or nearly so
            if eval_fn is not None and eval_every and (step + 1) % eval_every == 0:
                log.flush(extra=lambda: eval_fn(place.on_one_device(params)))
            if should_stop is not None and should_stop():
                break
    if not keep_placement:
        params, opt_state = place.on_one_device((params, opt_state))
    return params, opt_state, log.history


class StepLog:
    """Steps' records in `history`, on the progress bar and to `on_step(step, record)`.

    `float()` of a device value waits for the device and costs a round trip, and a loop
    doing it each step idles the device while the host loads the next batch. `push` starts
    a step's metrics' copy to the host and logs the step pushed before it: while the host
    waits for step k, step k + 1 is queued and the device stays busy. `flush` logs the
    queued step now. A non-finite loss raises when its step is logged, naming the step.
    `to_host(metrics) -> {name: float}`; a `with` block flushes and closes the bar.
    """

    def __init__(self, to_host: Callable, on_step: Callable[[int, dict], None] | None, bar, *,
                 postfix: Callable[[dict], dict] | None = None):
        self.to_host, self.on_step, self.bar = to_host, on_step, bar
        self.postfix = postfix or (lambda record: {"loss": f"{record['loss']:.4f}"})
        self.history, self._queued = [], None

    def push(self, step: int, metrics) -> None:
        """Queue `step`'s metrics (device arrays) and log the step queued before it."""
        start_host_copy(metrics)
        self.flush()
        self._queued = (step, metrics)

    def flush(self, extra: Callable[[], dict] | None = None) -> None:
        """Log the queued step now; `extra()` (e.g. eval metrics) joins its record once its loss is checked."""
        if self._queued is None:
            return
        (step, metrics), self._queued = self._queued, None  # dequeued first: a raise logs nothing twice
        record = {"step": step, **self.to_host(metrics)}
        _check_finite(record)
        if extra is not None:
            record.update(extra())
        self.log(record)

    def log(self, record: dict) -> None:
        """Log a record that is already on the host."""
        self.history.append(record)
        self.bar.update(1)
        self.bar.set_postfix(**self.postfix(record))
        if self.on_step is not None:
            self.on_step(record["step"], record)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        try:  # also when the loop raised: the steps it finished are logged, as a step-by-step loop would
            self.flush()
        finally:
            self.bar.close()


def start_host_copy(tree) -> None:
    """Start copying `tree`'s device arrays to the host, without waiting: a later
    `device_get` (or `float`) finds them there or on their way."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            x.copy_to_host_async()


def _check_finite(record):
    if not np.isfinite(record["loss"]):
        raise FloatingPointError(
            f"Loss became {record['loss']} at step {record['step']}; lower the learning rate "
            "or check the batch (every row needs completion tokens)."
        )


class Placement:
    """Where a strategy keeps the state and the batch, and how to get them back whole.

    "jit": one device (the state copied, so a donating step cannot delete the caller's
    arrays); "pmap": replicated with a leading device axis, batches split
    [n, B/n, ...]; "shard_map", "dp", "fsdp": placed on the step's mesh
    (`parallel.place_state`, `parallel.place_batch`).
    """

    def __init__(self, step_fn, parallel_mode: str, keep_placement: bool = False, *, caller: str = "run()"):
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"Unknown parallel mode {parallel_mode!r}; choose one of {PARALLEL_MODES}.")
        built_for = getattr(step_fn, "parallel_mode", parallel_mode)
        if built_for != parallel_mode:
            raise ValueError(f"The step was built for parallel_mode={built_for!r} but {caller} was given "
                             f"{parallel_mode!r}; pass the same mode to make_step and {caller}.")
        self.on_mesh = parallel_mode in parallel.MESH_MODES
        if jax.process_count() > 1 and not self.on_mesh:
            raise ValueError(f"parallel_mode={parallel_mode!r} runs within one process, but this is process "
                             f"{jax.process_index()} of {jax.process_count()}; use one of {parallel.MESH_MODES}.")
        if keep_placement and not self.on_mesh:
            raise ValueError(f"keep_placement=True applies to the mesh strategies {parallel.MESH_MODES}, "
                             f"not {parallel_mode!r}.")
        self.parallel_mode = parallel_mode
        self.mesh = (getattr(step_fn, "mesh", None) or parallel.make_mesh()) if self.on_mesh else None
        self.n_devices = jax.local_device_count() if parallel_mode == "pmap" else 1

    def state(self, params, opt_state, frozen=None, *, copy: bool = True):
        """(params, opt_state, frozen) placed as the strategy wants them: as new arrays, or with
        `copy=False` (the caller hands them over) as they are where they lie so already.

        On one device ("jit") the state is committed to the device it is on: `optimizer.init`
        leaves some leaves uncommitted, and the step's outputs are committed, so a step fed the
        mix would compile again at its second call."""
        if self.parallel_mode == "pmap":
            return parallel.replicate((params, opt_state, frozen), self.n_devices)
        if self.on_mesh:
            return parallel.place_state((params, opt_state, frozen), self.mesh, self.parallel_mode, copy=copy)
        # copies made without a compiled program (jnp.copy compiles and dispatches one per leaf)
        device = _device_of((params, opt_state))
        params, opt_state = jax.device_put((params, opt_state), device, may_alias=False if copy else None)
        if not copy and frozen is not None:
            frozen = jax.device_put(frozen, device)
        return params, opt_state, frozen

    def batch(self, batch):
        """A global batch of host rows (this process's rows, with several), placed for the step."""
        if self.parallel_mode == "pmap":
            return parallel.shard_batch(batch, self.n_devices)
        return parallel.place_batch(batch, self.mesh) if self.on_mesh else batch

    def metrics(self, metrics) -> dict:
        """A step's metrics as Python floats (device 0's copy under pmap: all copies are equal),
        fetched in one `device_get` (a `float()` each would wait for the device once per metric)."""
        host = jax.device_get(metrics)
        if self.parallel_mode == "pmap":
            host = {k: v[0] for k, v in host.items()}
        return {k: float(v) for k, v in host.items()}

    def on_one_device(self, tree):
        if self.parallel_mode == "pmap":  # device 0's copies, as parallel.unreplicate, in one program
            return _first_replica(jax.tree.map(lambda x: x.addressable_shards[0].data, tree))
        return parallel.gather(tree) if self.on_mesh else tree


def _device_of(tree):
    """The device the state's first array is on (an uncommitted one's: the default device)."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return next(iter(arrays[0].devices())) if arrays else jax.local_devices()[0]


@jax.jit
def _first_replica(tree):
    """[1, ...] -> [...] for every leaf: one compiled program, where eager indexing compiles
    and dispatches one per leaf (each a slow round of its own on an accelerator)."""
    return jax.tree.map(lambda x: x[0], tree)


def run_on_policy(step_fn, params, opt_state, rollout_fn: Callable, *, steps: int, start_step: int = 0,
                  num_iterations: int = 1, parallel_mode: str = "jit", reference=None, frozen=None,
                  desc: str = "rl",
                  progress: bool = True, on_step: Callable[[int, dict], None] | None = None,
                  keep_placement: bool = False, hand_over: bool = False,
                  should_stop: Callable[[], bool] | None = None):
    """On-policy RL (GRPO): every step samples a batch with the current policy, then
    makes `num_iterations` updates on it. Returns (params, opt_state, history).

    `rollout_fn(step, params, reference) -> (batch, metrics)` gets the current params and
    the frozen `reference` as they lie for the strategy (replicated under pmap, on the
    step's mesh otherwise), samples with them, and returns the step's global training
    batch as host arrays plus its own metrics (Python floats: rewards, lengths). The
    batch is placed as in `run` and the step applied to it `num_iterations` times (μ,
    Tunix's `num_iterations`); `reference` is not passed to the step (the rollout
    puts what the objective needs of it, e.g. its log-probs, in the batch). `frozen`, when
    given (a LoRA policy's base: `lora.frozen(base)`), is placed like the state, passed to
    every step and to `rollout_fn` as a fourth argument.

    One record per step: the rollout's metrics, the updates' metrics averaged over the
    μ updates, and "time/rollout_s" and "time/update_s": wall seconds of the rollout
    (sampling, scoring, rewards, to host) and of the μ updates (until the new params
    are ready). Placement, `hand_over`, `should_stop` and the returned state are as in `run`.
    """
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
        raise ValueError(f"num_iterations must be an int >= 1, got {num_iterations!r}.")
    place = Placement(step_fn, parallel_mode, keep_placement, caller="run_on_policy()")
    params, opt_state, (reference, frozen) = place.state(params, opt_state, (reference, frozen), copy=not hand_over)
    extra = () if frozen is None else (frozen,)

    bar = progress_bars.bar(total=steps, desc=desc, disable=not progress)
    with StepLog(place.metrics, on_step, bar, postfix=_loss_and_reward) as log:
        for step in range(start_step, start_step + steps):
            started = time.perf_counter()
            batch, rollout_metrics = rollout_fn(step, params, reference, *extra)
            sampled = time.perf_counter()
            batch = place.batch(batch)
            updates = []
            for _ in range(num_iterations):
                params, opt_state, metrics = step_fn(params, opt_state, batch, frozen)
                updates.append(metrics)
            # the next rollout needs these params anyway: wait for them, the metrics copying meanwhile
            start_host_copy(updates)
            jax.block_until_ready(params)
            updated = time.perf_counter()
            updates = [place.metrics(u) for u in updates]
            record = {"step": step + 1, **rollout_metrics,
                      **{k: float(np.mean([u[k] for u in updates])) for k in updates[0]},
                      "time/rollout_s": sampled - started, "time/update_s": updated - sampled}
            _check_finite(record)
            log.log(record)
            if should_stop is not None and should_stop():
                break
    if not keep_placement:
        params, opt_state = place.on_one_device((params, opt_state))
    return params, opt_state, log.history


def _loss_and_reward(record: dict) -> dict:
    return {"loss": f"{record['loss']:.4f}", "reward": f"{record.get('reward', float('nan')):.3f}"}
