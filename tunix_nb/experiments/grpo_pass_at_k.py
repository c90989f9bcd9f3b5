"""Lesson 08's experiment: GRPO turns pass@k into pass@1 on long answers.

The shipped long-family student (`long_family`) samples right answers unreliably: its
pass@8 is over 20 points above its greedy accuracy. Three policies per seed (the seed
sets GRPO's prompt order and sampling keys, and the evaluation's sampling keys):

- `sft`: the student itself, sampled at its best temperature on the validation split
  (sharpening without learning);
- `rft`: rejection-sampling fine-tuning on the same number of samples as GRPO draws: the
  student's own samples of the same fresh prompts, the right ones kept, then SFT on them;
- `grpo`: GRPO from the student with an exact-match reward (DeepSeekMath, 2024).

Each policy is scored on the test split: greedy exact match, sampled pass@1 at the
temperature the validation split picks for it, and pass@k for k = 1 ... 64 at
temperature 1 (the unbiased estimator), per sub-task.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NAME = "lesson08_grpo"
ARMS = ("sft", "rft", "grpo")
HEADLINE = "long"


@dataclasses.dataclass(frozen=True)
class GrpoPassAtKConfig:
    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 8
    learning_rate: float = 3e-4
    beta: float = 0.04
    temperatures: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    pass_at_1_samples: int = 8
    pass_at_k_samples: int = 64
    ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    rft_batch_size: int = 64
    rft_learning_rate: float = 1e-3


CONFIG_CLASS = GrpoPassAtKConfig


def settings(config: GrpoPassAtKConfig) -> list[str]:
    return [HEADLINE]


def prepare(config: GrpoPassAtKConfig) -> dict:
    from tunix_nb.experiments import long_family

    parts = long_family.splits(n_fresh=config.steps * config.prompts_per_step)
    graphdef, params = long_family.load("student")
    return {**parts, "student": (graphdef, params), "record": {"gate": long_family.gate(graphdef, params)}}


def train_grpo(seed: int, config: GrpoPassAtKConfig, shared: dict):
    from tunix_nb import data, grpo, rewards, train

    graphdef, start = shared["student"]
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=5,
                                                     total_steps=config.steps))
    step_fn = train.make_step(grpo.objective(graphdef, beta=config.beta), opt)
    rollout_fn = grpo.make_rollout(graphdef, shared["fresh"], rewards.combine([rewards.exact_match]),
                                   batch_size=config.prompts_per_step, group_size=config.group_size, seed=seed,
                                   beta=config.beta, max_new_tokens=data.LONG_MAX_NEW_TOKENS,
                                   prompt_len=data.LONG_PROMPT_LEN)
    params, _, history = train.run_on_policy(step_fn, start, opt.init(start), rollout_fn, steps=config.steps,
                                             reference=start, progress=False)
    return params, [h["reward"] for h in history]


def train_rft(seed: int, config: GrpoPassAtKConfig, shared: dict):
    """The student's right answers among as many samples as GRPO draws, then SFT on them."""
    from tunix_nb import data, sft, train
    from tunix_nb.experiments import long_family
    from tunix_nb.tokenizer import ByteTokenizer

    graphdef, start = shared["student"]
    prompts = shared["fresh"]
    answers = long_family.sample_answers(graphdef, start, prompts, n=config.group_size, temperature=1.0,
                                         seed=1000 + seed)
    kept = [dict(e, completion=a) for e, row in zip(prompts, answers) for a in row if a == e["completion"]]
    rows = data.sft_arrays(kept, ByteTokenizer(), data.LONG_SEQ_LEN)
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=config.rft_learning_rate, warmup_steps=5,
                                                     total_steps=config.steps))
    step_fn = train.make_step(sft.objective(graphdef), opt)
    params, _, _ = train.run(step_fn, start, opt.init(start),
                             lambda s: data.batch_at(rows, s, config.rft_batch_size, seed=seed),
                             steps=config.steps, progress=False)
    return params, len(kept)


def run_arm(arm: str, seed: int, config: GrpoPassAtKConfig, shared: dict, setting: str = HEADLINE) -> dict:
    graphdef, params = shared["student"]
    extra = {}
    if arm == "grpo":
        params, extra["reward_curve"] = train_grpo(seed, config, shared)
    elif arm == "rft":
        params, extra["rft_examples"] = train_rft(seed, config, shared)
    return {**evaluate_policy(graphdef, params, seed, config, shared), **extra}


def evaluate_policy(graphdef, params, seed: int, config: GrpoPassAtKConfig, shared: dict) -> dict:
    """Greedy and sampled scores on the test split, at the temperature validation picks."""
    from tunix_nb.experiments import long_family, stats

    val, test = shared["validation"], shared["test"]
    n = config.pass_at_1_samples
    val_pass_at_1 = {t: float(long_family.sample_correct(graphdef, params, val, n=n, temperature=t,
                                                         seed=10 * seed + 1).mean())
                     for t in config.temperatures}
    best_t = max(val_pass_at_1, key=val_pass_at_1.get)
    sampled = long_family.sample_correct(graphdef, params, test, n=n, temperature=best_t, seed=10 * seed + 2)
    at_1 = long_family.sample_correct(graphdef, params, test, n=config.pass_at_k_samples, temperature=1.0,
                                      seed=10 * seed + 3)
    return {"scores": sampled.mean(axis=1).tolist(),
            "greedy": long_family.greedy_correct(graphdef, params, test).astype(float).tolist(),
            "best_temperature": best_t, "validation_pass_at_1": {str(t): v for t, v in val_pass_at_1.items()},
            "pass_at_k": {str(k): v.tolist() for k, v in zip(config.ks, stats.pass_at_k_curve(at_1, config.ks))},
            "tasks": [e["task"] for e in test]}


def summarise(record: dict) -> dict:
    from tunix_nb.experiments import runner, stats

    runs = record["runs"][HEADLINE]
    greedy = lambda arm: [r["greedy"] for r in runs[arm]]  # noqa: E731
    return {
        "sampled_pass_at_1": {arm: stats.mean_interval(runner.scores(record, HEADLINE, arm)) for arm in runs},
        "greedy": {arm: stats.mean_interval(greedy(arm)) for arm in runs},
        "best_temperatures": {arm: [r["best_temperature"] for r in runs[arm]] for arm in runs},
        "grpo_over_sft_sampled": runner.gain(record, HEADLINE, "grpo", "sft"),
        "grpo_over_sft_greedy": stats.paired_gain(greedy("grpo"), greedy("sft")),
        "grpo_over_rft_sampled": runner.gain(record, HEADLINE, "grpo", "rft"),
        "pass_at_k": {arm: {k: float(np.mean([r["pass_at_k"][k] for r in runs[arm]]))
                            for k in runs[arm][0]["pass_at_k"]} for arm in runs},
    }
