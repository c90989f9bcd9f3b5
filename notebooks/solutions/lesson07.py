"""Lesson 07 (benchmarks): loop against vmap at small B, MFU against width, the all-reduce's share.

Timings, so every figure is a ratio of two things timed side by side in this process
(`bench.median_seconds`), and the defaults are small: the lesson's own sizes are the
arguments' values in `tunix_nb.bench`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_nb import bench, data, model, parallel, sft, train
from tunix_nb.tokenizer import ByteTokenizer

RESULTS = Path(__file__).resolve().parent.parent.parent / "results" / "bench.json"


def loop_against_vmap(batch_sizes=(1, 2, 4), repeats: int = 5) -> dict[int, float]:
    """Lesson 07, exercise 1: loop / vmap time of the per-example distillation loss at small B.

    `bench.bench_vmap` (logits [B, 24, 259]) at each B in `batch_sizes`; returns {B: loop
    time / vmap time}. Both process the same B examples, so a ratio above 1 means the
    loop costs more per example too.
    """
    figures = bench.bench_vmap(list(batch_sizes), repeats)
    curve = figures["vmap_speedup_over_loop"]["curve"]
    return {int(b): float(v["loop_over_vmap"]) for b, v in curve.items()}


def committed_loop_over_vmap(results_path=RESULTS) -> dict[int, float]:
    """{B: loop / vmap} of the committed results/bench.json (B = 1 ... 256)."""
    curve = json.loads(Path(results_path).read_text())["figures"]["vmap_speedup_over_loop"]["curve"]
    return {int(b): float(v["loop_over_vmap"]) for b, v in curve.items()}


def _seconds(cfg, batch: int, seq_len: int, repeats: int, part: str) -> float:
    """Median seconds of the SFT training step ("step") or of the forward pass ("forward")."""
    # Only the shapes matter for timing: random NumPy values, no initialisation to compile.
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    tokens = rng.integers(3, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq_len), np.float32),
         "attention_mask": np.ones((batch, seq_len), np.int32)}
    objective = sft.objective(graphdef, compute_dtype=None)
    if part == "forward":
        forward = jax.jit(lambda p: objective(p, b)[0])
        return bench.median_seconds(lambda: forward(params), repeats=repeats)
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    step = train.make_step(objective, opt)
    opt_state = opt.init(params)
    return bench.median_seconds(lambda: step(params, opt_state, b), repeats=repeats)


def mfu_by_width(widths=(64, 256), *, part: str = "step", n_layers: int = 4, batch: int = 4, seq_len: int = 64,
                 repeats: int = 3, peak_size: int = 512) -> dict[int, dict[str, float]]:
    """Lesson 07, exercise 2: MFU of models of each width in `widths`.

    `bench.bench_mfu`'s model (`n_layers` layers, 4 heads, d_ff = 3 d) at d_model = each
    width, batches [batch, seq_len]; the peak is a jit-compiled float32 matmul
    [peak_size]². (`bench.bench_mfu` itself fixes d_model = 256.) `part="step"` times the
    training step against its model FLOPs (`bench.model_flops_per_step`), as the bench's
    headline figure; `part="forward"` times the forward pass against a third of them,
    as the bench's profile. Returns {d: {"mfu", "seconds", "model_flops"}}.
    """
    if part not in ("step", "forward"):
        raise ValueError(f"part={part!r}: use 'step' or 'forward'")
    a = jax.random.normal(jax.random.key(0), (peak_size, peak_size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    peak = 2 * peak_size**3 / bench.median_seconds(lambda: matmul(a), repeats=max(repeats, 5))
    out = {}
    for d in widths:
        cfg = model.get_config("student", d_model=d, n_layers=n_layers, n_heads=4, d_ff=3 * d)
        seconds = _seconds(cfg, batch, seq_len, repeats, part)
        flops = bench.model_flops_per_step(cfg, batch, seq_len) / (3 if part == "forward" else 1)
        out[d] = {"mfu": flops / seconds / peak, "seconds": seconds, "model_flops": flops}
    return out


def allreduce_bytes(compiled_text: str) -> int:
    """Bytes one call of a compiled program all-reduces: the sizes of its all-reduce results, from the HLO text."""
    itemsize = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
    total = 0
    for types in re.findall(r"= (.+?) all-reduce(?:-start)?\(", compiled_text):
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types):
            total += itemsize[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def allreduce_share_by_global_batch(global_batches=(16, 128), *, preset: str = "tiny", repeats: int = 5,
                                    results_path=RESULTS) -> dict:
    """Lesson 07, exercise 3: the all-reduce's share of the pmap SFT step, per global batch.

    As `bench.bench_dp`: the pmap step with and without its psum on all n devices, at
    each global batch B in `global_batches` (rows [B, 24], B / n per device); the share
    is (with - without) / with, clipped at 0. Why it falls, read from the compiled
    program rather than the clock: "allreduce_bytes" (what one step all-reduces: the
    gradient, the loss sum and the token count) is the same at every B, while
    "step_flops" (XLA's count for one device's program) grows with B.
    "gradient_bytes" is 4 x the parameter count.

    Returns {"measured": {B: share}, "allreduce_bytes": {B: bytes}, "step_flops": {B:
    flops}, "gradient_bytes", "devices", "committed": {B: share}}, the last from
    results/bench.json (the figures of the benchmark run).
    """
    n = jax.local_device_count()
    out = {"measured": {}, "allreduce_bytes": {}, "step_flops": {}, "devices": n}
    if global_batches:
        rows = data.sft_arrays(data.load_sft()[: max(global_batches)], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
        graphdef, params = model.split(model.make_model(preset, seed=0))
        out["gradient_bytes"] = 4 * sum(x.size for x in jax.tree.leaves(params))
        opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
        objective = sft.objective(graphdef)
        state = parallel.replicate((params, opt.init(params)), n)
        with_ar = train.make_step(objective, opt, parallel_mode="pmap")
        without_ar = train.make_step(objective, opt, parallel_mode="pmap", all_reduce=False)
        for global_batch in global_batches:
            b = parallel.shard_batch(data.batch_at(rows, 0, global_batch, seed=0), n)
            compiled = with_ar.lower(*state, b).compile()
            out["allreduce_bytes"][global_batch] = allreduce_bytes(compiled.as_text())
            analysis = compiled.cost_analysis()
            analysis = analysis[0] if isinstance(analysis, list) else analysis
            out["step_flops"][global_batch] = float(analysis["flops"])
            t_with = bench.median_seconds(lambda: compiled(*state, b), repeats=repeats)
            t_without = bench.median_seconds(lambda: without_ar(*state, b), repeats=repeats)
            out["measured"][global_batch] = max(t_with - t_without, 0.0) / t_with
    out["committed"] = {}
    if Path(results_path).exists():
        figure = json.loads(Path(results_path).read_text())["figures"]["allreduce_share"]
        out["committed"] = {int(b): v["share"] for b, v in figure["share_by_global_batch"].items()}
    return out
