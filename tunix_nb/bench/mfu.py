"""The mfu group: the SFT step's FLOPs per second over the machine's matmul peak, the backward
pass against the forward, and the backward-pass fix (`model.per_token`) against the model before it.

On a chip in `tunix_nb.mfu.PEAK_FLOPS` (a TPU, an A100, ...), `train_step_mfu` is a real-size
model's instead: the training command's step at Qwen3-0.6B's shapes with the remedies measured
on a v5e (results/tpu_v5e_training/README.md: 8 x 1024 tokens, bfloat16 compute, remat,
donation, the blocks as one scan, vocabulary chunks of 8192 with every position at once, and
the attention --attention auto picks: splash on a TPU; 4 of its 28 layers with --quick),
random weights made on the chip, its model FLOPs (`tunix_nb.mfu`) over the chip's bfloat16 peak. The
small model's figure against a measured float32 matmul peak means nothing there (issue 47:
0.100 on a v5e); it stays as the CPU's figure, and as a detail on a chip."""

from __future__ import annotations

import contextlib
import gzip
import json
import tempfile
from pathlib import Path

from tunix_nb.bench.common import compiled_cost, interleaved_times, medians, spread, spread_of_ratio, timed_figure

FIGURES = {"train_step_mfu": (0.45, "min"), "backward_over_forward": (2.5, "max")}


CHIP_MODEL = "Qwen3-0.6B"  # data/model_configs/
CHIP_BATCH, CHIP_SEQ_LEN, CHIP_QUICK_LAYERS = 8, 1024, 4


def measure(*, quick: bool, repeats: int) -> dict:
    from tunix_nb import mfu

    figures = bench_mfu(repeats, quick=quick)
    peak = mfu.device_peak()
    if peak is not None:
        small = {k: figures["train_step_mfu"][k] for k in ("value", "matmul_peak_flops_per_second", "model")}
        figures.update(bench_mfu_on_chip(peak, repeats, quick=quick, small_model=small))
    return figures


def chip_config(quick: bool, backend: str | None = None):
    """Qwen3-0.6B's ModelConfig with per-block remat, its blocks as one scan, and the attention the
    command's --attention auto picks on `backend` (JAX's by default) for one device in bfloat16
    (4 layers with --quick)."""
    import dataclasses

    from tunix_nb import fused_attention, hf, random_checkpoint

    config = hf.model_config(random_checkpoint.preset_config(CHIP_MODEL.lower()))
    attention, _ = fused_attention.choose("auto", compute_dtype="bfloat16", one_device=True, backend=backend)
    return dataclasses.replace(config, remat=True, scan_layers=True, attention=attention,
                               n_layers=CHIP_QUICK_LAYERS if quick else config.n_layers)


def bench_mfu_on_chip(peak, repeats: int, *, quick: bool, config=None, batch: int = CHIP_BATCH,
                      seq_len: int = CHIP_SEQ_LEN, small_model: dict | None = None) -> dict:
    """train_step_mfu of a real-size model (`chip_config`, or `config`) against `peak`, the step
    timed call after call with its donated state passed on."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunix_nb import mfu, model, sft, train

    config = config or chip_config(quick)
    graphdef, params = model.split(nnx.jit(lambda: model.make_model(config, seed=0))())  # one program, not op by op
    optimizer = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    state = [params, jax.jit(optimizer.init)(params)]
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq_len), np.float32),
            "attention_mask": np.ones((batch, seq_len), np.int32)}
    objective = sft.objective(graphdef, compute_dtype=jnp.bfloat16, vocab_chunk=8192)
    started = time.perf_counter()
    step = train.make_step(objective, optimizer, donate=True).lower(*state, rows).compile()
    compile_seconds = time.perf_counter() - started

    def one_step():
        state[0], state[1], metrics = step(state[0], state[1], rows)
        return metrics

    seconds = np.asarray(interleaved_times({"step": one_step}, repeats=repeats, min_seconds=0)["step"])
    flops = mfu.step_flops(config, batch=batch, seq_len=seq_len)
    xla_flops = compiled_cost(step)["flops"]
    return timed_figure(FIGURES, "train_step_mfu", spread(flops / seconds / peak.flops_per_second),
                        chip=peak.chip, device_kind=peak.device_kind, peak_flops_per_second=peak.flops_per_second,
                        peak_dtype=peak.dtype, step_seconds=float(np.median(seconds)), model_flops_per_step=flops,
                        xla_flops_per_step=xla_flops, compile_seconds=compile_seconds,
                        xla_flops_utilisation=float(xla_flops / np.median(seconds) / peak.flops_per_second),
                        model={"name": CHIP_MODEL, "n_layers": config.n_layers, "params": model.count_params(state[0]),
                               "batch": batch, "seq_len": seq_len, "compute_dtype": "bfloat16", "remat": config.remat,
                               "scan_layers": config.scan_layers, "attention": config.attention,
                               "vocab_chunk": 8192, "seq_chunk": None},
                        small_model_against_measured_matmul_peak=small_model,
                        note="model FLOPs (tunix_nb.mfu: 6N + attention) / step time / the chip's bfloat16 peak")


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

    from tunix_nb import step_profile

    index = step_profile.hlo_index(compiled.as_text())
    instructions = index.lines
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
        jax.profiler.stop_trace()
        events = step_profile.trace_events(trace_dir)
    seconds = step_profile.op_seconds(events, index, calls)
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


def mfu_setup(batch: int, seq_len: int, **sizes):
    """(cfg, graphdef, params, batch, optimizer): the benchmark's model (d_model 256, 4
    layers, d_ff 768; `sizes` overrides them, for tests) and one SFT batch of random tokens."""
    import numpy as np

    from tunix_nb import model, train

    cfg = model.get_config("student", **{"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 768, **sizes})
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
    cfg, graphdef, params, b, opt = mfu_setup(*((4, 64) if quick else (8, 128)))
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
    return {**timed_figure(FIGURES, "train_step_mfu", mfu, **details),
            **timed_figure(FIGURES, "backward_over_forward", backward, forward_seconds=med["forward"],
                           forward_backward_seconds=med["forward_backward"], flops_ratio=2.0,
                           note="(forward+backward - forward) / forward, SFT on the MFU model; "
                                "2.0 in matmul FLOPs")}
