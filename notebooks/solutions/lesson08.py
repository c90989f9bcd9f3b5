"""Lesson 08 (GRPO with verifiable rewards): advantages by difficulty, group size, KL gradients, learning rate.

The lesson's setting: the SFT student shipped in `data/sft_student` is the policy's
start and the frozen reference; rollouts draw fresh prompts from the task's generator
(every training and held-out prompt excluded), G completions each at temperature 1,
scored by `exact_match + char_match`. The defaults here are small, so that the tests
run in seconds; the written solutions quote runs at the lesson's sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import checkpoint, data, evaluate, grpo, losses, rewards, train

# ------------------------------------------------------------------ shared setup


@functools.lru_cache(maxsize=1)
def lesson_setup():
    """(graphdef, sft_params, eval_examples, reward_set): the lesson's policy and data, loaded once."""
    graphdef, sft_params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    eval_examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")
    reward_set = rewards.combine([rewards.exact_match, rewards.char_match])
    return graphdef, sft_params, eval_examples, reward_set


def fresh_prompts(n: int, seed: int = 8) -> list[dict]:
    """n new examples of the task, none of them a training or held-out prompt (the lesson's rollout prompts)."""
    _, _, eval_examples, _ = lesson_setup()
    seen = [e["prompt"] for e in data.load_sft() + eval_examples]
    return data.generate_sft(n, seed=seed, exclude=seen)


# ------------------------------------------------------------------ exercise 1


def advantages_by_difficulty(group_size: int = 8) -> dict:
    """Lesson 08, exercise 1: the advantages of a group of G 0/1 rewards with k right, k = 1 ... G-1.

    For each estimator in `losses.ADVANTAGE_ESTIMATORS`, {k: {"right": A of a right answer,
    "wrong": A of a wrong one, "push": sum over the group of |A|}} (floats). The rewards
    of a group are [G]: k ones, then G - k zeros.
    """
    G = group_size
    out = {}
    for est in losses.ADVANTAGE_ESTIMATORS:
        out[est] = {}
        for k in range(1, G):
            r_G = np.array([1.0] * k + [0.0] * (G - k), np.float32)
            a_G = np.asarray(losses.group_advantages(r_G, G, estimator=est))
            out[est][k] = {"right": float(a_G[0]), "wrong": float(a_G[-1]), "push": float(np.abs(a_G).sum())}
    return out


# ------------------------------------------------------------------ exercise 2


def zero_std_by_group_size(group_sizes=(2, 4, 8, 16), n_prompts: int = 32, seed: int = 0) -> dict:
    """Lesson 08, exercise 2: how many groups carry no signal, as G grows.

    Samples max(group_sizes) completions (temperature 1, the SFT student) for each of
    `n_prompts` fresh prompts, once, then takes each prompt's first G of them: the
    rewards are [n_prompts, max G], and a group of G is a prefix of a group of 2G.
    Returns {G: {"frac_reward_zero_std", "flat_all_right" (of those flat groups, the
    fraction whose G answers are all exactly right), "pass_at_g" (fraction of prompts
    with at least one exactly right answer), "completions" (n_prompts * G, the rollout's
    size)}}.
    """
    graphdef, sft_params, _, reward_set = lesson_setup()
    G_max = max(group_sizes)
    examples = fresh_prompts(n_prompts)
    sample = grpo.make_sampler(graphdef, temperature=1.0)
    ro = grpo.rollout(sample, sft_params, sft_params, grpo.prompt_rows(examples), examples,
                      grpo.rollout_keys(seed, 0, n_prompts * G_max), reward_set, group_size=G_max)
    total_NxG = ro.rewards.total.reshape(n_prompts, G_max)
    exact_NxG = ro.rewards.per_function["exact_match"].reshape(n_prompts, G_max)
    out = {}
    for G in group_sizes:
        prefix = rewards.Rewards(total_NxG[:, :G].ravel(), {})
        flat_N = total_NxG[:, :G].max(axis=1) == total_NxG[:, :G].min(axis=1)
        all_right_N = exact_NxG[:, :G].min(axis=1) == 1.0
        out[G] = {"frac_reward_zero_std": rewards.reward_metrics(prefix, G)["frac_reward_zero_std"],
                  "flat_all_right": float(all_right_N[flat_N].mean()) if flat_N.any() else float("nan"),
                  "pass_at_g": float(np.mean(exact_NxG[:, :G].max(axis=1) == 1.0)),
                  "completions": n_prompts * G}
    return out


# ------------------------------------------------------------------ exercise 3


def kl_estimator_gradients(vocab: int = 10, seed: int = 0, spread: float = 1.0) -> dict:
    """Lesson 08, exercise 3: which divergence each KL estimator's expected gradient follows.

    A policy pi = softmax(theta) over `vocab` tokens, theta [V], and a fixed reference
    ref [V]. The loss term is what `losses.grpo_loss` adds with beta = 1 and advantage 0
    on tokens sampled from pi: E_{y ~ pi}[k(y)], with the sampling distribution held
    fixed (the rollout is data). Here the expectation is exact: one row of all V tokens,
    each weighted by pi(y) through the mask. Returns the gradients [V] with respect to
    theta: {"kl", "mse_kl", "low_var_kl"} (each estimator's), "reverse" (of KL(pi || ref),
    the penalty's target) and "forward" (of KL(ref || pi)).
    """
    k1, k2 = jax.random.split(jax.random.key(seed))
    theta_V = jax.random.normal(k1, (vocab,))
    log_ref_V = jax.nn.log_softmax(theta_V + spread * jax.random.normal(k2, (vocab,)))

    def loss_term(theta, estimator):
        logp_1xV = jax.nn.log_softmax(theta)[None]
        weights_1xV = jax.lax.stop_gradient(jnp.exp(logp_1xV))  # pi(y), held fixed: the samples' frequencies
        s, w, _ = losses.grpo_loss(logp_1xV, None, log_ref_V[None], jnp.zeros(1), weights_1xV, beta=1.0,
                                   kl_estimator=estimator, aggregation="token-mean")
        return s / w

    def reverse_kl(theta):
        logp = jax.nn.log_softmax(theta)
        return jnp.sum(jnp.exp(logp) * (logp - log_ref_V))

    def forward_kl(theta):
        return jnp.sum(jnp.exp(log_ref_V) * (log_ref_V - jax.nn.log_softmax(theta)))

    out = {est: np.asarray(jax.grad(loss_term)(theta_V, est)) for est in losses.KL_ESTIMATORS}
    out["reverse"] = np.asarray(jax.grad(reverse_kl)(theta_V))
    out["forward"] = np.asarray(jax.grad(forward_kl)(theta_V))
    return out


# ------------------------------------------------------------------ exercise 4


def learning_rate_and_beta(settings=((3e-4, 0.04), (1e-3, 0.04), (1e-3, 0.0)), steps: int = 12,
                           batch_size: int = 8, group_size: int = 4, evaluate_held_out: bool = False) -> dict:
    """Lesson 08, exercise 4: GRPO runs from the SFT student at several (learning rate, beta).

    Each run: `steps` steps of `batch_size` fresh prompts x `group_size` completions, on one
    device (`jit`), AdamW with the lesson's 5 warmup steps (fewer in a shorter run).
    Returns {(lr, beta): {"kl":
    `kl_to_reference` of the trained policy (measured the same way whatever beta, also
    with beta = 0, where the run itself computes no KL), "reward": mean total reward over
    the last quarter of the steps, "exact_match": held-out greedy exact match per sub-task
    and "all" (only with `evaluate_held_out`, else None)}}.
    """
    graphdef, sft_params, eval_examples, reward_set = lesson_setup()
    examples = fresh_prompts(steps * batch_size)
    out = {}
    for lr, beta in settings:
        opt = train.make_optimizer(train.OptimizerConfig(learning_rate=lr, warmup_steps=min(5, steps - 1),
                                                         total_steps=steps))
        step_fn = train.make_step(grpo.objective(graphdef, beta=beta), opt)
        rollout_fn = grpo.make_rollout(graphdef, examples, reward_set, batch_size=batch_size,
                                       group_size=group_size, seed=0, beta=beta)
        params, _, history = train.run_on_policy(step_fn, sft_params, opt.init(sft_params), rollout_fn,
                                                 steps=steps, reference=sft_params, progress=False)
        tail = history[-max(1, steps // 4):]
        em = None
        if evaluate_held_out:
            em = {t: evaluate.exact_match_accuracy(graphdef, params, [e for e in eval_examples if e["task"] == t],
                                                   batch_size=50) for t in data.TASKS}
            em["all"] = float(np.mean(list(em.values())))
        out[(lr, beta)] = {"kl": kl_to_reference(params),
                           "reward": float(np.mean([h["reward"] for h in tail])), "exact_match": em}
    return out


def kl_to_reference(params, n_prompts: int = 64, group_size: int = 4, seed: int = 1) -> float:
    """Mean per-token KL(policy || reference) (the k3 estimate) on completions the policy samples
    (temperature 1) for the first `n_prompts` held-out prompts, `group_size` each."""
    graphdef, sft_params, eval_examples, reward_set = lesson_setup()
    examples = eval_examples[:n_prompts]
    sample = grpo.make_sampler(graphdef, temperature=1.0, old_logps=True, ref_logps=True)
    ro = grpo.rollout(sample, params, sft_params, grpo.prompt_rows(examples), examples,
                      grpo.rollout_keys(seed, 0, n_prompts * group_size), reward_set, group_size=group_size)
    b = ro.batch
    _, _, metrics = losses.grpo_loss(b["old_logps"], None, b["ref_logps"], jnp.zeros(len(b["advantages"])),
                                     b["completion_mask"], kl_estimator="low_var_kl")
    return float(metrics["kl"])
