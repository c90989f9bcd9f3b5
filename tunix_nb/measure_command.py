"""The training command, measured: its step's compiles, step times, and MFU by model FLOPs
(`tunix_nb.mfu`) beside XLA's FLOP count of the same compiled step.

    python -m tunix_nb.measure_command --out full.json -- sft --model runs/qwen3_random \\
        --train-file rows.jsonl --max-length 1025 --batch-size 8 --remat --steps 15

runs `python -m tunix_nb.train` in this process (`cli.main`) and watches it:
- compiles: JAX's compile log (`jax_log_compiles`), each program's tracing, lowering and XLA
  compile seconds, and whether the persistent compilation cache served it;
- step times: when each step's metrics reach the host. The loop fetches step k's while step
  k + 1 runs, so in steady state the gaps between those moments are the device's step times;
  the first `WARMUP_STEPS` (compile, first transfers) are left out of the median;
- FLOPs: `mfu.step_flops` for the model and batch; XLA's `cost_analysis()` of the step compiled
  ahead of time from the run's own argument shapes, which the persistent compilation cache
  (on in the command) serves without a second compile. With remat, XLA's count holds the
  recomputed forward, so XLA FLOPs / time / peak is hardware utilisation, not MFU.
- where the time goes (`--trace-steps N`): a `jax.profiler` trace of N steps after the warm-up,
  read by `tunix_nb.step_profile`: the step's ops by kind (matmuls, layout copies, other) and by
  the function they come from, the slowest ops (`--trace-top`, 10 by default), and the device's
  idle time between steps (time it waited on the host).
Needs `--parallel jit` (one device) and `--model` a preset or a local Hugging Face folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

WARMUP_STEPS = 2
STEP_PROGRAM = "jit(step)"
# JAX's compile log (jax_log_compiles): one message per phase of each program's compile
PHASES = {
    "tracing": re.compile(r"Finished tracing (?:\+ transforming )?(?P<name>\S+) for (?P<kind>\w+) in (?P<s>[\d.e-]+) sec"),
    "lowering": re.compile(r"Finished jaxpr to MLIR module conversion (?P<program>\S+) in (?P<s>[\d.e-]+) sec"),
    "xla_compile": re.compile(r"Finished XLA compilation of (?P<program>\S+) in (?P<s>[\d.e-]+) sec"),
}
# the compile log's other messages, not passed on
QUIET = ("Compiling ", "Persistent compilation cache", "Not writing persistent cache entry")


class CompileLog(logging.Handler):
    """JAX's compile log as records {program, phase, seconds}, with the persistent cache's hits."""

    def __init__(self):
        super().__init__()
        self.records, self.cache_hits = [], 0

    def emit(self, record):
        """Keep the compile log's records; hand JAX's other messages on to the root logger (the
        "jax" logger does not propagate while this handler is on, so compiles do not flood stderr)."""
        message = record.getMessage()
        for phase, pattern in PHASES.items():
            found = pattern.match(message)
            if found:
                fields = found.groupdict()
                program = fields.get("program") or f"{fields['kind']}({fields['name']})"
                self.records.append({"program": program, "phase": phase, "seconds": float(fields["s"])})
                return
        if not message.startswith(QUIET):
            logging.getLogger().handle(record)

    def on_event(self, event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def of(self, program: str, phase: str | None = None, since: int = 0) -> list[dict]:
        return [r for r in self.records[since:] if r["program"] == program and phase in (None, r["phase"])]


class RunRecorder:
    """Patches `train.run` and `StepLog.log` while the command runs: the step function, the
    state's shapes and placement as the loop receives them, one batch, and each step's time."""

    def __init__(self, trace_steps: int = 0, trace_dir: str | None = None):
        self.step_fn, self.args, self.lora, self.trained_params = None, None, False, 0
        self.logged = []  # (perf_counter seconds, record) per step, as the host sees it
        self.trace_steps, self.trace_dir, self.tracing = trace_steps, trace_dir, False

    def _trace_around(self, steps_logged: int):
        """Trace the steps after the warm-up: from the (WARMUP_STEPS + 1)-th step's metrics on,
        for `trace_steps` more."""
        import jax

        if not self.trace_steps:
            return
        if steps_logged == WARMUP_STEPS + 1:
            jax.profiler.start_trace(self.trace_dir)
            self.tracing = True
        elif steps_logged == WARMUP_STEPS + 1 + self.trace_steps and self.tracing:
            self.stop_trace()

    def stop_trace(self):
        import jax

        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False

    @contextlib.contextmanager
    def patched(self):
        from tunix_nb import train
        from tunix_nb.train import loop

        run, log = train.run, loop.StepLog.log

        def recording_run(step_fn, params, opt_state, batch_fn, *, frozen=None, start_step=0, **kw):
            if self.step_fn is None:
                self.step_fn = step_fn
                self.args = (_abstract(params), _abstract(opt_state), _abstract(batch_fn(start_step), placed=False),
                             _abstract(frozen))
                self.lora = isinstance(frozen, dict) and "base" in frozen
                self.trained_params = sum(x.size for x in _leaves(params))
            return run(step_fn, params, opt_state, batch_fn, frozen=frozen, start_step=start_step, **kw)

        def recording_log(step_log, record):
            self.logged.append((time.perf_counter(), dict(record)))
            log(step_log, record)
            self._trace_around(len(self.logged))

        train.run, loop.StepLog.log = recording_run, recording_log
        try:
            yield self
        finally:
            self.stop_trace()
            train.run, loop.StepLog.log = run, log


def _leaves(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]


def _abstract(tree, *, placed: bool = True):
    """Shapes and dtypes of `tree` (and, for device arrays, their shardings): what the step is
    lowered from. Host rows (the batch) get none, as the step receives them."""
    import jax

    def like(x):
        sharding = x.sharding if placed and isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(like, tree)


def step_seconds(logged) -> list[float]:
    """Seconds between consecutive steps' metrics reaching the host, after the warm-up steps."""
    moments = [t for t, _ in logged]
    gaps = [b - a for a, b in zip(moments, moments[1:])]
    return gaps[WARMUP_STEPS - 1:]


def flag_value(argv, flag: str, default: str) -> str:
    """The value of `flag` in a command line (`--flag VALUE` or `--flag=VALUE`), the last one winning."""
    value = default
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def model_config_of(argv):
    """The kit's ModelConfig of the command's --model: a preset or a local Hugging Face folder."""
    from tunix_nb import hf, model

    name = flag_value(argv, "--model", "student")
    if name in model.PRESETS:
        return model.get_config(name)
    if Path(name).is_dir():
        return hf.model_config(hf.read_config(name))
    raise ValueError(f"--model {name}: measure_command reads a preset ({sorted(model.PRESETS)}) or a local "
                     "Hugging Face folder (write one with python -m tunix_nb.random_checkpoint).")


def xla_analysis(step_fn, args) -> dict:
    """XLA's FLOPs and memory of the step compiled from the run's argument shapes."""
    from tunix_nb.bench.common import compiled_cost
    from tunix_nb.memory_plan.analysis import memory_of

    started = time.perf_counter()
    compiled = step_fn.lower(*args).compile()
    return {"flops": compiled_cost(compiled)["flops"], "memory": memory_of(compiled),
            "seconds": time.perf_counter() - started, "hlo_text": compiled.as_text()}


@contextlib.contextmanager
def compile_log():
    """A `CompileLog` of JAX's compiles (its log and its monitoring events) while the block runs;
    JAX's settings as they were afterwards."""
    import jax

    log, jax_logger, was_logging = CompileLog(), logging.getLogger("jax"), jax.config.jax_log_compiles
    jax_logger.addHandler(log)
    jax_logger.propagate = False
    jax.monitoring.register_event_listener(log.on_event)
    jax.config.update("jax_log_compiles", True)
    try:
        yield log
    finally:
        jax.config.update("jax_log_compiles", was_logging)
        jax_logger.removeHandler(log)
        jax_logger.propagate = True
        jax.monitoring.unregister_event_listener(log.on_event)


def step_profile_of(trace_dir, hlo_text: str, traced_steps: int, top: int = 10) -> dict:
    """The traced steps' ops (per step; the `top` slowest ops and sources) and the device's idle
    time between steps."""
    from tunix_nb import step_profile

    events = step_profile.trace_events(trace_dir)
    gaps = step_profile.program_gaps(events, "jit_step")
    # where the device has a line of whole programs: the steps' worth it ran in the window (the
    # first and last runs may be cut by the window's edges, so not their count); else the steps asked for
    calls = sum(gaps["run_seconds"]) / max(gaps["run_seconds"]) if gaps else traced_steps
    return {"traced_steps": calls, "ops": step_profile.summarise(events, hlo_text, calls=calls, top=top),
            "programs": gaps, "trace_lines": step_profile.lines_summary(events)}


def measure(command_argv: list[str], *, trace_steps: int = 0, trace_dir: str | None = None, trace_top: int = 10
            ) -> dict:
    """Run the training command with `command_argv` in this process; its measurements. With
    `trace_steps`, a profile of that many steps after the warm-up (kept in `trace_dir` if given),
    naming its `trace_top` slowest ops and sources."""
    import tempfile

    from tunix_nb import cli

    if flag_value(command_argv, "--parallel", "jit") != "jit":
        raise ValueError("measure_command times one device: run the command with --parallel jit (the default).")
    config = model_config_of(command_argv)
    scratch = tempfile.TemporaryDirectory()
    recorder = RunRecorder(trace_steps, trace_dir or scratch.name)
    with compile_log() as compiles, scratch:
        with recorder.patched():
            started = time.perf_counter()
            code = cli.main(command_argv)
            wall = time.perf_counter() - started
        if code != 0 or recorder.step_fn is None:
            return {"command": command_argv, "exit_code": code, "error": "the command failed; see its output"}
        run_records, hits_before = len(compiles.records), compiles.cache_hits
        xla = xla_analysis(recorder.step_fn, recorder.args)
        # served from memory (no compile logged) or from the persistent cache: the run's own program
        xla["compiled_again"] = bool(compiles.of(STEP_PROGRAM, "xla_compile", since=run_records))
        xla["persistent_cache_hit"] = compiles.cache_hits > hits_before
        compiles.records = compiles.records[:run_records]
        profile = (step_profile_of(recorder.trace_dir, xla.pop("hlo_text"), trace_steps, trace_top)
                   if trace_steps else None)
    return {**summary(command_argv, config, recorder, compiles, xla, wall), "profile": profile}


def summary(command_argv, config, recorder, compiles, xla: dict, wall: float) -> dict:
    """The record: compiles, step times, tokens per second, MFU and XLA's FLOPs over the peak."""
    import jax

    from tunix_nb import mfu

    batch_rows, seq_len = recorder.args[2]["inputs"].shape
    adapters = recorder.trained_params if recorder.lora else None
    flops = mfu.step_flops(config, batch=batch_rows, seq_len=seq_len, adapter_params=adapters)
    halved = mfu.step_flops(config, batch=batch_rows, seq_len=seq_len, adapter_params=adapters, causal_halving=True)
    times = step_seconds(recorder.logged)
    median = statistics.median(times) if times else None
    peak = mfu.device_peak()
    over_peak = (lambda f: mfu.utilisation(f, median, peak)) if peak and median else (lambda f: None)
    step_program = compiles.of(STEP_PROGRAM)
    # XLA's cost analysis counts a loop's body once: with the blocks scanned, its FLOPs are not the step's
    xla_step_flops = None if "--scan-layers" in command_argv else xla["flops"]
    return {
        "command": command_argv, "exit_code": 0, "wall_seconds": wall,
        "device": {"kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
                   "count": jax.device_count()},
        "versions": versions(), "peak": None if peak is None else vars(peak),
        "model": {"matmul_params": mfu.matmul_params(config), "n_layers": config.n_layers,
                  "vocab_size": config.vocab_size, "lora": recorder.lora, "trained_params": recorder.trained_params},
        "batch": batch_rows, "seq_len": seq_len, "steps_logged": len(recorder.logged),
        "loss": {"first": recorder.logged[0][1].get("loss"), "last": recorder.logged[-1][1].get("loss")},
        "step_compiles": len(compiles.of(STEP_PROGRAM, "xla_compile")),
        "step_compile_seconds": {phase: sum(r["seconds"] for r in step_program if r["phase"] == phase)
                                 for phase in PHASES},
        "compiles": compiles.records,
        "step_seconds": times, "median_step_seconds": median,
        "tokens_per_second": batch_rows * seq_len / median if median else None,
        "model_flops_per_step": flops, "model_flops_per_step_causal_halved": halved,
        "xla_flops_per_step": xla_step_flops, "xla_flops_counted": xla["flops"],
        "xla_over_model_flops": None if xla_step_flops is None else xla_step_flops / flops,
        "mfu": over_peak(flops), "mfu_causal_halved": over_peak(halved),
        "xla_flops_utilisation": None if xla_step_flops is None else over_peak(xla_step_flops),
        "xla_memory": xla["memory"],
        "xla_analysis": {k: xla[k] for k in ("seconds", "compiled_again", "persistent_cache_hit")},
        "note": "; ".join(
            ([] if peak else [f"no peak for device kind {jax.devices()[0].device_kind!r}: MFU needs a chip in "
                              "tunix_nb.mfu.PEAK_FLOPS"])
            + ([] if xla_step_flops is not None else ["--scan-layers: XLA's cost analysis counts the scanned blocks "
                                                      "once (xla_flops_counted), so no XLA utilisation"])) or None,
    }


def versions() -> dict:
    """jax, jaxlib and, where installed, libtpu."""
    from importlib import metadata

    found = {}
    for package in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.measure_command",
                                     usage="%(prog)s --out FILE.json -- COMMAND [FLAGS of python -m tunix_nb.train]",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="profile this many steps after the warm-up (default 0: no profile)")
    parser.add_argument("--trace-dir", help="keep the profiler's trace there (TensorBoard, Perfetto)")
    parser.add_argument("--trace-top", type=int, default=10,
                        help="how many of the slowest ops and sources the profile names (default 10)")
    args = parser.parse_args(ours)
    if not command:
        parser.error("give the training command after --, e.g. -- sft --model DIR --steps 15")
    try:
        result = measure(command, trace_steps=args.trace_steps, trace_dir=args.trace_dir, trace_top=args.trace_top)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result.get(k) for k in ("exit_code", "step_compiles", "median_step_seconds", "mfu",
                                                 "xla_flops_utilisation")}))
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
