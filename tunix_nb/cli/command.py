"""The training command itself: `main` runs the stages in the order data flows through them:
flags, config, build, run, export. `prepare` is everything up to the first step.
"""

from __future__ import annotations

import sys

from tunix_nb import devices, distributed
from tunix_nb.cli.checkpoints import open_checkpoints, resume, with_recorded_defaults
from tunix_nb.cli.export import export_run
from tunix_nb.cli.flags import FlagError, RunError, build_parser, check_flags, command_parser, parse_args
from tunix_nb.cli.loop import keep_metrics_file, open_trackers, packing_of, train_with_saves
from tunix_nb.cli.methods import build_method, stack_layers
from tunix_nb.cli.output_paths import check_output_paths
from tunix_nb.cli.run_config import check_devices, resolve_config
from tunix_nb.cli.stop_signals import StopRequest
from tunix_nb.distributed import print_once
from tunix_nb.train.config import MESH_CHOICES


def start_jax(args) -> None:
    """Fix the device count, share compiled programs across runs (the persistent
    compilation cache) and join the other processes: all before JAX starts."""
    if args.devices:
        devices.simulate_cpu_devices(args.devices)
    devices.use_compile_cache()
    if args.distributed:  # jax.devices() then lists every process's devices
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               heartbeat_timeout_s=args.heartbeat_timeout)


def prepare(args):
    """(config, manager, method, step_fn, start step, mesh, run key): everything up to the first
    step, checked, with the state (`method.params`, `method.opt_state`) restored from --ckpt-dir
    when it holds this run."""
    import jax

    from tunix_nb import parallel, train

    config = resolve_config(args)
    check_devices(config, args.parallel)
    config = with_recorded_defaults(args, config)
    manager = open_checkpoints(args, config)  # checked first: a clash changes nothing
    method = build_method(config, with_eval=args.eval_every is not None)
    if config.training.scan_layers:
        method = stack_layers(method)
    n_rows = len(next(iter(method.rows.values())))
    if config.batch_size > n_rows:
        raise FlagError(f"--batch-size {config.batch_size} is larger than the {n_rows} training examples")
    method.packing = packing_of(config, method.rows, args.parallel)
    if method.packing is not None:
        print_once(f"--packing: each step's {config.batch_size} examples in {method.packing.num_rows} rows of "
                   f"{method.packing.max_length} tokens")
    updates = config.num_iterations  # grpo: the schedule counts updates, mu per step
    optimizer = train.make_optimizer(train.OptimizerConfig(
        learning_rate=config.training.learning_rate, warmup_steps=config.training.warmup_steps * updates,
        total_steps=config.steps * updates))
    mesh = parallel.make_mesh() if args.parallel in MESH_CHOICES else None  # every process's devices
    step_fn = train.make_step(method.objective, optimizer, parallel_mode=args.parallel, donate=True, mesh=mesh,
                              grad_accum=config.training.grad_accum)
    run_key = jax.random.key(config.seed)
    plain_like = None
    if method.unstack is not None:  # trained stacked: a checkpoint saved one tree per block converts
        plain_params = jax.eval_shape(method.unstack, method.params)
        plain_like = (plain_params, jax.eval_shape(optimizer.init, plain_params))
    method.params, method.opt_state, start = resume(manager, args, method.params, optimizer.init(method.params),
                                                    run_key, mesh, plain_like)
    return config, manager, method, step_fn, start, mesh, run_key


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    usage = command_parser(parser, args.command)
    try:
        check_flags(args)
        check_output_paths(args)
    except FlagError as err:
        usage.error(str(err))
    start_jax(args)
    import jax

    from tunix_nb import rewards

    try:
        config, manager, method, step_fn, start, mesh, run_key = prepare(args)
        keep_metrics_file(args, start)
    except FlagError as err:
        usage.error(str(err))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trackers = open_trackers(args, start)
    try:
        # SIGTERM / SIGINT: the step in flight is saved, then the run stops (several processes
        # agree on that step first)
        with StopRequest(processes=jax.process_count()) as stop:
            params, step = train_with_saves(args, config, method, step_fn, start, manager, trackers, mesh, run_key,
                                            stop)
    except rewards.RewardError as err:  # a reward function went wrong mid-run: its message names it
        print(f"error: --rewards / --reward-funcs: {err}. The checkpoints saved so far are kept.", file=sys.stderr)
        return 2
    finally:
        trackers.close()
    code = _finish(args, config, method, params, step, stop, manager)
    if args.distributed:  # leave together: waits for the other processes to finish too
        distributed.shutdown()
    return code


def _finish(args, config, method, params, step, stop, manager) -> int:
    """Say how the run ended and export a finished one; -> the command's exit code."""
    import jax

    if stop.requested() and step < config.steps:
        saved = f"saved step {step} in {args.ckpt_dir}" if manager is not None else "no --ckpt-dir, nothing saved"
        print_once(f"Stopped by {stop.name} after step {step} of {config.steps}: {saved}; run the same command "
                   "to resume.")
        return stop.exit_code
    if step < config.steps:
        print_once(f"Stopped after step {step} of {config.steps} (--stop-after); run the same command "
                   "without it to resume.")
    else:
        export_run(args, config, method, params, step)
        print_once(f"Done: {config.command} {config.model}, {config.steps} steps"
                   + (f", {jax.process_count()} processes." if jax.process_count() > 1 else "."))
    return 0
