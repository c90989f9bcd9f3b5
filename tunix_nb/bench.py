"""Benchmarks behind lesson 07: `python -m tunix_nb.bench [--quick] [--only NAME] [--out DIR]`.

Every figure is a ratio of two things timed side by side in the same run, because a
shared machine is noisy; absolute times are kept as details. The contenders are timed in
rounds, each timing every contender once, and a figure is the median of its per-round
ratios, stored with their spread (quartiles, min and max). `--quick` runs smaller sizes
with fewer rounds: its figures are marked as not comparable to the targets. Results go
to DIR/bench.json (merged with what is there) and DIR/*.png.

`--only memory` compiles (never runs) real models' training steps for a TPU v5e chip and
reports XLA's memory analysis, before and after the memory remedies: DIR/memory.json
(`tunix_nb.memory_plan`; the TPU targets need libtpu, see `tunix_nb.memory_plan.targets`).

Its optional part, the kit's steps against Tunix's trainers, needs google-tunix (not in
requirements.txt) and runs on its own: `python -m tunix_nb.tunix_compare` (skipped, with
the reason and the install commands, where Tunix is not installed).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tunix_nb import devices

# The committed figures and plots (results/ beside tunix_nb/), found from any working
# directory: Colab runs notebooks from /content, not from notebooks/.
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

# figure name -> (group that measures it, target, "max" if the figure must stay below it)
FIGURES = {
    "vmap_speedup_over_loop": ("vmap", None, None),
    "vmap_over_batched_ratio": ("vmap", 1.10, "max"),
    "train_step_mfu": ("mfu", 0.45, "min"),
    "backward_over_forward": ("mfu", 2.5, "max"),
    "dp_overhead": ("dp", 1.25, "max"),
    "allreduce_share": ("dp", 0.05, "max"),
    "ckpt_save_over_disk_bandwidth": ("ckpt", 0.5, "min"),  # a share of a physical limit: <= 1
    "async_block_share": ("ckpt", 0.10, "max"),
    "ckpt_restore_seconds": ("ckpt", None, None),
    "dpo_cached_ref_speedup": ("dpo", 1.25, "min"),
    "compile_share": ("compile", None, None),
    "kv_cache_decode_speedup": ("kv_cache", None, None),
    "grpo_rollout_share": ("grpo", None, None),
    "lora_optimizer_state_share": ("lora", None, None),
    "lora_step_time_ratio": ("lora", None, None),
    "lora_exact_match_over_full": ("lora", None, None),
    "remat_memory_ratio": ("remat", None, None),
    "remat_step_time_ratio": ("remat", None, None),
}
GROUPS = ("vmap", "mfu", "dp", "ckpt", "dpo", "compile", "kv_cache", "grpo", "lora", "remat")
# Run only when named (--only): "memory" compiles real models' steps for a TPU chip
# (tunix_nb.memory_plan), minutes per step on a CPU, and writes DIR/memory.json.
OPTIONAL_GROUPS = ("memory",)


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


def _figure(name, value, **details):
    _, target, kind = FIGURES[name]
    meets = None if target is None else (value <= target if kind == "max" else value >= target)
    return {name: {"value": value, "target": target, "target_kind": kind, "meets_target": meets, **details}}


def _timed_figure(name, ratio_spread: dict, **details):
    """A figure whose value is the median of its per-round ratios, stored with their spread."""
    return _figure(name, ratio_spread["median"], spread=ratio_spread, **details)


# ------------------------------------------------------------------------------ vmap


def _kd_batched(s_BxLxV, t_BxLxV, y_BxL, m_BxL, temperature=2.0, alpha=0.5):
    """The per-example distillation loss written by hand with a batch axis -> [B]."""
    import jax
    import jax.numpy as jnp

    logq = jax.nn.log_softmax(s_BxLxV / temperature, axis=-1)
    logp = jax.nn.log_softmax(t_BxLxV / temperature, axis=-1)
    kl_BxL = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    ce_BxL = -jnp.take_along_axis(jax.nn.log_softmax(s_BxLxV, axis=-1), y_BxL[..., None], axis=-1)[..., 0]
    n_B = jnp.maximum(m_BxL.sum(-1), 1.0)
    soft_B = temperature**2 * (kl_BxL * m_BxL).sum(-1) / n_B
    return alpha * soft_B + (1 - alpha) * (ce_BxL * m_BxL).sum(-1) / n_B


def bench_vmap(batch_sizes, repeats, seq_len=24, vocab=259):
    import jax
    import jax.numpy as jnp

    from tunix_nb import losses

    one = jax.jit(losses.kl_distillation_per_example)
    vmapped = jax.jit(jax.vmap(losses.kl_distillation_per_example))
    batched = jax.jit(_kd_batched)
    curve = {}
    for b in batch_sizes:
        k1, k2, k3 = jax.random.split(jax.random.key(b), 3)
        s = jax.random.normal(k1, (b, seq_len, vocab))
        t = 3.0 * jax.random.normal(k2, (b, seq_len, vocab))
        y = jax.random.randint(k3, (b, seq_len), 0, vocab)
        m = (jnp.arange(seq_len) < 6).astype(jnp.float32)[None].repeat(b, 0)
        loop = lambda: [one(s[i], t[i], y[i], m[i]) for i in range(b)]
        # two pairs, each timed in turns: the loop's many small calls disturb what follows them
        pair = interleaved_times({"vmap": lambda: vmapped(s, t, y, m), "batched": lambda: batched(s, t, y, m)},
                                 repeats=repeats)
        against_loop = interleaved_times({"loop": loop, "vmap": lambda: vmapped(s, t, y, m)}, repeats=repeats)
        loop_over_vmap, vmap_over_batched = (spread_of_ratio(against_loop, "loop", "vmap"),
                                             spread_of_ratio(pair, "vmap", "batched"))
        curve[b] = {"loop_seconds": medians(against_loop)["loop"], "vmap_seconds": medians(pair)["vmap"],
                    "batched_seconds": medians(pair)["batched"],
                    "loop_over_vmap": loop_over_vmap["median"], "loop_over_vmap_spread": loop_over_vmap,
                    "vmap_over_batched": vmap_over_batched["median"], "vmap_over_batched_spread": vmap_over_batched}
    at = 64 if 64 in curve else max(curve)
    shape = {"batch_size": at, "seq_len": seq_len, "vocab": vocab, "repeats": repeats}
    # what XLA compiled for each: equal costs mean the two programs do the same work
    args = (jnp.zeros((at, seq_len, vocab)), jnp.zeros((at, seq_len, vocab)),
            jnp.zeros((at, seq_len), jnp.int32), jnp.ones((at, seq_len)))
    xla_cost = {"vmap": cost(vmapped, *args), "batched": cost(batched, *args)}
    return {**_timed_figure("vmap_speedup_over_loop", curve[at]["loop_over_vmap_spread"], **shape, curve=curve),
            **_timed_figure("vmap_over_batched_ratio", curve[at]["vmap_over_batched_spread"], **shape,
                            xla_cost=xla_cost)}


# ------------------------------------------------------------------------------- mfu


def model_flops_per_step(cfg, batch: int, seq_len: int) -> float:
    """Analytic training FLOPs: 3 x forward (forward + 2x for backward), matmuls only."""
    d, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    per_token = 2 * layers * (4 * d * d + 3 * d * f)  # q, k, v, out; gate, up, down
    per_token += 2 * d * v                            # tied output head
    per_token += layers * 2 * 2 * seq_len * d         # scores and weighted values (full L x L)
    return 3.0 * per_token * batch * seq_len


@contextlib.contextmanager
def linears_on_token_grid():
    """The model as it was before the backward-pass fix, for programs traced inside this
    block: every Linear applied to the [B, L, D] activations directly, instead of to the
    tokens laid out as one [B*L, D] matrix (`model.per_token`). The same numbers."""
    from tunix_nb import model

    saved = model.per_token
    model.per_token = lambda layer, x: layer(x)
    try:
        yield
    finally:
        model.per_token = saved


def op_profile(compiled, args, *, calls: int = 5, top: int = 8) -> dict:
    """Where a compiled program's time goes, op by op: a `jax.profiler` trace of `calls`
    calls, each traced op matched to its instruction in the compiled HLO.

    by_kind: the ops grouped by kind (the fusion's name without its number, e.g.
    "copy_bitcast_fusion"); top_ops: the slowest, with the JAX operation they come from
    (the HLO's op_name, e.g. "transpose(jvp(jit(silu)))" is SiLU's gradient);
    layout_copy_share: the share of the traced time spent in copies and transposes.
    Empty where the backend's trace does not name the HLO's ops.
    """
    import re
    from collections import Counter

    import jax

    hlo = compiled.as_text()
    instructions = {m.group(1): m.group(0) for m in re.finditer(r"^\s*%?([\w.\-]+) = .*$", hlo, re.M)}
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
        jax.profiler.stop_trace()
        traces = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(traces[-1].read_bytes()))["traceEvents"] if traces else []
    seconds = Counter()
    for event in events:
        if "dur" in event and event.get("name") in instructions:
            seconds[event["name"]] += event["dur"] * 1e-6 / calls
    total = sum(seconds.values())
    if not total:
        return {}
    by_kind = Counter()
    for name, t in seconds.items():
        by_kind[re.sub(r"[._]\d+$", "", name)] += t

    def described(name, t):
        line = instructions[name]
        source = re.search(r'op_name="([^"]*)"', line)
        shape = re.search(r"= (\S+)", line)
        return {"op": name, "seconds": t, "share": t / total, "shape": shape.group(1) if shape else "",
                "source": source.group(1) if source else ""}

    copies = sum(t for kind, t in by_kind.items() if "copy" in kind or "transpose" in kind)
    return {"calls": calls, "traced_seconds": total, "layout_copy_share": copies / total,
            "by_kind": [{"kind": k, "seconds": t, "share": t / total} for k, t in by_kind.most_common(top)],
            "top_ops": [described(n, t) for n, t in seconds.most_common(top)]}


def _mfu_setup(batch: int, seq_len: int):
    """(cfg, graphdef, params, batch, optimizer): the benchmark's model (d_model 256, 4
    layers, d_ff 768) and one SFT batch of random tokens."""
    import numpy as np

    from tunix_nb import model, train

    cfg = model.get_config("student", d_model=256, n_layers=4, n_heads=4, d_ff=768)
    graphdef, params = model.split(model.make_model(cfg, seed=0))
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq_len), np.float32),
         "attention_mask": np.ones((batch, seq_len), np.int32)}
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    return cfg, graphdef, params, b, opt


def _step_programs(graphdef, params, opt, b):
    """(step, forward, forward+backward), compiled: for timing before and after the fix."""
    import jax

    from tunix_nb import sft, train

    objective = sft.objective(graphdef)
    step = train.make_step(objective, opt).lower(params, opt.init(params), b).compile()
    forward = jax.jit(lambda p: objective(p, b)[0]).lower(params).compile()
    forward_backward = jax.jit(jax.grad(lambda p: objective(p, b)[0])).lower(params).compile()
    return step, forward, forward_backward


def bench_mfu(repeats, quick=False):
    """The SFT step's FLOPs per second over the machine's matmul peak, timed in turns with
    the peak; the backward pass against the forward; and the fix of the backward pass
    (`model.per_token`) against the model before it, on the same batch in the same run."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tunix_nb import model

    n = 512 if quick else 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    cfg, graphdef, params, b, opt = _mfu_setup(*((4, 64) if quick else (8, 128)))
    batch, seq_len = b["inputs"].shape
    opt_state = opt.init(params)
    step, forward, forward_backward = _step_programs(graphdef, params, opt, b)
    grads = forward_backward(params)
    update = jax.jit(lambda g, s, p: opt.update(g, s, p))
    # the model's own largest matmul (tokens x d_model @ d_model x d_ff): how near the peak
    # a matmul of this size runs, the ceiling for the step's MFU
    x_NxD = jax.random.normal(jax.random.key(1), (batch * seq_len, cfg.d_model))
    w_DxF = jax.random.normal(jax.random.key(2), (cfg.d_model, cfg.d_ff))
    model_matmul = jax.jit(lambda x, w: x @ w)
    contenders = {
        "peak_matmul": lambda: matmul(a), "model_matmul": lambda: model_matmul(x_NxD, w_DxF),
        "step": lambda: step(params, opt_state, b), "forward": lambda: forward(params),
        "forward_backward": lambda: forward_backward(params),
        "optimizer_update": lambda: update(grads, opt_state, params)}
    if not quick:  # the model before the backward-pass fix, in the same rounds
        with linears_on_token_grid():
            step_before, _, forward_backward_before = _step_programs(graphdef, params, opt, b)
        contenders.update(step_before_fix=lambda: step_before(params, opt_state, b),
                          forward_backward_before_fix=lambda: forward_backward_before(params))
    t = interleaved_times(contenders, repeats=repeats)
    flops = model_flops_per_step(cfg, batch, seq_len)
    times = {k: np.asarray(v) for k, v in t.items()}
    mfu = spread(flops * times["peak_matmul"] / (2 * n**3 * times["step"]))
    backward = spread((times["forward_backward"] - times["forward"]) / times["forward"])
    med = medians(t)
    seconds, peak = med["step"], 2 * n**3 / med["peak_matmul"]
    profile = {f"{k}_seconds": v for k, v in med.items() if k not in ("peak_matmul", "step", "model_matmul")}
    profile["matmul_flops_share_of_forward_time_at_peak"] = flops / 3 / peak / profile["forward_seconds"]
    profile["model_matmul_over_peak"] = spread(
        (2 * batch * seq_len * cfg.d_model * cfg.d_ff / times["model_matmul"]) / (2 * n**3 / times["peak_matmul"]))
    fix = {}
    if not quick:  # op by op: where the step's time goes, and where it went before the fix
        fix = {"step_speedup": spread_of_ratio(t, "step_before_fix", "step"),
               "backward_over_forward_before": spread(
                   (times["forward_backward_before_fix"] - times["forward"]) / times["forward"]),
               "mfu_before": spread(flops * times["peak_matmul"] / (2 * n**3 * times["step_before_fix"])),
               "what": "every Linear applied to [B*L, D] tokens (model.per_token) instead of [B, L, D]",
               "op_profile_before": op_profile(step_before, (params, opt_state, b))}
        profile["op_profile"] = op_profile(step, (params, opt_state, b))
    details = dict(step_seconds=seconds, model_flops_per_step=flops,
                   xla_flops_per_step=compiled_cost(step)["flops"],
                   achieved_flops_per_second=flops / seconds, matmul_peak_flops_per_second=peak,
                   peak_matmul_size=n, repeats=repeats, profile=profile, fix=fix,
                   model={"d_model": cfg.d_model, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff,
                          "params": model.count_params(params), "batch": batch, "seq_len": seq_len,
                          "dtype": "float32"})
    return {**_timed_figure("train_step_mfu", mfu, **details),
            **_timed_figure("backward_over_forward", backward, forward_seconds=med["forward"],
                            forward_backward_seconds=med["forward_backward"], flops_ratio=2.0,
                            note="(forward+backward - forward) / forward, SFT on the MFU model; "
                                 "2.0 in matmul FLOPs")}


# -------------------------------------------------------------------------------- dp


def _sft_setup(batch_size=64):
    from tunix_nb import data, model, train
    from tunix_nb.tokenizer import ByteTokenizer

    rows = data.sft_arrays(data.load_sft()[:512], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    graphdef, params = model.split(model.make_model("student", seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    return graphdef, params, opt, data.batch_at(rows, 0, batch_size, seed=0)


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

    graphdef, params, opt, batch = _sft_setup()
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
    return {**_timed_figure("dp_overhead", spread_of_ratio(times, f"{worst}/{n_max}", "jit"), at_devices=n_max,
                            strategy=worst, per_strategy=table, jit_step_seconds=medians(times)["jit"],
                            global_batch=64, repeats=repeats),
            # a share below 0 is noise (the step without the all-reduce timed slower): shown as 0
            **_figure("allreduce_share", max(share["median"], 0.0), spread=share, devices=n_max, global_batch=at,
                      step_seconds=by_batch[at]["step_seconds"],
                      step_without_allreduce_seconds=by_batch[at]["step_without_allreduce_seconds"],
                      repeats=repeats, gradient_bytes=4 * sum(x.size for x in jax.tree.leaves(params)),
                      share_by_global_batch=by_batch)}


# ------------------------------------------------------------------------------ ckpt


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root: its bytes are on disk, not in the page cache."""
    for path in [root, *root.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_and_fsync(path: Path, payload: bytes) -> float:
    """Seconds to write payload to a new file and fsync it (the disk-bandwidth probe)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def _orbax_save(directory: Path, state, *, async_save: bool, restore: bool = False) -> dict:
    """Seconds an Orbax save blocks the caller, takes until its files are on disk (fsync'd
    like the probe's), and, if asked, takes to restore; the checkpoint is deleted after."""
    import shutil

    import jax
    import orbax.checkpoint as ocp

    from tunix_nb import checkpoint

    manager = checkpoint.make_manager(directory, keep=1, async_save=async_save)
    t0 = time.perf_counter()
    manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(state)))
    out = {"blocked": time.perf_counter() - t0}
    manager.wait_until_finished()
    fsync_tree(directory)
    out["total"] = time.perf_counter() - t0
    if restore:
        t0 = time.perf_counter()
        restored = manager.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
        jax.block_until_ready(dict(restored["params"]))
        out["restore"] = time.perf_counter() - t0
    manager.close()
    out["bytes_on_disk"] = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    shutil.rmtree(directory)
    return out


def bench_ckpt(megabytes, repeats):
    """An Orbax save against the disk's write bandwidth, both timed until their bytes are
    on disk; how long an async save blocks; the restore time.

    Rounds rotate the order (probe, sync save, async save), after one warm-up round: the
    first write of a process ran 4x slower here, and one contender must not always
    follow another's writes.
    """
    import jax
    import numpy as np

    n_arrays = 8
    per = int(megabytes * 2**20 / 4 / n_arrays)
    state = {f"w{i}": jax.numpy.asarray(np.random.default_rng(i).standard_normal(per, np.float32))
             for i in range(n_arrays)}
    nbytes = sum(x.nbytes for x in state.values())
    payload = np.random.default_rng(0).bytes(nbytes)
    runs = {"disk": [], "sync": [], "async": [], "memory": []}
    # the same save into RAM (tmpfs), where no disk is involved: what the save costs the CPU
    memory_root = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=".") as root, tempfile.TemporaryDirectory(dir=memory_root) as in_memory:
        contenders = {"disk": lambda r: _write_and_fsync(Path(root) / f"disk{r}.bin", payload),
                      "sync": lambda r: _orbax_save(Path(root) / f"sync{r}", state, async_save=False, restore=True),
                      "async": lambda r: _orbax_save(Path(root) / f"async{r}", state, async_save=True)}
        if memory_root is not None:
            contenders["memory"] = lambda r: _orbax_save(Path(in_memory) / f"sync{r}", state, async_save=False)
        names = list(contenders)
        for r in range(-1, repeats):  # round -1 warms up
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = contenders[name](r)
                if r >= 0:
                    runs[name].append(out)
    med = lambda xs: float(np.median(xs))
    disk_s = np.asarray(runs["disk"])
    sync_s = np.asarray([x["total"] for x in runs["sync"]])
    blocked_s = np.asarray([x["blocked"] for x in runs["async"]])
    restore_s = [x["restore"] for x in runs["sync"]]
    disk_bw, save_bw = nbytes / med(disk_s), nbytes / med(sync_s)
    return {**_timed_figure("ckpt_save_over_disk_bandwidth", spread(disk_s / sync_s),
                            state_bytes=nbytes, save_bytes_per_second=save_bw, disk_write_bytes_per_second=disk_bw,
                            bytes_on_disk=runs["sync"][0]["bytes_on_disk"], repeats=repeats,
                            save_to_memory_seconds=med([x["total"] for x in runs["memory"]]) if runs["memory"] else None,
                            note="both timed until their bytes are on disk: the probe writes one file of the "
                                 "same size and fsyncs it; the sync Orbax save waits, then fsyncs every file "
                                 "and folder it wrote"),
            **_timed_figure("async_block_share", spread(blocked_s / sync_s), async_blocked_seconds=med(blocked_s),
                            async_total_seconds=med([x["total"] for x in runs["async"]]),
                            sync_seconds=med(sync_s), repeats=repeats),
            **_figure("ckpt_restore_seconds", med(restore_s), spread=spread(restore_s), state_bytes=nbytes,
                      restore_bytes_per_second=nbytes / med(restore_s), repeats=repeats)}


# ------------------------------------------------------------------------------- dpo


def bench_dpo(repeats):
    import jax

    from tunix_nb import data, dpo, model, train
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params = model.split(model.make_model("student", seed=0))
    pairs = data.preference_arrays(data.load_preferences()[:64], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    pairs = dpo.reference_log_probs(graphdef, params, pairs, batch_size=64)
    batch = data.batch_at(pairs, 0, 32, seed=0)
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    opt_state = opt.init(params)
    objective = dpo.objective(graphdef)
    cached = train.make_step(objective, opt)
    recompute = train.make_step(dpo.objective(graphdef, cached_reference=False), opt)
    # the profile: what the recomputing step adds (one reference forward pass), and what
    # both steps share (the policy's forward and backward passes, the optimizer update)
    reference_forward = jax.jit(lambda p, b: dpo.pair_log_probs(graphdef, p, b))
    policy_grad = jax.jit(jax.grad(lambda p, b: objective(p, b, None)[0]))
    times = interleaved_times({"cached": lambda: cached(params, opt_state, batch),
                                "recompute": lambda: recompute(params, opt_state, batch, params),
                                "reference_forward": lambda: reference_forward(params, batch),
                                "policy_forward_backward": lambda: policy_grad(params, batch)}, repeats=repeats)
    t = medians(times)
    xla_cost = {"cached_step": cost(cached, params, opt_state, batch),
                "recompute_step": cost(recompute, params, opt_state, batch, params),
                "reference_forward": cost(reference_forward, params, batch),
                "policy_forward_backward": cost(policy_grad, params, batch)}
    flops = {k: v["flops"] for k, v in xla_cost.items()}
    return _timed_figure(
        "dpo_cached_ref_speedup", spread_of_ratio(times, "recompute", "cached"), cached_seconds=t["cached"],
        recompute_seconds=t["recompute"], pairs_per_step=32, repeats=repeats,
        profile={f"{k}_seconds": v for k, v in t.items()}, xla_cost=xla_cost,
        # the ceiling in arithmetic: 4/3 when backward = 2 forwards and the update is free
        flops_ratio=flops["recompute_step"] / flops["cached_step"],
        # the ceiling in time on this machine: the cached step plus one reference forward
        predicted_from_profile=(t["cached"] + t["reference_forward"]) / t["cached"],
        backward_over_forward_seconds=(t["policy_forward_backward"] - t["reference_forward"]) / t["reference_forward"],
        backward_over_forward_flops=(flops["policy_forward_backward"] - flops["reference_forward"])
        / flops["reference_forward"])


# -------------------------------------------------------------------------- kv_cache


def bench_kv_cache(repeats, quick=False, batch_size=64):
    """Greedy decoding with the KV cache (sampler.generate) against rerunning the whole
    sequence for every token (model.greedy_generate): same model, prompts and tokens.

    The model is the student, the policy GRPO samples from; the figure is at the kit's
    answer length (data.MAX_NEW_TOKENS), the curve shows how the gap grows with length.
    """
    import jax
    import numpy as np

    from tunix_nb import data, model, sampler
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params = model.split(model.make_model("student", seed=0))
    prompts = data.prompt_arrays([e["prompt"] for e in data.load_sft()[:batch_size]], ByteTokenizer(),
                                 data.DEFAULT_PROMPT_LEN)
    tokens_BxP, mask_BxP = prompts["tokens"], prompts["attention_mask"]
    key = jax.random.key(0)
    curve = {}
    for new in (data.MAX_NEW_TOKENS, 32) if quick else (data.MAX_NEW_TOKENS, 32, 128):
        # eos -1: every row decodes all `new` tokens, so both do the same work
        recompute = lambda: model.greedy_generate(graphdef, params, tokens_BxP, mask_BxP, max_new_tokens=new,
                                                  eos_id=-1)
        cached = lambda: sampler.generate(graphdef, params, tokens_BxP, mask_BxP, key, max_new_tokens=new,
                                          temperature=0, eos_id=-1).tokens
        if not np.array_equal(recompute(), cached()):
            raise RuntimeError(f"the cached and recomputing decoders disagree at {new} new tokens")
        times = interleaved_times({"recompute": recompute, "cached": cached}, repeats=repeats)
        t, speedup = medians(times), spread_of_ratio(times, "recompute", "cached")
        curve[new] = {"cached_tokens_per_second": batch_size * new / t["cached"],
                      "recompute_tokens_per_second": batch_size * new / t["recompute"],
                      "cached_seconds": t["cached"], "recompute_seconds": t["recompute"],
                      "speedup": speedup["median"], "speedup_spread": speedup}
    at = data.MAX_NEW_TOKENS
    return _timed_figure("kv_cache_decode_speedup", curve[at]["speedup_spread"], new_tokens=at, batch_size=batch_size,
                   prompt_len=data.DEFAULT_PROMPT_LEN, model="student", params=model.count_params(params),
                   repeats=repeats, curve=curve, same_tokens=True,
                   note="greedy decoding, tokens per second with the KV cache / recomputing the sequence")


def bench_grpo(repeats, batch_size=16, group_size=8, num_iterations=2):
    """Where a GRPO step's time goes: the rollout (sampling G completions per prompt with the
    KV cache, rewards, old and reference log-probs) against the μ updates on it.

    The shipped SFT student on one device, `repeats` steps after one that compiles; the
    figure is the rollout's share of the step (medians of each part).
    """
    import numpy as np

    from tunix_nb import checkpoint, data, grpo, rewards, train

    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    reward_set = rewards.combine({"exact_match": rewards.exact_match, "char_match": rewards.char_match})
    rollout_fn = grpo.make_rollout(graphdef, data.load_sft(), reward_set, batch_size=batch_size,
                                   group_size=group_size, seed=0, num_iterations=num_iterations)
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=3e-4, warmup_steps=1,
                                                     total_steps=(repeats + 1) * num_iterations + 1))
    step_fn = train.make_step(grpo.objective(graphdef), opt)
    _, _, history = train.run_on_policy(step_fn, params, opt.init(params), rollout_fn, steps=repeats + 1,
                                        num_iterations=num_iterations, reference=params, progress=False)
    rollout_s = np.asarray([h["time/rollout_s"] for h in history[1:]])
    update_s = np.asarray([h["time/update_s"] for h in history[1:]])
    return _timed_figure("grpo_rollout_share", spread(rollout_s / (rollout_s + update_s)),
                   rollout_seconds=float(np.median(rollout_s)), update_seconds=float(np.median(update_s)),
                   prompts=batch_size, group_size=group_size,
                   num_iterations=num_iterations, max_new_tokens=data.MAX_NEW_TOKENS, model="student",
                   repeats=repeats,
                   note="one GRPO step on one device: rollout / (rollout + num_iterations updates)")


# ------------------------------------------------------------------------------ lora

# (name, LoRA rank or None for full fine-tuning, quantisation of the base, learning rate)
LORA_SETTINGS = (("full", None, "none", 1e-3), ("lora r1", 1, "none", 1e-2), ("lora r4", 4, "none", 1e-2),
                 ("lora r16", 16, "none", 1e-2), ("qlora nf4 r16", 16, "nf4", 1e-2))


def lora_setups(graphdef, params, settings=LORA_SETTINGS):
    """{name: (graphdef, trained, frozen, objective, learning_rate, base)} for each setting."""
    from tunix_nb import lora, sft

    out = {}
    for name, rank, quantize, learning_rate in settings:
        if rank is None:
            out[name] = (graphdef, params, None, sft.objective(graphdef), learning_rate, None)
            continue
        lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=rank, alpha=float(rank), quantize=quantize)
        out[name] = (lora_graphdef, adapters, lora.frozen(base), lora.objective(sft.objective(lora_graphdef)),
                     learning_rate, base)
    return out


def _saved_bytes(params, opt_state) -> int:
    """Bytes on disk of a checkpoint of (params, opt_state), as the training command writes it."""
    from tunix_nb import checkpoint

    with tempfile.TemporaryDirectory(dir=".") as root:
        manager = checkpoint.make_manager(Path(root) / "ck", keep=1, async_save=False)
        checkpoint.save(manager, 1, params=params, opt_state=opt_state, meta={}, force=True)
        manager.wait_until_finished()
        manager.close()
        return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


def _thin_matmul_profile(rows, graphdef, params, repeats, ranks=(1, 4, 16)) -> dict:
    """The adapter path (x A) B of one d x d projection against the dense x W it adds to:
    time and FLOPs of each relative to the dense matmul, timed in turns."""
    import jax
    from flax import nnx

    d = nnx.merge(graphdef, params).cfg.d_model
    x = jax.random.normal(jax.random.key(0), (rows, d))
    w = jax.random.normal(jax.random.key(1), (d, d))
    fns = {"dense": jax.jit(lambda x: x @ w)}
    for r in ranks:
        a, b = jax.random.normal(jax.random.key(2), (d, r)), jax.random.normal(jax.random.key(3), (r, d))
        fns[f"r{r}"] = jax.jit(lambda x, a=a, b=b: (x @ a) @ b)
    seconds = interleaved_medians({k: (lambda f=f: f(x)) for k, f in fns.items()}, repeats=max(repeats, 10))
    return {k: {"time_over_dense": seconds[k] / seconds["dense"],
                "flops_over_dense": 1.0 if k == "dense" else 2 * int(k[1:]) / d, "seconds": seconds[k]}
            for k in fns}


def bench_lora(repeats, steps=300, n_eval=200, batch_size=64):
    """LoRA and QLoRA against full fine-tuning of the same model on the same batches.

    From the shipped SFT student (55% held-out exact match), `steps` SFT steps on fresh
    prompts of the task (none a training or held-out prompt) for each setting: what
    trains, its optimizer state, the checkpoint on disk, the step's time (all settings
    timed in turns) and XLA's FLOP count, and the held-out exact match after. Alpha =
    rank (scale 1, as Tunix's examples); LoRA's learning rate is 10x full fine-tuning's.
    """
    import jax

    from tunix_nb import checkpoint, data, evaluate, lora, train
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    held_out = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")[:n_eval]
    seen = [e["prompt"] for e in data.load_sft() + data.load_sft(data.DATA_DIR / "sft_eval.jsonl")]
    rows = data.sft_arrays(data.generate_sft(steps * batch_size, seed=8, exclude=seen), ByteTokenizer(),
                           data.DEFAULT_SEQ_LEN)
    batch = data.batch_at(rows, 0, batch_size, seed=0)
    table, steps_fns = {}, {}
    for name, (g, trained, frozen, objective, lr, base) in lora_setups(graphdef, params).items():
        opt = train.make_optimizer(train.OptimizerConfig(learning_rate=lr, warmup_steps=5, total_steps=steps))
        step = train.make_step(objective, opt)
        opt_state = opt.init(trained)
        steps_fns[name] = (lambda step=step, t=trained, o=opt_state, f=frozen: step(t, o, batch, f))
        out, out_state, history = train.run(step, trained, opt_state, lambda s: data.batch_at(rows, s, batch_size, seed=0),
                                            steps=steps, frozen=frozen, progress=False)
        model_state = out if base is None else lora.combine(out, base)
        table[name] = {
            "trainable_params": lora.count(trained), "optimizer_state_bytes": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
            "frozen_bytes": 0 if base is None else sum(x.nbytes for x in jax.tree.leaves(base)),
            "checkpoint_bytes": _saved_bytes(out, out_state), "step_flops": cost(step, trained, opt_state, batch, frozen)["flops"],
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "exact_match": evaluate.exact_match_accuracy(g, model_state, held_out, batch_size=n_eval)}
    step_times = interleaved_times(steps_fns, repeats=repeats)
    seconds = medians(step_times)
    total = table["full"]["trainable_params"]
    for name, row in table.items():
        row["trainable_share"] = row["trainable_params"] / total
        row["step_seconds"] = seconds[name]
    before = evaluate.exact_match_accuracy(graphdef, params, held_out, batch_size=n_eval)
    profile = _thin_matmul_profile(batch_size * data.DEFAULT_SEQ_LEN, graphdef, params, repeats)
    common = dict(table=table, exact_match_before=before, steps=steps, batch_size=batch_size, held_out=n_eval,
                  model="student (data/sft_student)", repeats=repeats)
    full, r16 = table["full"], table["lora r16"]
    return {**_figure("lora_optimizer_state_share", r16["optimizer_state_bytes"] / full["optimizer_state_bytes"],
                      **common, note="LoRA rank 16 / full fine-tuning, AdamW state bytes"),
            **_timed_figure("lora_step_time_ratio", spread_of_ratio(step_times, "lora r16", "full"),
                      qlora_ratio=table["qlora nf4 r16"]["step_seconds"] / full["step_seconds"],
                      flops_ratio=r16["step_flops"] / full["step_flops"], thin_matmul_profile=profile,
                      note="LoRA rank 16 step / full fine-tuning step, one device, timed in turns"),
            **_figure("lora_exact_match_over_full", r16["exact_match"] / full["exact_match"],
                      note=f"held-out exact match after {steps} steps, LoRA rank 16 / full fine-tuning")}


# ----------------------------------------------------------------------------- remat

# XLA's CPU scheduler by default orders ops for parallelism, not memory; this flag makes
# it schedule to keep less alive, as the TPU and GPU schedulers do
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def remat_programs(batch: int, seq_len: int) -> dict:
    """{"plain", "remat": (compiled SFT step, its args)} for the MFU model at this size."""
    from tunix_nb import model, sft, train

    _, graphdef, params, b, opt = _mfu_setup(batch, seq_len)
    args = (params, opt.init(params), b)
    out = {}
    for name, g in (("plain", graphdef), ("remat", model.with_remat(graphdef, params))):
        out[name] = (train.make_step(sft.objective(g), opt).lower(*args).compile(), args)
    return out


def temp_bytes(programs: dict) -> dict:
    """XLA's temporary buffer size of each compiled program: activations, gradients and
    scratch, the part of the step's peak memory that rematerialisation can shrink."""
    return {name: int(compiled.memory_analysis().temp_size_in_bytes) for name, (compiled, _) in programs.items()}


def bench_remat(repeats, quick=False):
    """The SFT step with each block rematerialised (`ModelConfig.remat`) against without:
    XLA's temporary memory of the compiled step and its time, at a size where activations
    dominate; both give the same update to float32 rounding (checked)."""
    import jax
    import numpy as np

    batch, seq_len = (4, 128) if quick else (8, 512)
    programs = remat_programs(batch, seq_len)
    memory = temp_bytes(programs)
    updates = {name: compiled(*args) for name, (compiled, args) in programs.items()}
    # recomputed activations can fuse differently: equal to float32 rounding, not always bitwise
    difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(jax.tree.leaves(updates["plain"]), jax.tree.leaves(updates["remat"])))
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
    return {**_figure("remat_memory_ratio", memory["remat"] / memory["plain"], **details,
                      note="XLA's temporary bytes of the compiled step, with remat / without"),
            **_timed_figure("remat_step_time_ratio", spread_of_ratio(times, "remat", "plain"),
                            note="step time with remat / without, timed in turns")}


def _remat_memory_in_child(batch, seq_len) -> dict:
    code = ("import json; from tunix_nb import bench; "
            f"print(json.dumps(bench.temp_bytes(bench.remat_programs({batch}, {seq_len}))))")
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": MEMORY_SCHEDULER_FLAG,
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"remat memory child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- compile


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
    graphdef, params, opt, batch = _sft_setup()
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
    figure = {"per_step": first}
    if not quick:  # the persistent compilation cache, across two fresh processes
        with tempfile.TemporaryDirectory(dir=".") as cache:
            runs = [_compile_times_in_child(cache) for _ in range(2)]
        figure["persistent_cache"] = {
            "cold": runs[0], "warm": runs[1],
            "warm_over_cold": {k: runs[1][k]["compile_seconds"] / runs[0][k]["compile_seconds"] for k in runs[0]}}
    worst = max(v["compile_over_step"] for v in first.values())
    return _figure("compile_share", worst, **figure)


def _compile_times_in_child(cache_dir) -> dict:
    code = ("import json, jax; from tunix_nb import devices; devices.simulate_cpu_devices(1); "
            f"jax.config.update('jax_compilation_cache_dir', {str(cache_dir)!r}); "
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
            "jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1); "
            "from tunix_nb import bench; print(json.dumps(bench.compile_times()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    env["TUNIX_NB_BENCH_CACHE_CHILD"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"compile-time child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ run


def run(groups, *, quick: bool, out_dir: Path, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    repeats = 3 if quick else 10
    jobs = {
        "vmap": lambda: bench_vmap([1, 8, 64] if quick else [1, 4, 16, 64, 256], repeats),
        "mfu": lambda: bench_mfu(repeats, quick=quick),
        "dp": lambda: bench_dp(repeats, [8] if quick else [1, 2, 4, 8], quick=quick),
        "ckpt": lambda: bench_ckpt(16 if quick else 128, 3 if quick else 5),
        "dpo": lambda: bench_dpo(repeats),
        "compile": lambda: bench_compile(quick=quick),
        "kv_cache": lambda: bench_kv_cache(repeats, quick=quick),
        "grpo": lambda: bench_grpo(repeats),
        "lora": lambda: bench_lora(repeats, steps=10 if quick else 300, n_eval=50 if quick else 200),
        "remat": lambda: bench_remat(repeats, quick=quick),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("figures", {})
    results["machine"] = machine()
    results["settings"] = {"quick": quick, "repeats": repeats, "comparable_to_targets": not quick,
                           "method": "each figure is the median of per-round ratios (spread: quartiles, min, "
                           "max): every round times each contender once, in rotating order, after 2 "
                           "warm-up calls; fast calls several per sample"}
    bar = tqdm(groups, desc="bench", disable=not progress)
    for group in bar:
        bar.set_postfix(figure=group)
        figures = jobs[group]()
        for fig in figures.values():
            # --quick measures smaller sizes over fewer rounds: an orientation, not a check
            fig["comparable_to_target"] = not quick
        results["figures"].update(figures)
        path.write_text(json.dumps(results, indent=2, sort_keys=True, default=float) + "\n")
    from tunix_nb import plots

    plots.save_bench_plots(results, out_dir)
    return results


def memory_group(out_dir: Path, *, quick: bool, vocab_chunk: int | None = None, seq_chunk: int | None = None) -> int:
    """The memory plans (tunix_nb.memory_plan.report): --quick plans the three rows with
    targets on one v5e chip only; a table on stdout, DIR/memory.json."""
    from tunix_nb.memory_plan import report

    rows, target_names = (report.QUICK_ROWS, ("v5e",)) if quick else (report.ROWS, report.targets.TARGETS)
    results = report.run(out_dir, rows=rows, target_names=target_names, vocab_chunk=vocab_chunk, seq_chunk=seq_chunk,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table(results))
    print(f"Wrote {out_dir / 'memory.json'}")
    return 0


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
            line += " met" if fig["meets_target"] else " MISSED"
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.bench", description=__doc__.splitlines()[0],
                                     epilog="The kit's steps against Tunix's trainers (optional, needs google-tunix): "
                                            "python -m tunix_nb.tunix_compare")
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (about a minute)")
    parser.add_argument("--only", choices=sorted(set(GROUPS) | set(FIGURES) | set(OPTIONAL_GROUPS)),
                        help="run one figure (or its group, e.g. dp_overhead runs the dp group)")
    parser.add_argument("--out", default="results", help="directory for bench.json and the plots")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    parser.add_argument("--vocab-chunk", type=int, default=None,
                        help="memory: the vocabulary chunk of the remedied step's log-probs (where the objective "
                             "takes one)")
    parser.add_argument("--seq-chunk", type=int, default=None,
                        help="memory: positions per row at a time on the chunked path (needs --vocab-chunk)")
    args = parser.parse_args(argv)
    if devices.accelerator_hint() is None:
        devices.simulate_cpu_devices(args.devices)
    if args.only == "memory":  # compiles, never runs: its own results file
        return memory_group(Path(args.out), quick=args.quick, vocab_chunk=args.vocab_chunk, seq_chunk=args.seq_chunk)
    groups = GROUPS if args.only is None else (args.only if args.only in GROUPS else FIGURES[args.only][0],)
    results = run(groups, quick=args.quick, out_dir=Path(args.out), progress=sys.stderr.isatty())
    for name, fig in sorted(results["figures"].items()):
        print(f"{name}: {describe(fig)}")
    out = Path(args.out)
    print(f"Wrote {out / 'bench.json'} and the plots {', '.join(sorted(p.name for p in out.glob('*.png')))} "
          f"in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
