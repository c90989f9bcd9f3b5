"""The kit's steps against Tunix's trainers: `python -m tunix_nb.tunix_compare [--quick] [--out DIR]`.

An optional part of the benchmark, for a learner choosing between this kit's steps and
Tunix's trainers. It runs where google-tunix 0.1.7 is installed, which requirements.txt
leaves out: Tunix declares safetensors<0.8 (the kit pins 0.8.0) and pulls in TensorFlow
Datasets, transformers, grain, numba, ... that its trainers never import. In an
environment of its own, from the repository root:

    python -m venv tunix_venv && . tunix_venv/bin/activate
    pip install -r requirements-lessons.txt && pip install --no-deps -e .
    pip install --no-deps google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 ml-collections==1.1.0
    pip install --no-deps wrapt==2.5.2 tensorboardX==2.6.5 jaxtyping==0.3.11 wadler-lindig==0.1.8
    pip install --no-deps sentencepiece==0.2.3 perfetto==0.59.1 pandas==3.1.1
    python -m tunix_nb.tunix_compare --out results

(the last packages are what `import tunix` and its trainers import, on the kit's own jax,
flax, optax and orbax pins). Without Tunix it prints why it is skipped and exits 0,
writing nothing.

Same model, same batches, same optimizer (the kit's AdamW), in one run: the kit's SFT,
DPO (cached reference) and distillation steps against Tunix's `PeftTrainer` (full
fine-tuning, its default loss), `DPOTrainer` and `DistillationTrainer` (`LogitStrategy`),
each driving the kit's student through `TunixModel`, an adapter to Tunix's model call.
Each device count runs in a process of its own (JAX fixes the count when it starts): 1
device, and 8 simulated CPU devices, where Tunix shards the batch over a mesh and the
kit runs its "dp" strategy (jit on a mesh, state replicated, rows split).

What is timed. A kit step as `train.run` runs it: the batch placed, then the step. A
Tunix step as its `train()` loop runs it, without the logging: `_prepare_inputs` (DPO:
the reference model's forward pass; distillation: the teacher's), `shard_input`, then
the jitted train step. On a mesh, Tunix's loop shards the batch only after
`_prepare_inputs`, so a host batch makes the reference or teacher pass run whole on
every device; the headline therefore feeds Tunix batches already sharded over its mesh
(as a sharded data loader would), and the host-batch feed is kept as a detail. Both
sides are timed in rounds, in turns (`bench.interleaved_times`); a figure is the median
of the per-round ratios kit / Tunix, with its spread. Targets: at most 1 (SFT,
distillation), and at most 3/4 for DPO, whose cached reference saves one of a step's
four forward-pass equivalents.

Losses. Each side's first steps' losses are recorded. SFT and DPO define the loss alike,
so the first-step losses must agree to float32 rounding; distillation does not
(`DEFINITIONS`), so there each side's first-step loss is checked against its own
definition evaluated on logits from the *other* side's call path.
Results go to DIR/tunix_compare.json and DIR/tunix_compare.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_nb import bench, data, devices, distill, dpo, losses, model, parallel, sft, train
from tunix_nb.tokenizer import ByteTokenizer
from tunix_nb.train.loop import Placement

TUNIX_VERSION = "0.1.7"  # the release whose trainers this module drives
TUNIX_MODULES = ("tunix.sft.peft_trainer", "tunix.sft.dpo.dpo_trainer", "tunix.distillation.distillation_trainer")
METHODS = ("sft", "dpo", "distill")
# kit step time / Tunix step time: at most these. DPO: the policy's forward and backward
# passes are ~3 forward passes, the reference 1 more, which the cached reference skips
TARGETS = {"sft": 1.0, "dpo": 0.70, "distill": 1.0}  # issue 27: SFT <= 1.0 and DPO <= 0.70
DEVICE_COUNTS = (1, 8)
# two float32 losses from different programs (other reduction orders), relative
LOSS_RTOL = 2e-5
SFT_BATCH, DPO_PAIRS, DISTILL_BATCH = 64, 32, 64
# each sample times calls for at least this long: on a shared machine a single 50 ms call
# can be preempted, and an average over several is steadier
SAMPLE_SECONDS = 0.2
TEMPERATURE, ALPHA, BETA = 2.0, 0.5, 0.1
SAME_DEFINITION = ("sft", "dpo")
DEFINITIONS = {
    "sft": "the same: NLL summed over the completion tokens of the global batch / their number",
    "dpo": f"the same: mean over pairs of -log sigmoid(beta h), beta {BETA}, no label smoothing, "
           "h = (pi_c - ref_c) - (pi_r - ref_r) of summed completion log-probs",
    "distill": "different. Kit (tunix_nb.distill): per example, T^2 KL(teacher_T || student_T) and the CE, "
               "each a mean over its completion tokens; alpha-mixed, averaged over examples. Tunix "
               "(LogitStrategy): T^2 KL at every position (prompt and padding too: no mask) and the CE against "
               "one-hot labels that are 0 off the completion, each a mean over all B x (L-1) positions; "
               f"alpha-mixed. T {TEMPERATURE}, alpha {ALPHA} on both sides",
}


def tunix_missing() -> str | None:
    """Why Tunix's trainers cannot be imported here, or None when they can."""
    try:
        for name in TUNIX_MODULES:
            __import__(name)
    except ImportError as e:  # tunix itself, or something its trainers import
        return (f"google-tunix's trainers are not importable ({type(e).__name__}: {e}). To run this comparison, "
                f"install google-tunix=={TUNIX_VERSION} with --no-deps in an environment of its own, plus what its "
                "trainers import: the commands are in `python -m tunix_nb.tunix_compare --help`")
    return None


# ------------------------------------------------------------------ the model adapter


class TunixModel(nnx.Module):
    """The kit's Transformer behind the model call Tunix's trainers make:
    model(input_tokens, positions, cache, attention_mask) -> (logits, None).

    Positions [B, L] and the attention mask [B, L, L] come from the caller, so the kit's
    forward pass (`Transformer._run`, which its own call and its cached decoding share)
    runs with Tunix's, not with its own (the same values: positions count real tokens,
    queries see the real tokens up to themselves).
    """

    def __init__(self, transformer):
        self.transformer = transformer

    def __call__(self, input_tokens, positions, cache=None, attention_mask=None):
        if cache is not None:
            raise NotImplementedError("TunixModel runs training passes only, without a KV cache.")
        logits_BxLxV, _ = self.transformer._run(input_tokens, positions, attention_mask.astype(bool))
        return logits_BxLxV, None


def wrap(graphdef, params, mesh=None):
    """A `TunixModel` holding a copy of `params`, replicated over `mesh` if given."""
    model = TunixModel(nnx.merge(graphdef, jax.tree.map(jnp.copy, params)))
    if mesh is not None:  # a full copy on every device, as the kit's "dp" keeps its state
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        nnx.update(model, jax.device_put(nnx.state(model), replicated))
    return model


def positions_and_mask(input_tokens_BxL):
    """Positions [B, L] and causal attention mask [B, L, L] of padded tokens, built as Tunix's
    examples build them (padding: the byte tokenizer's pad id, checked on the batches)."""
    from tunix.sft import utils

    real_BxL = input_tokens_BxL != ByteTokenizer.pad_id
    return utils.build_positions_from_mask(real_BxL), utils.make_causal_attn_mask(real_BxL)


def sft_model_inputs(x):
    """PeftTrainer's `gen_model_input_fn`: what its default loss takes, from a TrainingInput."""
    positions_BxL, mask_BxLxL = positions_and_mask(x.input_tokens)
    return {"input_tokens": x.input_tokens, "input_mask": x.input_mask, "positions": positions_BxL,
            "attention_mask": mask_BxLxL}


def next_token_logits(tunix_model, input_tokens, input_mask):
    """LogitStrategy's forward function: logits [B, L-1, V] at the positions that have a next token."""
    positions_BxL, mask_BxLxL = positions_and_mask(input_tokens)
    logits_BxLxV, _ = tunix_model(input_tokens, positions_BxL, None, mask_BxLxL)
    return logits_BxLxV[:, :-1]


def next_token_labels(input_tokens, input_mask):
    """LogitStrategy's labels [B, L-1, V]: the next token one-hot, 0 where it is no completion token."""
    return jax.nn.one_hot(input_tokens[:, 1:], ByteTokenizer.vocab_size) * input_mask[:, 1:, None]


# --------------------------------------------------------------------------- batches


def sft_rows(n=512):
    """The first n SFT examples of the shipped task as the kit's rows [n, 24]."""
    return data.sft_arrays(data.load_sft()[:n], ByteTokenizer(), data.DEFAULT_SEQ_LEN)


def tunix_token_rows(rows):
    """The kit's SFT rows as Tunix's {input_tokens, input_mask} [N, L]: the same inputs, and the
    mask on the input positions whose *next* token is a completion target, so that
    `input_mask[:, 1:]` is the kit's loss mask less its last column (always 0 here)."""
    if rows["loss_mask"][:, -1].any():
        raise ValueError("The rows' last target is a completion token: raise seq_len by one.")
    if not np.array_equal(rows["inputs"] != ByteTokenizer.pad_id, rows["attention_mask"] == 1):
        raise ValueError("Tunix finds padding by the pad id, but these rows hold it on real tokens.")
    mask_NxL = np.concatenate([np.zeros_like(rows["loss_mask"][:, :1]), rows["loss_mask"][:, :-1]], axis=1)
    return {"input_tokens": rows["inputs"], "input_mask": mask_NxL}


def completion_arrays(texts, tokenizer, length):
    """Completions + eos, right-padded: Tunix's (ids, mask) [N, length]."""
    ids_NxC = np.full((len(texts), length), tokenizer.pad_id, np.int32)
    for i, text in enumerate(texts):
        row = [*tokenizer.encode(text), tokenizer.eos_id]
        if len(row) > length:
            raise ValueError(f"completion {text!r} needs {len(row)} tokens with eos, more than {length}.")
        ids_NxC[i, :len(row)] = row
    return ids_NxC, (ids_NxC != tokenizer.pad_id).astype(np.int32)


def pair_rows(n=256):
    """(the kit's preference rows, Tunix's) for the same n pairs, row for row: the kit's
    prompt + answer right-padded to 24 tokens, Tunix's prompt left-padded to 16 then the
    answer right-padded to 8. Padding changes no real token's logits on either side."""
    tok, pairs = ByteTokenizer(), data.load_preferences()[:n]
    prompts = data.prompt_arrays([p["prompt"] for p in pairs], tok, data.DEFAULT_PROMPT_LEN)
    tunix = {"prompt_ids": prompts["tokens"], "prompt_mask": prompts["attention_mask"]}
    for side in ("chosen", "rejected"):
        tunix[f"{side}_ids"], tunix[f"{side}_mask"] = completion_arrays(
            [p[side] for p in pairs], tok, data.DEFAULT_SEQ_LEN - data.DEFAULT_PROMPT_LEN)
    return data.preference_arrays(pairs, tok, data.DEFAULT_SEQ_LEN), tunix


# ------------------------------------------------------------------------ both sides


def optimizer():
    """The kit's AdamW (warmup, cosine decay, clipping): one optax transformation for both sides."""
    return train.make_optimizer(train.OptimizerConfig(total_steps=100))


def kit_side(objective, params, batch_fn, frozen, n_devices, steps):
    """(`steps` kit steps' metrics from `params`, a call making one more step on batch 0 as
    `train.run` makes it). The step donates its state's buffers, as Tunix's its optimizer's."""
    mode = "jit" if n_devices == 1 else "dp"
    opt = optimizer()
    mesh = parallel.make_mesh(n_devices) if n_devices > 1 else None
    step = train.make_step(objective, opt, parallel_mode=mode, mesh=mesh, donate=True)
    _, _, history = train.run(step, params, opt.init(params), batch_fn, steps=steps, parallel_mode=mode,
                              frozen=frozen, progress=False)
    place = Placement(step, mode)
    state = list(place.state(params, opt.init(params), frozen))
    first = batch_fn(0)

    def one_step():
        state[0], state[1], metrics = step(state[0], state[1], place.batch(first), state[2])
        return metrics

    return history, one_step


def tunix_mesh(n_devices):
    """Tunix's mesh: its default data axis "fsdp" over n devices; None (no mesh) for one."""
    return None if n_devices == 1 else jax.sharding.Mesh(np.array(jax.devices()[:n_devices]), ("fsdp",))


def on_mesh(mesh):
    """Tunix 0.1.7 reads its mesh from `pxla.thread_resources`, which on JAX 0.10 only the
    deprecated `with mesh:` sets (under `jax.set_mesh` Tunix sees no mesh, shards nothing)."""
    return contextlib.nullcontext() if mesh is None else mesh


def presharded(trainer, batch, mesh):
    """The batch split over Tunix's mesh (its own `shard_input`), as a sharded loader hands it over."""
    from tunix.sft import sharding_utils

    with on_mesh(mesh):
        return sharding_utils.shard_input(batch, trainer.config.data_sharding_axis)


def tunix_config(cls, steps, **extra):
    """No evaluation, checkpoints or metric backends: the trainer's loop and its step only."""
    return cls(eval_every_n_steps=10**9, max_steps=steps, pbar_description=None, **extra)


def step_clock():
    """Tunix training hooks noting when each step of `train()` ends. The loop reports a step
    one step late, when it reads back its loss, so the intervals are its per-step times."""
    from tunix.sft import hooks

    class StepClock(hooks.TrainingHooks):
        def __init__(self):
            self.ends = []

        def on_train_step_end(self, train_ctx, train_step, train_loss):
            self.ends.append(time.perf_counter())

        def on_train_start(self, train_ctx): ...
        def on_train_end(self, train_ctx): ...
        def on_train_step_start(self, train_ctx): ...
        def on_eval_step_start(self, train_ctx): ...
        def on_eval_step_end(self, train_ctx, eval_loss): ...

    return StepClock()


def tunix_side(trainer, batch_fn, mesh, steps, metrics=("loss",)):
    """Tunix's own `train()` over `steps` batches: ({metric: [per step]}, loop seconds per step,
    one step on batch 0 as the loop runs it)."""
    from tunix.sft import sharding_utils

    clock = step_clock()
    trainer.with_training_hooks(clock)
    with on_mesh(mesh):
        trainer.train([presharded(trainer, batch_fn(s), mesh) for s in range(steps)])
    history = {m: [float(x) for x in trainer.metrics_logger.get_metric_history("", m, "train")] for m in metrics}
    train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

    def one_step(batch):
        with on_mesh(mesh):
            return train_step(sharding_utils.shard_input(trainer._prepare_inputs(batch),
                                                         trainer.config.data_sharding_axis))

    loop_seconds = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return history, loop_seconds, one_step


def timings(kit_call, tunix_step, trainer, first, mesh, repeats, extra=None) -> dict:
    """Kit and Tunix steps timed in turns, with the parts of Tunix's step (preparing the batch,
    the jitted step) and, on a mesh, Tunix fed the host batch instead of a sharded one."""
    from tunix.sft import sharding_utils

    train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

    def prepare():
        with on_mesh(mesh):
            return sharding_utils.shard_input(trainer._prepare_inputs(presharded(trainer, first, mesh)),
                                              trainer.config.data_sharding_axis)

    example = prepare()

    def jitted():
        with on_mesh(mesh):
            return train_step(example)

    contenders = {"kit": kit_call, "tunix": lambda: tunix_step(presharded(trainer, first, mesh)),
                  **(extra or {}), "tunix_prepare": prepare, "tunix_jitted_step": jitted}
    if mesh is not None:
        contenders["tunix_host_batch"] = lambda: tunix_step(first)
    times = bench.interleaved_times(contenders, repeats=repeats, min_seconds=SAMPLE_SECONDS)
    out = {"kit_over_tunix": bench.spread_of_ratio(times, "kit", "tunix"), "seconds": bench.medians(times)}
    if mesh is not None:
        out["kit_over_tunix_host_batch"] = bench.spread_of_ratio(times, "kit", "tunix_host_batch")
    return out


def summary(kit_history, tunix_history, loop_seconds, timed, **details) -> dict:
    return {**timed, "losses": {"kit": [h["loss"] for h in kit_history], "tunix": tunix_history["loss"]},
            "tunix_train_loop_seconds_per_step": float(np.median(loop_seconds)) if loop_seconds else None,
            **details}


# -------------------------------------------------------------------------- contests


def contest_sft(n_devices, steps, repeats):
    from tunix.sft import peft_trainer

    rows = sft_rows()
    tunix_rows = tunix_token_rows(rows)
    graphdef, params = model.split(model.make_model("student", seed=0))
    kit_batch = lambda s: data.batch_at(rows, s, SFT_BATCH, seed=0)  # noqa: E731
    kit_history, kit_call = kit_side(sft.objective(graphdef), params, kit_batch, None, n_devices, steps)
    mesh = tunix_mesh(n_devices)
    trainer = peft_trainer.PeftTrainer(wrap(graphdef, params, mesh), optimizer(),
                                       tunix_config(peft_trainer.TrainingConfig, steps))
    trainer.with_gen_model_input_fn(sft_model_inputs)
    batch_fn = lambda s: peft_trainer.TrainingInput(**data.batch_at(tunix_rows, s, SFT_BATCH, seed=0))  # noqa: E731
    tunix_history, loop_seconds, tunix_step = tunix_side(trainer, batch_fn, mesh, steps)
    timed = timings(kit_call, tunix_step, trainer, batch_fn(0), mesh, repeats)
    profile = gradient_profile(sft.objective(graphdef), graphdef, params, kit_batch(0), trainer, batch_fn(0), repeats)
    checks = [("loss: kit step, Tunix step", kit_history[0]["loss"], tunix_history["loss"][0])]
    return summary(kit_history, tunix_history, loop_seconds, timed, checks=checks, gradient_profile=profile)


def contest_dpo(n_devices, steps, repeats):
    from tunix.sft.dpo import dpo_trainer

    kit_rows, tunix_rows = pair_rows()
    graphdef, params = model.split(model.make_model("student", seed=0))
    dpo.reference_log_probs(graphdef, params, kit_rows, batch_size=DPO_PAIRS)  # compiles the scorer
    t0 = time.perf_counter()
    kit_rows = dpo.reference_log_probs(graphdef, params, kit_rows, batch_size=DPO_PAIRS)
    once_per_batch = (time.perf_counter() - t0) * DPO_PAIRS / len(kit_rows["chosen_inputs"])
    kit_batch = lambda s: data.batch_at(kit_rows, s, DPO_PAIRS, seed=0)  # noqa: E731
    kit_history, kit_call = kit_side(dpo.objective(graphdef, beta=BETA), params, kit_batch, None, n_devices, steps)
    _, recompute_call = kit_side(dpo.objective(graphdef, beta=BETA, cached_reference=False), params, kit_batch,
                                 params, n_devices, 1)
    mesh = tunix_mesh(n_devices)
    trainer = dpo_trainer.DPOTrainer(wrap(graphdef, params, mesh), wrap(graphdef, params, mesh), optimizer(),
                                     tunix_config(dpo_trainer.DPOTrainingConfig, steps, beta=BETA, label_smoothing=0.0))
    batch_fn = lambda s: dpo_trainer.TrainingInput(**data.batch_at(tunix_rows, s, DPO_PAIRS, seed=0))  # noqa: E731
    tunix_history, loop_seconds, tunix_step = tunix_side(trainer, batch_fn, mesh, steps,
                                                         ("loss", "log_probs/chosen", "log_probs/rejected"))
    timed = timings(kit_call, tunix_step, trainer, batch_fn(0), mesh, repeats, {"kit_recompute": recompute_call})
    profile = gradient_profile(dpo.objective(graphdef, beta=BETA), graphdef, params, kit_batch(0), trainer,
                               trainer._prepare_inputs(batch_fn(0)), repeats)
    # Tunix scores the 8 completion positions only (logits_to_keep); the kit all 24, then masks
    checks = [("loss: kit step, Tunix step", kit_history[0]["loss"], tunix_history["loss"][0]),
              ("mean summed log-prob of the chosen answers: kit step, Tunix step", kit_history[0]["logps/chosen"],
               tunix_history["log_probs/chosen"][0]),
              ("mean summed log-prob of the rejected answers: kit step, Tunix step", kit_history[0]["logps/rejected"],
               tunix_history["log_probs/rejected"][0])]
    return summary(kit_history, tunix_history, loop_seconds, timed, checks=checks,
                   kit_reference_once_seconds_per_batch=once_per_batch, gradient_profile=profile)


def gradient_profile(objective, graphdef, params, kit_batch, trainer, tunix_example, repeats) -> dict:
    """The part both steps share, apart: the policy's forward and backward pass on the same
    rows, the kit's objective against the trainer's own loss function (`loss_fn` on
    `gen_model_input_fn`), on one device. XLA's cost of each, and their times in turns."""
    def tunix_loss(tunix_model, example):
        out = trainer.loss_fn(tunix_model, **trainer.gen_model_input_fn(example))
        return out[0] if isinstance(out, tuple) else out  # (loss, aux) where the trainer has aux

    kit = jax.jit(jax.grad(lambda p, b: objective(p, b, None)[0]))
    model_graphdef, model_params = nnx.split(wrap(graphdef, params))
    tunix = jax.jit(jax.grad(lambda p, ex: tunix_loss(nnx.merge(model_graphdef, p), ex)))
    one_device = jax.devices()[0]  # on a mesh too: one device's work on each side
    params, model_params, kit_batch, tunix_example = jax.device_put(
        (params, model_params, kit_batch, tunix_example), one_device)
    times = bench.interleaved_times({"kit": lambda: kit(params, kit_batch),
                                     "tunix": lambda: tunix(model_params, tunix_example)},
                                    repeats=repeats, min_seconds=SAMPLE_SECONDS)
    return {"kit_over_tunix": bench.spread_of_ratio(times, "kit", "tunix"), "seconds": bench.medians(times),
            "xla_cost": {"kit": bench.cost(kit, params, kit_batch),
                         "tunix": bench.cost(tunix, model_params, tunix_example)}}


def contest_distill(n_devices, steps, repeats):
    from tunix.distillation import distillation_trainer, strategies

    rows = sft_rows()
    tunix_rows = tunix_token_rows(rows)
    graphdef, params = model.split(model.make_model("student", seed=0))
    teacher_graphdef, teacher_params = distill.load_teacher()
    kit_batch = lambda s: data.batch_at(rows, s, DISTILL_BATCH, seed=0)  # noqa: E731
    objective = distill.objective(graphdef, teacher_graphdef, temperature=TEMPERATURE, alpha=ALPHA)
    kit_history, kit_call = kit_side(objective, params, kit_batch, teacher_params, n_devices, steps)
    mesh = tunix_mesh(n_devices)
    strategy = strategies.LogitStrategy(next_token_logits, next_token_logits, next_token_labels,
                                        temperature=TEMPERATURE, alpha=ALPHA)
    trainer = distillation_trainer.DistillationTrainer(
        wrap(graphdef, params, mesh), wrap(teacher_graphdef, teacher_params, mesh), strategy, optimizer(),
        tunix_config(distillation_trainer.TrainingConfig, steps))
    batch_fn = lambda s: distillation_trainer.TrainingInput(  # noqa: E731
        **data.batch_at(tunix_rows, s, DISTILL_BATCH, seed=0))
    tunix_history, loop_seconds, tunix_step = tunix_side(trainer, batch_fn, mesh, steps)
    timed = timings(kit_call, tunix_step, trainer, batch_fn(0), mesh, repeats)
    kit_definition, tunix_definition = crossed_definitions(
        (graphdef, params), (teacher_graphdef, teacher_params), kit_batch(0), strategy)
    checks = [("loss: kit step, the kit's definition on logits from Tunix's call path", kit_history[0]["loss"],
               kit_definition),
              ("loss: Tunix step, Tunix's definition on logits from the kit's call path", tunix_history["loss"][0],
               tunix_definition)]
    return summary(kit_history, tunix_history, loop_seconds, timed, checks=checks,
                   kit_definition_on_tunix_logits=kit_definition, tunix_definition_on_kit_logits=tunix_definition)


def crossed_definitions(student, teacher, batch, strategy):
    """(the kit's loss from logits of Tunix's call path, Tunix's loss from the kit's), first step.

    Kit: `losses.distillation_loss` on `next_token_logits` of both wrapped models (the
    last position dropped: its target is never a completion token). Tunix: its
    `LogitStrategy.compute_loss` on `model.apply`'s logits. Each must equal that side's
    first-step loss: the same models and batches, two definitions.
    """
    rows = {k: jnp.asarray(v) for k, v in tunix_token_rows(batch).items()}
    via_tunix = [next_token_logits(wrap(*m), **rows) for m in (student, teacher)]
    kit, _ = losses.distillation_loss(*via_tunix, batch["targets"][:, :-1], batch["loss_mask"][:, :-1],
                                      temperature=TEMPERATURE, alpha=ALPHA)
    via_kit = [model.apply(*m, batch["inputs"], batch["attention_mask"])[:, :-1] for m in (student, teacher)]
    tunix, _ = strategy.compute_loss(*via_kit, next_token_labels(**rows))
    return float(kit), float(tunix)


CONTESTS = {"sft": contest_sft, "dpo": contest_dpo, "distill": contest_distill}


# ------------------------------------------------------------------------ processes


def measure(n_devices: int, quick: bool) -> dict:
    """Every contest on the first `n_devices` devices of this process."""
    import tunix

    if jax.device_count() < n_devices:
        return {"skipped": f"{n_devices} devices asked, {jax.device_count()} {jax.default_backend()} device(s) here"}
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # `with mesh:` and thread_resources (on_mesh)
    steps, repeats = (3, 3) if quick else (8, 20)
    out = {"machine": bench.machine(), "tunix_version": tunix.__version__, "loss_steps": steps, "repeats": repeats}
    for name, contest in CONTESTS.items():
        out[name] = contest(n_devices, steps, repeats)
    return out


def measure_in_child(n_devices: int, quick: bool, attempts: int = 2) -> dict:
    """`measure` in a fresh process that simulates `n_devices` CPU devices (none on an accelerator).

    A failed process is run once more, and its error kept (`failed_attempts`): on 8 simulated
    devices sharing 2 busy cores, XLA's CPU runtime once in about ten runs aborted an
    all-to-all whose 8th device thread had not joined within its 40 s limit ("only 7 of
    them arrived on time"). Both DPO sides have all-to-alls: they concatenate the chosen
    and rejected rows of a sharded batch.
    """
    # the accelerator, if any, is the child's: this process starts only children, one at a time
    env = devices.child_env(keep_accelerator=True)
    code = ("import json; from tunix_nb import devices; "
            f"devices.accelerator_hint() or devices.simulate_cpu_devices({n_devices}); "
            "from tunix_nb import tunix_compare; "
            f"print(json.dumps(tunix_compare.measure({n_devices}, {quick})))")
    failures = []
    for _ in range(attempts):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
        if run.returncode == 0:
            return {**json.loads(run.stdout.strip().splitlines()[-1]), "failed_attempts": failures}
        failures.append(run.stderr[-1500:])
    raise RuntimeError(f"The {n_devices}-device measurement failed {attempts} times; last:\n{failures[-1]}")


# --------------------------------------------------------------------------- results


def agreement(checks) -> dict:
    """First-step values that must be equal, each pair within LOSS_RTOL of each other."""
    rows = [{"what": what, "values": [a, b], "relative_difference": abs(a - b) / max(abs(b), 1e-12)}
            for what, a, b in checks]
    return {"checks": rows, "rtol": LOSS_RTOL, "agree": all(r["relative_difference"] <= LOSS_RTOL for r in rows)}


def figure(method: str, raw: dict) -> dict:
    """One contest as a figure: kit / Tunix step time against its target, and the losses."""
    ratio = raw["kit_over_tunix"]
    target = TARGETS[method]
    if method in SAME_DEFINITION:  # every step's loss, not just the first: the same updates
        kit, tunix = np.asarray(raw["losses"]["kit"]), np.asarray(raw["losses"]["tunix"])
        raw["losses"]["max_relative_difference"] = float(np.max(np.abs(kit - tunix) / np.abs(tunix)))
    return {"value": ratio["median"], "target": target, "target_kind": "max", "meets_target": ratio["median"] <= target,
            # the target inside the rounds' quartiles: met or missed by the machine's noise
            "target_within_iqr": ratio["q25"] <= target <= ratio["q75"],
            "spread": ratio, "loss_definition": DEFINITIONS[method], "first_step": agreement(raw.pop("checks")),
            **{k: v for k, v in raw.items() if k != "kit_over_tunix"}}


def results(runs: dict, command: str, quick: bool, load: dict) -> dict:
    figures = {m: {n: figure(m, run[m]) for n, run in runs.items() if "skipped" not in run} for m in METHODS}
    some = next(run for run in runs.values() if "skipped" not in run)
    return {
        "command": command, "quick": quick, "comparable_to_targets": not quick,
        "versions": {"google-tunix": some["tunix_version"], **some["machine"]["versions"]},
        "machines": {n: run.get("machine", run) for n, run in runs.items()},
        "failed_attempts": {n: run.get("failed_attempts", []) for n, run in runs.items()},
        "load_average": load,
        "settings": {"model": "student preset (d_model 64, 2 layers), seed 0; distillation teacher: data/teacher",
                     "batches": {"sft": SFT_BATCH, "dpo_pairs": DPO_PAIRS, "distill": DISTILL_BATCH, "seq_len": 24},
                     "optimizer": "tunix_nb.train.make_optimizer(OptimizerConfig(total_steps=100)) on both sides",
                     "kit_strategy": {"1": "jit", "8": "dp"}, "tunix_mesh": {"1": None, "8": {"fsdp": 8}},
                     "loss_steps": some["loss_steps"], "repeats": some["repeats"],
                     "method": "kit step (batch placed + step) and Tunix step (shard_input + _prepare_inputs + "
                               "shard_input + jitted train step, as train() runs it without logging, fed a batch "
                               "sharded over its mesh) timed in rounds in rotating order after 2 warm-up calls, "
                               f"each sample the mean of calls filling {SAMPLE_SECONDS} s; a figure is the median "
                               "of per-round kit / Tunix ratios"},
        "notes": {
            "kit_over_tunix_host_batch": "on a mesh, Tunix fed a host (NumPy) batch, as its loop takes one from a data "
                                         "iterator: _prepare_inputs runs the reference or teacher forward pass before "
                                         "shard_input, so whole on every device",
            "compatibility": f"Tunix {some['tunix_version']} runs on the kit's jax, flax, optax and orbax pins. It "
                             "reads its mesh from pxla.thread_resources (deprecated since JAX 0.8.2), which only the "
                             "deprecated `with mesh:` sets: under jax.set_mesh its trainers shard nothing. Its "
                             "declared safetensors<0.8 and its other requirements are not imported by the trainers",
        },
        "figures": figures,
        "targets_met": all(f["meets_target"] for per_n in figures.values() for f in per_n.values()),
        "losses_agree": all(f["first_step"]["agree"] for per_n in figures.values() for f in per_n.values()),
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bars = [(m, n, f) for m in METHODS for n, f in res["figures"][m].items()]
    for i, (m, n, f) in enumerate(bars):
        s = f["spread"]
        ax.bar(i, f["value"], color="C0" if f["meets_target"] else "C3")
        ax.errorbar(i, f["value"], yerr=[[f["value"] - s["q25"]], [s["q75"] - f["value"]]], color="k", capsize=3)
        ax.hlines(f["target"], i - 0.4, i + 0.4, colors="k", linestyles="--")
    ax.set_xticks(range(len(bars)), [f"{m}\n{n} dev" for m, n, _ in bars])
    ax.set_ylabel("kit step / Tunix step (time)")
    ax.set_title(f"Kit vs Tunix {res['versions']['google-tunix']}: median, IQR; dashed: target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(method: str, n: str, f: dict) -> str:
    s, first = f["spread"], f["first_step"]
    verdict = "met" if f["meets_target"] else "MISSED"
    if f["target_within_iqr"]:
        verdict += " (within the rounds' IQR)"
    return (f"{method}, {n} device(s): kit/Tunix step time {f['value']:.3f} (IQR {s['q25']:.3f}-{s['q75']:.3f}), "
            f"target <= {f['target']} {verdict}; first-step loss kit {f['losses']['kit'][0]:.6f}, "
            f"Tunix {f['losses']['tunix'][0]:.6f}{'' if method in SAME_DEFINITION else ' (two definitions)'}; "
            f"checks {'agree' if first['agree'] else 'DISAGREE'} (rtol {first['rtol']:g})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.tunix_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds: a check, not a figure")
    parser.add_argument("--out", default="results", help="directory for tunix_compare.json and .png")
    args = parser.parse_args(argv)
    reason = tunix_missing()
    if reason is not None:
        print(f"tunix_compare skipped: {reason}")
        return 0
    load = {"before": os.getloadavg()}
    runs = {str(n): measure_in_child(n, args.quick) for n in DEVICE_COUNTS}
    load["after"] = os.getloadavg()
    command = "python -m tunix_nb.tunix_compare" + (" --quick" if args.quick else "") + f" --out {args.out}"
    res = results(runs, command, args.quick, load)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tunix_compare.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    plot(res, out / "tunix_compare.png")
    for method in METHODS:
        for n, f in res["figures"][method].items():
            print(describe(method, n, f))
    for n, failures in res["failed_attempts"].items():
        for error in failures:
            print(f"The {n}-device measurement failed once and ran again; its error ends:\n{error[-600:]}")
    print(f"Wrote {out / 'tunix_compare.json'} and {out / 'tunix_compare.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
