"""The step builder every method shares: one step body under jit, pmap, shard_map, dp or fsdp.

A step is a pure function `step(params, opt_state, batch, frozen) -> (params,
opt_state, metrics)`: `frozen` holds what is not trained (a teacher's parameters, or
nothing). There is no dropout, so a step needs no random key; the data order comes
from `tunix_nb.data.batch_at(seed, step)`.

Every objective returns `(loss_sum, weight, metrics)`: the loss over the batch is
`loss_sum / weight`. An objective with terms normalised by different counts (DPO's
pair loss over pairs plus RPO's NLL over chosen tokens) returns dicts of loss sums and
weights, one entry per named term; the loss is the sum of the terms' ratios, and the
step reports each as the metric `loss/<name>`, exact on any number of devices. For SFT
that is (NLL summed over completion tokens, number of completion tokens); for
per-example losses it is (sum over examples, examples). Under
`pmap` and `shard_map` the step psums both before dividing, so the loss and the
gradients are those of the *global* batch, exactly as on one device, however the
tokens fall across devices. Under `dp` and `fsdp` (jit on a mesh) the step sees the
global batch as one array, so it divides once, as on one device, and XLA inserts the
collectives.

Metrics follow the same rule when the objective gives them as a `(sum, count)` pair
(GRPO's token means: clip_ratio, kl, entropy): the step all-reduces both and reports
sum / count, exact on any number of devices. A plain scalar metric is averaged over
devices (pmean), which is exact only when every device's shard carries the same
weight (e.g. DPO's per-pair means over equal shards).

Parallel strategies (`PARALLEL_MODES`), all with the same step body:
- "jit": one device.
- "pmap": per-device code; state replicated with a leading device axis, batch
  [n, B/n, ...]; explicit psum. Legacy, kept because lesson 03 teaches it.
- "shard_map": per-device code on a Mesh; state replicated P(), batch rows split
  P("data"), no device axis; explicit psum. pmap's direct successor.
- "dp": jit with NamedShardings; state replicated, batch rows split; the all-reduce
  is inserted by XLA.
- "fsdp": as dp, but params and optimizer state stored split over the mesh
  (`parallel.fsdp_spec`). One sharding constraint asks for whole params inside the
  loss, so XLA all-gathers them for the forward/backward pass and reduce-scatters the
  gradients back to the slices each device updates. (The whole tree at once: a large
  model would gather layer by layer, e.g. inside a scan over layers.)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from tunix_nb import parallel

PARALLEL_MODES = ("jit", "pmap", "shard_map", "dp", "fsdp")


def make_step(objective: Callable, optimizer: optax.GradientTransformation, *, parallel_mode="jit",
              all_reduce: bool = True, donate: bool = False, mesh=None, grad_accum: int = 1):
    """A compiled training step for `objective` under one of `PARALLEL_MODES`.

    Under pmap, params/opt_state/frozen are replicated and the batch is sharded
    (`tunix_nb.parallel`); loss sums, weights and gradients are psum'd over devices
    before the division, so every device applies the global batch's update. shard_map
    runs the same per-device body on a Mesh, without the leading device axis. dp and
    fsdp compile the single-device body with `jax.jit` and shardings on a Mesh (fsdp
    also asks for whole params inside the loss; see the module docstring). For the mesh
    strategies `mesh` defaults to `parallel.make_mesh()` (all devices), and the result
    is a `MeshStep` (call it like a function; it carries `.mesh`).
    `all_reduce=False` (pmap, shard_map) drops the psum (each device then trains on its
    own shard): it exists only to measure what the all-reduce costs. `donate=True` lets
    XLA reuse the input params/opt_state buffers for the outputs (less memory on an
    accelerator), but then the arrays passed in are deleted by the call.
    `grad_accum=K` runs each device's rows as K micro-batches in turn (rows k, k + K, ...),
    summing loss sums, weights and gradients and dividing once: the whole batch's update,
    with the activations of one micro-batch at a time.
    """
    _check_step_options(parallel_mode, all_reduce, grad_accum)
    axis = {"pmap": parallel.DEVICE_AXIS, "shard_map": parallel.MESH_AXIS}.get(parallel_mode)
    if parallel_mode in parallel.MESH_MODES and mesh is None:
        mesh = parallel.make_mesh()
    # fsdp: the state is stored split; the forward/backward pass needs it whole
    gather = _gather_whole(mesh) if parallel_mode == "fsdp" else None

    def all_reduce_sum(tree):  # per-device code sums over devices; jit on a mesh sees it whole
        return lax.psum(tree, axis) if axis is not None and all_reduce else tree

    def local_terms(p, batch, frozen):
        if gather is not None:  # XLA all-gathers here, and reduce-scatters the gradient back
            p = gather(p)
        loss_sums, weights, metrics = objective(p, batch, frozen)
        return as_terms(loss_sums), (as_terms(weights), metrics)

    def whole_batch(params, batch, frozen):
        """(loss sums, weights, grads, metrics, metric sums) of the batch, reduced over devices."""
        loss_sums, pullback, (weights, metrics) = jax.vjp(lambda p: local_terms(p, batch, frozen), params,
                                                          has_aux=True)
        metrics, metric_sums = split_metric_sums(metrics)
        check_terms(loss_sums, weights)
        if len(loss_sums) == 1:  # the usual case: one all-reduce of (sum, weight, grads), divide once
            (grads,) = pullback({k: jnp.ones_like(v) for k, v in loss_sums.items()})
            loss_sums, weights, grads = all_reduce_sum((loss_sums, weights, grads))
            weights = {k: jnp.maximum(w, 1.0) for k, w in weights.items()}  # no completion tokens: no NaN
            (weight,) = weights.values()
            return loss_sums, weights, jax.tree.map(lambda g: g / weight, grads), metrics, metric_sums
        # terms over different counts: the global counts first, then the backward pass
        loss_sums, weights = all_reduce_sum((loss_sums, weights))
        weights = {k: jnp.maximum(w, 1.0) for k, w in weights.items()}
        # weights count data, not parameters: the gradient of sum_k loss_sum_k / weight_k
        # is the pullback of (1 / weight_k)_k
        (grads,) = pullback({k: 1.0 / w for k, w in weights.items()})
        return loss_sums, weights, all_reduce_sum(grads), metrics, metric_sums

    def micro_batches(params, batch, frozen):
        """As `whole_batch`, over `grad_accum` micro-batches in a `lax.scan`: each term's
        loss sum, weight and gradient are summed over them, and divided once at the end,
        so ragged micro-batches (unequal token counts) give the whole batch's update."""
        split = jax.tree.map(lambda x: _micro_batches(x, grad_accum), batch)

        def one(micro):
            loss_sums, pullback, (weights, metrics) = jax.vjp(lambda p: local_terms(p, micro, frozen), params,
                                                              has_aux=True)
            check_terms(loss_sums, weights)
            # one gradient per term: the terms' global weights are known only after the scan
            grads = _per_term_grads(pullback, loss_sums)
            return loss_sums, weights, grads, *split_metric_sums(metrics)

        def add(total, micro):
            return jax.tree.map(jnp.add, total, one(micro)), None

        first = jax.tree.map(lambda x: x[0], split)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first))
        (loss_sums, weights, term_grads, metrics, metric_sums), _ = lax.scan(add, zeros, split)
        metrics = {k: v / grad_accum for k, v in metrics.items()}  # equal-sized micro-batches
        loss_sums, weights, term_grads = all_reduce_sum((loss_sums, weights, term_grads))
        weights = {k: jnp.maximum(w, 1.0) for k, w in weights.items()}
        grads = jax.tree.map(lambda *g: sum(g), *[jax.tree.map(lambda x, k=k: x / weights[k], term_grads[k])
                                                  for k in term_grads])
        return loss_sums, weights, grads, metrics, metric_sums

    def step(params, opt_state, batch, frozen=None):
        if gather is not None and frozen is not None:
            frozen = gather(frozen)
        reduce = whole_batch if grad_accum == 1 else micro_batches
        loss_sums, weights, grads, metrics, metric_sums = reduce(params, batch, frozen)
        metrics = _global_metrics(metrics, all_reduce_sum(metric_sums), loss_sums, weights,
                                  mean_axis=axis if all_reduce else None)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = sum(loss_sums[k] / weights[k] for k in loss_sums)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}
        return params, opt_state, metrics

    return _compile(step, parallel_mode, axis=axis, mesh=mesh, donate=donate)


def _gather_whole(mesh) -> Callable:
    """A function that asks XLA for a tree whole on every device of `mesh` (an all-gather)."""
    whole = parallel.replicated(mesh)
    return lambda tree: lax.with_sharding_constraint(tree, whole)


def _global_metrics(metrics: dict, metric_sums: dict, loss_sums: dict, weights: dict, *, mean_axis) -> dict:
    """The step's metrics over the global batch: each term's loss when there are several,
    scalar metrics averaged over `mean_axis` (per-example means over equal shards; None:
    nothing to average), and (sum, count) pairs, already summed over devices, as exact means."""
    if len(loss_sums) > 1:
        metrics = {**metrics, **{f"loss/{k}": loss_sums[k] / weights[k] for k in loss_sums}}
    if mean_axis is not None:
        metrics = lax.pmean(metrics, mean_axis)
    return {**metrics, **{k: total / jnp.maximum(count, 1.0) for k, (total, count) in metric_sums.items()}}


def _check_step_options(parallel_mode: str, all_reduce: bool, grad_accum) -> None:
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}.")
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"Unknown parallel mode {parallel_mode!r}; choose one of {PARALLEL_MODES}.")
    if not all_reduce and parallel_mode in ("dp", "fsdp"):
        raise ValueError(f"all_reduce=False needs per-device code (pmap or shard_map); under {parallel_mode!r} "
                         "the step sees the global batch and XLA inserts the collectives.")


def _compile(step, parallel_mode: str, *, axis, mesh, donate: bool):
    """`step` compiled for its strategy; `donate` lets XLA reuse params/opt_state's buffers."""
    donate_argnums = (0, 1) if donate else ()
    if parallel_mode == "jit":
        return jax.jit(step, donate_argnums=donate_argnums)
    if parallel_mode == "pmap":
        return jax.pmap(step, axis_name=axis, donate_argnums=donate_argnums)
    return MeshStep(step, mesh, parallel_mode, donate_argnums=donate_argnums)


def _per_term_grads(pullback, loss_sums: dict) -> dict:
    """{term: the gradient of that term's loss sum alone}, from one vjp's pullback."""
    return {k: pullback({j: jnp.ones_like(v) if j == k else jnp.zeros_like(v) for j, v in loss_sums.items()})[0]
            for k in loss_sums}


def check_terms(loss_sums: dict, weights: dict) -> None:
    if set(weights) != set(loss_sums):
        raise ValueError(f"The objective's loss sums {sorted(loss_sums)} and weights {sorted(weights)} must "
                         "name the same terms.")


def _micro_batches(x, k: int):
    """[B, ...] -> [k, B/k, ...], micro-batch i holding rows i, i + k, i + 2k, ...: with rows
    split over devices, every device keeps a share of every micro-batch."""
    rows = x.shape[0]
    if rows % k:
        raise ValueError(f"The batch of {rows} rows (per device, under pmap and shard_map) does not divide "
                         f"into grad_accum={k} micro-batches; use a batch size that is a multiple of {k}.")
    return x.reshape(rows // k, k, *x.shape[1:]).swapaxes(0, 1)


def as_terms(x) -> dict:
    """An objective's loss sum (or weight): one scalar, or a dict of them, one per named term."""
    return dict(x) if isinstance(x, dict) else {"loss": x}


def split_metric_sums(metrics: dict) -> tuple[dict, dict]:
    """(scalar metrics, {name: (sum, count)}): an objective's metrics given as pairs are
    reduced as sums and counts, the others averaged over devices."""
    pairs = {k: v for k, v in metrics.items() if isinstance(v, tuple)}
    for k, v in pairs.items():
        if len(v) != 2:
            raise ValueError(f"metric {k!r} is a tuple of {len(v)}; a metric is a scalar or a (sum, count) pair.")
    return {k: v for k, v in metrics.items() if k not in pairs}, {k: tuple(v) for k, v in pairs.items()}


class MeshStep:
    """A step on a device mesh: "shard_map", "dp" or "fsdp". Call it like the step.

    The state's shardings depend on its shapes (FSDP splits each array by its own
    shape), so the jitted function is built at the first call, with `in_shardings`
    and `out_shardings` that keep the state where it is: replicated for shard_map/dp,
    split for fsdp. The inputs must already lie that way (`parallel.place_state`,
    `parallel.place_batch`; `train.run` does it); metrics come back replicated.
    """

    def __init__(self, step, mesh, parallel_mode, *, donate_argnums=()):
        if parallel_mode not in parallel.MESH_MODES:
            raise ValueError(f"MeshStep runs {parallel.MESH_MODES}, not {parallel_mode!r}.")
        self.step, self.mesh, self.parallel_mode = step, mesh, parallel_mode
        self.donate_argnums = donate_argnums
        self._compiled = {}

    def shardings(self, params, opt_state, frozen=None):
        """(in_shardings, out_shardings) for these arguments: the state placed per strategy."""
        state = parallel.state_shardings((params, opt_state, frozen), self.mesh, self.parallel_mode)
        rep = parallel.replicated(self.mesh)
        in_shardings = (state[0], state[1], parallel.data_sharding(self.mesh), state[2])
        return in_shardings, (state[0], state[1], rep)

    def jitted(self, params, opt_state, frozen=None):
        """The jitted function for these arguments' shapes (e.g. to `.lower(...)` it)."""
        key = jax.tree.structure((params, opt_state, frozen)), tuple(
            np.shape(x) for x in jax.tree.leaves((params, opt_state, frozen)))
        if key not in self._compiled:
            in_shardings, out_shardings = self.shardings(params, opt_state, frozen)
            fn = self.step
            if self.parallel_mode == "shard_map":
                # Per-device code, like pmap: check_vma=False keeps pmap's semantics (the
                # gradient of replicated params is the local one, and the step psums it).
                fn = jax.shard_map(fn, mesh=self.mesh, check_vma=False,
                                   in_specs=(P(), P(), P(parallel.MESH_AXIS), P()), out_specs=P())
            self._compiled[key] = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                          donate_argnums=self.donate_argnums)
        return self._compiled[key]

    def __call__(self, params, opt_state, batch, frozen=None):
        return self.jitted(params, opt_state, frozen)(params, opt_state, batch, frozen)

    def __repr__(self):
        return f"MeshStep({self.parallel_mode!r}, mesh={dict(self.mesh.shape)})"
