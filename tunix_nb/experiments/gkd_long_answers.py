"""Lesson 11's experiment: on-policy distillation where errors compound, on long answers.

Offline distillation trains the student on right prefixes only; at inference it continues
its own, and an early slip can derail the rest (exposure bias; the DAgger bound, Ross &
Bagnell 2010: O(T^2 eps) against O(T eps) for on-policy training, a prediction for long
answers, not a measured law). Arms from the same student (the shipped long-family one),
with the same teacher, the same divergence and the same number of teacher forward passes
over rows of the same length (`data.LONG_SEQ_LEN`):

- `offline`: the dataset's answers (lesson 02's distillation, the divergence alone);
- `on_policy`: the student's own samples every step (GKD with lmbda = 1).

Both train on the generalized JSD (beta 0.5) alone (alpha 1): on-policy rows carry no
right answer, so the offline arm gets no cross-entropy either.

Three task families (`family`): the long family (reversals and sorts, `long_family`);
running counts of bits (`count_family`), where a student that learnt "the digit before plus
the next bit" carries a slip into every later digit, and the teacher learnt to correct it;
and the same counts of exactly 14 bits (`count14_family`), where no answer stops early.

Scored on the test split by edit similarity (it sees errors made after the student's own
wrong prefix, which exact match cannot), exact match as a control, and by answer length;
the share of token errors caused by the student's own prefix (`evaluate.errors_by_position`,
free-running minus teacher-forced) on the longest third, and that share within the student's
own answers, the tail an early eos leaves out (`evaluate.errors_after_own_end`); and the same split by sub-task,
with what its wrong answers look like (edits from the right one; a symbol short or long),
since a reversal's slips and a sort's are not alike (`by_task_summary`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

NAME = "lesson11_gkd"
ARMS = ("offline", "on_policy")
HEADLINE = "long"


@dataclasses.dataclass(frozen=True)
class GkdLongConfig:
    steps: int = 200
    batch_size: int = 64
    learning_rate: float = 1e-3
    beta: float = 0.5  # the generalized JSD, for both arms
    alpha: float = 1.0  # the divergence alone on every row: no cross-entropy on the dataset's answers
    temperature: float = 1.0  # the on-policy arm's sampling temperature
    lmbda: float = 1.0  # the on-policy arm's share of steps on the student's own samples (TRL's lmbda)
    offline_first: int = 0  # steps of offline distillation both arms share before they part (a warm start)
    eval_split: str = "test"  # "validation" for pilots: designs are chosen there, never on the test prompts
    # "count": running counts, where a slip is carried into every later digit; "count14": the
    # same of exactly 14 bits, with its own one-layer student, so that no answer stops early
    family: str = "long"
    student: str = "student"  # the count family's "small_student": a one-layer student, nearer its floor
    # a diagnostic, not a design: the offline arm's answer inputs swapped at this rate
    # (`long_family.with_wrong_prefixes`), the teacher scoring every position, so that it is
    # taught corrections too, without sampling (0: the dataset's answers as they are)
    offline_slip_rate: float = 0.0
    offline_slip_taught: bool = True  # False: positions after a swap left out of the loss (the control)
    # 0: each arm is scored after its last step (the stored records). N: every N steps along the
    # one trajectory the validation split's edit similarity is measured (the run's "curve"), and
    # the arm is scored at its best checkpoint: its budget chosen like a hyperparameter
    eval_every: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family is one of {', '.join(FAMILIES)}; got {self.family!r}.")
        if self.student != "student" and (self.family, self.student) != ("count", "small_student"):
            raise ValueError(f"student is 'student', or 'small_student' with family=count; "
                             f"got {self.student!r} with family={self.family!r}.")
        from tunix_nb.experiments import pilots

        pilots.check_eval_split(self.eval_split)
        if self.eval_every < 0 or (self.eval_every and self.steps % self.eval_every):
            raise ValueError(f"eval_every={self.eval_every} must divide steps={self.steps} (or be 0: score the "
                             "last step only).")


CONFIG_CLASS = GkdLongConfig
# the module with each family's splits and checkpoints
FAMILIES = {"long": "long_family", "count": "count_family", "count14": "count14_family"}
COUNTS = ("count", "count14")  # the families of running counts, which get the slip probes


def settings(config: GkdLongConfig) -> list[str]:
    return [HEADLINE]


def prepare(config: GkdLongConfig) -> dict:
    import importlib

    family = importlib.import_module(f"tunix_nb.experiments.{FAMILIES[config.family]}")
    shared = {**family.splits(), "student": family.load(config.student), "teacher": family.load("teacher")}
    if config.family in COUNTS:  # the record keeps the datasheet's figures of the two checkpoints
        shared["record"] = {"validation_exact_match": family.validation_exact_match(shared["student"],
                                                                                    shared["teacher"])}
    return shared


def checkpoints(arm: str, seed: int, config: GkdLongConfig, shared: dict):
    """(step, params) every `config.eval_every` steps (or once, at the end) of `arm`'s one
    trajectory from the shared warm start: one schedule over `config.steps`, never restarted."""
    from tunix_nb import data, gkd, train

    graphdef, _ = shared["student"]
    teacher_graphdef, teacher = shared["teacher"]
    step_fn, opt = distill_step(config, graphdef, teacher_graphdef)
    params = warm_start(seed, config, shared)
    opt_state = opt.init(params)
    if arm == "offline":
        batches = offline_batches(seed, config, shared, first=config.offline_first)
        run = train.run
    else:
        batches = gkd.make_batches(graphdef, teacher_graphdef, shared["teacher_train"], batch_size=config.batch_size,
                                   seed=seed, lmbda=config.lmbda, temperature=config.temperature,
                                   max_new_tokens=data.LONG_MAX_NEW_TOKENS, seq_len=data.LONG_SEQ_LEN,
                                   prompt_len=data.LONG_PROMPT_LEN)
        run = train.run_on_policy
    every = config.eval_every or config.steps
    for start in range(0, config.steps, every):
        params, opt_state, _ = run(step_fn, params, opt_state, batches, steps=every, start_step=start, frozen=teacher,
                                   progress=False)
        yield start + every, params


def best_checkpoint(arm: str, seed: int, config: GkdLongConfig, shared: dict):
    """(params, chosen step, validation curve): the checkpoint of the trajectory with the best
    mean edit similarity on the validation split (the first of ties); with `eval_every` 0, the
    last step and no curve."""
    from tunix_nb import evaluate
    from tunix_nb.experiments import long_family, stats

    graphdef, _ = shared["student"]
    best, curve = (-1.0, None, 0), []
    for step, params in checkpoints(arm, seed, config, shared):
        if not config.eval_every:
            return params, step, []
        val = shared["validation"]
        answers = evaluate.generate_answers(graphdef, params, [e["prompt"] for e in val], **long_family.LENGTHS)
        similarity = float(np.mean([stats.edit_similarity(a, e["completion"]) for a, e in zip(answers, val)]))
        curve.append({"step": step, "val_edit_similarity": similarity})
        if similarity > best[0]:
            best = (similarity, params, step)
    return best[1], best[2], curve


def distill_step(config: GkdLongConfig, graphdef, teacher_graphdef):
    """(step_fn, optimizer): the divergence both arms train on, with the arms' schedule."""
    from tunix_nb import distill, train

    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=10,
                                                     total_steps=config.steps))
    objective = distill.objective(graphdef, teacher_graphdef, beta=config.beta, alpha=config.alpha)
    return train.make_step(objective, opt), opt


def offline_batches(seed: int, config: GkdLongConfig, shared: dict, first: int = 0):
    """step -> the offline batch: the dataset's answers, in seed's order, from batch `first` on
    (with `config.offline_slip_rate` of their answer inputs swapped, and with
    `offline_slip_taught=False` nothing after a swap in the loss)."""
    from tunix_nb import data
    from tunix_nb.tokenizer import ByteTokenizer

    from tunix_nb.experiments.long_family import right_prefixes_only, with_wrong_prefixes

    rows = data.sft_arrays(shared["teacher_train"], ByteTokenizer(), data.LONG_SEQ_LEN)

    def batch(step):
        plain = data.batch_at(rows, first + step, config.batch_size, seed=seed)
        swapped = with_wrong_prefixes(plain, config.offline_slip_rate, seed=(seed, first + step))
        return swapped if config.offline_slip_taught else right_prefixes_only(swapped, plain)

    return batch


def warm_start(seed: int, config: GkdLongConfig, shared: dict):
    """The shipped student after `config.offline_first` offline steps (its own schedule), once per seed."""
    from tunix_nb import train

    graphdef, start = shared["student"]
    if not config.offline_first:
        return start
    key = ("warm_start", seed)
    if key not in shared:
        teacher_graphdef, teacher = shared["teacher"]
        step_fn, opt = distill_step(dataclasses.replace(config, steps=config.offline_first), graphdef, teacher_graphdef)
        shared[key] = train.run(step_fn, start, opt.init(start), offline_batches(seed, config, shared),
                                steps=config.offline_first, frozen=teacher, progress=False)[0]
    return shared[key]


def run_arm(arm: str, seed: int, config: GkdLongConfig, shared: dict, setting: str = HEADLINE) -> dict:
    from tunix_nb import data, evaluate
    from tunix_nb.experiments import long_family, stats

    graphdef, _ = shared["student"]
    params, chosen_step, curve = best_checkpoint(arm, seed, config, shared)
    budget = {"chosen_step": chosen_step, "curve": curve} if config.eval_every else {}
    test = shared[config.eval_split]
    answers = evaluate.generate_answers(graphdef, params, [e["prompt"] for e in test], **long_family.LENGTHS)
    tasks, longest = np.array([e["task"] for e in test]), longest_third(test)
    right = evaluate.right_tokens_by_row(graphdef, params, [e for e, x in zip(test, longest) if x],
                                          seq_len=data.LONG_SEQ_LEN, **long_family.LENGTHS)
    slip = {}
    if config.family in COUNTS:  # what it predicts right after a miscount: the right digit, or the slip carried on
        from tunix_nb.experiments import count_family

        slip = {"after_a_slip": count_family.after_a_slip(graphdef, params, test),  # a slip planted, one too high
                "after_own_slip": count_family.after_own_slip(answers, test)}  # its own first slip, free-running
    return {**slip, **budget, "scores": [stats.edit_similarity(a, e["completion"]) for a, e in zip(answers, test)],
            "exact_match": [float(a == e["completion"]) for a, e in zip(answers, test)],
            "answer_length": [len(e["completion"]) for e in test], "task": tasks.tolist(),
            "edits": [stats.edit_distance(a, e["completion"]) for a, e in zip(answers, test)],
            "own_length": [len(a) for a in answers],
            **error_figures(evaluate.error_rates(right)),
            "errors_by_own_end": evaluate.errors_after_own_end(right),  # where an early eos leaves a missing tail
            "by_task": {task: error_figures(evaluate.error_rates(right, tasks[longest] == task))
                        for task in sorted(set(tasks))}}


def error_figures(errors: dict) -> dict:
    """Free-running and teacher-forced token error, and the own-prefix share, from `errors_by_position`'s rates."""
    return {"own_prefix_share": own_prefix_share(errors), "free_running_error": token_error(errors, "free_running"),
            "teacher_forced_error": token_error(errors, "teacher_forced")}


def longest_third(examples) -> np.ndarray:
    """[N] bool: the answers in the top third of lengths (the longest, where errors compound most)."""
    lengths = np.array([len(e["completion"]) for e in examples])
    return lengths >= np.quantile(lengths, 2 / 3)


def token_error(errors: dict, key: str) -> float:
    """The error rate over every answer token (`errors_by_position`'s rates, weighted by rows)."""
    w = errors["rows"]
    return float((errors[key] * w).sum() / w.sum())


def own_prefix_share(errors: dict) -> float:
    """The share of free-running token errors that the model's own earlier tokens caused:
    (free-running - teacher-forced) / free-running, over every answer token."""
    w = errors["rows"]
    free, forced = (errors["free_running"] * w).sum(), (errors["teacher_forced"] * w).sum()
    return float((free - forced) / free) if free > 0 else 0.0


def summarise(record: dict) -> dict:
    from tunix_nb.experiments import stats

    runs = record["runs"][HEADLINE]
    long = np.array(runs["offline"][0]["answer_length"]) >= np.quantile(runs["offline"][0]["answer_length"], 2 / 3)
    pick = lambda arm, key, mask=slice(None): [np.asarray(r[key])[mask] for r in runs[arm]]  # noqa: E731
    return {
        "edit_similarity_longest_third": {arm: stats.mean_interval(pick(arm, "scores", long)) for arm in runs},
        "on_policy_over_offline_longest_third": stats.paired_gain(pick("on_policy", "scores", long),
                                                                   pick("offline", "scores", long)),
        "on_policy_over_offline_all": stats.paired_gain(pick("on_policy", "scores"), pick("offline", "scores")),
        "exact_match_control": stats.paired_gain(pick("on_policy", "exact_match"), pick("offline", "exact_match")),
        **error_summary(runs),
        "by_task": {task: by_task_summary(runs, long, task) for task in sorted(set(runs["offline"][0]["task"]))},
        **{probe: slip_summary(runs, probe) for probe in ("after_a_slip", "after_own_slip")
           if probe in runs["offline"][0]},
        **(own_end_summary(runs) if "errors_by_own_end" in runs["offline"][0] else {}),
    }


def own_end_summary(runs: dict) -> dict:
    """The longest third's own-prefix share within each arm's own answers (an early eos's
    missing tail left out), and the part of its own-prefix errors that are that tail, per arm:
    mean and per seed (`evaluate.errors_after_own_end`). A seed with no such error has 0 for
    either fraction, not a NaN."""
    def per_seed(arm, figure):
        return [figure(r["errors_by_own_end"]) for r in runs[arm]]

    def within(errors):  # (free-running - teacher-forced) / free-running, inside the answers
        return own_prefix_part(errors["within"]) / max(errors["within"]["free_running"], 1)

    def tail(errors):  # the missing tails' part of all the errors the own prefix caused
        caused = own_prefix_part(errors["within"]) + own_prefix_part(errors["after_end"])
        return own_prefix_part(errors["after_end"]) / max(caused, 1)

    return {name: {arm: mean_and_seeds(per_seed(arm, figure)) for arm in runs}
            for name, figure in (("own_prefix_share_within_answer_longest_third", within),
                                 ("tail_part_of_own_prefix_errors_longest_third", tail))}


def mean_and_seeds(values: list) -> dict:
    """A figure over seeds as the summary keeps it: {"mean", "per_seed"}."""
    return {"mean": float(np.mean(values)), "per_seed": values}


def own_prefix_part(counts: dict) -> int:
    """Free-running minus teacher-forced token errors: those the model's own prefix caused."""
    return counts["free_running"] - counts["teacher_forced"]


def slip_summary(runs: dict, probe: str) -> dict:
    """The count family's shares right after a slip (`after_a_slip`: planted; `after_own_slip`:
    the model's own), right digit and slip carried on, per arm: mean and per seed."""
    per_seed = lambda arm, key: [r[probe][key] for r in runs[arm]]  # noqa: E731
    return {arm: {key: mean_and_seeds(per_seed(arm, key)) for key in ("right", "carried")} for arm in runs}


def error_summary(figures_by_arm: dict) -> dict:
    """The longest third's own-prefix share (mean and per seed), free-running and teacher-forced error, per arm."""
    values = lambda arm, key: [f[key] for f in figures_by_arm[arm]]  # noqa: E731
    return {
        "own_prefix_share_longest_third": {arm: mean_and_seeds(values(arm, "own_prefix_share"))
                                           for arm in figures_by_arm},
        "free_running_error_longest_third": {arm: mean_and_seeds(values(arm, "free_running_error"))
                                             for arm in figures_by_arm},
        "teacher_forced_error_longest_third": {arm: float(np.mean(values(arm, "teacher_forced_error")))
                                               for arm in figures_by_arm},
    }


def by_task_summary(runs: dict, long: np.ndarray, task: str) -> dict:
    """The family's longest third, one sub-task's rows of it: the paired gains, the error figures, and
    what the wrong answers look like, pooled over seeds (how many edits from the right one; how many
    have the wrong length, which shifts every later position, so that position-aligned counting
    charges that slip at each of them). None where an arm has no wrong answer."""
    from tunix_nb.experiments import stats

    mask = long & (np.array(runs["offline"][0]["task"]) == task)
    pick = lambda arm, key: [np.asarray(r[key])[mask] for r in runs[arm]]  # noqa: E731
    wrong = {arm: [np.asarray(r["exact_match"])[mask] == 0 for r in runs[arm]] for arm in runs}

    def pooled(arm, values):
        chosen = np.concatenate([v[w] for v, w in zip(values, wrong[arm])])
        return float(chosen.mean()) if chosen.size else None  # no wrong answer: nothing to describe

    return {
        "on_policy_over_offline": stats.paired_gain(pick("on_policy", "scores"), pick("offline", "scores")),
        "exact_match": stats.paired_gain(pick("on_policy", "exact_match"), pick("offline", "exact_match")),
        **error_summary({arm: [r["by_task"][task] for r in runs[arm]] for arm in runs}),
        "edits_per_wrong_answer": {arm: pooled(arm, pick(arm, "edits")) for arm in runs},
        "wrong_answers_of_the_wrong_length": {
            arm: pooled(arm, [o != g for o, g in zip(pick(arm, "own_length"), pick(arm, "answer_length"))])
            for arm in runs},
    }
