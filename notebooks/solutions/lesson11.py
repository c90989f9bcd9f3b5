"""Lesson 11 (on-policy distillation, GKD): the JSD's endpoints, exposure bias by sub-task, sampling temperature.

The lesson's setting: the teacher shipped in `data/teacher`, the SFT student in
`data/sft_student`, and fresh prompts from the task's generator (no training or
held-out prompt). The defaults are the lesson's sizes where they are cheap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import checkpoint, data, distill, evaluate, gkd, grpo, losses, model


@functools.lru_cache(maxsize=1)
def lesson_setup():
    """(student graphdef, SFT params, teacher graphdef, teacher params), loaded once."""
    graphdef, sft_params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    teacher_graphdef, teacher_params = distill.load_teacher()
    return graphdef, sft_params, teacher_graphdef, teacher_params


def fresh_prompts(n: int, seed: int = 4242) -> list[dict]:
    """n new examples of the task: none a training or held-out prompt (seed 4242: the lesson's test set)."""
    known = [e["prompt"] for e in data.load_sft() + data.load_sft(data.DATA_DIR / "sft_eval.jsonl")]
    return data.generate_sft(n, seed=seed, exclude=known)


# ------------------------------------------------------------------ exercise 1


def jsd_near_its_endpoints(betas=(0.0, 1e-3, 0.5, 1 - 1e-3, 1.0), vocab: int = 8, seed: int = 0) -> dict:
    """The generalized JSD of one pair of distributions at each beta (temperature 1), with
    both KLs and beta * KL(p_t || p_s), the first-order value near beta = 0."""
    k_s, k_t = jax.random.split(jax.random.key(seed))
    s_1xV, t_1xV = 2 * jax.random.normal(k_s, (1, vocab)), 2 * jax.random.normal(k_t, (1, vocab))
    y, m = jnp.zeros((1,), jnp.int32), jnp.ones((1,))
    jsd = {b: float(losses.generalized_jsd_per_example(s_1xV, t_1xV, y, m, beta=b, temperature=1.0)) for b in betas}
    logp_s, logp_t = jax.nn.log_softmax(s_1xV[0]), jax.nn.log_softmax(t_1xV[0])
    forward = float(jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s)))
    reverse = float(jnp.sum(jnp.exp(logp_s) * (logp_s - logp_t)))
    return {"jsd": jsd, "forward_kl": forward, "reverse_kl": reverse,
            "first_order": {b: b * forward for b in betas if 0 < b < 0.5}}


# ------------------------------------------------------------------ exercise 2


def exposure_bias_by_task(n_prompts: int = 1000) -> dict:
    """Per sub-task, for the SFT student: the share of its free-running token errors caused
    by its own earlier mistakes, its token error after the right prefix, and the mean
    answer length (tokens, eos included)."""
    graphdef, sft_params, _, _ = lesson_setup()
    test = fresh_prompts(n_prompts)
    out = {}
    for task in data.TASKS:
        examples = [e for e in test if e["task"] == task]
        e = evaluate.errors_by_position(graphdef, sft_params, examples)
        w = e["rows"]
        out[task] = {"bias_share": float(((e["free_running"] - e["teacher_forced"]) * w).sum()
                                         / max((e["free_running"] * w).sum(), 1e-9)),
                     "teacher_forced_error": float((e["teacher_forced"] * w).sum() / w.sum()),
                     "answer_tokens": float(w.sum() / w[0])}
    return out


# ------------------------------------------------------------------ exercise 3


def sampling_temperature(temperatures=(0.5, 1.0, 1.5), n_prompts: int = 256, beta: float = 0.5) -> dict:
    """For each temperature: on-policy samples of `n_prompts` fresh prompts from the SFT
    student, their mean length, the teacher's mean log-prob of the sampled tokens, and the
    GKD loss (`distill.objective`, beta, on `gkd.sampled_batch`)."""
    graphdef, sft_params, teacher_graphdef, teacher_params = lesson_setup()
    examples = fresh_prompts(n_prompts, seed=777)
    prompts = grpo.prompt_rows(examples)
    objective = distill.objective(graphdef, teacher_graphdef, beta=beta)
    out = {}
    for temperature in temperatures:
        sample = grpo.make_sampler(graphdef, temperature=temperature)
        rows = sample(sft_params, None, prompts["prompt_tokens"], prompts["prompt_mask"],
                      grpo.rollout_keys(0, 0, n_prompts))
        batch = gkd.sampled_batch(rows, own_sample=True)
        T = rows["completion_mask"].shape[1]
        teacher_logits = model.apply(teacher_graphdef, teacher_params, batch["inputs"], batch["attention_mask"])
        logp_BxT = losses.token_log_probs(teacher_logits[:, -T:], batch["targets"][:, -T:])
        mask_BxT = np.asarray(rows["completion_mask"]) > 0
        loss_sum, weight, _ = objective(sft_params, batch, teacher_params)
        out[temperature] = {"mean_length": float(mask_BxT.sum(1).mean()),
                            "teacher_logp": float(np.asarray(logp_BxT)[mask_BxT].mean()),
                            "loss": float(loss_sum / weight)}
    return out
