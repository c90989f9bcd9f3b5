"""Running counts of exactly 14 bits, and their shipped student: lesson 11's fourth design.

The count family's answers run from 6 to 14 digits, and its one-layer student sometimes
stops early. Every position after that eos is missing, a free-running error the right
prefix does not make, so the own-prefix share charges it to the student's own prefix; yet
on-policy training cannot teach what to do after an eos (docs/lesson11_designs.md, "What the share
counts"). Here every answer has 14 digits and the stop is never in doubt: what is left to
compound is a slip carried on.

- the student (`data/count14_student`): the `tiny` preset (one layer), plain SFT on 6000
  examples, stopped at step 200 of a 2000-step schedule at learning rate 6e-3 (partially
  competent: it miscounts now and then and carries the slip on; the step was chosen on the
  validation split, data/README.md);
- the teacher: the count family's (`data/count_teacher`), which corrects a slip instead of
  carrying it on.

Splits from their own seeds, no prompt in two of them. Of the 2^14 = 16384 prompts the four
splits hold 12000.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tunix_nb import data
from tunix_nb.experiments import count_family
from tunix_nb.experiments.long_family import Recipe, train_checkpoint

STUDENT_DIR = data.DATA_DIR / "count14_student"
SPLIT_SEEDS = {"student_train": 511, "teacher_train": 512, "validation": 513, "test": 514}
SIZES = {"student_train": 6000, "teacher_train": 4000, "validation": 1000, "test": 1000}
STUDENT = Recipe("tiny", "student_train", steps=2000, stop_at=200, learning_rate=6e-3)


@cache
def splits() -> dict[str, list[dict]]:
    """Every split, each prompt in exactly one of them."""
    return count_family.draw_splits(SPLIT_SEEDS, SIZES, family="count14")


def remake(out_dir) -> dict:
    """Train the student into out_dir/count14_student; its last metrics."""
    return {"count14_student": train_checkpoint(STUDENT, Path(out_dir) / "count14_student",
                                                splits()[STUDENT.split], family="count14")}


def validation_exact_match(student, teacher) -> dict:
    """Both checkpoints' greedy exact match on this family's validation split (the datasheet's figures)."""
    return count_family.validation_exact_match(student, teacher, splits()["validation"])


def load(which: str = "student"):
    """(graphdef, params): this family's student, or the count family's teacher."""
    from tunix_nb import checkpoint

    if which == "teacher":
        return count_family.load("teacher")
    if which != "student":
        raise ValueError(f"which is 'student' or 'teacher'; got {which!r}.")
    graphdef, params, _ = checkpoint.load_model(STUDENT_DIR)
    return graphdef, params
