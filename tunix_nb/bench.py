"""Benchmarks behind lesson 07: `python -m tunix_nb.bench [--quick] [--only NAME] [--out DIR]`.

Every figure is a ratio of two things timed side by side in the same run (medians over
repeats, after warm-up), because a shared machine is noisy; absolute times are kept as
details. Results go to DIR/bench.json (merged with what is there) and DIR/*.png.
"""

from __future__ import annotations

import argparse
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
    "train_step_mfu": ("mfu", 0.40, "min"),
    "dp_overhead": ("dp", 1.25, "max"),
    "allreduce_share": ("dp", 0.05, "max"),
    "ckpt_save_over_disk_bandwidth": ("ckpt", 0.5, "min"),
    "async_block_share": ("ckpt", 0.10, "max"),
    "ckpt_restore_seconds": ("ckpt", None, None),
    "dpo_cached_ref_speedup": ("dpo", 1.25, "min"),
    "compile_share": ("compile", None, None),
    "kv_cache_decode_speedup": ("kv_cache", None, None),
    "grpo_rollout_share": ("grpo", None, None),
    "lora_optimizer_state_share": ("lora", None, None),
    "lora_step_time_ratio": ("lora", None, None),
    "lora_exact_match_over_full": ("lora", None, None),
}
GROUPS = ("vmap", "mfu", "dp", "ckpt", "dpo", "compile", "kv_cache", "grpo", "lora")


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


def interleaved_medians(fns: dict, *, repeats: int, warmup: int = 2, min_seconds: float = 0.01) -> dict:
    """{name: median seconds per call} of each fn(), timed in turns: A B C, B C A, C A B, ...

    For ratios on a shared machine: a burst of load from elsewhere then slows every
    contender alike, instead of falling on whichever one happened to be timed then. The
    order rotates because a call can slow the one after it (a Python loop of 64 small
    dispatches made the next program ~20% slower here), so no contender always follows
    the same one.
    A fast fn is called several times per sample (enough for `min_seconds`), so that
    timer resolution and per-sample jitter do not dominate a millisecond call.
    """
    import jax
    import numpy as np

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
    return {name: float(np.median(t)) for name, t in times.items()}


def cost(jitted, *args) -> dict:
    """XLA's own estimate for one call of a jitted function: {"flops", "bytes_accessed"}."""
    analysis = jitted.lower(*args).compile().cost_analysis()
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
        pair = interleaved_medians({"vmap": lambda: vmapped(s, t, y, m), "batched": lambda: batched(s, t, y, m)},
                                   repeats=repeats)
        against_loop = interleaved_medians({"loop": loop, "vmap": lambda: vmapped(s, t, y, m)}, repeats=repeats)
        curve[b] = {"loop_seconds": against_loop["loop"], "vmap_seconds": pair["vmap"],
                    "batched_seconds": pair["batched"],
                    "loop_over_vmap": against_loop["loop"] / against_loop["vmap"],
                    "vmap_over_batched": pair["vmap"] / pair["batched"]}
    at = 64 if 64 in curve else max(curve)
    shape = {"batch_size": at, "seq_len": seq_len, "vocab": vocab, "repeats": repeats}
    # what XLA compiled for each: equal costs mean the two programs do the same work
    args = (jnp.zeros((at, seq_len, vocab)), jnp.zeros((at, seq_len, vocab)),
            jnp.zeros((at, seq_len), jnp.int32), jnp.ones((at, seq_len)))
    xla_cost = {"vmap": cost(vmapped, *args), "batched": cost(batched, *args)}
    return {**_figure("vmap_speedup_over_loop", curve[at]["loop_over_vmap"], **shape, curve=curve),
            **_figure("vmap_over_batched_ratio", curve[at]["vmap_over_batched"], **shape, xla_cost=xla_cost)}


# ------------------------------------------------------------------------------- mfu


def model_flops_per_step(cfg, batch: int, seq_len: int) -> float:
    """Analytic training FLOPs: 3 x forward (forward + 2x for backward), matmuls only."""
    d, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    per_token = 2 * layers * (4 * d * d + 3 * d * f)  # q, k, v, out; gate, up, down
    per_token += 2 * d * v                            # tied output head
    per_token += layers * 2 * 2 * seq_len * d         # scores and weighted values (full L x L)
    return 3.0 * per_token * batch * seq_len


def bench_mfu(repeats, quick=False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tunix_nb import model, sft, train

    n = 512 if quick else 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    batch, seq_len = (4, 64) if quick else (8, 128)
    cfg = model.get_config("student", d_model=256, n_layers=4, n_heads=4, d_ff=768)
    graphdef, params = model.split(model.make_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq_len), np.float32),
         "attention_mask": np.ones((batch, seq_len), np.int32)}
    opt = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    objective = sft.objective(graphdef)
    step = train.make_step(objective, opt)
    opt_state = opt.init(params)
    contenders = {"peak_matmul": lambda: matmul(a), "step": lambda: step(params, opt_state, b)}
    if not quick:  # a coarse profile: where the step's time goes (forward, backward, optimizer update)
        forward = jax.jit(lambda p: objective(p, b)[0])
        grad = jax.jit(jax.grad(lambda p: objective(p, b)[0]))
        grads = grad(params)
        update = jax.jit(lambda g, s, p: opt.update(g, s, p))
        contenders.update(forward=lambda: forward(params), forward_backward=lambda: grad(params),
                          optimizer_update=lambda: update(grads, opt_state, params))
    t = interleaved_medians(contenders, repeats=repeats)  # the peak and the step side by side
    peak, seconds = 2 * n**3 / t["peak_matmul"], t["step"]
    flops = model_flops_per_step(cfg, batch, seq_len)
    details = dict(step_seconds=seconds, model_flops_per_step=flops,
                   xla_flops_per_step=cost(step, params, opt_state, b)["flops"],
                   achieved_flops_per_second=flops / seconds, matmul_peak_flops_per_second=peak,
                   peak_matmul_size=n, repeats=repeats,
                   model={"d_model": cfg.d_model, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff,
                          "params": model.count_params(params), "batch": batch, "seq_len": seq_len,
                          "dtype": "float32"})
    if not quick:
        profile = {f"{k}_seconds": v for k, v in t.items() if k not in ("peak_matmul", "step")}
        profile["matmul_flops_share_of_forward_time_at_peak"] = flops / 3 / peak / profile["forward_seconds"]
        details["profile"] = profile
    return _figure("train_step_mfu", flops / seconds / peak, **details)


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


def bench_dp(repeats, device_counts, quick=False):
    import jax
    import numpy as np

    from tunix_nb import parallel, sft, train

    graphdef, params, opt, batch = _sft_setup()
    objective = sft.objective(graphdef)
    opt_state = opt.init(params)
    jit_step = train.make_step(objective, opt)
    t_jit = median_seconds(lambda: jit_step(params, opt_state, batch), repeats=repeats)
    modes = [m for m in ("pmap", "shard_map", "dp") if m in train.PARALLEL_MODES]
    # the counts this machine has (on a single chip or CPU device: just 1)
    device_counts = [n for n in device_counts if n <= jax.local_device_count()] or [jax.local_device_count()]
    table = {}
    for mode in modes:
        for n in device_counts:
            step, state, b = _placed_step(objective, opt, mode, (params, opt_state), batch, n)
            table.setdefault(mode, {})[n] = median_seconds(lambda: step(*state, b), repeats=repeats) / t_jit
    n_max = max(device_counts)
    state = parallel.replicate((params, opt_state), n_max)
    b = parallel.shard_batch(batch, n_max)
    with_ar = train.make_step(objective, opt, parallel_mode="pmap")
    without_ar = train.make_step(objective, opt, parallel_mode="pmap", all_reduce=False)
    t = interleaved_medians({"with": lambda: with_ar(*state, b), "without": lambda: without_ar(*state, b)},
                            repeats=repeats)
    t_with, t_without = t["with"], t["without"]
    # The all-reduce moves a fixed amount (one gradient); the compute grows with the batch.
    by_batch = {}
    for global_batch in (() if quick else (64, 256)):
        big = {k: np.concatenate([v] * (global_batch // 64)) for k, v in batch.items()}
        bb = parallel.shard_batch(big, n_max)
        t = interleaved_medians({"with": lambda: with_ar(*state, bb), "without": lambda: without_ar(*state, bb)},
                                repeats=repeats)
        tw, to = t["with"], t["without"]
        by_batch[global_batch] = {"step_seconds": tw, "share": max(tw - to, 0.0) / tw}
    worst = max(table[m][n_max] for m in table)
    return {**_figure("dp_overhead", worst, at_devices=n_max, per_strategy=table, jit_step_seconds=t_jit,
                      global_batch=64, repeats=repeats),
            **_figure("allreduce_share", max(t_with - t_without, 0.0) / t_with, devices=n_max,
                      step_seconds=t_with, step_without_allreduce_seconds=t_without, repeats=repeats,
                      gradient_bytes=4 * sum(x.size for x in jax.tree.leaves(params)), share_by_global_batch=by_batch)}


# ------------------------------------------------------------------------------ ckpt


def bench_ckpt(megabytes, repeats):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from tunix_nb import checkpoint

    n_arrays = 8
    per = int(megabytes * 2**20 / 4 / n_arrays)
    state = {f"w{i}": jax.numpy.asarray(np.random.default_rng(i).standard_normal(per, np.float32))
             for i in range(n_arrays)}
    nbytes = sum(x.nbytes for x in state.values())
    sync_s, blocked_s, async_total_s, restore_s, disk_s = [], [], [], [], []
    with tempfile.TemporaryDirectory(dir=".") as root:
        payload = np.random.default_rng(0).bytes(nbytes)
        for r in range(repeats):
            path = Path(root) / f"disk{r}.bin"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            disk_s.append(time.perf_counter() - t0)
            path.unlink()
            for async_save in (False, True):
                manager = checkpoint.make_manager(Path(root) / f"ck{r}{async_save}", keep=1, async_save=async_save)
                t0 = time.perf_counter()
                manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(state)))
                blocked = time.perf_counter() - t0
                manager.wait_until_finished()
                total = time.perf_counter() - t0
                if async_save:
                    blocked_s.append(blocked)
                    async_total_s.append(total)
                else:
                    sync_s.append(total)
                    t0 = time.perf_counter()
                    restored = manager.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
                    jax.block_until_ready(dict(restored["params"]))
                    restore_s.append(time.perf_counter() - t0)
                manager.close()
    med = lambda xs: float(np.median(xs))
    disk_bw, save_bw = nbytes / med(disk_s), nbytes / med(sync_s)
    return {**_figure("ckpt_save_over_disk_bandwidth", save_bw / disk_bw, state_bytes=nbytes,
                      save_bytes_per_second=save_bw, disk_write_bytes_per_second=disk_bw, repeats=repeats,
                      note="disk bandwidth: one file of the same size written and fsync'd"),
            **_figure("async_block_share", med(blocked_s) / med(sync_s), async_blocked_seconds=med(blocked_s),
                      async_total_seconds=med(async_total_s), sync_seconds=med(sync_s), repeats=repeats),
            **_figure("ckpt_restore_seconds", med(restore_s), state_bytes=nbytes,
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
    t = interleaved_medians({"cached": lambda: cached(params, opt_state, batch),
                             "recompute": lambda: recompute(params, opt_state, batch, params),
                             "reference_forward": lambda: reference_forward(params, batch),
                             "policy_forward_backward": lambda: policy_grad(params, batch)}, repeats=repeats)
    xla_cost = {"cached_step": cost(cached, params, opt_state, batch),
                "recompute_step": cost(recompute, params, opt_state, batch, params),
                "reference_forward": cost(reference_forward, params, batch),
                "policy_forward_backward": cost(policy_grad, params, batch)}
    flops = {k: v["flops"] for k, v in xla_cost.items()}
    return _figure(
        "dpo_cached_ref_speedup", t["recompute"] / t["cached"], cached_seconds=t["cached"],
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
        t = interleaved_medians({"recompute": recompute, "cached": cached}, repeats=repeats)
        curve[new] = {"cached_tokens_per_second": batch_size * new / t["cached"],
                      "recompute_tokens_per_second": batch_size * new / t["recompute"],
                      "cached_seconds": t["cached"], "recompute_seconds": t["recompute"],
                      "speedup": t["recompute"] / t["cached"]}
    at = data.MAX_NEW_TOKENS
    return _figure("kv_cache_decode_speedup", curve[at]["speedup"], new_tokens=at, batch_size=batch_size,
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
    rollout_s = float(np.median([h["time/rollout_s"] for h in history[1:]]))
    update_s = float(np.median([h["time/update_s"] for h in history[1:]]))
    return _figure("grpo_rollout_share", rollout_s / (rollout_s + update_s), rollout_seconds=rollout_s,
                   update_seconds=update_s, prompts=batch_size, group_size=group_size,
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

    d = nnx_d_model(graphdef, params)
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


def nnx_d_model(graphdef, params) -> int:
    from flax import nnx

    return nnx.merge(graphdef, params).cfg.d_model


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
    seconds = interleaved_medians(steps_fns, repeats=repeats)
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
            **_figure("lora_step_time_ratio", r16["step_seconds"] / full["step_seconds"],
                      qlora_ratio=table["qlora nf4 r16"]["step_seconds"] / full["step_seconds"],
                      flops_ratio=r16["step_flops"] / full["step_flops"], thin_matmul_profile=profile,
                      note="LoRA rank 16 step / full fine-tuning step, one device, timed in turns"),
            **_figure("lora_exact_match_over_full", r16["exact_match"] / full["exact_match"],
                      note=f"held-out exact match after {steps} steps, LoRA rank 16 / full fine-tuning")}


# --------------------------------------------------------------------------- compile


def compile_times(only=None) -> dict:
    """Compile and step seconds of each lesson's main step (runs in a child process too)."""
    from tunix_nb import data, distill, dpo, model, sft, train
    from tunix_nb.tokenizer import ByteTokenizer

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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
        "ckpt": lambda: bench_ckpt(16 if quick else 128, 1 if quick else 3),
        "dpo": lambda: bench_dpo(repeats),
        "compile": lambda: bench_compile(quick=quick),
        "kv_cache": lambda: bench_kv_cache(repeats, quick=quick),
        "grpo": lambda: bench_grpo(repeats),
        "lora": lambda: bench_lora(repeats, steps=10 if quick else 300, n_eval=50 if quick else 200),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("figures", {})
    results["machine"] = machine()
    results["settings"] = {"quick": quick, "repeats": repeats,
                           "method": "ratios of medians over repeats after 2 warm-up calls; the contenders of "
                           "each ratio are timed in turns (A, B, A, B, ...), fast calls several per sample"}
    bar = tqdm(groups, desc="bench", disable=not progress)
    for group in bar:
        bar.set_postfix(figure=group)
        results["figures"].update(jobs[group]())
        path.write_text(json.dumps(results, indent=2, sort_keys=True, default=float) + "\n")
    from tunix_nb import plots

    plots.save_bench_plots(results, out_dir)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_nb.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (about a minute)")
    parser.add_argument("--only", choices=sorted(set(GROUPS) | set(FIGURES)),
                        help="run one figure (or its group, e.g. dp_overhead runs the dp group)")
    parser.add_argument("--out", default="results", help="directory for bench.json and the plots")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    args = parser.parse_args(argv)
    if devices.accelerator_hint() is None:
        devices.simulate_cpu_devices(args.devices)
    groups = GROUPS if args.only is None else (args.only if args.only in GROUPS else FIGURES[args.only][0],)
    results = run(groups, quick=args.quick, out_dir=Path(args.out), progress=sys.stderr.isatty())
    for name, fig in sorted(results["figures"].items()):
        target = "" if fig["target"] is None else f" (target {'<=' if fig['target_kind'] == 'max' else '>='} {fig['target']})"
        print(f"{name}: {fig['value']:.3f}{target}")
    out = Path(args.out)
    print(f"Wrote {out / 'bench.json'} and the plots {', '.join(sorted(p.name for p in out.glob('*.png')))} "
          f"in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
