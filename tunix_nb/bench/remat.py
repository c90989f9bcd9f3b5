"""The remat group: the SFT step with each block rematerialised against without, in XLA's
temporary memory and in time."""

from __future__ import annotations

import json
import subprocess
import sys

from tunix_nb import devices
from tunix_nb.memory_plan import analysis
from tunix_nb.bench.common import figure, interleaved_times, medians, spread_of_ratio, timed_figure
from tunix_nb.bench.mfu import mfu_setup

FIGURES = {"remat_memory_ratio": (None, None), "remat_step_time_ratio": (None, None)}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_remat(repeats, quick=quick)



# XLA's CPU scheduler by default orders ops for parallelism, not memory; this flag makes
# it schedule to keep less alive, as the TPU and GPU schedulers do
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def remat_programs(batch: int, seq_len: int, **sizes) -> dict:
    """{"plain", "remat": (compiled SFT step, its args)} for the MFU model at this size
    (`sizes`: `mfu_setup`'s overrides)."""
    from tunix_nb import model, sft, train

    _, graphdef, params, b, opt = mfu_setup(batch, seq_len, **sizes)
    args = (params, opt.init(params), b)
    out = {}
    for name, g in (("plain", graphdef), ("remat", model.with_remat(graphdef, params))):
        out[name] = (train.make_step(sft.objective(g), opt).lower(*args).compile(), args)
    return out


def update_difference(programs, batch: int, seq_len: int, **sizes) -> float:
    """The largest difference between the plain and the rematerialised step's updates, with
    float32 compute and float32 matmuls. `programs` computed that way already (a CPU's
    default); None: the pair is compiled again under `compare.agreement_precision`, because a
    TPU's default (bfloat16 compute, one-pass matmuls) rounds differently wherever the
    recomputation fuses differently: 1.1e-3 apart on a v5e chip, by rounding, not by remat."""
    import jax
    import numpy as np

    from tunix_nb import compare

    if programs is None:
        with compare.agreement_precision():
            programs = remat_programs(batch, seq_len, **sizes)
    updates = {name: compiled(*args) for name, (compiled, args) in programs.items()}
    # recomputed activations can fuse differently: equal to float32 rounding, not always bitwise
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(updates["plain"]), jax.tree.leaves(updates["remat"])))


def computes_in_float32() -> bool:
    """Whether this process's "auto" programs compute as `compare.agreement_precision` does:
    float32 activations, and float32 matmuls exact (a CPU's)."""
    import jax

    from tunix_nb import precision

    return jax.default_backend() == "cpu" and precision.resolve_compute_dtype("auto") is None


def temp_bytes(programs: dict) -> dict:
    """XLA's temporary buffer size of each compiled program: activations, gradients and
    scratch, the part of the step's peak memory that rematerialisation can shrink."""
    return {name: analysis.temporary_bytes(compiled) for name, (compiled, _) in programs.items()}


def bench_remat(repeats, quick=False):
    """The SFT step with each block rematerialised (`ModelConfig.remat`) against without:
    XLA's temporary memory of the compiled step and its time, at a size where activations
    dominate; both give the same update to float32 rounding (checked)."""
    import jax

    batch, seq_len = (4, 128) if quick else (8, 512)
    programs = remat_programs(batch, seq_len)
    memory = temp_bytes(programs)
    difference = update_difference(programs if computes_in_float32() else None, batch, seq_len)
    if difference > 1e-6:
        raise RuntimeError(f"the rematerialised step's update differs from the plain step's by {difference:.2g}")
    times = interleaved_times({name: (lambda c=c, a=a: c(*a)) for name, (c, a) in programs.items()},
                              repeats=repeats, warmup=1)
    details = dict(batch=batch, seq_len=seq_len, model="d_model 256, 4 layers, d_ff 768",
                   update_max_abs_difference=difference,
                   temp_bytes=memory, step_seconds=medians(times), repeats=repeats)
    if jax.default_backend() == "cpu" and not quick:
        details["temp_bytes_with_memory_scheduler"] = _remat_memory_in_child(batch, seq_len)
        details["memory_scheduler_flag"] = MEMORY_SCHEDULER_FLAG
    return {**figure(FIGURES, "remat_memory_ratio", memory["remat"] / memory["plain"], **details,
                     note="XLA's temporary bytes of the compiled step, with remat / without"),
            **timed_figure(FIGURES, "remat_step_time_ratio", spread_of_ratio(times, "remat", "plain"),
                           note="step time with remat / without, timed in turns")}


def _remat_memory_in_child(batch, seq_len) -> dict:
    code = ("import json; from tunix_nb.bench import remat; "
            f"print(json.dumps(remat.temp_bytes(remat.remat_programs({batch}, {seq_len}))))")
    env = devices.child_env(XLA_FLAGS=MEMORY_SCHEDULER_FLAG)  # on the CPU, as the flag is the CPU scheduler's
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"remat memory child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
