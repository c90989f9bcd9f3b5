"""The run stage's loop: train from the start step to --stop-after or --steps, saving every
--save-every steps and evaluating every --eval-every (keeping the best checkpoint), with the
metrics going to --report-to's trackers. Each step's batch is a pure function of (--seed,
step), packed with --packing; each process loads only its own rows of it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from tunix_nb import distributed, tracking
from tunix_nb.cli.checkpoints import BestCheckpoint
from tunix_nb.cli.methods import Method
from tunix_nb.cli.run_config import RunConfig
from tunix_nb.distributed import print_once


def open_trackers(args, start: int) -> tracking.Trackers:
    """--report-to's trackers, resumed at `start` (process 0 only; the others log nothing)."""
    if not distributed.is_main_process():
        return tracking.Trackers([])
    logging_dir = args.logging_dir or (str(Path(args.ckpt_dir) / "tensorboard") if args.ckpt_dir else None)
    return tracking.open_trackers(args.report_to, start=start, metrics_file=args.metrics_file,
                                  logging_dir=logging_dir)


def keep_metrics_file(args, start: int) -> None:
    """A run that starts at step 0 moves --metrics-file's rows aside rather than cutting them: they
    may be another run's (or a restart's own, killed before its first save), so nothing is lost.
    A resumed run keeps the rows up to its step and appends, as the trackers do."""
    path = Path(args.metrics_file) if args.metrics_file else None
    if start > 0 or path is None or not path.is_file() or not distributed.is_main_process():
        return
    rows = tracking.read_jsonl_upto(path, float("inf"))
    if rows:
        aside = path.with_name(f"{path.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        print_once(f"--metrics-file {path} held {len(rows)} rows of an earlier run; this run starts at step 0, so "
                   f"they were moved to {aside.name} beside it")


def make_eval_loss(method: Method, batch_size: int, mesh):
    """params -> the objective's loss over the whole eval split (sums and weights over chunks of
    `batch_size` rows, divided once: the token mean for sft, the pair mean for dpo)."""
    import jax

    from tunix_nb import parallel

    objective = jax.jit(method.eval_objective or method.objective)
    rows = method.eval_rows
    n_rows = len(next(iter(rows.values())))

    def eval_loss(params) -> float:
        params = parallel.gather(params) if mesh is not None else params
        total = weight = 0.0
        for lo in range(0, n_rows, batch_size):
            loss_sum, chunk_weight, _ = objective(params, {k: v[lo:lo + batch_size] for k, v in rows.items()},
                                                  method.frozen)
            total, weight = total + float(loss_sum), weight + float(chunk_weight)
        return total / weight

    return eval_loss


def train_with_saves(args, config, method, step_fn, start, manager, trackers, mesh, run_key, stop=None):
    """Train `method`'s state from `start` to --stop-after or --steps, saving every --save-every
    steps and evaluating every --eval-every steps; -> (params, step).

    The state is placed on the devices once, here, and handed to the loop chunk after chunk:
    nothing else holds it, so it lives once and the step's donation frees each step's input.
    `stop` (a `StopRequest`): once it is requested, the step in flight is the last, and it is
    saved and committed before this returns."""
    import jax

    from tunix_nb import checkpoint

    evaluate = make_eval_loss(method, config.batch_size, mesh) if args.eval_every else None
    best = BestCheckpoint(args.ckpt_dir, async_save=not args.sync_save) if evaluate and manager else None
    pending = {}  # an evaluating step's record, logged once its eval loss is in

    def log(step, record):
        if evaluate is not None and step % args.eval_every == 0:
            pending[step] = record
        else:
            trackers.log(record)

    rollout_fn = None if method.make_rollout is None else method.make_rollout(args.parallel, mesh)
    params, opt_state = place_once(args, method, step_fn, mesh)
    step = start
    stop_at = config.steps if args.stop_after is None else args.stop_after
    while step < stop_at:  # run to the next save (or eval) point, save (in the background), repeat
        chunk = min(args.save_every - step % args.save_every, stop_at - step,
                    args.eval_every - step % args.eval_every if evaluate else stop_at)
        params, opt_state, done = _train_chunk(args, config, method, step_fn, params, opt_state, rollout_fn, step,
                                               chunk, log, mesh, stop)
        step += done
        stopping = stop is not None and stop.requested()
        state = dict(params=params, opt_state=opt_state, rng=jax.random.fold_in(run_key, step),
                     meta={"config": config.record(), "seed": config.seed})
        if manager is not None:
            checkpoint.save(manager, step, force=step == stop_at or stopping, **state)
        if step in pending:
            record = {**pending.pop(step), "eval/loss": evaluate(params)}
            trackers.log(record)
            if best is not None:
                best.offer(step, record["eval/loss"], **state)
        if stopping:
            break
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if best is not None:
        best.close()
    return params, step


def place_once(args, method, step_fn, mesh):
    """(params, opt_state) taken from `method`, placed for the step with the frozen weights and
    the reference (put back on `method`), all without copies: the loop gets them as they lie.
    Under pmap `train.run` replicates each chunk's state (every device holds a replica anyway)."""
    from tunix_nb import train

    params, opt_state = method.take_state()
    if args.parallel == "pmap":
        return params, opt_state
    place = train.Placement(step_fn, args.parallel, keep_placement=mesh is not None, caller="the command")
    params, opt_state, (method.frozen, method.reference) = place.state(
        params, opt_state, (method.frozen, method.reference), copy=False)
    return params, opt_state


def _train_chunk(args, config, method, step_fn, params, opt_state, rollout_fn, step, chunk, log, mesh, stop):
    """`chunk` steps from `step`, fewer if `stop` is requested: -> (params, opt_state, steps run)."""
    from tunix_nb import train

    # under pmap train.run hands back one (unreplicated) copy; on a mesh the state stays
    # placed, and every process saves its own shards of it
    common = dict(steps=chunk, start_step=step, parallel_mode=args.parallel,
                  progress=sys.stderr.isatty() and distributed.is_main_process(), on_step=log,
                  desc=f"{config.command} {step}->{step + chunk}", keep_placement=mesh is not None,
                  hand_over=True, should_stop=None if stop is None else stop.should_stop)
    if rollout_fn is None:
        params, opt_state, history = train.run(step_fn, params, opt_state, batch_source(method, config, mesh),
                                               frozen=method.frozen, **common)
    else:  # on-policy: each step samples its batch with the current params
        params, opt_state, history = train.run_on_policy(step_fn, params, opt_state, rollout_fn,
                                                         num_iterations=config.num_iterations,
                                                         reference=method.reference, frozen=method.frozen, **common)
    return params, opt_state, len(history)


def batch_source(method: Method, config: RunConfig, mesh):
    """step -> this process's rows of the step's batch: `data.batch_at`'s examples, a pure
    function of (--seed, step), packed into `method.packing.num_rows` rows with --packing."""
    from tunix_nb import data, packing

    if method.packing is None:
        my_rows = _process_rows(mesh, config.batch_size)
        return lambda k: data.batch_at(method.rows, k, config.batch_size, seed=config.seed, rows=my_rows)
    my_rows = _process_rows(mesh, method.packing.num_rows) or slice(None)

    def packed_batch(k):  # every process packs the global batch, then keeps its rows
        batch, _ = packing.packed_batch_at(method.rows, k, config.batch_size, seed=config.seed, cfg=method.packing)
        return {key: rows[my_rows] for key, rows in batch.items()}

    return packed_batch


def packing_of(config: RunConfig, rows: dict, parallel_mode: str):
    """--packing: the packing.PackingConfig of every step (None without it). Rows as long as the
    unpacked ones; as many as the run's fullest step needs (`packing.rows_needed`), rounded
    up to a multiple of the devices x --grad-accum so that every batch splits evenly: a pure
    function of the run's data and flags, so a resumed run packs as it did."""
    if not config.data.packing:
        return None
    import jax

    from tunix_nb import packing

    cfg = packing.PackingConfig(max_length=int(rows["inputs"].shape[1]))
    needed = packing.rows_needed(rows, steps=config.steps, batch_size=config.batch_size, seed=config.seed, cfg=cfg)
    multiple = (1 if parallel_mode == "jit" else jax.device_count()) * config.training.grad_accum
    return dataclasses.replace(cfg, num_rows=-(-needed // multiple) * multiple)


def _process_rows(mesh, batch_size):
    """This process's share of every global batch: all of it, unless several processes run."""
    from tunix_nb import parallel

    return parallel.process_rows(mesh, batch_size) if mesh is not None else None
