"""The grpo group: where a GRPO step's time goes, the rollout against the updates on it."""

from __future__ import annotations

from tunix_nb.bench.common import spread, timed_figure

FIGURES = {"grpo_rollout_share": (None, None)}


def measure(*, quick: bool, repeats: int) -> dict:
    return bench_grpo(repeats)


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
    return timed_figure(FIGURES, "grpo_rollout_share", spread(rollout_s / (rollout_s + update_s)),
                        rollout_seconds=float(np.median(rollout_s)), update_seconds=float(np.median(update_s)),
                        prompts=batch_size, group_size=group_size, num_iterations=num_iterations,
                        max_new_tokens=data.MAX_NEW_TOKENS, model="student", repeats=repeats,
                        note="one GRPO step on one device: rollout / (rollout + num_iterations updates)")
