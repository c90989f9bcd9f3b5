"""The long task family's splits, its two shipped checkpoints, and the pilot gate they must pass.

Lessons 08 and 11 need answers long enough for a policy to get some right by chance and
for errors to compound: reversing and sorting 6-14 symbols (`data.LONG_TASKS`). Every
split is drawn from its own seed, none shares a prompt with another:

- the student's SFT set: 4500 reversals and 2000 sorts (sorting is learnt faster; the
  mix brings both sub-tasks to partial competence at the same step);
- the teacher's SFT set: 8000, balanced;
- the validation split (1000), for every choice: a checkpoint, a temperature, a step;
- the test split (1000), scored once, never used for a choice;
- fresh prompts for on-policy training (GRPO, GKD).

The student (`data/long_student`): the `student` preset, SFT on its set for 440 steps of
a 460-step schedule at learning rate 6e-3 (a run stopped early: partially competent; the
recipe and the stop step were chosen on the validation split, against the gate below, which
this checkpoint meets with three sampling seeds; data/README.md gives the recipes tried).
The pilot gate, on the validation split at temperature 1: sampled pass@1 between 30% and
70%, and pass@8 at least 20 points above greedy (a policy that samples right answers
unreliably: what GRPO can turn into pass@1). The teacher (`data/long_teacher`): the `teacher` preset, 2000 steps.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np

from tunix_nb import data

STUDENT_DIR = data.DATA_DIR / "long_student"
TEACHER_DIR = data.DATA_DIR / "long_teacher"
SPLIT_SEEDS = {"student_train": 301, "teacher_train": 302, "validation": 303, "test": 304, "fresh": 305}
GATE = {"pass_at_1": (0.30, 0.70), "pass_at_8_over_greedy": 0.20}
LENGTHS = dict(prompt_len=data.LONG_PROMPT_LEN, max_new_tokens=data.LONG_MAX_NEW_TOKENS)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a shipped checkpoint is trained (SFT with the kit's AdamW and cosine schedule)."""

    preset: str
    split: str
    steps: int
    stop_at: int
    learning_rate: float
    batch_size: int = 64
    warmup_steps: int = 50
    seed: int = 0
    # the share of answer tokens swapped, in the inputs only, for another of the row's: the
    # targets stay right, so the model learns to carry on after a mistake (0: plain SFT)
    wrong_prefix_rate: float = 0.0


STUDENT = Recipe("student", "student_train", steps=460, stop_at=440, learning_rate=6e-3)
TEACHER = Recipe("teacher", "teacher_train", steps=2000, stop_at=2000, learning_rate=2e-3)


@cache
def splits(n_fresh: int = 8000) -> dict[str, list[dict]]:
    """Every split, each prompt in exactly one of them."""
    seen: list[str] = []
    out = {}
    sizes = {"student_train": 9000, "teacher_train": 8000, "validation": 1000, "test": 1000, "fresh": n_fresh}
    for name, n in sizes.items():
        out[name] = data.generate_sft(n, seed=SPLIT_SEEDS[name], family="long", exclude=seen)
        seen += [e["prompt"] for e in out[name]]
    reversals = [e for e in out["student_train"] if e["task"] == "long_reverse"]  # all 4500
    sorts = [e for e in out["student_train"] if e["task"] == "long_sort"][:2000]
    out["student_train"] = reversals + sorts
    return out


def train_checkpoint(recipe: Recipe, out_dir, examples=None, family: str = "long") -> dict:
    """Train `recipe` on `examples` (default: this family's split `recipe.split`) and export its
    params to `out_dir`; returns the run's last metrics."""
    from tunix_nb import checkpoint, model, sft, train
    from tunix_nb.tokenizer import ByteTokenizer

    examples = splits()[recipe.split] if examples is None else examples
    rows = data.sft_arrays(examples, ByteTokenizer(), data.LONG_SEQ_LEN)
    graphdef, params = model.split(model.make_model(recipe.preset, seed=recipe.seed))
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=recipe.learning_rate,
                                                     warmup_steps=recipe.warmup_steps, total_steps=recipe.steps))
    step_fn = train.make_step(sft.objective(graphdef), opt)
    batch = lambda s: with_wrong_prefixes(data.batch_at(rows, s, recipe.batch_size, seed=recipe.seed),  # noqa: E731
                                          recipe.wrong_prefix_rate, seed=(recipe.seed, s))
    params, _, history = train.run(step_fn, params, opt.init(params), batch, steps=recipe.stop_at, progress=False)
    checkpoint.export_params(params, out_dir, step=recipe.stop_at,
                             meta={"model": recipe.preset, "recipe": dataclasses.asdict(recipe), "family": family})
    return history[-1]


def with_wrong_prefixes(batch: dict, rate: float, *, seed) -> dict:
    """`batch` with a `rate` share of its answer tokens, as inputs, swapped for another of the
    row's answer tokens; the targets stay the right answer's, position by position.

    The prediction after a swapped token is still trained towards the right next token, so
    the model learns to carry on from a wrong prefix as if the mistake were a slip at one
    position, not to continue it. rate 0: `batch` itself."""
    if not rate:
        return batch
    rng = np.random.default_rng(seed)
    mask_BxL = batch["loss_mask"] > 0
    answer_input_BxL = np.zeros_like(mask_BxL)
    answer_input_BxL[:, 1:] = mask_BxL[:, 1:] & mask_BxL[:, :-1]  # inputs that are answer tokens (not eos)
    swap_BxL = answer_input_BxL & (rng.random(mask_BxL.shape) < rate)
    inputs_BxL = batch["inputs"].copy()
    for row, col in zip(*np.nonzero(swap_BxL)):
        inputs_BxL[row, col] = inputs_BxL[row, rng.choice(np.flatnonzero(answer_input_BxL[row]))]
    return {**batch, "inputs": inputs_BxL}


def right_prefixes_only(swapped: dict, original: dict) -> dict:
    """`swapped` (from `with_wrong_prefixes(original, ...)`) with every position from a row's
    first swapped input on left out of the loss: the same rows, the same right prefixes as
    `swapped` holds, and no correction taught after a wrong one (lesson 11's control)."""
    changed_BxL = swapped["inputs"] != original["inputs"]
    first_B = np.where(changed_BxL.any(axis=1), changed_BxL.argmax(axis=1), changed_BxL.shape[1])
    after_a_swap_BxL = np.arange(changed_BxL.shape[1])[None, :] >= first_B[:, None]
    return {**swapped, "loss_mask": np.where(after_a_swap_BxL, 0, swapped["loss_mask"])}


def load(which: str = "student"):
    """(graphdef, params) of the shipped long-family student or teacher."""
    from tunix_nb import checkpoint

    graphdef, params, _ = checkpoint.load_model(STUDENT_DIR if which == "student" else TEACHER_DIR)
    return graphdef, params


def sample_correct(graphdef, params, examples, *, n: int, temperature: float, seed: int = 0) -> np.ndarray:
    """[N, n] bool: which of n sampled answers (at `temperature`) to each example are exactly right."""
    answers = sample_answers(graphdef, params, examples, n=n, temperature=temperature, seed=seed)
    return np.array([[a == e["completion"] for a in row] for row, e in zip(answers, examples)])


def sample_answers(graphdef, params, examples, *, n: int, temperature: float, seed: int = 0,
                   chunk: int = 1000) -> list[list[str]]:
    """n answers to each example sampled at `temperature` (row keys: a pure function of seed)."""
    from tunix_nb import grpo

    sample = grpo.make_sampler(graphdef, temperature=temperature, max_new_tokens=data.LONG_MAX_NEW_TOKENS)
    prompts = grpo.prompt_rows(examples, prompt_len=data.LONG_PROMPT_LEN)
    tokens, mask = np.repeat(prompts["prompt_tokens"], n, axis=0), np.repeat(prompts["prompt_mask"], n, axis=0)
    keys = grpo.rollout_keys(seed, 0, len(tokens))
    texts = []
    for start in range(0, len(tokens), chunk):
        part = slice(start, start + chunk)
        texts += grpo.completion_texts(sample(params, params, tokens[part], mask[part], keys[part]))
    return [texts[i * n:(i + 1) * n] for i in range(len(examples))]


def greedy_correct(graphdef, params, examples) -> np.ndarray:
    """[N] bool: whether each greedy answer is exactly right."""
    from tunix_nb import evaluate

    answers = evaluate.generate_answers(graphdef, params, [e["prompt"] for e in examples], **LENGTHS)
    return np.array([a == e["completion"] for a, e in zip(answers, examples)])


def gate(graphdef, params, examples=None) -> dict:
    """The pilot gate's figures on the validation split, and whether they pass."""
    examples = examples or splits()["validation"]
    sampled = sample_correct(graphdef, params, examples, n=8, temperature=1.0, seed=1)
    greedy = greedy_correct(graphdef, params, examples)
    figures = {"greedy": float(greedy.mean()), "pass_at_1": float(sampled.mean()),
               "pass_at_8": float(sampled.any(axis=1).mean())}
    lo, hi = GATE["pass_at_1"]
    figures["passes"] = bool(lo <= figures["pass_at_1"] <= hi
                             and figures["pass_at_8"] - figures["greedy"] >= GATE["pass_at_8_over_greedy"])
    return figures
