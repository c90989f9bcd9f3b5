"""The dpo group: the DPO step with the reference's log-probs cached against recomputing them in
every step."""

from __future__ import annotations

from tunix_nb.bench.common import cost, interleaved_times, medians, spread_of_ratio, timed_figure

FIGURES = {"dpo_cached_ref_speedup": (1.25, "min")}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_dpo(repeats)


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
    return timed_figure(
        FIGURES, "dpo_cached_ref_speedup", spread_of_ratio(times, "recompute", "cached"), cached_seconds=t["cached"],
        recompute_seconds=t["recompute"], pairs_per_step=32, repeats=repeats,
        profile={f"{k}_seconds": v for k, v in t.items()}, xla_cost=xla_cost,
        # the ceiling in arithmetic: 4/3 when backward = 2 forwards and the update is free
        flops_ratio=flops["recompute_step"] / flops["cached_step"],
        # the ceiling in time on this machine: the cached step plus one reference forward
        predicted_from_profile=(t["cached"] + t["reference_forward"]) / t["cached"],
        backward_over_forward_seconds=(t["policy_forward_backward"] - t["reference_forward"]) / t["reference_forward"],
        backward_over_forward_flops=(flops["policy_forward_backward"] - flops["reference_forward"])
        / flops["reference_forward"])
