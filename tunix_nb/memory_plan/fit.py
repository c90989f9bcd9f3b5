"""Does a step fit? XLA's memory analysis of a step about to train, beside the stored plans.

`analyse_step` compiles the caller's own step (`train.make_step`) for the arguments it is
about to train on, on the devices it will run on, and returns XLA's analysis without
running it: on a TPU that is the chip's plan. `stored_row` reads a real model's plan from
results/memory.json (`python -m tunix_nb.bench --only memory`, compiled for a TPU v5e chip
with libtpu), so a machine without the chip, or without libtpu, can print both side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from tunix_nb import parallel
from tunix_nb.memory_plan.analysis import memory_of

RESULTS = Path(__file__).resolve().parent.parent.parent / "results" / "memory.json"
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _shapes(tree, shape=lambda s: s):
    """The tree's leaves as ShapeDtypeStructs (concrete or abstract leaves alike), `shape` applied."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(shape(tuple(x.shape)), x.dtype), tree)


def _pmap_batch_shape(n: int):
    def split(shape):
        if not shape or shape[0] % n:
            raise ValueError(f"A batch leaf of shape {shape} does not split over the {n} devices pmap runs on; "
                             f"use a batch size that is a multiple of {n}.")
        return (n, shape[0] // n, *shape[1:])
    return split


def analyse_step(step, params, opt_state, batch, frozen=None, *, parallel_mode: str = "jit") -> dict:
    """XLA's memory analysis, per device, of `step` compiled for these arguments, never run.

    The arguments are what `train.run(step, params, opt_state, batch_fn, frozen=...)` takes:
    the state as the caller holds it and one global batch (`batch_fn(0)`), under the same
    `parallel_mode` the step was built for. Only their shapes and dtypes are read, so
    `jax.ShapeDtypeStruct`s do as well and nothing is allocated. The compiled program is
    the one the first training step runs (JAX's caches keep it), on the devices it runs
    on: the CPU's analysis on a CPU, the chip's on a TPU. Returns `memory_of`'s fields
    (argument, output, temp, alias and total bytes) plus "backend" and "devices".
    """
    if parallel_mode == "pmap":
        n = jax.local_device_count()
        replicated = _shapes((params, opt_state, frozen), lambda s: (n, *s))
        lowered = step.lower(*replicated[:2], _shapes(batch, _pmap_batch_shape(n)), replicated[2])
        devices = n
    elif parallel_mode == "jit":
        lowered = step.lower(*_shapes((params, opt_state, batch, frozen)))
        devices = 1
    elif parallel_mode in parallel.MESH_MODES:
        args = _shapes((params, opt_state, batch, frozen))
        lowered = step.jitted(args[0], args[1], args[3]).lower(*args)
        devices = step.mesh.size
    else:
        raise ValueError(f"Unknown parallel mode {parallel_mode!r}; pass the one the step was built for.")
    return {**memory_of(lowered.compile()), "backend": jax.default_backend(), "devices": devices}


def device_memory_bytes(device=None) -> int | None:
    """The memory a device's runtime says it may use (`bytes_limit`); None where it says
    nothing (the CPU)."""
    stats = (device or jax.devices()[0]).memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def stored_row(model: str, strategy: str, variant: str, target: str = "v5e", path: Path = RESULTS) -> dict:
    """The stored plan of one step: results/memory.json's row for `model` ("Qwen3-0.6B"),
    `strategy` ("full", "lora", "qlora"), `variant` ("before", "after", "after, chunked")
    and `target` ("v5e", "v5e-8", "cpu")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run python -m tunix_nb.bench --only memory "
                                "(the v5e rows need libtpu: see tunix_nb.memory_plan.targets).")
    rows = json.loads(path.read_text())["rows"]
    for row in rows:
        if (row["model"], row["strategy"], row["variant"], row["target"]) == (model, strategy, variant, target):
            return row
    held = sorted({(r["model"], r["strategy"], r["variant"], r["target"]) for r in rows})
    raise KeyError(f"{path.name} holds no row for model={model!r}, strategy={strategy!r}, variant={variant!r}, "
                   f"target={target!r}; it holds {held}.")


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or above: "1.53 MiB"."""
    for unit, size in UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:,.0f} bytes"


def describe(memory: dict) -> str:
    """One line of an analysis: arguments, outputs, temporaries, aliased and their total."""
    parts = [f"{name} {format_bytes(memory[f'{key}_bytes'])}" for name, key in
             (("arguments", "argument"), ("outputs", "output"), ("temporaries", "temp"), ("aliased", "alias"))]
    return ", ".join(parts) + f"; total {format_bytes(memory['total_bytes'])}"
