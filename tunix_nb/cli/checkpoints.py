"""The run stage's checkpoints: open --ckpt-dir (refusing one that holds another run), resume
from the newest checkpoint that restores, and keep the best one by eval loss.

The command saves the training state with Orbax every --save-every steps (in the background),
and resumes on its own from the newest checkpoint in --ckpt-dir, to exactly the run an
uninterrupted one would have been: same parameters, bit for bit, on the same device
count. It refuses (leaving the checkpoints untouched) when that run's config differs
from the flags given.

Resuming, in detail:
- Batches are a pure function of (--seed, step), and no step draws random numbers, so
  the step is the whole data/RNG state. GRPO's rollouts and on-policy distillation's
  batches (distill --lmbda) do sample, with keys that are a pure function of (--seed,
  step, row) (`sampler.rollout_keys`; `gkd.batch_source` for which steps sample), so the
  same holds. Each checkpoint also holds the run key folded with its step (item `rng`),
  which the resumed run checks against its own.
- A save killed midway leaves `<step>.orbax-checkpoint-tmp`, which is not a checkpoint;
  the resumed run ignores it and Orbax replaces it when it saves that step again.
- If the newest checkpoint is damaged, the run warns (step and error), resumes from the
  one before, and renames the damaged one to `<step>.damaged-<time>` so that the step
  can be saved again. It prints the new name; nothing is deleted.
- Checkpoints hold one copy of the state, so a run may resume on another device count
  (--devices, --parallel): bit for bit the same state, replicated onto the new devices.
- A run started before the subcommands existed (its checkpoints record the older, flat
  run config) resumes with the same flags: a field the old config lacks counts as its
  default (`RunConfig.clashes_with`).
- With --eval-every, the best checkpoint by eval loss is kept in `<--ckpt-dir>/best`
  (its own Orbax manager, keeping one), beside the newest ones; a resumed run keeps it
  and replaces it only with a better one.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from tunix_nb import distributed
from tunix_nb.cli.flags import RunError
from tunix_nb.cli.run_config import RunConfig
from tunix_nb.distributed import print_once


def open_checkpoints(args, config: RunConfig):
    """The run's CheckpointManager (None without --ckpt-dir), refusing one that holds another run."""
    from tunix_nb import checkpoint

    if not args.ckpt_dir:
        return None
    manager = checkpoint.make_manager(args.ckpt_dir, keep=args.keep, save_every=args.save_every,
                                      async_save=not args.sync_save)
    saved = checkpoint.newest_readable_meta(manager)
    if saved is not None:
        saved_config = saved.get("config", {})
        saved_hash = saved_config.get("model_sha256")
        if saved_hash != config.model_sha256 and (saved_hash or config.model_sha256):
            raise RunError(f"--ckpt-dir {args.ckpt_dir} holds a run of another model: its config.json and "
                           f"weights hash to {saved_hash or 'none (a preset, ' + repr(saved_config.get('model')) + ')'}"
                           f", --model {args.model} to {config.model_sha256 or 'none (a preset)'}. Pass the "
                           "--model that run trained (and its --revision), or use another --ckpt-dir. "
                           "Nothing was changed.")
        clashes = config.clashes_with(saved_config)
        if clashes:
            detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in clashes.items())
            raise RunError(f"--ckpt-dir {args.ckpt_dir} holds a different run ({detail}). "
                           "Use another --ckpt-dir, or the same flags to resume it. Nothing was changed.")
    return manager


def with_recorded_defaults(args, config: RunConfig) -> RunConfig:
    """`config` with the values default rules chose (`RunConfig.defaulted`: --max-length's default)
    replaced by those the run in --ckpt-dir recorded, said on stdout: a run begun under another
    default resumes as it began. Values given as flags are checked by `open_checkpoints`."""
    from tunix_nb import checkpoint

    if not (args.ckpt_dir and config.defaulted and _holds_saved_steps(Path(args.ckpt_dir))):
        return config
    with warnings.catch_warnings():  # a damaged newest step: open_checkpoints reports it
        warnings.simplefilter("ignore")
        try:
            saved = checkpoint.load_meta(args.ckpt_dir).get("config", {})
        except (FileNotFoundError, checkpoint.DamagedCheckpointError):
            return config
    config, adopted = config.with_recorded(saved)
    for name, (today, recorded) in adopted.items():
        print_once(f"--{name.replace('_', '-')}: {recorded}, as the run in --ckpt-dir {args.ckpt_dir} recorded it "
                   f"(today's default: {today})")
    return config


def _holds_saved_steps(ckpt_dir: Path) -> bool:
    """Whether --ckpt-dir holds a saved step (a folder named by its step number), by listing it.

    Every process of a run gets the same answer: another process may already have created the
    folder (its CheckpointManager does), but none can save before all have opened theirs. Opening
    a reader to look would be one more Orbax barrier on this process alone, and the processes'
    barriers would then pair up wrongly ("sync_global_devices name mismatch").
    """
    return ckpt_dir.is_dir() and any(entry.name.isdigit() and entry.is_dir() for entry in ckpt_dir.iterdir())


def resume(manager, args, params, opt_state, run_key, mesh, plain_like=None):
    """(params, opt_state, start step): from the newest checkpoint that restores, or as given.

    Damaged newer steps are moved aside (renamed, never deleted) so they can be saved again.
    `plain_like`: (params, opt_state) structures in the model's own layout, for a run that stacks
    its blocks (--scan-layers) to resume from a checkpoint saved one tree per block.
    """
    import jax

    from tunix_nb import checkpoint

    if manager is None or not manager.all_steps():
        return params, opt_state, 0
    newest = manager.latest_step()
    with warnings.catch_warnings(record=True) as caught:  # printed below, without file names
        warnings.simplefilter("always", checkpoint.DamagedCheckpointWarning)
        try:
            params, opt_state, meta = checkpoint.restore(
                manager, params_like=params, opt_state_like=opt_state, mesh=mesh,
                parallel_mode=args.parallel if mesh is not None else None, plain_like=plain_like)
        except checkpoint.DamagedCheckpointError as err:
            raise RunError(f"{err}. Move the damaged steps out of --ckpt-dir {args.ckpt_dir} (or use "
                           "another --ckpt-dir) to start over. Nothing was changed.")
        finally:
            for w in caught if distributed.is_main_process() else ():
                print(f"warning: {w.category.__name__}: {w.message}", file=sys.stderr, flush=True)
    start = meta["step"]
    if "rng" in meta and not (jax.random.key_data(meta["rng"]) ==
                              jax.random.key_data(jax.random.fold_in(run_key, start))).all():
        raise RunError(f"the RNG key saved at step {start} is not this run's; "
                       "the checkpoint was not written by this command. Nothing was changed.")
    _set_aside_newer(manager, start)
    print_once(f"Resuming from the checkpoint at step {start} in {args.ckpt_dir}"
               + (f" (newest was {newest})" if newest != start else ""))
    return params, opt_state, start


def _set_aside_newer(manager, start):
    """Rename the steps after `start` (they failed to restore), once, from process 0."""
    import jax

    from tunix_nb import checkpoint

    for step in sorted(s for s in manager.all_steps() if s > start):
        if distributed.is_main_process():
            moved = checkpoint.set_aside(manager, step)
            print_once(f"The checkpoint at step {step} is damaged: moved it aside to {moved.name} "
                       "(nothing deleted), so that step can be saved again.")
    if jax.process_count() > 1:  # nobody saves before the renames are done
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoints set aside")
        manager.reload()


class BestCheckpoint:
    """The best checkpoint by eval loss, in <ckpt_dir>/best: its own Orbax manager, keeping one.

    A separate manager, not Orbax's `best_fn` on the run's: that one would keep the best N
    instead of the newest N, and --keep and resuming rely on the newest. A resumed run reads
    the best eval loss so far from its meta and replaces it only with a lower one.
    """

    def __init__(self, ckpt_dir, *, async_save: bool):
        from tunix_nb import checkpoint

        self.manager = checkpoint.make_manager(Path(ckpt_dir) / "best", keep=1, save_every=1, async_save=async_save)
        meta = checkpoint.newest_readable_meta(self.manager)
        self.eval_loss = float("inf") if meta is None else float(meta["eval_loss"])

    def offer(self, step: int, eval_loss: float, **state) -> bool:
        """Save `state` (checkpoint.save's arguments) at `step` if `eval_loss` is the lowest yet."""
        from tunix_nb import checkpoint

        latest = self.manager.latest_step()
        if not eval_loss < self.eval_loss or (latest is not None and step <= latest):
            return False  # (a step at or before the best's: a resumed run's replay, which can only tie)
        state["meta"] = {**state["meta"], "eval_loss": eval_loss}
        checkpoint.save(self.manager, step, force=True, **state)
        self.eval_loss = eval_loss
        return True

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
