"""The compile group: each lesson's main step's compile time over its step time, and the
persistent compilation cache across two fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from tunix_nb import devices
from tunix_nb.bench.common import figure, median_seconds, sft_setup

FIGURES = {"compile_share": (None, None)}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_compile(quick=quick)


def compile_times(only=None) -> dict:
    """Compile and step seconds of each lesson's main step (runs in a child process too).

    Compiled for real: a persistent compilation cache configured for this process
    (`devices.use_compile_cache`) is switched off here, unless a child measuring the
    cache switched it on itself.
    """
    import jax

    from tunix_nb import data, distill, dpo, model, sft, train
    from tunix_nb.tokenizer import ByteTokenizer

    if not os.environ.get("TUNIX_NB_BENCH_CACHE_CHILD"):
        jax.config.update("jax_enable_compilation_cache", False)
    graphdef, params, opt, batch = sft_setup()
    opt_state = opt.init(params)
    teacher_graphdef, teacher_params = model.split(model.make_model("teacher", seed=1))
    pairs = data.preference_arrays(data.load_preferences()[:32], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    steps = {
        "02 distill step": (distill.objective(graphdef, teacher_graphdef), batch, teacher_params),
        "03 sft step": (sft.objective(graphdef), batch, None),
        "04 dpo step": (dpo.objective(graphdef, cached_reference=False), pairs, params),
    }
    out = {}
    for name, (objective, step_batch, frozen) in steps.items():
        if only is not None and name not in only:
            continue
        args = (params, opt_state, step_batch, frozen)
        t0 = time.perf_counter()
        compiled = train.make_step(objective, opt).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        step_s = median_seconds(lambda: compiled(*args), repeats=5)
        out[name] = {"compile_seconds": compile_s, "step_seconds": step_s, "compile_over_step": compile_s / step_s}
    return out


def bench_compile(quick=False):
    first = compile_times(only=("03 sft step",) if quick else None)
    details = {"per_step": first}
    if not quick:  # the persistent compilation cache, across two fresh processes (on the CPU)
        with tempfile.TemporaryDirectory(dir=".") as cache:
            runs = [_compile_times_in_child(cache) for _ in range(2)]
        details["persistent_cache"] = {
            "cold": runs[0], "warm": runs[1],
            "warm_over_cold": {k: runs[1][k]["compile_seconds"] / runs[0][k]["compile_seconds"] for k in runs[0]}}
    worst = max(v["compile_over_step"] for v in first.values())
    return figure(FIGURES, "compile_share", worst, **details)


def _compile_times_in_child(cache_dir) -> dict:
    """`compile_times()` in a fresh process on one CPU device (`devices.child_env`: this process
    may hold the TPU chip, which has one holder), with its own empty persistent cache."""
    code = ("import json, jax; "
            f"jax.config.update('jax_compilation_cache_dir', {str(cache_dir)!r}); "
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
            "jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1); "
            "from tunix_nb.bench.compile import compile_times; print(json.dumps(compile_times()))")
    env = {k: v for k, v in devices.child_env(TUNIX_NB_BENCH_CACHE_CHILD="1").items()
           if not k.startswith("JAX_PERSISTENT_CACHE") and k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"compile-time child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
