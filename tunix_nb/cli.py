"""`python -m tunix_nb.train`: SFT and distillation from the command line, resumable.

It resumes on its own from the newest checkpoint in --ckpt-dir, and refuses (leaving
the checkpoints untouched) when that run's config differs from the flags given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tunix_nb import devices

COMMANDS = ("sft", "distill")
# Flags that define a run: resuming with other values would be a different run.
RUN_DEFINING = ("command", "model", "teacher", "steps", "batch_size", "seed", "learning_rate",
                "warmup_steps", "compute_dtype")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be greater than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_nb.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("command", choices=COMMANDS, help="what to train")
    parser.add_argument("--model", default="student", help="model preset: tiny, student or teacher")
    parser.add_argument("--teacher", help="distill: the teacher's checkpoint directory "
                        "(default: the teacher shipped in data/teacher)")
    parser.add_argument("--steps", type=_positive_int, default=300, help="total training steps")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="global batch size, split over the devices")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial params and the data order")
    parser.add_argument("--learning-rate", type=_positive_float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10%% of --steps, at most 20)")
    parser.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: float32 on CPU, bfloat16 on TPU/GPU (params stay float32)")
    parser.add_argument("--ckpt-dir", help="where to save checkpoints; resumes from the newest one there")
    parser.add_argument("--save-every", type=_positive_int, default=50, help="save every K steps")
    parser.add_argument("--keep", type=_positive_int, default=3, help="keep the newest N checkpoints")
    parser.add_argument("--devices", type=_positive_int,
                        help="on CPU, simulate N devices (must be set before JAX starts)")
    parser.add_argument("--parallel", choices=("jit", "pmap"), default="jit",
                        help="jit: one device; pmap: data parallel over all devices")
    parser.add_argument("--metrics-file", help="write one JSON line per step (step, loss, ...)")
    parser.add_argument("--export-params", help="at the end, also write a params-only checkpoint here")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be >= 0 and below --steps {args.steps}")
    if args.devices:
        devices.simulate_cpu_devices(args.devices)  # before anything starts JAX

    import jax  # noqa: E402  (after the device count is fixed)

    from tunix_nb import checkpoint, data, model, train
    from tunix_nb.tokenizer import ByteTokenizer

    if args.command == "distill" and args.teacher is None:
        args.teacher = str(data.DATA_DIR / "teacher")
    if args.model not in model.PRESETS:
        parser.error(f"--model {args.model!r} is not a preset; choose one of {sorted(model.PRESETS)}")
    n_devices = jax.local_device_count() if args.parallel == "pmap" else 1
    if args.batch_size % n_devices:
        parser.error(f"--batch-size {args.batch_size} does not divide by the {n_devices} devices; "
                     f"use a multiple of {n_devices}")
    compute_dtype = (devices.defaults_for().compute_dtype if args.compute_dtype == "auto"
                     else args.compute_dtype)
    config = {"command": args.command, "model": args.model,
              "teacher": args.teacher if args.command == "distill" else None,
              "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
              "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps,
              "compute_dtype": compute_dtype}

    tokenizer = ByteTokenizer()
    rows = data.sft_arrays(data.load_sft(), tokenizer, data.DEFAULT_SEQ_LEN)
    graphdef, params = model.split(model.make_model(args.model, seed=args.seed))
    optimizer = train.make_optimizer(train.OptimizerConfig(
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, total_steps=args.steps))
    opt_state = optimizer.init(params)
    dtype = train.resolve_compute_dtype(compute_dtype)
    frozen = None
    if args.command == "sft":
        objective = train.sft_objective(graphdef, compute_dtype=dtype)
    else:
        teacher_meta = checkpoint.load_meta(args.teacher)
        teacher_graphdef, teacher_like = model.split(model.make_model(teacher_meta["model"]))
        frozen = checkpoint.params_into(teacher_like, checkpoint.load_params(args.teacher))
        objective = train.distill_objective(graphdef, teacher_graphdef, compute_dtype=dtype)
    step_fn = train.make_step(objective, optimizer, parallel_mode=args.parallel, donate=True)

    start = 0
    manager = None
    if args.ckpt_dir:
        manager = checkpoint.make_manager(args.ckpt_dir, keep=args.keep, save_every=args.save_every)
        if manager.all_steps():
            saved = checkpoint.load_meta(args.ckpt_dir)
            clashes = {k: (saved.get("config", {}).get(k), config[k]) for k in RUN_DEFINING
                       if saved.get("config", {}).get(k) != config[k]}
            if clashes:
                detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in clashes.items())
                print(f"error: --ckpt-dir {args.ckpt_dir} holds a different run ({detail}). "
                      "Use another --ckpt-dir, or the same flags to resume it. Nothing was changed.",
                      file=sys.stderr)
                return 2
            params, opt_state, meta = checkpoint.restore(manager, params_like=params, opt_state_like=opt_state)
            start = meta["step"]
            print(f"Resuming from the checkpoint at step {start} in {args.ckpt_dir}", flush=True)

    metrics_file = Path(args.metrics_file) if args.metrics_file else None
    if metrics_file is not None:  # keep the lines of steps already done, drop any beyond
        kept = []
        if metrics_file.exists() and start > 0:
            kept = [l for l in metrics_file.read_text().splitlines() if l and json.loads(l)["step"] <= start]
        metrics_file.write_text("".join(l + "\n" for l in kept))

    def batch_fn(step):
        return data.batch_at(rows, step, args.batch_size, seed=args.seed)

    def log(step, record):
        if metrics_file is not None:
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    progress = sys.stderr.isatty()
    step = start
    while step < args.steps:  # run to the next save point, save, repeat
        chunk = min(args.save_every - step % args.save_every, args.steps - step)
        params, opt_state, _ = train.run(step_fn, params, opt_state, batch_fn, steps=chunk, start_step=step,
                                         parallel_mode=args.parallel, frozen=frozen,
                                         desc=f"{args.command} {step}->{step + chunk}", progress=progress,
                                         on_step=log)
        step += chunk
        if manager is not None:
            checkpoint.save(manager, step, params=params, opt_state=opt_state,
                            meta={"config": config, "seed": args.seed},
                            force=step == args.steps)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if args.export_params:
        checkpoint.export_params(params, args.export_params, step=step,
                                 meta={"model": args.model, "config": config})
    print(f"Done: {args.command} {args.model}, {args.steps} steps.", flush=True)
    return 0
