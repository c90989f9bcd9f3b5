"""The build stage's result: a `Method`, what one command trains (the model, its rows, its
objective, what stays frozen, how it samples and what it exports), made by one builder per
command. A new method adds its builder to `build_method` (CONTRIBUTING.md).
"""

from __future__ import annotations

import dataclasses

from tunix_nb import distill, dpo, gkd, grpo, sft
from tunix_nb.cli.flags import FlagError, RunError
from tunix_nb.cli.models import build_model, trainable
from tunix_nb.cli.rows import encoded_user_data, training_arrays, training_examples
from tunix_nb.cli.run_config import RunConfig, chunks_of
from tunix_nb.distributed import print_once


@dataclasses.dataclass
class Method:
    """What one command trains: the model, its rows, its objective and what stays frozen."""

    graphdef: object
    params: object
    rows: dict
    objective: object
    frozen: object = None
    # on-policy methods (grpo): (parallel_mode, mesh) -> rollout_fn for train.run_on_policy,
    # and the reference the rollout scores with
    make_rollout: object = None
    reference: object = None
    # the trained params -> (graphdef, params) of the plain model to export (LoRA: merged)
    exportable: object = None
    # the eval split's rows, which `objective` scores (with --eval-every; None: no eval loss)
    eval_rows: dict | None = None
    tokenizer: object = None
    lora_alpha: float | None = None  # LoRA: the adapters' alpha (scale alpha / rank), for --export-adapter
    # --packing: how each step's examples become packed rows (packing.PackingConfig, its num_rows
    # set in `prepare`); and the objective of the unpacked eval rows where `objective` wants packed ones
    packing: object = None
    eval_objective: object = None
    # the optimizer's state (set in `prepare`, with `params` restored from --ckpt-dir where it holds this run)
    opt_state: object = None
    # --scan-layers: the trained params -> the model's own State (one tree per block), for the
    # exports; None where the params are trained in the model's layout already (`stack_layers`)
    unstack: object = None

    def take_state(self):
        """(params, opt_state), keeping no reference here: the loop's are then the only ones, so
        the training state lives once on the devices and the donating step frees each step's input."""
        state, self.params, self.opt_state = (self.params, self.opt_state), None, None
        return state


def stack_layers(method: Method) -> Method:
    """--scan-layers: train the blocks' parameters stacked on a layer axis (`layer_stack`), so that
    the optimizer's program, and with it the compile, does not grow with the depth. The params
    are handed over (the per-block arrays freed as they are stacked), and so is a LoRA base, which
    the step would otherwise stack anew every step; the objectives slice the blocks back out;
    `unstack` gives the exports the model's own layout. On-policy methods, whose sampling runs the
    blocks one by one, and blocks that differ keep one tree per block."""
    from tunix_nb import layer_stack, lora

    if method.make_rollout is not None:
        return method
    try:
        stacked = layer_stack.layout(method.params, method.frozen)
    except ValueError as err:
        print_once(f"--scan-layers: {err} The state stays one tree per block.")
        return method
    method.params, method.frozen = layer_stack.stack_state(method.params, method.frozen, stacked, delete_blocks=True)
    method.objective = stacked.objective(method.objective)
    if method.eval_objective is not None:
        method.eval_objective = stacked.objective(method.eval_objective)
    method.unstack = stacked.unstack
    if stacked.base_like is not None:  # the base's blocks were freed: the export merges into the stack's
        # slices, of the base as placed for the step (read at the export: placing may replace it)
        graphdef, alpha = method.graphdef, method.lora_alpha
        method.exportable = lambda params: lora.merge(graphdef, params, stacked.base(method.frozen["base"]), alpha=alpha)
    return method


def build_method(config: RunConfig, *, with_eval: bool = False) -> Method:
    """The model, data rows, objective and frozen parameters of `config.command` (with the eval
    split's rows too when `with_eval`)."""
    from tunix_nb import precision

    graphdef, params, tokenizer = build_model(config)
    dtype = precision.resolve_compute_dtype(config.training.compute_dtype)
    build = {"sft": _sft_method, "dpo": _dpo_method, "grpo": _grpo_method, "distill": _distill_method}
    method = build[config.command](config, graphdef, params, tokenizer, dtype, with_eval)
    method.tokenizer = tokenizer
    return method


def _sft_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    t = trainable(config, graphdef, params)
    return Method(t.graphdef, t.params, training_arrays(config, tokenizer),
                  t.objective(sft.objective(t.graphdef, compute_dtype=dtype, **chunks_of(config))), frozen=t.frozen(),
                  exportable=t.exportable, eval_rows=training_arrays(config, tokenizer, "eval") if with_eval else None,
                  lora_alpha=t.alpha)


def _dpo_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    t, options = trainable(config, graphdef, params), config.method
    objective = dpo.objective(t.graphdef, beta=options.beta, loss_type=options.loss_type,
                              sft_weight=options.sft_weight, length_normalize=options.length_normalize,
                              cached_reference=not options.reference_in_step, compute_dtype=dtype,
                              **chunks_of(config))
    if options.reference_in_step:  # the step scores the reference: its own copy, as the policy's is donated
        import jax
        import jax.numpy as jnp

        reference = t.frozen(jax.tree.map(jnp.copy, t.reference()))
        with_reference = lambda rows: rows  # noqa: E731
    else:
        reference = t.frozen()

        # cached once: the reference never changes (LoRA: the base, adapters off). Scored in the step's
        # batch shape: in bfloat16 another shape rounds apart, and step 1 would not start at ln 2.
        def with_reference(rows):
            return dpo.reference_log_probs(t.graphdef, t.reference(), rows, length_normalize=options.length_normalize,
                                           compute_dtype=dtype, batch_size=config.batch_size, **chunks_of(config))

    eval_rows = with_reference(training_arrays(config, tokenizer, "eval")) if with_eval else None
    return Method(t.graphdef, t.params, with_reference(training_arrays(config, tokenizer)), t.objective(objective),
                  frozen=reference, exportable=t.exportable, eval_rows=eval_rows, lora_alpha=t.alpha)


def _grpo_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    import jax
    import jax.numpy as jnp

    from tunix_nb import lora

    t, options = trainable(config, graphdef, params), config.method  # the SFT checkpoint stays as the reference
    if config.data.train_file is None:
        examples, rows = training_examples(config), None
    else:  # the prompts as the chat template renders them; every column reaches the rewards
        encoded = encoded_user_data(config, tokenizer)
        examples, rows = encoded.examples, encoded.arrays
    reward_set = make_reward_set(options, examples, user_data=config.data.train_file is not None)
    objective = grpo.objective(t.graphdef, epsilon=options.epsilon, epsilon_high=options.epsilon_high,
                               beta=options.beta, kl_estimator=options.kl_estimator,
                               aggregation=options.aggregation, compute_dtype=dtype, **chunks_of(config))

    graphdef, is_lora = t.graphdef, t.lora  # the closure keeps no reference to t's starting params

    def make_rollout(parallel_mode, mesh):
        rollout_fn = grpo.make_rollout(
            graphdef, examples, reward_set, batch_size=config.batch_size, group_size=options.group_size,
            seed=config.seed, estimator=options.advantage, num_iterations=options.num_iterations,
            beta=options.beta, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
            compute_dtype=dtype, parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer, rows=rows,
            **chunks_of(config))
        # with LoRA the reference is the base itself: no second copy of the weights
        return lora.rollout(rollout_fn, with_reference=options.beta > 0) if is_lora else rollout_fn

    # a copy: the step donates the policy's arrays, which the reference must outlive
    reference = jax.tree.map(jnp.copy, t.params) if options.beta > 0 and not t.lora else None
    rows = training_arrays(config, tokenizer, examples=examples) if rows is None else rows
    return Method(t.graphdef, t.params, rows, t.objective(objective),
                  frozen=t.frozen(), make_rollout=make_rollout, reference=reference, exportable=t.exportable,
                  lora_alpha=t.alpha)


def _distill_method(config, graphdef, params, tokenizer, dtype, with_eval) -> Method:
    options, sampling = config.method, config.gkd
    rows = training_arrays(config, tokenizer)
    eval_rows = training_arrays(config, tokenizer, "eval") if with_eval else None
    teacher_graphdef, teacher_params = distill.load_teacher(options.teacher)
    objective = distill.objective(graphdef, teacher_graphdef, beta=options.beta or 0.0, compute_dtype=dtype,
                                  **chunks_of(config))
    if config.data.packing:  # per-example means taken per segment; the eval rows stay unpacked
        from tunix_nb import packing

        packed = packing.distill_objective(graphdef, teacher_graphdef, beta=options.beta or 0.0, compute_dtype=dtype,
                                           **chunks_of(config))
        return Method(graphdef, params, rows, packed, frozen=teacher_params, eval_rows=eval_rows,
                      eval_objective=objective)
    if not (sampling.lmbda or sampling.seq_kd):  # offline: the dataset's answers
        return Method(graphdef, params, rows, objective, frozen=teacher_params, eval_rows=eval_rows)

    def make_batches(parallel_mode, mesh):  # GKD: the student's samples, the teacher's answers
        return gkd.make_batches(graphdef, teacher_graphdef, training_examples(config),
                                batch_size=config.batch_size, seed=config.seed, lmbda=sampling.lmbda,
                                seq_kd=sampling.seq_kd, temperature=sampling.temperature or 1.0,
                                max_new_tokens=sampling.max_new_tokens, compute_dtype=dtype,
                                parallel_mode=parallel_mode, mesh=mesh, tokenizer=tokenizer)

    return Method(graphdef, params, rows, objective, frozen=teacher_params, make_rollout=make_batches,
                  eval_rows=eval_rows)


def make_reward_set(options: grpo.GRPOConfig, examples, user_data: bool = False):
    """--rewards' built-in functions and --reward-funcs' own, each under its name (metric
    rewards/<name>/...); tried once on the first examples before training, unless they are the
    built-ins on the shipped task (a --train-file may lack the columns the built-ins read)."""
    from tunix_nb import rewards

    funcs = {name: grpo.REWARD_FUNCTIONS[name] for name in options.reward_names}
    if options.reward_funcs:
        try:
            own = rewards.load_reward_funcs(options.reward_funcs)
        except ValueError as err:
            raise FlagError(str(err))
        both = sorted(set(own) & set(funcs))
        if both:
            raise FlagError(f"--reward-funcs: {', '.join(both)} is also a --rewards name; each reward logs "
                            "rewards/<name>, so rename your function or drop it from --rewards")
        funcs.update(own)
    reward_set = rewards.combine(funcs)
    if options.reward_funcs or user_data:
        _try_rewards(reward_set, examples[:4], options)
    return reward_set


def _try_rewards(reward_set, examples, options: grpo.GRPOConfig) -> None:
    """Call the reward functions on `examples` with their reference answers (or empty strings) as the completions:
    a function that fails, or returns the wrong length or NaN, stops the run before it starts."""
    from tunix_nb import rewards

    flags = " / ".join(flag for flag, given in (("--rewards", options.reward_names),
                                                ("--reward-funcs", options.reward_funcs)) if given)
    # the built-ins read the shipped task's columns: say how to feed them, or to leave them out
    hint = (f" The built-in --rewards {options.rewards} read the reference answer from a 'completion' column: "
            "name yours so, or pass your own with --reward-funcs (alone unless --rewards names built-ins)."
            if options.reward_names else "")
    columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
    # the reference answers where the data has them (the shipped task), else empty completions
    prompts = [e["prompt"] for e in examples]
    completions = rewards.for_reward_functions(prompts, [e.get("completion", "") for e in examples])
    try:
        reward_set(prompts, completions, **columns)
    except rewards.RewardError as err:
        raise RunError(f"{flags}: {err} (tried on the first {len(examples)} examples, their reference "
                       f"answers as the completions).{hint} Nothing was changed.")
    except Exception as err:  # a function raised: show what it was called with
        raise RunError(f"{flags}: a reward function raised {type(err).__name__}: {err}, called as "
                       f"fn(prompts, completions, {', '.join(f'{k}=' for k in columns)}) on the first "
                       f"{len(examples)} examples.{hint} Nothing was changed.")
