"""Lesson 02's experiment: distillation where it is known to help, when labels are scarce and prompts free.

A few hundred prompts have right answers; thousands more have none, and only the teacher
can score them (Hinton et al., 2015; Stanton et al., 2021 on why the transfer set
matters). Three students, each from the same initialisation per seed:

- `labels`: hard labels on the labelled prompts alone;
- `teacher_labels`: plus the unlabelled prompts with the teacher's greedy answers as hard
  labels (sequence-level distillation): more data, no soft targets;
- `distilled`: plus the unlabelled prompts with the teacher's soft targets (the KL at T along
  the teacher's greedy answers), the labelled ones with lesson 02's mix of both.

`distilled` against `labels` is the gain of distillation; against `teacher_labels` it is
the gain of soft targets over the same teacher-labelled prompts. Every run picks its
reporting step on a validation split (the best validation exact match of its checkpoints)
and is scored on test prompts never used for a choice.

Options for the reruns (issue 49), each off by default, where the stored record was made:
`labelled_pool` lets each seed draw its labelled prompts from a larger labelled pool (the
test set stays fixed), `learning_rates` gives each arm its own learning rate (chosen on
validation from one grid), and `eval_split="validation"` makes a pilot that never touches
the test prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NAME = "lesson02_distillation"
ARMS = ("labels", "teacher_labels", "distilled")
HEADLINE = "labels=300"  # the setting the lesson's claims are about; the others draw the gain's curve


@dataclasses.dataclass(frozen=True)
class ScarceLabelsConfig:
    """The experiment's settings; the stored run's are the defaults."""

    label_counts: tuple[int, ...] = (100, 300, 1000)
    unlabelled: int = 4000
    val_prompts: int = 300
    test_prompts: int = 1000
    steps: int = 300
    eval_every: int = 75
    batch_size: int = 64
    learning_rate: float = 3e-3
    temperature: float = 2.0
    alpha: float = 0.5  # the labelled rows' mix of soft and hard terms (lesson 02's)
    pool_seed: int = 777  # the fresh prompts: none is in the shipped files
    # 0: every seed's n labelled prompts are the pool's first n (the stored run); N: a pool of N
    # labelled prompts, from which each seed draws its own n, so the seeds vary the data too
    labelled_pool: int = 0
    # "" : every arm at learning_rate; "labels=1e-2,distilled=3e-3": those arms at their own
    learning_rates: str = ""
    eval_split: str = "test"  # "validation" for pilots: settings are chosen there, never on the test prompts

    def __post_init__(self):
        from tunix_nb.experiments import pilots

        pilots.check_eval_split(self.eval_split)
        if self.labelled_pool and self.labelled_pool < max(self.label_counts):
            raise ValueError(f"labelled_pool={self.labelled_pool} holds fewer prompts than the largest label count "
                             f"{max(self.label_counts)}; make it at least that, or 0 for the first n of a fixed pool.")
        arm_learning_rate(self, ARMS[0])  # a malformed learning_rates fails here, before any run

    def learning_rate_of(self, arm: str) -> float:
        return arm_learning_rate(self, arm)


def arm_learning_rate(config: ScarceLabelsConfig, arm: str) -> float:
    """`arm`'s learning rate: its entry in `learning_rates` ("arm=value,..."), else `learning_rate`."""
    chosen = {}
    for item in filter(None, (part.strip() for part in config.learning_rates.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep or name not in ARMS:
                raise ValueError
            chosen[name] = float(value)
        except ValueError:
            raise ValueError(f"learning_rates={config.learning_rates!r}: expected 'arm=value' items joined by "
                             f"commas, with arms from {', '.join(ARMS)}, e.g. 'labels=1e-2,distilled=3e-3'") from None
    return chosen.get(arm, config.learning_rate)


def settings(config: ScarceLabelsConfig) -> list[str]:
    return [f"labels={n}" for n in config.label_counts]


def prepare(config: ScarceLabelsConfig) -> dict:
    """The prompts (labelled pool, unlabelled, validation, test), the teacher and its answers."""
    from tunix_nb import data, distill, evaluate

    shipped = [e["prompt"] for e in data.load_sft() + data.load_sft(data.DATA_DIR / "sft_eval.jsonl")]
    n_labelled = config.labelled_pool or max(config.label_counts)
    pool = data.generate_sft(n_labelled + config.unlabelled + config.val_prompts + config.test_prompts,
                             seed=config.pool_seed, exclude=shipped)
    cuts = np.cumsum([n_labelled, config.unlabelled, config.val_prompts])
    labelled, unlabelled, val, test = np.split(np.array(pool, dtype=object), cuts)
    teacher_graphdef, teacher_params = distill.load_teacher()
    answers = evaluate.generate_answers(teacher_graphdef, teacher_params, [e["prompt"] for e in unlabelled])
    scored = {"test": list(test), "validation": list(val)}[config.eval_split]
    scored_answers = evaluate.generate_answers(teacher_graphdef, teacher_params, [e["prompt"] for e in scored])
    return {"labelled": list(labelled), "teacher_examples": [dict(e, completion=a) for e, a in zip(unlabelled, answers)],
            "val": list(val), "test": scored, "teacher": (teacher_graphdef, teacher_params),
            "teacher_test_answers": scored_answers}


def labelled_examples(shared: dict, n_labels: int, seed: int, config: ScarceLabelsConfig) -> list:
    """The n labelled prompts a seed trains on: the pool's first n, or with `labelled_pool` its
    own draw of n from the whole pool (the same draw for every arm of the seed)."""
    if not config.labelled_pool:
        return shared["labelled"][:n_labels]
    order = np.random.default_rng([config.pool_seed, seed]).permutation(len(shared["labelled"]))
    return [shared["labelled"][i] for i in order[:n_labels]]


def training_rows(arm: str, n_labels: int, shared: dict, *, labelled: list | None = None) -> dict:
    """The arm's rows: the labelled examples (`labelled`, or the pool's first `n_labels`), and
    for the teacher arms the teacher-answered prompts; `own_sample` 1 marks rows whose answer is
    the teacher's, not a label (`distill.objective` trains those on the soft term alone)."""
    from tunix_nb import data
    from tunix_nb.tokenizer import ByteTokenizer

    def rows(examples, teachers):
        r = data.sft_arrays(examples, ByteTokenizer(), data.DEFAULT_SEQ_LEN)
        r["own_sample"] = np.full(len(examples), float(teachers), np.float32)
        return r

    labelled = rows(shared["labelled"][:n_labels] if labelled is None else labelled, False)
    if arm == "labels":
        return labelled
    # an empty teacher answer still trains: eos alone is its answer
    teachers = rows([dict(e, completion=e["completion"] or " ") for e in shared["teacher_examples"]],
                    arm == "distilled")
    return {k: np.concatenate([labelled[k], teachers[k]]) for k in labelled}


def run_arm(arm: str, seed: int, config: ScarceLabelsConfig, shared: dict, setting: str = HEADLINE) -> dict:
    """Train one student; score it on the test prompts (a pilot: the validation prompts) at the
    step its validation curve picks."""
    from tunix_nb import data, distill, evaluate, model, train

    n_labels = int(setting.split("=")[1])
    rows = training_rows(arm, n_labels, shared, labelled=labelled_examples(shared, n_labels, seed, config))
    teacher_graphdef, teacher_params = shared["teacher"]
    graphdef, params = model.split(model.make_model("student", seed=seed))
    objective = distill.objective(graphdef, teacher_graphdef, temperature=config.temperature,
                                  alpha=config.alpha if arm == "distilled" else 0.0)
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=config.learning_rate_of(arm), warmup_steps=config.steps // 30,
                                                     total_steps=config.steps))
    step_fn = train.make_step(objective, opt)
    opt_state, curve, best = opt.init(params), [], (-1.0, None, 0)
    for start in range(0, config.steps, config.eval_every):
        params, opt_state, _ = train.run(step_fn, params, opt_state,
                                         lambda s: data.batch_at(rows, s, config.batch_size, seed=seed),
                                         steps=config.eval_every, start_step=start, frozen=teacher_params,
                                         progress=False)
        val = evaluate.exact_match_accuracy(graphdef, params, shared["val"])
        curve.append({"step": start + config.eval_every, "val_exact_match": val})
        if val > best[0]:
            best = (val, params, start + config.eval_every)
    answers = evaluate.generate_answers(graphdef, best[1], [e["prompt"] for e in shared["test"]])
    return {"scores": [float(a == e["completion"]) for a, e in zip(answers, shared["test"])],
            "agrees_with_teacher": [float(a == t) for a, t in zip(answers, shared["teacher_test_answers"])],
            "curve": curve, "chosen_step": best[2]}


CONFIG_CLASS = ScarceLabelsConfig


def summarise(record: dict) -> dict:
    """Per setting: each arm's mean test exact match and fidelity (agreement with the teacher),
    and the two paired gains with their 95% intervals."""
    from tunix_nb.experiments import runner, stats

    out = {}
    for setting, arms in record["runs"].items():
        out[setting] = {
            "exact_match": {arm: stats.mean_interval(runner.scores(record, setting, arm)) for arm in arms},
            "fidelity": {arm: stats.mean_interval([r["agrees_with_teacher"] for r in runs])
                         for arm, runs in arms.items()},
            "distilled_over_labels": runner.gain(record, setting, "distilled", "labels"),
            "soft_over_teacher_labels": runner.gain(record, setting, "distilled", "teacher_labels"),
            "chosen_steps": {arm: [r["chosen_step"] for r in runs] for arm, runs in arms.items()},
        }
    return out
