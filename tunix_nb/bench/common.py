"""What every benchmark group shares: timing in rounds, spreads of ratios, XLA's cost estimate,
the machine's description, figures with their targets, and DIR/bench.json, the record."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

# The committed figures and plots (results/ beside tunix_nb/), found from any working
# directory: Colab runs notebooks from /content, not from notebooks/.
RESULTS_DIR = Path(__file__).resolve().parent.parent.parent / "results"
RESULTS_FILE = "bench.json"


def median_seconds(fn, *, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() (which returns arrays to wait for) after warm-up calls."""
    import jax
    import numpy as np

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def interleaved_times(fns: dict, *, repeats: int, warmup: int = 2, min_seconds: float = 0.01) -> dict:
    """{name: [seconds per call, one per round]} of each fn(), timed in rounds: A B C, B C A, ...

    For ratios on a shared machine: each round times every contender once, so a burst of
    load from elsewhere slows the contenders of one round alike, and the ratio within a
    round (`spread_of_ratio`) cancels it. The order rotates because a call can slow the
    one after it (a Python loop of 64 small dispatches made the next program ~20% slower
    here), so no contender always follows the same one.
    A fast fn is called several times per sample (enough for `min_seconds`), so that
    timer resolution and per-sample jitter do not dominate a millisecond call.
    """
    import jax

    calls = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            one = time.perf_counter() - t0
        calls[name] = max(1, math.ceil(min_seconds / max(one, 1e-9)))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / calls[name])
    return times


def interleaved_medians(fns: dict, *, repeats: int, warmup: int = 2, min_seconds: float = 0.01) -> dict:
    """{name: median seconds per call} of each fn(), timed in rounds (`interleaved_times`)."""
    return medians(interleaved_times(fns, repeats=repeats, warmup=warmup, min_seconds=min_seconds))


def spread(values) -> dict:
    """The median of repeated measurements with their quartiles, extremes and count."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    return {"median": float(np.median(v)), "q25": float(np.percentile(v, 25)), "q75": float(np.percentile(v, 75)),
            "min": float(v.min()), "max": float(v.max()), "rounds": int(v.size)}


def spread_of_ratio(times: dict, numerator: str, denominator: str) -> dict:
    """The spread of numerator / denominator over the rounds of `interleaved_times`."""
    import numpy as np

    return spread(np.asarray(times[numerator]) / np.asarray(times[denominator]))


def medians(times: dict) -> dict:
    """{name: median} of `interleaved_times`' rounds."""
    import numpy as np

    return {name: float(np.median(t)) for name, t in times.items()}


def cost(jitted, *args) -> dict:
    """XLA's own estimate for one call of a jitted function: {"flops", "bytes_accessed"}."""
    return compiled_cost(jitted.lower(*args).compile())


def compiled_cost(compiled) -> dict:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis  # a list in older JAX
    return {"flops": float(analysis.get("flops", 0.0)), "bytes_accessed": float(analysis.get("bytes accessed", 0.0))}


def machine() -> dict:
    import flax
    import jax
    import optax
    import orbax.checkpoint as ocp

    devs = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devs[0].device_kind, "device_count": len(devs),
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                         "orbax-checkpoint": ocp.__version__}}



def figure(targets: dict, name: str, value, **details) -> dict:
    """{name: the figure}: its value and details, with its target from `targets` (a group's
    FIGURES: name -> (target, "max" if the figure must stay below it, "min" above))."""
    target, kind = targets[name]
    meets = None if target is None else (value <= target if kind == "max" else value >= target)
    return {name: {"value": value, "target": target, "target_kind": kind, "meets_target": meets, **details}}


def timed_figure(targets: dict, name: str, ratio_spread: dict, **details) -> dict:
    """A figure whose value is the median of its per-round ratios, stored with their spread."""
    return figure(targets, name, ratio_spread["median"], spread=ratio_spread, **details)


def sft_setup(batch_size=64):
    """(graphdef, params, optimizer, batch): the student and one SFT batch of the shipped task."""
    from tunix_nb import data, model, train
    from tunix_nb.tokenizer import ByteTokenizer

    rows = data.sft_arrays(data.load_sft()[:512], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    graphdef, params = model.split(model.make_model("student", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    return graphdef, params, opt, data.batch_at(rows, 0, batch_size, seed=0)


# ------------------------------------------------------------------------------ the record


def read_results(out_dir: Path) -> dict:
    """DIR/bench.json as stored ({} where there is none yet)."""
    path = Path(out_dir) / RESULTS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_results(out_dir: Path, results: dict) -> Path:
    """Write DIR/bench.json (creating DIR); returns its path."""
    path = Path(out_dir) / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=True, default=float) + "\n")
    return path


def store(out_dir: Path, key: str, record: dict) -> Path:
    """Put a group's own record (e.g. "memory", "packing") into DIR/bench.json under `key`,
    keeping everything else there; returns the file's path."""
    return write_results(out_dir, {**read_results(out_dir), key: record})


def describe(fig: dict) -> str:
    """A figure as one line: value, its spread, and its target (or why it is not comparable)."""
    line = f"{fig['value']:.3f}"
    if "spread" in fig:
        line += f" (IQR {fig['spread']['q25']:.3f}-{fig['spread']['q75']:.3f}, {fig['spread']['rounds']} rounds)"
    if fig["target"] is not None:
        line += f" target {'<=' if fig['target_kind'] == 'max' else '>='} {fig['target']}"
        if not fig.get("comparable_to_target", True):
            line += " [--quick: not comparable to the target]"
        else:
            line += _verdict(fig)
    return line


def _verdict(fig: dict) -> str:
    """" met" when every round is on the target's side; when only the median is, saying "met"
    would claim what the machine's noise has not shown."""
    if not fig["meets_target"]:
        return " MISSED"
    spread = fig.get("spread")
    if spread is None:
        return " met"
    worst = spread["max"] if fig["target_kind"] == "max" else spread["min"]
    inside = worst <= fig["target"] if fig["target_kind"] == "max" else worst >= fig["target"]
    return " met" if inside else " met by the median only (its rounds cross the target)"
