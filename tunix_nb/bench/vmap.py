"""The vmap group: a per-example loss under `jax.vmap` against a Python loop of it and against
the same loss written by hand with a batch axis (lesson 01)."""

from __future__ import annotations

from tunix_nb.bench.common import cost, interleaved_times, medians, spread_of_ratio, timed_figure

# figure name -> (target, "max" if the figure must stay below it, "min" above)
FIGURES = {"vmap_speedup_over_loop": (None, None), "vmap_over_batched_ratio": (1.10, "max")}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_vmap([1, 8, 64] if quick else [1, 4, 16, 64, 256], repeats)


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
    return {**timed_figure(FIGURES, "vmap_speedup_over_loop", curve[at]["loop_over_vmap_spread"], **shape,
                           curve=curve),
            **timed_figure(FIGURES, "vmap_over_batched_ratio", curve[at]["vmap_over_batched_spread"], **shape,
                           xla_cost=xla_cost)}
