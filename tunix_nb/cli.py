"""`python -m tunix_nb.train`: SFT, distillation and DPO from the command line, resumable.

It saves the training state with Orbax every --save-every steps (in the background),
and resumes on its own from the newest checkpoint in --ckpt-dir, to exactly the run an
uninterrupted one would have been: same parameters, bit for bit, on the same device
count. It refuses (leaving the checkpoints untouched) when that run's config differs
from the flags given.

Resuming, in detail:
- Batches are a pure function of (--seed, step), and no step draws random numbers, so
  the step is the whole data/RNG state. Each checkpoint also holds the run key folded
  with its step (item `rng`), which the resumed run checks against its own.
- A save killed midway leaves `<step>.orbax-checkpoint-tmp`, which is not a checkpoint;
  the resumed run ignores it and Orbax replaces it when it saves that step again.
- If the newest checkpoint is damaged, the run warns (step and error), resumes from the
  one before, and renames the damaged one to `<step>.damaged-<time>` so that the step
  can be saved again. It prints the new name; nothing is deleted.
- Checkpoints hold one copy of the state, so a run may resume on another device count
  (--devices, --parallel): bit for bit the same state, replicated onto the new devices.

Several processes (a TPU pod slice, GPU hosts, or `python -m tunix_nb.launch` on one
machine) run the same command with --coordinator/--num-processes/--process-id (or
--distributed, to let JAX read them from the cluster) and --parallel dp, fsdp or
shard_map: each process loads only its share of every batch, they save checkpoints
together into one --ckpt-dir (shared storage), and process 0 prints and writes the
metrics file.

`preempt` (for tests and notebook 05) runs the CLI and SIGKILLs it between saves or
during one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from tunix_nb import devices, distributed  # neither starts JAX on import

# train.PARALLEL_MODES, spelled out: the parser is built before JAX may start.
PARALLEL_CHOICES = ("jit", "pmap", "shard_map", "dp", "fsdp")
MESH_CHOICES = ("shard_map", "dp", "fsdp")  # parallel.MESH_MODES: the strategies that span processes
COMMANDS = ("sft", "distill", "dpo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # as tunix_nb.losses.DPO_LOSS_TYPES, without importing JAX
# Flags that define a run: resuming with other values would be a different run.
RUN_DEFINING = ("command", "model", "teacher", "init_from", "beta", "loss_type", "sft_weight", "steps",
                "batch_size", "seed", "learning_rate", "warmup_steps", "compute_dtype")
DEFAULT_LEARNING_RATE = {"sft": 3e-3, "distill": 3e-3, "dpo": 1e-3}
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # where Orbax writes a step before committing it


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")


def _positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds '(default: x)' only where the help does not say it and the default is a value."""

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_nb.train", description=__doc__.splitlines()[0],
        formatter_class=_HelpFormatter,
        epilog="Resume an interrupted run by repeating its command: it continues from the newest "
               "checkpoint in --ckpt-dir.")
    parser.add_argument("command", choices=COMMANDS,
                        help="what to train: sft (supervised fine-tuning), distill (from a teacher) "
                             "or dpo (preference pairs, from an SFT checkpoint)")
    parser.add_argument("--model", help="model preset: tiny, student or teacher (default: student; "
                        "dpo: the preset of the --init-from checkpoint)")
    parser.add_argument("--teacher", help="distill: the teacher's checkpoint directory "
                        "(default: the teacher shipped in data/teacher)")
    parser.add_argument("--init-from", help="dpo: the SFT checkpoint the policy and the frozen reference "
                        "start from (default: the SFT student shipped in data/sft_student)")
    parser.add_argument("--beta", type=_positive_float,
                        help="dpo: strength of the pull towards the reference (default: 0.1)")
    parser.add_argument("--loss-type", choices=DPO_LOSS_TYPES,
                        help="dpo: sigmoid (DPO), ipo or hinge (SLiC) (default: sigmoid)")
    parser.add_argument("--sft-weight", type=_non_negative_float,
                        help="dpo: weight of an SFT term on the chosen answers (RPO) (default: 0)")
    parser.add_argument("--steps", type=_positive_int, default=300, help="total training steps")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="global batch size (examples, or pairs for dpo), split over the devices")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial params and the data order")
    parser.add_argument("--learning-rate", type=_positive_float,
                        help="peak learning rate (default: 3e-3; dpo: 1e-3)")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10%% of --steps, at most 20)")
    parser.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: float32 on CPU, bfloat16 on TPU/GPU (params stay float32)")
    parser.add_argument("--ckpt-dir", help="where to save checkpoints; resumes from the newest one there")
    parser.add_argument("--save-every", type=_positive_int, default=50,
                        help="save every K steps (and at the last step), asynchronously")
    parser.add_argument("--keep", type=_positive_int, default=3, help="keep the newest N checkpoints")
    parser.add_argument("--sync-save", action="store_true",
                        help="block training while a checkpoint is written (default: write in the background)")
    parser.add_argument("--stop-after", type=_positive_int,
                        help="stop after this step, saving a checkpoint there, as if preempted; "
                             "run the same command again (without it) to resume")
    parser.add_argument("--devices", type=_positive_int,
                        help="on CPU, simulate N devices (per process, with several processes)")
    parser.add_argument("--parallel", choices=PARALLEL_CHOICES, default="jit",
                        help="jit: one device; pmap: data parallel, replicated state; shard_map: the pmap "
                             "step on a Mesh; dp: jit with a batch-sharded NamedSharding; fsdp: dp with "
                             "params and optimizer state sharded too. Checkpoints restore under any of them")
    group = parser.add_argument_group(
        "several processes", "one process per host (python -m tunix_nb.launch starts them on one machine); "
        "needs --parallel dp, fsdp or shard_map")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, where JAX's coordination service listens")
    group.add_argument("--num-processes", type=_positive_int, help="how many processes take part")
    group.add_argument("--process-id", type=int, help="this process's index, 0 ... --num-processes - 1")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run whose coordinator, process count and index JAX "
                            "detects (Cloud TPU pod slice, SLURM, Open MPI, Kubernetes)")
    group.add_argument("--heartbeat-timeout", type=_positive_int, default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                       help="seconds after which a silent process counts as dead and the others stop")
    parser.add_argument("--metrics-file", help="write one JSON line per step (step, loss, ...)")
    parser.add_argument("--export-params", help="at the end, also write a params-only checkpoint here")
    return parser


def _check_flags(parser, args) -> None:
    """Flag combinations argparse cannot check on its own; fills in per-command defaults."""
    only = {"teacher": "distill", "init_from": "dpo", "beta": "dpo", "loss_type": "dpo", "sft_weight": "dpo"}
    for name, command in only.items():
        if getattr(args, name) is not None and args.command != command:
            parser.error(f"--{name.replace('_', '-')} applies only to {command}, not {args.command}")
    if args.command == "dpo":
        args.beta = 0.1 if args.beta is None else args.beta
        args.loss_type = args.loss_type or "sigmoid"
        args.sft_weight = 0.0 if args.sft_weight is None else args.sft_weight
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATE[args.command]
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be >= 0 and below --steps {args.steps}")
    if args.stop_after is not None and args.stop_after > args.steps:
        parser.error(f"--stop-after {args.stop_after} is beyond --steps {args.steps}")
    if args.stop_after is not None and not args.ckpt_dir:
        parser.error("--stop-after needs --ckpt-dir: the run saves a checkpoint there to resume from")
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            parser.error(f"several processes need all of --coordinator, --num-processes and --process-id; "
                         f"missing {', '.join(missing)} (or use --distributed on a cluster JAX detects)")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process-id {args.process_id} must be in 0 ... {args.num_processes - 1}")
        args.distributed = True
    if args.distributed and args.parallel not in MESH_CHOICES:
        parser.error(f"--parallel {args.parallel} runs within one process; with several processes use "
                     f"one of {', '.join(MESH_CHOICES)}")


def _newest_readable_meta(manager):
    """The meta of the newest checkpoint whose meta reads (a damaged one is reported by restore)."""
    from tunix_nb import checkpoint

    for step in sorted(manager.all_steps(), reverse=True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return checkpoint.load_meta(manager.directory, step)
        except Exception:
            continue
    return None


def _read_metrics(path: Path, upto: int) -> list[str]:
    """The lines of steps <= upto; a line cut short by a kill is dropped."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    if args.devices:
        devices.simulate_cpu_devices(args.devices)  # before anything starts JAX
    if args.distributed:  # also before JAX starts: jax.devices() then lists every process's devices
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               heartbeat_timeout_s=args.heartbeat_timeout)

    import jax  # noqa: E402  (after the device count is fixed)

    from tunix_nb import checkpoint, data, model, parallel, train
    from tunix_nb.tokenizer import ByteTokenizer

    main_process = distributed.is_main_process()

    def say(message):  # what every process would print alike: once, from process 0
        if main_process:
            print(message, flush=True)

    if args.command == "distill" and args.teacher is None:
        args.teacher = str(data.DATA_DIR / "teacher")
    init_meta = None
    if args.command == "dpo":
        if args.init_from is None:
            args.init_from = str(data.DATA_DIR / "sft_student")
        try:
            init_meta = checkpoint.load_meta(args.init_from)
        except FileNotFoundError:
            parser.error(f"--init-from {args.init_from}: no checkpoint there; train one with "
                         f"`python -m tunix_nb.train sft --ckpt-dir {args.init_from}` first")
        init_model = init_meta.get("model") or init_meta.get("config", {}).get("model")
        if args.model is not None and args.model != init_model:
            parser.error(f"--model {args.model!r} differs from the --init-from checkpoint's model "
                         f"{init_model!r}; leave --model out")
        args.model = init_model
    args.model = args.model or "student"
    if args.model not in model.PRESETS:
        parser.error(f"--model {args.model!r} is not a preset; choose one of {sorted(model.PRESETS)}")
    n_devices = 1 if args.parallel == "jit" else jax.device_count()
    if args.batch_size % n_devices:
        parser.error(f"--batch-size {args.batch_size} does not divide by the {n_devices} devices; "
                     f"use a multiple of {n_devices}")
    compute_dtype = (devices.defaults_for().compute_dtype if args.compute_dtype == "auto"
                     else args.compute_dtype)
    config = {"command": args.command, "model": args.model,
              "teacher": args.teacher if args.command == "distill" else None,
              "init_from": args.init_from, "beta": args.beta, "loss_type": args.loss_type,
              "sft_weight": args.sft_weight,
              "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
              "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps,
              "compute_dtype": compute_dtype}

    manager = None
    if args.ckpt_dir:  # check the run there before anything else: a clash changes nothing
        manager = checkpoint.make_manager(args.ckpt_dir, keep=args.keep, save_every=args.save_every,
                                          async_save=not args.sync_save)
        saved = _newest_readable_meta(manager) if manager.all_steps() else None
        if saved is not None:
            saved_config = saved.get("config", {})
            clashes = {k: (saved_config.get(k), config[k]) for k in RUN_DEFINING if saved_config.get(k) != config[k]}
            if clashes:
                detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in clashes.items())
                print(f"error: --ckpt-dir {args.ckpt_dir} holds a different run ({detail}). "
                      "Use another --ckpt-dir, or the same flags to resume it. Nothing was changed.",
                      file=sys.stderr)
                return 2

    tokenizer = ByteTokenizer()
    graphdef, params = model.split(model.make_model(args.model, seed=args.seed))
    dtype = train.resolve_compute_dtype(compute_dtype)
    frozen = None
    if args.command == "dpo":  # policy and frozen reference both start from the SFT checkpoint
        params = checkpoint.params_into(params, checkpoint.load_params(args.init_from))
        rows = data.preference_arrays(data.load_preferences(), tokenizer, data.DEFAULT_SEQ_LEN)
        rows = train.reference_log_probs(graphdef, params, rows)  # cached once: the reference never changes
        objective = train.dpo_objective(graphdef, beta=args.beta, loss_type=args.loss_type,
                                        sft_weight=args.sft_weight, compute_dtype=dtype)
    else:
        rows = data.sft_arrays(data.load_sft(), tokenizer, data.DEFAULT_SEQ_LEN)
        if args.command == "sft":
            objective = train.sft_objective(graphdef, compute_dtype=dtype)
        else:
            teacher_meta = checkpoint.load_meta(args.teacher)
            teacher_graphdef, teacher_like = model.split(model.make_model(teacher_meta["model"]))
            frozen = checkpoint.params_into(teacher_like, checkpoint.load_params(args.teacher))
            objective = train.distill_objective(graphdef, teacher_graphdef, compute_dtype=dtype)
    n_rows = len(next(iter(rows.values())))
    if args.batch_size > n_rows:
        parser.error(f"--batch-size {args.batch_size} is larger than the {n_rows} training examples")
    optimizer = train.make_optimizer(train.OptimizerConfig(
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, total_steps=args.steps))
    opt_state = optimizer.init(params)
    on_mesh = args.parallel in MESH_CHOICES
    mesh = parallel.make_mesh() if on_mesh else None  # every process's devices
    step_fn = train.make_step(objective, optimizer, parallel_mode=args.parallel, donate=True, mesh=mesh)
    run_key = jax.random.key(args.seed)

    start = 0
    if manager is not None and manager.all_steps():
        newest = manager.latest_step()
        with warnings.catch_warnings(record=True) as caught:  # printed below, without file names
            warnings.simplefilter("always", checkpoint.DamagedCheckpointWarning)
            try:
                restored = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state,
                                              mesh=mesh, parallel_mode=args.parallel if on_mesh else None)
            except checkpoint.DamagedCheckpointError as err:
                restored = err
        for w in caught if main_process else ():
            print(f"warning: {w.category.__name__}: {w.message}", file=sys.stderr, flush=True)
        if isinstance(restored, Exception):
            print(f"error: {restored}. Move the damaged steps out of --ckpt-dir {args.ckpt_dir} (or use "
                  "another --ckpt-dir) to start over. Nothing was changed.", file=sys.stderr)
            return 2
        params, opt_state, meta = restored
        start = meta["step"]
        if "rng" in meta and not (jax.random.key_data(meta["rng"]) ==
                                  jax.random.key_data(jax.random.fold_in(run_key, start))).all():
            print(f"error: the RNG key saved at step {start} is not this run's; "
                  "the checkpoint was not written by this command. Nothing was changed.", file=sys.stderr)
            return 2
        for step in sorted(s for s in manager.all_steps() if s > start):  # they failed to restore
            if main_process:  # one rename, by one process
                moved = checkpoint.set_aside(manager, step)
                say(f"The checkpoint at step {step} is damaged: moved it aside to {moved.name} "
                    "(nothing deleted), so that step can be saved again.")
        if jax.process_count() > 1:  # nobody saves before the renames are done
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("checkpoints set aside")
            manager.reload()
        say(f"Resuming from the checkpoint at step {start} in {args.ckpt_dir}"
            + (f" (newest was {newest})" if newest != start else ""))

    metrics_file = Path(args.metrics_file) if args.metrics_file and main_process else None
    if metrics_file is not None:  # keep the lines of steps already done, drop any beyond
        kept = _read_metrics(metrics_file, start) if metrics_file.exists() and start > 0 else []
        metrics_file.write_text("".join(line + "\n" for line in kept))

    # this process's share of every global batch: all of it, unless several processes run
    my_rows = parallel.process_rows(mesh, args.batch_size) if on_mesh else None

    def batch_fn(step):
        return data.batch_at(rows, step, args.batch_size, seed=args.seed, rows=my_rows)

    def log(step, record):
        if metrics_file is not None:
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    progress = sys.stderr.isatty() and main_process
    stop = args.steps if args.stop_after is None else args.stop_after
    step = start
    while step < stop:  # run to the next save point, save (in the background), repeat
        chunk = min(args.save_every - step % args.save_every, stop - step)
        # train.run replicates the state under pmap and hands back one (unreplicated) copy; on a
        # mesh the state stays placed, and every process saves its own shards of it
        params, opt_state, _ = train.run(step_fn, params, opt_state, batch_fn, steps=chunk, start_step=step,
                                         parallel_mode=args.parallel, frozen=frozen,
                                         desc=f"{args.command} {step}->{step + chunk}", progress=progress,
                                         on_step=log, keep_placement=on_mesh)
        step += chunk
        if manager is not None:
            checkpoint.save(manager, step, params=params, opt_state=opt_state,
                            meta={"config": config, "seed": args.seed}, rng=jax.random.fold_in(run_key, step),
                            force=step == stop)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if step < args.steps:
        say(f"Stopped after step {step} of {args.steps} (--stop-after); run the same command "
            "without it to resume.")
    else:
        if args.export_params:
            checkpoint.export_params(params, args.export_params, step=step,
                                     meta={"model": args.model, "config": config})
        say(f"Done: {args.command} {args.model}, {args.steps} steps"
            + (f", {jax.process_count()} processes." if jax.process_count() > 1 else "."))
    if args.distributed:  # leave together: waits for the other processes to finish too
        distributed.shutdown()
    return 0


# ------------------------------------------------------------------ preemption drills


def _in_flight_saves(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.glob(f"*{TMP_SUFFIX}*")) if ckpt_dir.is_dir() else []


def _last_logged_step(metrics_file: Path) -> int:
    try:
        lines = metrics_file.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def preempt(argv, *, ckpt_dir, metrics_file, when: str, after_step: int = 1, timeout: float = 120.0,
            env=None, cwd=None) -> dict:
    """Run `python -m tunix_nb.train *argv` and SIGKILL it mid-run; returns what was killed when.

    when="between_saves": once the metrics file shows a step > `after_step` and no save
    is in flight; when="during_save": once a step after `after_step` is being written
    (Orbax's `<step>.orbax-checkpoint-tmp` directory exists). To kill at a known moment,
    the process is frozen with SIGSTOP, the condition is checked on the frozen process,
    and then it is SIGKILLed (or let go with SIGCONT to try again). `argv` must include
    the --ckpt-dir and --metrics-file given here.

    Returns {"killed": bool, "step": last step logged, "in_flight": tmp dir names, "returncode"}.
    Raises TimeoutError if the run neither finished nor could be killed in time.
    """
    if when not in ("between_saves", "during_save"):
        raise ValueError(f"when={when!r}: use 'between_saves' or 'during_save'")
    ckpt_dir, metrics_file = Path(ckpt_dir), Path(metrics_file)
    if cwd is not None:
        ckpt_dir, metrics_file = Path(cwd) / ckpt_dir, Path(cwd) / metrics_file
    stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", "tunix_nb.train", *argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.monotonic() + timeout
    stale = set(_in_flight_saves(ckpt_dir))  # left by an earlier kill: not this run's saves

    def in_flight_saves():
        return [name for name in _in_flight_saves(ckpt_dir) if name not in stale]

    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach the kill point within {timeout} s")
            step, in_flight = _last_logged_step(metrics_file), in_flight_saves()
            ready = step > after_step and (bool(in_flight) == (when == "during_save"))
            if when == "during_save":
                ready = ready and any(int(name.split(".")[0]) > after_step for name in in_flight)
            if not ready:
                time.sleep(0.001)
                continue
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it, then check the condition still holds
            step, in_flight = _last_logged_step(metrics_file), in_flight_saves()
            if bool(in_flight) == (when == "during_save"):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return {"killed": True, "step": step, "in_flight": in_flight, "returncode": proc.returncode}
            os.kill(proc.pid, signal.SIGCONT)
        stderr.seek(0)
        return {"killed": False, "step": _last_logged_step(metrics_file), "in_flight": [],
                "returncode": proc.returncode, "stderr": stderr.read()}
    finally:
        if proc.poll() is None:  # a timeout or an error above: do not leave it running
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stderr.close()
