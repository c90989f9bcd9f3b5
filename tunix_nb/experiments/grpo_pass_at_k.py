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
    # 0: GRPO and RFT are scored after their last step (the stored record). N: every N steps
    # along the one trajectory, the validation split's sampled pass@1 at temperature 1 (GRPO's
    # reward) is measured (the run's "curve"), and the policy is scored at its best checkpoint
    eval_every: int = 0
    eval_split: str = "test"  # "validation" for pilots: settings are chosen there, never on the test prompts

    def __post_init__(self):
        from tunix_nb.experiments import pilots

        pilots.check_eval_split(self.eval_split)
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"temperatures {self.temperatures}: give one or more, each >= 0 (0 is greedy).")
        if self.eval_every < 0 or (self.eval_every and self.steps % self.eval_every):
            raise ValueError(f"eval_every={self.eval_every} must divide steps={self.steps} (or be 0: score the "
                             "last step only).")


CONFIG_CLASS = GrpoPassAtKConfig


def settings(config: GrpoPassAtKConfig) -> list[str]:
    return [HEADLINE]


def prepare(config: GrpoPassAtKConfig) -> dict:
    from tunix_nb.experiments import long_family

    parts = long_family.splits(n_fresh=config.steps * config.prompts_per_step)
    graphdef, params = long_family.load("student")
    return {**parts, "student": (graphdef, params), "record": {"gate": long_family.gate(graphdef, params)}}


def grpo_checkpoints(seed: int, config: GrpoPassAtKConfig, shared: dict):
    """(step, params, training rewards so far) every `eval_every` steps (or once, at the end) of
    GRPO's one trajectory from the student."""
    from tunix_nb import data, grpo, rewards, train

    graphdef, start = shared["student"]
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=5,
                                                     total_steps=config.steps))
    step_fn = train.make_step(grpo.objective(graphdef, beta=config.beta), opt)
    rollout_fn = grpo.make_rollout(graphdef, shared["fresh"], rewards.combine([rewards.exact_match]),
                                   batch_size=config.prompts_per_step, group_size=config.group_size, seed=seed,
                                   beta=config.beta, max_new_tokens=data.LONG_MAX_NEW_TOKENS,
                                   prompt_len=data.LONG_PROMPT_LEN)
    params, opt_state, rewards_so_far = start, opt.init(start), []
    every = config.eval_every or config.steps
    for first in range(0, config.steps, every):
        params, opt_state, history = train.run_on_policy(step_fn, params, opt_state, rollout_fn, steps=every,
                                                         start_step=first, reference=start, progress=False)
        rewards_so_far += [h["reward"] for h in history]
        yield first + every, params, list(rewards_so_far)


def rft_checkpoints(seed: int, config: GrpoPassAtKConfig, shared: dict):
    """The student's right answers among as many samples as GRPO draws, then SFT on them:
    (step, params, how many answers were kept) every `eval_every` steps (or once, at the end)."""
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
    params, opt_state = start, opt.init(start)
    every = config.eval_every or config.steps
    for first in range(0, config.steps, every):
        params, opt_state, _ = train.run(step_fn, params, opt_state,
                                         lambda s: data.batch_at(rows, s, config.rft_batch_size, seed=seed),
                                         steps=every, start_step=first, progress=False)
        yield first + every, params, len(kept)


def run_arm(arm: str, seed: int, config: GrpoPassAtKConfig, shared: dict, setting: str = HEADLINE) -> dict:
    graphdef, params = shared["student"]
    extra = {}
    if arm != "sft":
        params, extra = best_checkpoint(arm, seed, config, shared)
    return {**evaluate_policy(graphdef, params, seed, config, shared), **extra}


def best_checkpoint(arm: str, seed: int, config: GrpoPassAtKConfig, shared: dict):
    """(params, what the record keeps of the trajectory): GRPO's training rewards or RFT's kept
    answers; with `eval_every`, also the validation curve and the chosen step, the checkpoint
    of best validation pass@1 at temperature 1 (the first of ties); without it, the last step."""
    from tunix_nb.experiments import long_family

    graphdef, _ = shared["student"]
    trajectory = grpo_checkpoints if arm == "grpo" else rft_checkpoints
    best, curve = (-1.0, None, 0, None), []
    for step, params, kept in trajectory(seed, config, shared):
        if not config.eval_every:
            best = (0.0, params, step, kept)
            continue
        val = float(long_family.sample_correct(graphdef, params, shared["validation"], n=config.pass_at_1_samples,
                                               temperature=1.0, seed=10 * seed + 4).mean())
        curve.append({"step": step, "val_pass_at_1_t1": val})
        if val > best[0]:
            best = (val, params, step, kept)
    extra = {"reward_curve": kept} if arm == "grpo" else {"rft_examples": kept}  # the whole run's, as stored
    if config.eval_every:
        extra.update(curve=curve, chosen_step=best[2])
    return best[1], extra


def evaluate_policy(graphdef, params, seed: int, config: GrpoPassAtKConfig, shared: dict) -> dict:
    """Greedy and sampled scores on the test split (a pilot's: on validation), at the
    temperature validation picks."""
    from tunix_nb.experiments import long_family, stats

    val, test = shared["validation"], shared[config.eval_split]
    n = config.pass_at_1_samples
    val_pass_at_1 = {t: float(correct_at(graphdef, params, val, n=n, temperature=t, seed=10 * seed + 1).mean())
                     for t in config.temperatures}
    best_t = max(val_pass_at_1, key=val_pass_at_1.get)
    sampled = correct_at(graphdef, params, test, n=n, temperature=best_t, seed=10 * seed + 2)
    at_1 = long_family.sample_correct(graphdef, params, test, n=config.pass_at_k_samples, temperature=1.0,
                                      seed=10 * seed + 3)
    return {"scores": sampled.mean(axis=1).tolist(),
            "greedy": long_family.greedy_correct(graphdef, params, test).astype(float).tolist(),
            "best_temperature": best_t, "validation_pass_at_1": {str(t): v for t, v in val_pass_at_1.items()},
            "pass_at_k": {str(k): v.tolist() for k, v in zip(config.ks, stats.pass_at_k_curve(at_1, config.ks))},
            "tasks": [e["task"] for e in test]}


def correct_at(graphdef, params, examples, *, n: int, temperature: float, seed: int):
    """[N, n] bool: n answers sampled at `temperature`; at 0, the greedy answer n times (its limit)."""
    from tunix_nb.experiments import long_family

    if temperature == 0:
        return np.repeat(long_family.greedy_correct(graphdef, params, examples)[:, None], n, axis=1)
    return long_family.sample_correct(graphdef, params, examples, n=n, temperature=temperature, seed=seed)


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
