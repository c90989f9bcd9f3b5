"""The count family's splits and its three shipped checkpoints: lesson 11's second and third designs.

Running counts of 6-14 bits (`data.COUNT_TASKS`: "cnt 1011=" -> "1123"). Each answer digit
is the one before it plus the next bit: a model trained on right prefixes can learn that
local rule, and then a slip is carried into every later digit. That is where on-policy
distillation should pay (lesson 11), if its teacher counts from the input instead.

- the teacher (`data/count_teacher`): the `teacher` preset, 2000 steps on its 8000
  examples with a tenth of its answer inputs swapped for another of the row's digits, the
  targets kept right (`long_family.with_wrong_prefixes`): it learns what comes next after a
  mistake, and so corrects a student's slip instead of carrying it on;
- the student (`data/count_student`): the `student` preset, plain SFT on its 6000 examples,
  stopped at step 280 of a 1200-step schedule at learning rate 6e-3 (partially competent;
  the step was chosen on the validation split, data/README.md).
- the small student (`data/count_small_student`): the `tiny` preset (one layer), plain SFT
  on the same examples for the whole of a 2000-step schedule at learning rate 6e-3: a
  student nearer the floor of what it can learn than the count student, so that a wrong
  prefix in its batch displaces less (lesson 11's third design).

Every split is drawn from its own seed, none shares a prompt with another. There are only
2^n strings of n bits and prompts are unique, so the short lengths run out: the splits hold
mostly 12-14-bit prompts (data/README.md gives the counts).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tunix_nb import data
from tunix_nb.experiments.long_family import Recipe, greedy_correct, train_checkpoint

STUDENT_DIR = data.DATA_DIR / "count_student"
TEACHER_DIR = data.DATA_DIR / "count_teacher"
SMALL_STUDENT_DIR = data.DATA_DIR / "count_small_student"
SPLIT_SEEDS = {"student_train": 311, "teacher_train": 312, "validation": 313, "test": 314}
SIZES = {"student_train": 6000, "teacher_train": 8000, "validation": 1000, "test": 1000}

STUDENT = Recipe("student", "student_train", steps=1200, stop_at=280, learning_rate=6e-3)
TEACHER = Recipe("teacher", "teacher_train", steps=2000, stop_at=2000, learning_rate=2e-3, wrong_prefix_rate=0.1)
SMALL_STUDENT = Recipe("tiny", "student_train", steps=2000, stop_at=2000, learning_rate=6e-3)
CHECKPOINTS = {"teacher": (TEACHER, TEACHER_DIR), "student": (STUDENT, STUDENT_DIR),
               "small_student": (SMALL_STUDENT, SMALL_STUDENT_DIR)}


@cache
def splits() -> dict[str, list[dict]]:
    """Every split, each prompt in exactly one of them."""
    return draw_splits(SPLIT_SEEDS, SIZES, family="count")


def draw_splits(split_seeds: dict, sizes: dict, family: str) -> dict[str, list[dict]]:
    """`sizes[name]` examples of `family` per split, each from `split_seeds[name]`, drawn in
    order and each prompt in exactly one split."""
    seen: list[str] = []
    out = {}
    for name, n in sizes.items():
        out[name] = data.generate_sft(n, seed=split_seeds[name], family=family, exclude=seen)
        seen += [e["prompt"] for e in out[name]]
    return out


def remake(out_dir, which=tuple(CHECKPOINTS)) -> dict:
    """Train the checkpoints named in `which` into out_dir/count_<name>; their last metrics."""
    return {f"count_{name}": train_checkpoint(CHECKPOINTS[name][0], Path(out_dir) / f"count_{name}",
                                              splits()[CHECKPOINTS[name][0].split], family="count")
            for name in which}


def validation_exact_match(student, teacher, validation=None) -> dict:
    """Both checkpoints' greedy exact match on `validation`, by default this family's
    validation split (the datasheet's figures)."""
    validation = splits()["validation"] if validation is None else validation
    return {name: float(greedy_correct(*model, validation).mean())
            for name, model in (("student", student), ("teacher", teacher))}


def with_slip(example: dict, k: int) -> dict:
    """`example` with answer digit k one too high (a miscount), the rest of the answer right."""
    answer = example["completion"]
    return {**example, "completion": answer[:k] + str((int(answer[k]) + 1) % 10) + answer[k + 1:]}


def after_a_slip(graphdef, params, examples, *, seed: int = 0) -> dict:
    """What a model predicts right after a slip: each answer, teacher-forced, with one digit k
    (drawn from `seed`, never the last) one too high. {"right": share whose digit k + 1 is the
    right one (it counts from the input), "carried": share that is the slip plus the next bit
    (it carried the slip on, the local rule)}."""
    import numpy as np

    from tunix_nb import model
    from tunix_nb.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    rng = np.random.default_rng(seed)
    slip_at = [int(rng.integers(0, len(e["completion"]) - 1)) for e in examples]
    slipped = [with_slip(e, k) for e, k in zip(examples, slip_at)]
    rows = data.sft_arrays(slipped, tok, data.LONG_SEQ_LEN)
    after_slip = (rows["loss_mask"] > 0).argmax(axis=1) + np.array(slip_at) + 1  # where digit k + 1 is predicted
    predicted = np.asarray(model.apply(graphdef, params, rows["inputs"], rows["attention_mask"])).argmax(-1)[
        np.arange(len(examples)), after_slip]
    next_bit = [int(e["prompt"].removeprefix("cnt ")[k + 1]) for e, k in zip(examples, slip_at)]
    right = [tok.encode(e["completion"][k + 1])[0] for e, k in zip(examples, slip_at)]
    carried = [tok.encode(str((int(s["completion"][k]) + b) % 10))[0] for s, k, b in zip(slipped, slip_at, next_bit)]
    return {"right": float(np.mean(predicted == right)), "carried": float(np.mean(predicted == carried))}


def after_own_slip(answers: list[str], examples) -> dict:
    """What a model's own greedy answers do right after their first wrong digit: the slips it
    makes itself, where `after_a_slip` plants one of its own choosing (one too high). Over the
    answers whose first wrong digit k is not their last: {"slips": how many, "right": share
    whose digit k + 1 is the right one, "carried": share that is their own digit k plus bit
    k + 1 (the slip carried on)}; a missing or non-digit k or k + 1 is neither."""
    right = carried = slips = 0
    for answer, example in zip(answers, examples):
        gold, bits = example["completion"], example["prompt"].removeprefix("cnt ").removesuffix("=")
        k = next((i for i, digit in enumerate(gold) if answer[i:i + 1] != digit), None)
        if k is None or k == len(gold) - 1:
            continue  # right throughout, or wrong only at the last digit: nothing comes after the slip
        slips += 1
        own, following = answer[k:k + 1], answer[k + 1:k + 2]
        right += following == gold[k + 1]
        carried += own.isdigit() and following == str((int(own) + int(bits[k + 1])) % 10)
    return {"slips": slips, "right": right / max(slips, 1), "carried": carried / max(slips, 1)}


def correction_and_cost(summary: dict) -> dict:
    """What on-policy training bought and what it paid, from a lesson11_gkd summary on this
    family: {"corrected": how much less often than offline the on-policy student carries a
    slip on (`after_a_slip`), "cost": how much more often it errs after the right prefix
    (teacher-forced token error, longest third)}. Both as fractions; the pilots set one
    against the other (lesson 11)."""
    carried, forced = summary["after_a_slip"], summary["teacher_forced_error_longest_third"]
    return {"corrected": carried["offline"]["carried"]["mean"] - carried["on_policy"]["carried"]["mean"],
            "cost": forced["on_policy"] - forced["offline"]}


def load(which: str = "student"):
    """(graphdef, params) of a shipped count-family checkpoint: "student", "teacher" or "small_student"."""
    from tunix_nb import checkpoint

    if which not in CHECKPOINTS:
        raise ValueError(f"which is one of {', '.join(CHECKPOINTS)}; got {which!r}.")
    graphdef, params, _ = checkpoint.load_model(CHECKPOINTS[which][1])
    return graphdef, params
