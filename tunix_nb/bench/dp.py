"""The dp group: each data-parallel strategy's step on n devices over the single-device step, and
the all-reduce's share of the pmap step."""

from __future__ import annotations

from tunix_nb.bench.common import figure, interleaved_times, medians, sft_setup, spread, spread_of_ratio, timed_figure

FIGURES = {"dp_overhead": (1.25, "max"), "allreduce_share": (0.05, "max")}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_dp(repeats, [8] if quick else [1, 2, 4, 8], quick=quick)


def _placed_step(objective, opt, mode, state, batch, n_devices):
    """(step, state, batch) laid out for a strategy on the first n_devices devices."""
    from tunix_nb import parallel, train

    if mode == "pmap":
        step = train.make_step(objective, opt, parallel_mode=mode)
        return step, parallel.replicate(state, n_devices), parallel.shard_batch(batch, n_devices)
    mesh = parallel.make_mesh(n_devices)
    step = train.make_step(objective, opt, parallel_mode=mode, mesh=mesh)
    return step, parallel.place_state(state, mesh, mode), parallel.place_batch(batch, mesh)


def bench_dp(repeats, device_counts, quick=False, allreduce_batches=(64, 128, 256, 512, 1024)):
    """Each strategy's step on n devices over the single-device jit step (global batch 64,
    all timed in turns), and the all-reduce's share of the pmap step (with it against
    without it, in turns) over a range of global batches: the figure is at the largest,
    where the step's compute, not its fixed costs, sets the time."""
    import jax
    import numpy as np

    from tunix_nb import parallel, sft, train

    graphdef, params, opt, batch = sft_setup()
    objective = sft.objective(graphdef)
    opt_state = opt.init(params)
    jit_step = train.make_step(objective, opt)
    modes = [m for m in ("pmap", "shard_map", "dp") if m in train.PARALLEL_MODES]
    # the counts this machine has (on a single chip or CPU device: just 1)
    device_counts = [n for n in device_counts if n <= jax.local_device_count()] or [jax.local_device_count()]
    contenders = {"jit": lambda: jit_step(params, opt_state, batch)}
    for mode in modes:
        for n in device_counts:
            step, state, b = _placed_step(objective, opt, mode, (params, opt_state), batch, n)
            contenders[f"{mode}/{n}"] = lambda step=step, state=state, b=b: step(*state, b)
    times = interleaved_times(contenders, repeats=repeats)
    table = {mode: {n: spread_of_ratio(times, f"{mode}/{n}", "jit")["median"] for n in device_counts}
             for mode in modes}
    n_max = max(device_counts)
    worst = max(modes, key=lambda m: table[m][n_max])
    state = parallel.replicate((params, opt_state), n_max)
    with_ar = train.make_step(objective, opt, parallel_mode="pmap")
    without_ar = train.make_step(objective, opt, parallel_mode="pmap", all_reduce=False)
    # The all-reduce moves a fixed amount (one gradient); the compute grows with the batch.
    by_batch = {}
    for global_batch in (64,) if quick else allreduce_batches:
        big = {k: np.concatenate([v] * (global_batch // 64)) for k, v in batch.items()}
        bb = parallel.shard_batch(big, n_max)
        t = interleaved_times({"with": lambda: with_ar(*state, bb), "without": lambda: without_ar(*state, bb)},
                              repeats=repeats)
        tw, to = np.asarray(t["with"]), np.asarray(t["without"])
        share = spread((tw - to) / tw)
        by_batch[global_batch] = {"step_seconds": float(np.median(tw)),
                                  "step_without_allreduce_seconds": float(np.median(to)),
                                  "share": share["median"], "share_spread": share}
    at = max(by_batch)
    share = by_batch[at]["share_spread"]
    return {**timed_figure(FIGURES, "dp_overhead", spread_of_ratio(times, f"{worst}/{n_max}", "jit"),
                           at_devices=n_max, strategy=worst, per_strategy=table,
                           jit_step_seconds=medians(times)["jit"], global_batch=64, repeats=repeats),
            # a share below 0 is noise (the step without the all-reduce timed slower): shown as 0
            **figure(FIGURES, "allreduce_share", max(share["median"], 0.0), spread=share, devices=n_max,
                     global_batch=at, step_seconds=by_batch[at]["step_seconds"],
                     step_without_allreduce_seconds=by_batch[at]["step_without_allreduce_seconds"],
                     repeats=repeats, gradient_bytes=4 * sum(x.size for x in jax.tree.leaves(params)),
                     share_by_global_batch=by_batch)}
