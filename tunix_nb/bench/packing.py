"""The packing group (`--only packing`): tokens per second of an SFT training step on one
batch laid out three ways, padded rows, packed rows and one padding-free row
(`tunix_nb.packing`), on a skewed length distribution: prompt + completion tokens uniform
over [16, 256] at 256 a row, so padding wastes about half of each padded batch. Its record
is DIR/bench.json's "packing", with the figure `packing_over_padding` (target >= 1.5).

Run only when named: at full size the padding-free layout (one long row under the kit's
dense attention) takes about 20 s a step on a CPU. One device: the three layouts are one
device's work, timed side by side in rounds, so the figure is their ratio.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from tunix_nb.bench.common import describe, interleaved_times, machine, spread, spread_of_ratio, store, \
    timed_figure

RECORD = "packing"
DEVICES = 1
FIGURES = {"packing_over_padding": (1.5, "min")}  # tokens per second, packed rows / padded rows
SIZES = {  # throughput_comparison's settings: the distribution, and a CI-sized one
    "full": dict(batch_size=32, max_length=256, min_length=16, preset="student", pad_to_multiple_of=128,
                 n_batches_for_padding=200),
    "quick": dict(batch_size=8, max_length=64, min_length=4, preset="tiny", pad_to_multiple_of=32,
                  n_batches_for_padding=20)}
NOTE = "times from a CPU are relative only: compare the layouts, not the machines"


def mean_padding_fractions(n_batches: int, batch_size: int, cfg, *, min_length: int, seed: int) -> dict[str, float]:
    """The padding fraction of padded rows, packed rows and padding-free rows, averaged
    over `n_batches` batches drawn from the benchmark's length distribution."""
    import numpy as np

    from tunix_nb import packing

    fractions = {"padding": [], "packing": [], "padding_free": []}
    for b in range(n_batches):
        arrays = packing.synthetic_examples(batch_size, min_length=min_length, max_length=cfg.max_length,
                                            seed=seed + b)
        fractions["padding"].append(packing.padding_fraction(arrays["attention_mask"]))
        for name, free in (("packing", False), ("padding_free", True)):
            layout = packing.pack(arrays, dataclasses.replace(cfg, padding_free=free))[1]
            fractions[name].append(layout.padding_fraction)
    return {name: float(np.mean(v)) for name, v in fractions.items()}


def throughput_comparison(*, batch_size: int = 32, max_length: int = 256, min_length: int = 16,
                          preset: str = "student", repeats: int = 9, pad_to_multiple_of: int = 128,
                          n_batches_for_padding: int = 200, seed: int = 0) -> dict:
    """Tokens per second of an SFT training step on one batch laid out three ways: padded
    rows, packed rows and one padding-free row, timed side by side in rounds
    (`interleaved_times`; compile excluded, medians), and each layout's padding. One step
    builder (`train.make_step`, jit, AdamW) and one objective (`sft.objective`, which
    reads a packed batch's segment ids) serve all three."""
    import jax
    import numpy as np

    from tunix_nb import model, packing, sft, train

    cfg = packing.PackingConfig(max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
    arrays = packing.synthetic_examples(batch_size, min_length=min_length, max_length=max_length, seed=seed)
    batches = {"padding": arrays, "packing": packing.pack(arrays, cfg)[0],
               "padding_free": packing.pack(arrays, dataclasses.replace(cfg, padding_free=True))[0]}
    graphdef, params = model.split(model.make_model(preset, seed=seed))
    optimizer = train.make_optimizer(train.OptimizerConfig())
    step, opt_state = train.make_step(sft.objective(graphdef), optimizer), optimizer.init(params)
    fns = {name: functools.partial(step, params, opt_state, jax.device_put(batch)) for name, batch in batches.items()}
    losses_seen = {name: float(fn()[2]["loss"]) for name, fn in fns.items()}
    times = interleaved_times(fns, repeats=repeats, warmup=2)
    tokens = int(arrays["attention_mask"].sum())
    tokens_per_second = {name: tokens / float(np.median(t)) for name, t in times.items()}
    return {
        "tokens_per_batch": tokens, "examples_per_batch": batch_size,
        "shapes": {name: list(batch["inputs"].shape) for name, batch in batches.items()},
        "padding_fraction": {name: packing.padding_fraction(batch["attention_mask"])
                             for name, batch in batches.items()},
        "padding_fraction_mean": mean_padding_fractions(n_batches_for_padding, batch_size, cfg,
                                                        min_length=min_length, seed=seed + 1),
        "padding_fraction_mean_batches": n_batches_for_padding,
        "loss": losses_seen,
        "seconds_per_step": {name: spread(t) for name, t in times.items()},
        "tokens_per_second": tokens_per_second,
        # the ratio of the medians, and (the headline, as the bench reports ratios) the
        # spread of the per-round ratios, which cancels load that slows a whole round
        "tokens_per_second_ratio": {name: tps / tokens_per_second["padding"]
                                    for name, tps in tokens_per_second.items()},
        "speedup_over_padding": {name: spread_of_ratio(times, "padding", name) for name in ("packing", "padding_free")},
    }


def with_figure(record: dict, *, quick: bool) -> dict:
    """The record with its figure, packed rows' tokens per second over padded rows' (the median
    of the per-round ratios), against its target; --quick's is not comparable to it."""
    figures = timed_figure(FIGURES, "packing_over_padding", record["speedup_over_padding"]["packing"])
    for fig in figures.values():
        fig["comparable_to_target"] = not quick
    return {**record, **figures}


def run_alone(out_dir: Path, *, quick: bool, options) -> int:
    """Measure (--quick: the tiny preset, 8 examples of up to 64 tokens), store DIR/bench.json's
    "packing" record, and print each layout's tokens per second and the figure."""
    sizes = SIZES["quick" if quick else "full"]
    result = throughput_comparison(repeats=options.repeats or (3 if quick else 10), **sizes)
    lengths = f"prompt + completion tokens uniform over [{sizes['min_length']}, {sizes['max_length']}], " \
              f"max length {sizes['max_length']}"
    record = with_figure({"command": options.command_line, "machine": machine(), "note": NOTE, "quick": quick,
                          "length_distribution": lengths, "preset": sizes["preset"], **result}, quick=quick)
    path = store(out_dir, RECORD, record)
    for name, tps in result["tokens_per_second"].items():
        print(f"{name:13s} padding {result['padding_fraction'][name]:6.1%}  {tps:10.0f} tokens/s")
    print(f"packing_over_padding: {describe(record['packing_over_padding'])}")
    print(f"Wrote {path} (its \"{RECORD}\" record)")
    return 0
