"""Training: optimizer, step builders for SFT and distillation, and the training loop.

A step is a pure function `step(params, opt_state, batch, frozen) -> (params,
opt_state, metrics)`: `frozen` holds what is not trained (a teacher's parameters, or
nothing). There is no dropout, so a step needs no random key; the data order comes
from `tunix_nb.data.batch_at(seed, step)`.

Every objective returns `(loss_sum, weight, metrics)`: the loss over the batch is
`loss_sum / weight`. For SFT that is (NLL summed over completion tokens, number of
completion tokens); for per-example losses it is (sum over examples, examples). Under
`pmap` and `shard_map` the step psums both before dividing, so the loss and the
gradients are those of the *global* batch, exactly as on one device, however the
tokens fall across devices. Under `dp` and `fsdp` (jit on a mesh) the step sees the
global batch as one array, so it divides once, as on one device, and XLA inserts the
collectives.

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

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from tunix_nb import devices, losses, parallel
from tunix_nb import model as model_lib

PARALLEL_MODES = ("jit", "pmap", "shard_map", "dp", "fsdp")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay, after global-norm clipping."""

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 500
    end_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0


def make_optimizer(cfg: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    if cfg.total_steps <= cfg.warmup_steps:
        raise ValueError(
            f"total_steps={cfg.total_steps} must exceed warmup_steps={cfg.warmup_steps}; "
            "train longer or warm up for fewer steps."
        )
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.learning_rate * cfg.end_learning_rate_fraction,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )


def resolve_compute_dtype(compute_dtype="auto"):
    """"auto": the backend's default (bfloat16 on TPU/GPU, float32 = None on CPU)."""
    if compute_dtype == "auto":
        compute_dtype = devices.defaults_for().compute_dtype
    return None if compute_dtype in (None, "float32", jnp.float32) else compute_dtype


def cast_floats(tree, dtype):
    """Mixed precision: a compute copy of the float leaves in `dtype` (None: unchanged).

    Gradients flow back through the cast, so they arrive in the parameters' float32.
    """
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


# ------------------------------------------------------------------------ objectives


def sft_objective(graphdef, *, compute_dtype="auto"):
    """(params, batch, frozen) -> (NLL summed over completion tokens, token count, {}).

    `compute_dtype`: "auto" computes in bfloat16 on TPU/GPU and float32 on CPU, with
    float32 parameters either way; pass jnp.float32 or jnp.bfloat16 to choose.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)

    def objective(params, batch, frozen=None):
        logits = model_lib.apply(graphdef, cast_floats(params, compute_dtype), batch["inputs"],
                                 batch["attention_mask"])
        nll_sum, count = losses.sft_loss(logits, batch["targets"], batch["loss_mask"])
        return nll_sum, count, {}

    return objective


def distill_objective(student_graphdef, teacher_graphdef, *, temperature=2.0, alpha=0.5,
                      compute_dtype="auto"):
    """(student params, batch, teacher params) -> (sum of per-example losses, B, metrics).

    The teacher runs in the same step, frozen: no gradient flows into it. With
    `alpha=0` (hard labels only, through the same per-example reduction) it is skipped.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)

    def objective(params, batch, teacher_params):
        student_logits = model_lib.apply(student_graphdef, cast_floats(params, compute_dtype),
                                         batch["inputs"], batch["attention_mask"])
        if alpha == 0.0:  # hard labels only: the soft term has weight 0, skip the teacher
            teacher_logits = lax.stop_gradient(student_logits)
        else:
            teacher_logits = lax.stop_gradient(model_lib.apply(
                teacher_graphdef, cast_floats(teacher_params, compute_dtype), batch["inputs"],
                batch["attention_mask"]))
        mean_loss, metrics = losses.distillation_loss(
            student_logits, teacher_logits, batch["targets"], batch["loss_mask"],
            temperature=temperature, alpha=alpha)
        n = batch["inputs"].shape[0]
        return mean_loss * n, jnp.float32(n), metrics

    return objective


def _stacked_pair(batch):
    """Chosen rows then rejected rows, [2B, L]: one forward pass scores both."""
    return {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
            for k in ("inputs", "targets", "loss_mask", "attention_mask")}


def pair_log_probs(graphdef, params, batch, *, length_normalize=False):
    """(chosen, rejected) completion log-probs [B] each, from one concatenated forward pass.

    `length_normalize=True` divides by the number of completion tokens (what IPO wants).
    """
    rows = _stacked_pair(batch)
    logits = model_lib.apply(graphdef, params, rows["inputs"], rows["attention_mask"])
    logps = losses.sequence_log_probs(logits, rows["targets"], rows["loss_mask"])
    if length_normalize:
        logps = logps / jnp.maximum(rows["loss_mask"].sum(axis=-1), 1.0)
    chosen, rejected = jnp.split(logps, 2)
    return chosen, rejected


def reference_log_probs(graphdef, params, pair_arrays, *, length_normalize=False, batch_size=256):
    """The frozen reference model's log-probs for every pair, computed once.

    Returns `pair_arrays` plus `ref_chosen_logps` and `ref_rejected_logps` [N], so that
    `data.batch_at` hands each DPO step its pairs' cached reference values.
    """
    fn = jax.jit(lambda p, b: pair_log_probs(graphdef, p, b, length_normalize=length_normalize))
    n = len(pair_arrays["chosen_inputs"])
    chosen, rejected = [], []
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size) % n  # pad the tail: one compiled shape
        c, r = fn(params, {k: v[idx] for k, v in pair_arrays.items()})
        keep = min(batch_size, n - start)
        chosen.append(np.asarray(c)[:keep])
        rejected.append(np.asarray(r)[:keep])
    return {**pair_arrays, "ref_chosen_logps": np.concatenate(chosen),
            "ref_rejected_logps": np.concatenate(rejected)}


def dpo_objective(graphdef, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                  length_normalize=False, cached_reference=True, sft_weight=0.0, compute_dtype="auto"):
    """(policy params, batch, reference params or None) -> (sum of pair losses, B, metrics).

    With `cached_reference` the batch carries `ref_chosen_logps`/`ref_rejected_logps`
    (from `reference_log_probs`); otherwise the frozen reference model runs in the step.
    `sft_weight > 0` adds that multiple of the chosen answers' per-token NLL (RPO, as
    TRL's `rpo_alpha`): it keeps the chosen answers likely while the margin grows.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    if loss_type not in losses.DPO_LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose one of {losses.DPO_LOSS_TYPES}.")

    def objective(params, batch, reference_params=None):
        pi_c, pi_r = pair_log_probs(graphdef, cast_floats(params, compute_dtype), batch,
                                    length_normalize=length_normalize)
        if cached_reference:
            ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            ref_c, ref_r = lax.stop_gradient(pair_log_probs(
                graphdef, cast_floats(reference_params, compute_dtype), batch,
                length_normalize=length_normalize))
        loss, metrics = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type=loss_type,
                                        label_smoothing=label_smoothing)
        metrics = {**metrics, "logps/chosen": pi_c.mean(), "logps/rejected": pi_r.mean()}
        if sft_weight:
            per_token = pi_c if length_normalize else pi_c / jnp.maximum(batch["chosen_loss_mask"].sum(-1), 1.0)
            chosen_nll = -per_token.mean()
            loss = loss + sft_weight * chosen_nll
            metrics["sft/chosen_nll"] = chosen_nll
        n = pi_c.shape[0]
        return loss * n, jnp.float32(n), jax.tree.map(lax.stop_gradient, metrics)

    return objective


# ------------------------------------------------------------------------------ steps


def make_step(objective: Callable, optimizer: optax.GradientTransformation, *, parallel_mode="jit",
              all_reduce: bool = True, donate: bool = False, mesh=None):
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
    """
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"Unknown parallel mode {parallel_mode!r}; choose one of {PARALLEL_MODES}.")
    if not all_reduce and parallel_mode in ("dp", "fsdp"):
        raise ValueError(f"all_reduce=False needs per-device code (pmap or shard_map); under {parallel_mode!r} "
                         "the step sees the global batch and XLA inserts the collectives.")
    axis = {"pmap": parallel.DEVICE_AXIS, "shard_map": parallel.MESH_AXIS}.get(parallel_mode)
    if parallel_mode in parallel.MESH_MODES and mesh is None:
        mesh = parallel.make_mesh()
    gather = None
    if parallel_mode == "fsdp":  # the state is stored split; the forward/backward pass needs it whole
        whole = parallel.replicated(mesh)
        gather = lambda tree: lax.with_sharding_constraint(tree, whole)  # noqa: E731

    def step(params, opt_state, batch, frozen=None):
        if gather is not None and frozen is not None:
            frozen = gather(frozen)

        def local_loss_sum(p):
            if gather is not None:  # XLA all-gathers here, and reduce-scatters the gradient back
                p = gather(p)
            loss_sum, weight, metrics = objective(p, batch, frozen)
            return loss_sum, (weight, metrics)

        (loss_sum, (weight, metrics)), grads = jax.value_and_grad(local_loss_sum, has_aux=True)(params)
        if axis is not None and all_reduce:  # the all-reduce: sum over devices, then divide once
            loss_sum, weight, grads = lax.psum((loss_sum, weight, grads), axis)
            metrics = lax.pmean(metrics, axis)  # per-example means over equal shards
        weight = jnp.maximum(weight, 1.0)  # a batch with no completion tokens: no NaN
        grads = jax.tree.map(lambda g: g / weight, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss_sum / weight, "grad_norm": optax.tree.norm(grads), **metrics}
        return params, opt_state, metrics

    donate_argnums = (0, 1) if donate else ()
    if parallel_mode == "jit":
        return jax.jit(step, donate_argnums=donate_argnums)
    if parallel_mode == "pmap":
        return jax.pmap(step, axis_name=axis, donate_argnums=donate_argnums)
    return MeshStep(step, mesh, parallel_mode, donate_argnums=donate_argnums)


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


def init_opt_state(optimizer, params):
    return optimizer.init(params)


# ------------------------------------------------------------------------------- loop


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


if __name__ == "__main__":  # python -m tunix_nb.train ...
    from tunix_nb.cli import main

    raise SystemExit(main())
